#!/usr/bin/env bash
# Build the OCI image without a daemon or a registry (buildah, chroot isolation), then export and check it.
#
#   packaging/oci/build.sh WORKDIR [TAG]        (TAG default: localhost/edge-appliance:<version>)
#
# WORKDIR holds buildah's storage (WORKDIR/storage, WORKDIR/run), the build context and the exported
# OCI layout (WORKDIR/oci). The base is a Debian bookworm minbase made once with debootstrap and
# imported (no registry is reachable). The image's Python environment is this project's tested engine
# environment (its site-packages copied, not downloaded again) plus the appliance's own wheel; the kernel
# lock and the SBOM are written from that copy here, and the build verifies the image's files against
# the lock before committing it. The embedded default model is
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

# vfs keeps whole copies: the working container, the committed layer and its diff on the way, then the
# exported blob. Measured: about 4x the environment at the peak (15.6 GB for a 3.9 GB one). A disk that
# runs out mid-build fails deep inside buildah ("no space left on device"); say it here instead.
prefix="$("$py" -c 'import sys; print(sys.prefix)')"
env_mib=$(du -sm "$prefix" | cut -f1)
need_mib=$(( env_mib * 4 + 1024 ))
free_mib=$(df -Pm "$work" | awk 'NR == 2 {print $4}')
if (( free_mib < need_mib )); then
    echo "error: building the image needs about $(( need_mib / 1024 )) GiB free under $work (buildah's vfs storage" \
         "keeps about four copies of the $(( env_mib / 1024 )) GiB engine environment); $(( free_mib / 1024 )) GiB" \
         "are free: free some space or give a WORKDIR on a larger disk" >&2
    exit 1
fi

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
rm -rf "$ctx" && mkdir -p "$ctx/appliance" "$ctx/venv"
# The engine environment as installed: site-packages and the files packages put beside it (intel-openmp's
# libraries in lib/, for one); without its scripts (their #! names this host's interpreter), this
# checkout's editable install and byte-code caches. Hard-linked where it can be, not copied: it is ~4 GB,
# and vfs makes its own full copies during the build (a copy here once ran a CI machine's disk out).
# Nothing writes to these files; the chmod below only adds read bits they already have.
if ! cp -al "$prefix/." "$ctx/venv/" 2>/dev/null; then
    say "hard links refused (another filesystem?): copying the environment"
    rm -rf "$ctx/venv" && mkdir "$ctx/venv"
    tar -C "$prefix" -cf - . | tar -C "$ctx/venv" -xf -
fi
rm -rf "$ctx/venv/bin" "$ctx/venv/pyvenv.cfg" "$ctx/venv/lib64" "$ctx/venv/.setup-stamp"
# Only what the appliance and the engine need at run time: the tests', linters' and benchmarks' packages
# (pytest, mypy, ruff, eval sets, the model's PyPI package) stay out (kernels/runtime.py; removing a
# hard link leaves the environment itself as it was). The names removed are kept beside the build.
"$py" -m kernels.runtime "$ctx/venv/lib/python3.11/site-packages" >"$work/left-out.txt"
say "left out of the image: $(cat "$work/left-out.txt")"
find "$ctx/venv" \( -name '__editable__*' -o -name 'edge_appliance*' -o -name '__pycache__' \) -prune \
    -exec rm -rf {} +
"$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/wheel" "$repo"
"$py" -m zipfile -e "$work/wheel"/edge_appliance-"$version"-py3-none-any.whl "$ctx/appliance"
model="${MODEL:-$("$py" -c 'from appliance.boot.default_model import default_model_dir; print(default_model_dir())')}"
cp -r "$model" "$ctx/model"
rm -f "$ctx/model/appliance-manifest.json"
# root owns the files in the image and the service runs as `appliance`: everything it loads is world-readable
chmod -R a+rX "$ctx/model" "$ctx/venv" "$ctx/appliance"
digest="$("$py" -c 'import sys; from kernels.manifest import build; print(build(sys.argv[1]).digest)' "$ctx/model")"
sed "s|@MODEL_DIGEST@|$digest|" "$here/image.toml" >"$ctx/image.toml"
cp "$here/Containerfile" "$ctx/"
cp -r "$repo/packaging/monitoring" "$ctx/monitoring"  # alert rules and dashboard, for the fleet to take out

say "locking the environment's kernels and writing the SBOM"
"$py" -m appliance.cli kernels lock --lock "$ctx/kernel-lock.json" \
    --site-dir "$ctx/venv/lib/python3.11/site-packages" >/dev/null
"$py" -m appliance.cli kernels sbom --lock "$ctx/kernel-lock.json" -o "$ctx/sbom.cdx.json"
lock_digest="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["digest"])' "$ctx/kernel-lock.json")"
sbom_digest="sha256:$(sha256sum "$ctx/sbom.cdx.json" | cut -d' ' -f1)"

say "building $tag"
"${bh[@]}" rmi -f "$tag" "$tag.unlabelled" >/dev/null 2>&1 || true  # a rebuild replaces, not accumulates
"${bh[@]}" bud --quiet --isolation chroot --layers=false --build-arg BASE="$base" -t "$tag" \
    --label org.opencontainers.image.title=edge-appliance \
    --label org.opencontainers.image.version="$version" \
    --label io.edge-appliance.model.digest="$digest" \
    --label io.edge-appliance.kernel-lock.digest="$lock_digest" \
    --label io.edge-appliance.sbom.path=/usr/share/edge-appliance/sbom.cdx.json \
    --label io.edge-appliance.sbom.digest="$sbom_digest" \
    --label io.edge-appliance.sbom.cdx-json-gzip-base64="$(gzip -9c "$ctx/sbom.cdx.json" | base64 -w0)" \
    -f "$ctx/Containerfile" "$ctx" >/dev/null
rm -rf "$ctx"

say "exporting the OCI layout to $work/oci"
rm -rf "$work/oci"
"${bh[@]}" push --quiet "$tag" "oci:$work/oci:$version"
echo "$tag"
