"""The ``fraud-scoring`` entry point (``python -m cli``) as a user meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env["FRAUD_DATA_DIR"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        text=True,
        capture_output=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("command", ["serve", "stream"])
def test_long_running_commands_refuse_without_redis_url(command: str, tmp_path: Path) -> None:
    r = _cli([command], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "REDIS_URL" in r.stderr and "--embedded-redis" in r.stderr


def test_every_app_folder_contributes_its_subcommands(tmp_path: Path) -> None:
    r = _cli(["--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("simulate", "batch", "train", "evaluate", "serve", "stream", "demo", "emit"):
        assert name in r.stdout
    for command in ("serve", "stream"):
        assert "--embedded-redis" in _cli([command, "--help"], tmp_path).stdout


def test_train_names_a_bad_config_field(tmp_path: Path) -> None:
    bad = tmp_path / "train.yaml"
    bad.write_text("holdout_days: 3\nlightgbm:\n  num_leafs: 63\n")
    r = _cli(["train", "--config", str(bad)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "lightgbm.num_leafs" in r.stderr and str(bad) in r.stderr
