# syntax=docker/dockerfile:1.7
# CPU image: ONNX Runtime on CPU (`pip install .[cpu]`).
#   docker build -t fraud-scoring:0.1.0 .
# GPU image: see Dockerfile.gpu.
#
# Two stages: "build" makes a virtual environment from wheels only; the final stage
# is a slim Python with that environment, tini and libgomp (LightGBM's OpenMP
# runtime) and nothing else: no compiler, no pip, no package caches, non-root.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY . .
# Our own wheel first, then every dependency as a prebuilt wheel: --only-binary makes
# a dependency without a wheel for this platform fail the build here instead of
# silently needing a compiler. The OTLP/HTTP exporter lets OTEL_TRACES_EXPORTER=otlp
# (set by the chart's otel.endpoint) export traces.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/venv/bin/pip install --only-binary=:all: \
      "$(ls /wheels/fraud_scoring-*.whl)[cpu]" opentelemetry-exporter-otlp-proto-http \
 && /opt/venv/bin/pip uninstall --yes pip setuptools wheel \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} + \
 && /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib

FROM ${PYTHON_IMAGE} AS runtime
ARG APP_UID=10001
RUN apt-get update \
 && apt-get install --yes --no-install-recommends libgomp1 tini \
 && rm -rf /var/lib/apt/lists/* \
 && python -m pip uninstall --yes pip setuptools wheel \
 && groupadd --gid ${APP_UID} app \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --no-create-home --home-dir /tmp --shell /usr/sbin/nologin app \
 && mkdir -p /var/lib/fraud-scoring \
 && chown ${APP_UID}:${APP_UID} /var/lib/fraud-scoring
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    FRAUD_HOST=0.0.0.0 \
    FRAUD_PORT=8080 \
    FRAUD_DATA_DIR=/var/lib/fraud-scoring/data \
    FRAUD_MODEL_REPO=/var/lib/fraud-scoring/models \
    FRAUD_EXECUTION_PROVIDER=cpu
WORKDIR /var/lib/fraud-scoring
USER ${APP_UID}:${APP_UID}
EXPOSE 8080
# tini as PID 1 forwards SIGTERM to the command (Python as PID 1 would ignore it
# unless it installs a handler) and reaps children.
ENTRYPOINT ["/usr/bin/tini", "--", "fraud-scoring"]
CMD ["serve"]
