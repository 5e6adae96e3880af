#!/usr/bin/env bash
# GPU checks and benchmark, for a machine with an NVIDIA GPU; about 3-4 minutes.
# Needs onnxruntime-gpu instead of onnxruntime: on a machine without internet, put the
# wheels in .whl/ first (see bench/README.md) and they are installed from there.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
PYTHON=${PYTHON:-python3}
[ -x .venv-gpu/bin/python ] || "$PYTHON" -m venv .venv-gpu
PIP=(.venv-gpu/bin/python -m pip install -q)
[ -d .whl ] && PIP+=(--no-index --find-links .whl)
"${PIP[@]}" -e ".[gpu]"
export PYTHONUNBUFFERED=1
echo "== placement, equality, rows/s";  timeout 180 .venv-gpu/bin/python -m bench.gpu_check
echo "== executor benchmark on CUDA"
FRAUD_EXECUTION_PROVIDER=cuda timeout 120 .venv-gpu/bin/python -m bench.bench_executor --seconds 3
