#!/usr/bin/env bash
# Debian's chromium for the browser tests (tests/test_docs_browser.py, tests/test_review.py:
# Playwright drives this binary; no browser download). Installed only as root and only
# where it is missing; elsewhere the tests skip, and under CI=true they fail instead.
set -euo pipefail
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-chromium: not root: run 'apt-get install chromium' for the browser tests" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    apt-get install -y -q chromium >/dev/null
}
