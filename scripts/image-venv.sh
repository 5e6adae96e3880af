#!/bin/sh
# Build an image's /opt/venv from the project wheel in /wheels (the Dockerfiles' build
# stages run it): `image-venv.sh cpu` (serving), `image-venv.sh cpu,train` (jobs),
# `image-venv.sh gpu onnxruntime-gpu==X` (GPU serving). Extra arguments are installed
# alongside. Wheels only: a dependency without a wheel for this platform fails the
# build here instead of silently needing a compiler.
set -eu
extras=$1
shift
"${PYTHON:-python3}" -m venv /opt/venv
# The OTLP/HTTP exporter lets OTEL_TRACES_EXPORTER=otlp (the chart's otel.endpoint) export.
/opt/venv/bin/pip install --no-cache-dir --only-binary=:all: \
    "$(ls /wheels/fraud_scoring-*.whl)[$extras]" opentelemetry-exporter-otlp-proto-http "$@"
# Feast requires SQLAlchemy[mypy]; the type checker (~60 MB) is never imported at run time.
/opt/venv/bin/pip uninstall --yes mypy pip setuptools wheel
# Dependencies' test suites (~75 MB) are never imported; bytecode is rebuilt once below.
find /opt/venv/lib -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
/opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib
