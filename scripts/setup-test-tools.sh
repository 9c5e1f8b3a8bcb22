#!/usr/bin/env bash
# Install the system tools the test suite calls (Debian packages, as root). `make test` runs it; `make run`
# does not need them.
#
# Under CI=true a missing tool fails this script, and a test that would skip for it fails too
# (tests/conftest.py): a fresh machine must show a missing install step, not pass green without it.
set -euo pipefail
LOG="${1:-.venv}.setup.log"
. "$(dirname "$0")/lib.sh"
ci() { case "${CI:-}" in ""|0|false|no) return 1 ;; *) return 0 ;; esac; }
lacking() {
    if ci; then say "$* (CI=true: the suite must run every test)"; exit 2; fi
    say "$*; the tests that need it will be skipped here (and fail under CI)"
}

# Tools the test suite calls (the packaging tests build and check the RPM and the OCI image with these, no
# container daemon needed; the unit tests verify the systemd units; failed tests report sockets with ss;
# promtool checks and unit-tests the alert rules (Debian ships it in `prometheus`, whose server a box with
# systemd running would also start); a headless Chromium renders the status page).
missing=()
for tool in rpmbuild:rpm rpmlint:rpmlint buildah:buildah podman:podman umoci:umoci oci-image-tool:oci-image-tool \
            debootstrap:debootstrap runc:runc systemd-analyze:systemd ss:iproute2 promtool:prometheus \
            chromium-headless-shell:chromium-headless-shell; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt_install "the test suite uses them" "${missing[@]}" \
        || lacking "missing: ${missing[*]} (Debian package names); install them as root, then run this again"
fi

# rpm's Python dependency generator runs under the interpreter on its own #! line (/usr/bin/python3 on
# Debian), not under the python3 first on PATH: without `packaging` there, it silently generates no
# python3.Xdist(...) requirements. Check with that interpreter.
gen=""
command -v rpm >/dev/null 2>&1 && gen="$(rpm --eval '%{_rpmconfigdir}')/pythondistdeps.py"
if [ -n "$gen" ] && [ -f "$gen" ]; then
    gen_python=$(sed -n '1s/^#! *\([^ ]*\).*/\1/p' "$gen")
    [ "${gen_python##*/}" = env ] && gen_python=$(sed -n '1s/^#! *[^ ]* *\([^ ]*\).*/\1/p' "$gen")
    if ! "$gen_python" -I -c 'import packaging.requirements' 2>/dev/null; then
        if apt_install "rpm's python dependency generator ($gen_python) imports it" python3-packaging; then
            "$gen_python" -I -c 'import packaging.requirements' \
                || { say "$gen_python still cannot import packaging after installing python3-packaging"; exit 2; }
        else
            lacking "$gen_python cannot import packaging (rpm's python dependency generator needs it): install python3-packaging"
        fi
    fi
elif [ -n "$gen" ]; then
    lacking "rpm has no $gen: the RPM would carry no Python requirements"
fi
