"""The batch jobs' progress on a terminal (``batch_jobs/progress.py``): ``batch`` and
``train`` run under a pseudo-terminal show their long phases live, and the materialize
line's rows/s is the writer's own (timed apart from the declared states' backfill)."""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import yaml

from tests.conftest import World


def on_a_terminal(args: list[str], env: dict[str, str], timeout_s: float = 600) -> tuple[int, str]:
    """Run ``python -m cli *args`` with stdout and stderr on a pseudo-terminal; its exit
    status and everything it wrote (carriage returns kept)."""
    main, child = pty.openpty()
    # A terminal's size: tqdm draws nothing 0 columns wide (a bare pty's size).
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", *args], stdout=child, stderr=child, env=env, close_fds=True
    )
    os.close(child)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError as exc:  # EIO: the child closed the terminal
                if exc.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode, out.decode(errors="replace")


def test_batch_and_train_show_their_phases_on_a_terminal(world: World, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(world.data_dir / "raw", data / "raw")
    shutil.copytree(world.data_dir / "features", data / "features")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FRAUD_", "REDIS_", "PROMETHEUS_MULTIPROC"))
    }
    # No REDIS_URL: a private server, empty, so the batch backfills every declared state.
    env.update(FRAUD_DATA_DIR=str(data), FRAUD_MODEL_REPO=str(tmp_path / "models"))
    day = world.last_day.isoformat()

    status, out = on_a_terminal(["batch", "--from", day, "--to", day], env)
    assert status == 0, out
    assert re.search(r"\rdaily features: .*1/1", out), out  # tqdm, as before
    writer = re.search(r"\rmaterialize [\d,]+ entity rows \(direct\): \d\d:\d\d", out)
    declared = re.search(r"\rdeclared states: backfill of new states.*: \d\d:\d\d", out)
    assert writer and declared, out
    # The writer's phase ends before the declared backfill starts, and the rows/s figure
    # divides by the writer's own time.
    done = re.search(r"materialize [\d,]+ entity rows \(direct\): done in ([\d.]+)s", out)
    backfill = out.index("declared backfill:")
    assert done and done.end() < backfill, out
    line = re.search(
        r"materialized (\d+) entity rows in ([\d.]+)s \((\d+) rows/s, the writer alone\); "
        r"declared states recorded in ([\d.]+)s",
        out,
    )
    assert line, out
    rows, secs, rate = int(line[1]), float(line[2]), int(line[3])
    assert secs <= float(done[1]) + 0.05
    assert abs(rows - rate * secs) <= rate * 0.006 + 1, (rows, secs, rate)  # %.2f s, %.0f
    # The printed summary rounds the same time to one decimal (from the unrounded value:
    # 10.649 s logs "10.65" and prints "10.6", so compare within a rounding step).
    summary = re.search(r"declared states in ([\d.]+)s", out)
    assert summary and abs(float(summary[1]) - float(line[4])) <= 0.051, out

    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "holdout_days": 4,
                "warmup_days": 5,
                "max_train_negatives": 15_000,
                "force": True,
                "lightgbm": {"n_estimators": 40},
            }
        )
    )
    status, out = on_a_terminal(["train", "--config", str(config)], env)
    assert status == 0, out
    for phase in ("point-in-time join of", "request, session and spanning features"):
        assert re.search(rf"\r{re.escape(phase)}.*: \d\d:\d\d", out), (phase, out)
    assert re.search(r"\rLightGBM on [\d,]+ rows: \d\d:\d\d, round \d+/40", out), out
