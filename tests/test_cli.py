"""The ``fraud-scoring`` entry point (``python -m cli``) as a user meets it."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import service.edge.server
from cli.main import build_parser, main
from fraud_scoring.settings import Settings, get_settings


def _cli(args: list[str], tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env["FRAUD_DATA_DIR"] = str(tmp_path)
    env.update(extra_env)
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


def test_version_prints_the_installed_package_version(tmp_path: Path) -> None:
    r = _cli(["--version"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"fraud-scoring {importlib.metadata.version('fraud-scoring')}"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("FRAUD_PORT", "abc"), ("FRAUD_WORKERS", "0"), ("REDIS_URL", "http://localhost")],
)
def test_a_bad_setting_names_its_environment_variable(
    variable: str, value: str, tmp_path: Path
) -> None:
    r = _cli(["serve"], tmp_path, **{variable: value})
    assert r.returncode == 2, r.stderr
    assert f"invalid configuration: {variable}:" in r.stderr


def test_every_emit_flag_has_help_text() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("emit", "serve"):
        for action in sub.choices[name]._actions:
            assert action.help, f"{name} {'/'.join(action.option_strings)} has no help text"


def test_serve_flags_override_the_host_and_port_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k in list(os.environ):
        if k.startswith("FRAUD_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("REDIS_URL", "redis://localhost:6379/0")  # never connected
    monkeypatch.setenv("FRAUD_HOST", "10.0.0.1")
    monkeypatch.setenv("FRAUD_PORT", "9000")
    seen: list[Settings] = []
    monkeypatch.setattr(service.edge.server, "serve", seen.append)
    get_settings.cache_clear()
    try:
        assert main(["serve", "--host", "0.0.0.0", "--port", "8123"]) == 0
        assert main(["serve", "--workers", "3"]) == 0
    finally:
        get_settings.cache_clear()
    assert [(s.host, s.port, s.workers) for s in seen] == [
        ("0.0.0.0", 8123, 1),
        ("10.0.0.1", 9000, 3),
    ]
