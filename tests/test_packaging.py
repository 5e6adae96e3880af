"""The serving install (core dependencies + ``cpu``/``gpu``) carries no training stack.

``serve`` and ``stream`` must import nothing that only the ``train`` extra installs, or
the serving image (which installs ``.[cpu]``) would fail at start; and the training
stack must stay out of the core dependencies, or the serving image grows again.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
IMAGE_VENV = PYPROJECT.parent / "scripts" / "image-venv.sh"

# Module -> distribution of everything only the batch job and training need.
TRAINING_STACK = {
    "duckdb": "duckdb",
    "lightgbm": "lightgbm",
    "onnxmltools": "onnxmltools",
    "onnx": "onnx",
    "skl2onnx": "skl2onnx",
    "sklearn": "scikit-learn",
    "matplotlib": "matplotlib",
}

# What `fraud-scoring serve` and `fraud-scoring stream` import, the lazy imports included.
SERVING_MODULES = [
    "cli.main",
    "service.edge.server",
    "service.edge.app",
    "streaming.metrics",
    "streaming.sources",
    "streaming.state",
    "streaming.updater",
]


# What scripts/image-venv.sh drops from the serving images (paths under site-packages):
# serving must neither open nor map any of it.
IMAGE_DROPS = re.compile(
    r"/site-packages/(?:"
    r"pyarrow/(?:libarrow_flight|libarrow_python_flight|_flight\.|_pyarrow_cpp_tests|include/|src/)"
    r"|numpy/_core/include/"
    r"|onnxruntime/capi/libonnxruntime\.so"
    r"|onnxruntime/(?:transformers|quantization|tools|datasets)/"
    r"|feast/ui/(?!__init__\.py|__pycache__/)"
    r"|pycountry/locales/"
    r"|(?:requirements|docs)/"
    r"|(?:ast_serialize|librt|pathspec|greenlet-stubs)/|mypy_extensions\.py"
    r")|\.(?:pyx|pxd|pxi)$"
)


def test_the_serving_images_bytecode_is_for_the_serving_modules() -> None:
    """scripts/image-venv.sh compiles bytecode in the serving images only for what
    importing SERVING_MODULES (and what serving imports later) loads: the same list."""
    block = re.search(r"^SERVING_MODULES = \[(.*?)^\]", IMAGE_VENV.read_text(), re.M | re.S)
    assert block, "scripts/image-venv.sh has no SERVING_MODULES list"
    assert re.findall(r'"([\w.]+)"', block.group(1)) == SERVING_MODULES


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_serve_and_stream_import_no_training_module() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {SERVING_MODULES!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in {sorted(TRAINING_STACK)!r} if m in sys.modules))\n"
        "print(sorted(m for m in sys.modules if m.startswith('batch_jobs.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[-2] == "[]", f"serving imports the training stack: {out[-2]}"
    # batch_jobs.commands (argument parsing only) and its settings are imported by the CLI;
    # the jobs are not.
    assert out[-1] in ("[]", "['batch_jobs.commands', 'batch_jobs.settings']"), out[-1]


def test_training_stack_is_the_train_extra() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    train = _names(extras["train"])
    for module, dist in TRAINING_STACK.items():
        assert dist not in core, f"{dist} ({module}) is a core dependency; move it to train"
        assert dist in train, f"{dist} ({module}) is missing from the train extra"
    assert "fraud-scoring[train]" in extras["dev"], "dev must install the training stack"


def test_the_clis_job_modules_are_the_training_stack() -> None:
    """What the CLI names as the jobs' (missing in the serving image) is every import of
    the ``train`` and ``spark`` extras."""
    from cli.main import JOB_MODULES

    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    modules = {v: k for k, v in TRAINING_STACK.items()}
    wanted = {modules.get(d, d) for d in _names(extras["train"]) | _names(extras["spark"])}
    assert wanted == JOB_MODULES


def test_serving_touches_nothing_the_serving_image_drops() -> None:
    """Every file Python opens (an audit hook) and every library mapped while serve and
    stream import and the event schema loads its ISO codes stays clear of IMAGE_DROPS."""
    if not Path("/proc/self/maps").exists():
        import pytest

        pytest.skip("needs /proc/self/maps (Linux)")
    code = (
        "import importlib, json, os, sys\n"
        "opened = []\n"
        "def hook(event, args):\n"
        "    if event == 'open' and args and isinstance(args[0], (str, bytes)):\n"
        "        opened.append(os.fsdecode(args[0]))\n"
        "sys.addaudithook(hook)\n"
        f"for m in {SERVING_MODULES!r}: importlib.import_module(m)\n"
        "import onnxruntime, pyarrow.parquet\n"
        "from fraud_scoring import events\n"
        "assert events.country_codes() and events.currency_codes()\n"
        "with open('/proc/self/maps') as f:\n"
        "    mapped = [line.split()[-1] for line in f if '/' in line]\n"
        "print(json.dumps(sorted(set(opened + mapped))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    touched = json.loads(out[-1])
    assert any("onnxruntime_pybind11_state" in p for p in touched), "no ONNX Runtime mapped"
    assert any("/pyarrow/libarrow.so" in p for p in touched), "no Arrow mapped"
    dropped = [p for p in touched if IMAGE_DROPS.search(p)]
    assert not dropped, f"serving uses files scripts/image-venv.sh drops: {dropped}"
