# CPU images, two targets (ONNX Runtime on CPU):
#   docker build --target serve -t fraud-scoring:0.1.0 .       # scoring API and updater
#   docker build --target jobs  -t fraud-scoring:0.1.0-jobs .  # batch, train, simulate
# `serve` installs `.[cpu]` (no training stack: about half the size; its job subcommands
# answer exit status 2 with a one-line pointer to the jobs image) and has a HEALTHCHECK;
# `jobs` installs `.[cpu,train]` and can run every subcommand. Builds with BuildKit and with the classic
# builder (DOCKER_BUILDKIT=0): no `# syntax=` frontend, no RUN --mount. The classic
# builder builds every stage before the target, so `--target serve` skips the jobs ones.
# GPU serving image: see Dockerfile.gpu.
#
# The build stages make a virtual environment from wheels only (scripts/image-venv.sh:
# without what no subcommand loads, and for `serve` also without what `serve` and
# `stream` never load); the final stages are a slim Python with that environment and
# tini (jobs: libgomp, LightGBM's OpenMP runtime) and nothing else: no compiler, no pip,
# non-root. apt's lists and package caches (/var/cache/apt/*.bin, ~80 MB) go in the
# layer that made them: Debian's images never write the caches, other bases may.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1
# binutils (strip, readelf): image-venv.sh strips the libraries and finds what no
# subcommand loads; the build stages only, not the final images.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends binutils \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM build AS venv-serve
RUN scripts/image-venv.sh cpu

FROM ${PYTHON_IMAGE} AS runtime
ARG APP_UID=10001
RUN apt-get update \
 && apt-get install --yes --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && python -m pip uninstall --yes pip setuptools wheel \
 && groupadd --gid ${APP_UID} app \
 && useradd --uid ${APP_UID} --gid ${APP_UID} --no-create-home --home-dir /tmp --shell /usr/sbin/nologin app \
 && mkdir -p /var/lib/fraud-scoring \
 && chown ${APP_UID}:${APP_UID} /var/lib/fraud-scoring
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
EXPOSE 8080
# tini as PID 1 forwards SIGTERM to the command (Python as PID 1 would ignore it
# unless it installs a handler) and reaps children.
ENTRYPOINT ["/usr/bin/tini", "--", "fraud-scoring"]
CMD ["serve"]

FROM runtime AS serve
ARG APP_UID=10001
COPY --from=venv-serve /opt/venv /opt/venv
USER ${APP_UID}:${APP_UID}
# Docker's health probe (Kubernetes ignores it; the chart has its own probes): the
# scoring API's /healthz on FRAUD_PORT over loopback, with the image's Python (no curl
# in the image). A container running `stream` instead of `serve` has no API there: give
# it its own (`--health-cmd`, compose `healthcheck:`) or `--no-healthcheck`.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('FRAUD_PORT', '8080')}/healthz\", timeout=4)"]

FROM build AS venv-jobs
RUN scripts/image-venv.sh cpu,train

FROM runtime AS jobs
ARG APP_UID=10001
RUN apt-get update \
 && apt-get install --yes --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY --from=venv-jobs /opt/venv /opt/venv
USER ${APP_UID}:${APP_UID}
CMD ["batch"]
