#!/usr/bin/env bash
# Build the OCI image without a daemon or a registry (buildah, chroot isolation), then export and check it.
#
#   packaging/oci/build.sh WORKDIR [TAG]        (TAG default: localhost/edge-appliance:<version>)
#
# WORKDIR holds buildah's storage (WORKDIR/storage, WORKDIR/run), the build context and the exported
# OCI layout (WORKDIR/oci). The base is a Debian bookworm minbase made once with debootstrap and
# imported (no registry is reachable). The image's Python environment is this project's tested engine
# environment (its site-packages copied, not downloaded again: the kernel lock written inside the image
# then matches the host's file for file) plus the appliance's own wheel. The embedded default model is
# baked in and pinned by its digest.
# Env: PYTHON (the project's venv python), MODEL (model folder; default: the converted embedded model).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="$(mkdir -p "${1:?usage: build.sh WORKDIR [TAG]}" && cd "$1" && pwd)"
py="${PYTHON:-$repo/.venv/bin/python}"
version="$("$py" -c 'import appliance; print(appliance.__version__)')"
tag="${2:-localhost/edge-appliance:$version}"
base="localhost/edge-appliance-base:bookworm"
bh=(buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs)
say() { printf '==> %s\n' "$*" >&2; }

if ! "${bh[@]}" inspect --type image "$base" >/dev/null 2>&1; then
    say "making the base image with debootstrap (once per WORKDIR)"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libnuma1,libgomp1,libstdc++6 \
        bookworm "$work/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
    ctr=$("${bh[@]}" from scratch)
    "${bh[@]}" add "$ctr" "$work/rootfs.tar" /
    "${bh[@]}" config --cmd /bin/bash "$ctr"
    "${bh[@]}" commit --quiet "$ctr" "$base" >/dev/null
    "${bh[@]}" rm "$ctr" >/dev/null
    rm -rf "$work/rootfs" "$work/rootfs.tar"
fi

say "preparing the build context"
ctx="$work/context"
rm -rf "$ctx" && mkdir -p "$ctx/appliance" "$ctx/site-packages"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the engine environment, without this checkout's editable install and without byte-code caches
tar -C "$site" --exclude='__editable__*' --exclude='edge_appliance*' --exclude='__pycache__' -cf - . \
    | tar -C "$ctx/site-packages" -xf -
"$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/wheel" "$repo"
"$py" -m zipfile -e "$work/wheel"/edge_appliance-"$version"-py3-none-any.whl "$ctx/appliance"
model="${MODEL:-$("$py" -c 'from appliance.default_model import default_model_dir; print(default_model_dir())')}"
cp -r "$model" "$ctx/model"
rm -f "$ctx/model/appliance-manifest.json"
digest="$("$py" -c 'import sys; from kernels.manifest import build; print(build(sys.argv[1]).digest)' "$ctx/model")"
sed "s|@MODEL_DIGEST@|$digest|" "$here/image.toml" >"$ctx/image.toml"
cp "$here/Containerfile" "$ctx/"

say "building $tag"
"${bh[@]}" bud --quiet --isolation chroot --layers=false --build-arg BASE="$base" -t "$tag.unlabelled" \
    -f "$ctx/Containerfile" "$ctx" >/dev/null

say "labelling: version, model digest, kernel lock digest, SBOM"
ctr=$("${bh[@]}" from "$tag.unlabelled")
sbom_file="$work/sbom.cdx.json"
"${bh[@]}" run --isolation chroot "$ctr" -- cat /usr/share/edge-appliance/sbom.cdx.json >"$sbom_file"
lock_digest=$("${bh[@]}" run --isolation chroot "$ctr" -- /opt/appliance/bin/python -c \
    'import json; print(json.load(open("/etc/appliance/kernel-lock.json"))["digest"])')
sbom_digest="sha256:$(sha256sum "$sbom_file" | cut -d' ' -f1)"
sbom_label="$(gzip -9c "$sbom_file" | base64 -w0)"
"${bh[@]}" config \
    --label org.opencontainers.image.title=edge-appliance \
    --label org.opencontainers.image.version="$version" \
    --label io.edge-appliance.model.digest="$digest" \
    --label io.edge-appliance.kernel-lock.digest="$lock_digest" \
    --label io.edge-appliance.sbom.path=/usr/share/edge-appliance/sbom.cdx.json \
    --label io.edge-appliance.sbom.digest="$sbom_digest" \
    --label io.edge-appliance.sbom.cdx-json-gzip-base64="$sbom_label" \
    "$ctr"
"${bh[@]}" commit --quiet "$ctr" "$tag" >/dev/null
"${bh[@]}" rm "$ctr" >/dev/null
"${bh[@]}" rmi "$tag.unlabelled" >/dev/null

say "exporting the OCI layout to $work/oci"
rm -rf "$work/oci"
"${bh[@]}" push --quiet "$tag" "oci:$work/oci:$version"
echo "$tag"
