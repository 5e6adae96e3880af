"""Shared fixtures: a real Redis-protocol server, a small simulated world, a trained model.

Everything is built by the project's own code in temporary folders. ``REDIS_URL`` set in
the environment is NOT used by tests: each session starts its own server so tests never
touch a shared database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from fraud_scoring.redis_server import embedded_redis, free_port

SIM_START = date(2026, 1, 1)
SIM_DAYS = 16


@dataclass(frozen=True)
class World:
    data_dir: Path
    model_repo: Path
    redis_url: str
    start: date
    days: int

    @property
    def last_day(self) -> date:
        return self.start + timedelta(days=self.days - 1)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> World:
    """Simulate 16 days, compute features for all of them, train a model (about 20 s).

    The online store holds snapshots up to the end of the next-to-last day, so the last
    day is a held-out day that can be scored point-in-time correctly.
    """
    from batch_jobs.batch import day_range, run_batch
    from batch_jobs.simulate import SimConfig, simulate
    from batch_jobs.train import TrainConfig, train

    root = tmp_path_factory.mktemp("world")
    # Seed 26: the held-out last day holds all three fraud patterns (checked in a test).
    cfg = SimConfig(cards=2000, merchants=200, days=SIM_DAYS, start=SIM_START, seed=26)
    simulate(cfg, root / "data" / "raw")
    last = SIM_START + timedelta(days=SIM_DAYS - 1)
    run_batch(root / "data", day_range(SIM_START, last - timedelta(days=1)), redis_server)
    run_batch(root / "data", [last], redis_server, materialize=False)
    train(
        root / "data",
        redis_server,
        root / "models",
        TrainConfig(holdout_days=4, warmup_days=5, max_train_negatives=15_000),
    )
    return World(root / "data", root / "models", redis_server, SIM_START, SIM_DAYS)


def wait_until(
    cond: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
    proc: subprocess.Popen[bytes] | None = None,
) -> Any:
    """Poll ``cond`` until it returns a truthy value; fail after ``timeout`` seconds, or at
    once if ``proc`` (the process being waited on) exits."""
    end = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        try:
            v = cond()
            if v:
                return v
        except Exception as exc:  # keep polling; report the last error on timeout
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f": {last_exc!r}" if last_exc else "")
    )


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10)


def start_server(world: World, tmp: Path, wait_for: str = "/readyz", **env: str) -> Server:
    """``fraud-scoring serve`` in a subprocess, waiting until ``wait_for`` answers 200."""
    port = free_port()
    full_env = {
        **os.environ,
        "REDIS_URL": world.redis_url,
        "FRAUD_DATA_DIR": str(world.data_dir),
        "FRAUD_MODEL_REPO": str(world.model_repo),
        "FRAUD_PORT": str(port),
        "FRAUD_HOST": "127.0.0.1",
        "FRAUD_REQUEST_TIMEOUT_MS": "2000",
        **env,
    }
    log = tmp / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fraud_scoring.cli", "serve"],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()}")
        return httpx.get(f"{srv.url}{wait_for}", timeout=1).status_code == 200

    try:
        wait_until(ready, timeout=60, what="server readiness")
    except BaseException:
        stop_server(srv)
        raise
    return srv


def stop_server(srv: Server) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait()


@pytest.fixture(scope="module")
def server(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(world, tmp_path_factory.mktemp("srv"))
    yield srv
    stop_server(srv)
