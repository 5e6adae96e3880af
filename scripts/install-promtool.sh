#!/usr/bin/env bash
# Put Prometheus's promtool into .venv/bin (once), for the alert rules' unit tests
# (tests/test_helm_alerts.py runs `promtool test rules`). No PyPI wheel ships promtool,
# so it comes from Debian's `prometheus` package: `apt-get download` fetches the .deb
# without installing it (no root, no daemon, no dependencies) and only the promtool
# binary (static but for libc) is unpacked. A promtool already on PATH is used as it is.
# Root only helps where the package lists are missing: it runs `apt-get update` first.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.venv/bin/promtool
[ -x "$dest" ] && exit 0
if command -v promtool >/dev/null; then
    ln -sf "$(command -v promtool)" "$dest"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1); }
if ! fetch; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null
        fetch
    else
        echo "install-promtool: apt-get download prometheus failed (no package lists?);" \
            "install promtool on PATH or run 'apt-get update' as root" >&2
        exit 1
    fi
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/x"
install -m 0755 "$work/x/usr/bin/promtool" "$dest"
"$dest" --version | head -1
