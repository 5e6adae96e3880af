#!/usr/bin/env bash
# Set up a virtual environment (once) and run the whole product locally:
# simulate -> daily features + Feast materialization -> train -> serve -> score.
# Uses REDIS_URL when set, else starts its own Redis-protocol server for the run (the
# demo needs no --embedded-redis: it hands that server's URL to the API it starts).
# Without installing: PYTHONPATH=. python -m cli demo
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,train]"
exec .venv/bin/fraud-scoring demo "$@"
