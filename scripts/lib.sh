# Helpers for the setup scripts (sourced; LOG names the log file).
say() { printf '==> %s\n' "$*" >&2; }

apt_install() {  # apt_install WHY PACKAGE...: Debian packages, when this runs as root with apt
    local why=$1; shift
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing $* ($why)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"; } >>"$LOG" 2>&1 \
            || { tail -n 20 "$LOG" >&2; say "apt-get failed; full log in $LOG"; exit 1; }
        return 0
    fi
    return 1
}
