"""The serving install (core dependencies + ``cpu``/``gpu``) carries no training stack.

``serve`` and ``stream`` must import nothing that only the ``train`` extra installs, or
the serving image (which installs ``.[cpu]``) would fail at start; and the training
stack must stay out of the core dependencies, or the serving image grows again.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

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
    # batch_jobs.commands (argument parsing only) is imported by the CLI; the jobs are not.
    assert out[-1] in ("[]", "['batch_jobs.commands']"), out[-1]


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
