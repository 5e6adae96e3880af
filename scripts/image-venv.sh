#!/bin/sh
# Build an image's /opt/venv from the project wheel in /wheels (the Dockerfiles' build
# stages run it): `image-venv.sh cpu` (serving), `image-venv.sh cpu,train` (jobs),
# `image-venv.sh gpu onnxruntime-gpu==X` (GPU serving). Extra arguments are installed
# alongside. Wheels only: a dependency without a wheel for this platform fails the
# build here instead of silently needing a compiler.
# The serving builds (extras without `train`) also drop the files that `serve` and
# `stream` never load (below); they need binutils (strip, readelf) in the build stage.
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
if [ -n "$serving" ]; then
    sp=$(echo /opt/venv/lib/python3*/site-packages)
    # Arrow Flight RPC (~32 MB): only `import pyarrow.flight` loads it (Feast's remote
    # offline store and offline server, never configured here); no kept library links it.
    rm -f "$sp"/pyarrow/libarrow_flight.so* "$sp"/pyarrow/libarrow_python_flight.so* \
        "$sp"/pyarrow/_flight.*.so "$sp"/pyarrow/_pyarrow_cpp_tests.*.so
    # C/C++ headers and sources and Cython sources (~10 MB): read only to compile an
    # extension against pyarrow/numpy/uvloop/..., and the image has no compiler.
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
    # onnxruntime's model-conversion, quantization and optimizer tools (~10 MB):
    # command-line tools; `import onnxruntime` and InferenceSession never import them.
    rm -rf "$sp"/onnxruntime/transformers "$sp"/onnxruntime/quantization \
        "$sp"/onnxruntime/tools "$sp"/onnxruntime/datasets
    # Feast's web UI (~26 MB: the React build, its sources and source maps) is read only
    # by `feast ui` (the feast-ui extra); feast/ui/__init__.py stays importable.
    find "$sp"/feast/ui -mindepth 1 -maxdepth 1 ! -name __init__.py -exec rm -rf {} +
    # Feast's wheel also installs its CI requirement lists and docs as top-level
    # requirements/ and docs/ directories (~5 MB of text, not importable).
    rm -rf "$sp"/requirements "$sp"/docs
    # pycountry's name translations (~22 MB of gettext catalogs): fraud_scoring/events.py
    # reads only the ISO codes (pycountry.countries, pycountry.currencies).
    rm -rf "$sp"/pycountry/locales
    # Debug information (~38 MB: valkey-server 12, uvloop 11, the Cython modules of
    # SQLAlchemy and PyYAML): --strip-debug keeps every symbol the loader needs.
    # auditwheel's grafted libraries (*.libs/) are left as they are.
    find "$sp" -type f ! -path '*.libs/*' | while read -r f; do
        if readelf -S "$f" 2>/dev/null | grep -q ' \.debug_'; then
            strip --strip-debug "$f"
        fi
    done
fi
/opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib
