#!/usr/bin/env bash
# Build the RPM: the appliance's wheel, then rpmbuild in a scratch top directory.
#   packaging/rpm/build.sh [OUTPUT_DIR]      (default: dist/rpm)
# Needs: rpmbuild (Debian: rpm), python3-packaging for the interpreter rpm's python dependency generator
# runs under (scripts/setup-test-tools.sh checks it), and the
# project's virtual environment (make setup) to build the wheel.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="$(mkdir -p "${1:-$repo/dist/rpm}" && cd "${1:-$repo/dist/rpm}" && pwd)"
py="${PYTHON:-$repo/.venv/bin/python}"
version="$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$repo/pyproject.toml")"

top="$(mktemp -d)"
trap 'rm -rf "$top"' EXIT
mkdir -p "$top"/{SOURCES,SPECS,BUILD,RPMS,SRPMS,BUILDROOT}
"$py" -m pip wheel --quiet --no-deps --no-build-isolation -w "$top/SOURCES" "$repo"
cp "$repo"/systemd/appliance.service "$repo"/systemd/appliance.sysusers.conf "$repo"/systemd/appliance.tmpfiles.conf \
   "$repo"/systemd/90-appliance.preset "$repo"/appliance/packaged.toml "$repo"/README.md \
   "$repo"/docs/configuration.md "$repo"/docs/cli.md "$top/SOURCES/"
tar -C "$repo/packaging" --owner=0 --group=0 -czf "$top/SOURCES/regional.tar.gz" regional
tar -C "$repo/packaging" --owner=0 --group=0 -czf "$top/SOURCES/monitoring.tar.gz" monitoring
cp "$here/edge-appliance.spec" "$top/SPECS/"
rpmbuild -bb --quiet --define "_topdir $top" --define "appliance_version $version" \
    "$top/SPECS/edge-appliance.spec"
rpm_file=$(find "$top/RPMS" -name '*.rpm')
# rpm's generator emits nothing, silently, when its interpreter lacks `packaging`: an RPM without its
# python3.Xdist(...) requirements installs on a box that cannot run it. Refuse to hand one out.
if ! rpm -qp --requires "$rpm_file" | grep -q '^python3\.[0-9]*dist('; then
    gen="$(rpm --eval '%{_rpmconfigdir}')/pythondistdeps.py"
    echo "build.sh: the RPM carries no python3.Xdist(...) requirements: rpm's python dependency generator" \
         "($gen) produced none; its interpreter ($(sed -n '1s/^#! *//p' "$gen" 2>/dev/null)) needs the packaging" \
         "module (Debian: apt-get install python3-packaging)" >&2
    exit 1
fi
cp "$rpm_file" "$out/"
ls "$out"/*.rpm
