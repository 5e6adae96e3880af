"""Feast's own CLI on feature_repo/ (through ``fraud-scoring feast``) writes what the
daily job writes.

``fraud-scoring batch`` materializes two simulated days into Redis database 0; Feast's
``plan``, ``apply`` and ``materialize`` (the real ``feast`` CLI, run by the wrapper with
a relative ``FRAUD_DATA_DIR`` and the Redis address from ``REDIS_URL``) into database 1.
Every key and every hash field must be equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from batch_jobs.daily_features import snapshot_time
from batch_jobs.simulate import SimConfig, simulate
from fraud_scoring.redis_server import embedded_redis


@pytest.fixture(scope="module")
def redis_base() -> Iterator[str]:
    """A private server; its URL without the database number."""
    with embedded_redis() as url:
        yield url.rsplit("/", 1)[0]


def _cli(cwd: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    # Relative, as in the documented local default: the wrapper resolves it against cwd.
    env.update(FRAUD_DATA_DIR="data", REDIS_URL=redis_url)
    proc = subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=cwd,
        text=True,
        capture_output=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc


def _dump(url: str) -> dict[bytes, Any]:
    client = redis.Redis.from_url(url)
    try:
        # Feast's hashes; the per-view markers (strings) hold each run's own time, and
        # the declared states ({agg:...}, recorded by the batch job) are not Feast's.
        return {
            k: client.hgetall(k)
            for k in client.scan_iter(_type="HASH")
            if not k.startswith((b"{agg:", b"fraud:seen:"))
        }
    finally:
        client.close()


def test_feast_cli_materializes_what_the_batch_job_does(tmp_path: Path, redis_base: str) -> None:
    cfg = SimConfig(cards=120, merchants=15, days=2, seed=11)
    simulate(cfg, tmp_path / "data" / "raw")
    first, last = cfg.start, cfg.start + timedelta(days=1)
    batch_db, feast_db = f"{redis_base}/0", f"{redis_base}/1"

    _cli(tmp_path, batch_db, "batch", "--from", first.isoformat(), "--to", last.isoformat())

    plan = _cli(tmp_path, feast_db, "feast", "plan")
    assert "card_30d" in plan.stdout and "merchant_90d" in plan.stdout, plan.stdout
    _cli(tmp_path, feast_db, "feast", "apply")
    # The batch job's window: [first day's snapshot, last day's snapshot].
    start = snapshot_time(first).isoformat()
    end = (snapshot_time(last) + timedelta(seconds=1)).isoformat()
    done = _cli(tmp_path, feast_db, "feast", "--", "materialize", start, end)
    assert "feast materialize: done in" in done.stderr  # the wrapper's phase, timed

    by_batch, by_feast = _dump(batch_db), _dump(feast_db)
    assert by_batch, "the batch job materialized nothing"
    assert by_feast.keys() == by_batch.keys()
    differing = [k for k in by_batch if by_batch[k] != by_feast[k]]
    assert not differing, f"{len(differing)} of {len(by_batch)} hashes differ"
    # The wrapper marks the views materialized, as the batch job does (else the service
    # would read this store as empty and apply its degraded policy).
    marks = redis.Redis.from_url(feast_db).keys("fraud_scoring:materialized:*")
    assert len(marks) == 2, marks
    # The registry the CLI wrote is the one under the relative data dir.
    assert (tmp_path / "data" / "feast" / "registry.db").is_file()


def _feast_plan(cwd: Path, redis_url: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env.update(FRAUD_DATA_DIR="data", REDIS_URL=redis_url, **extra)
    return subprocess.run(
        [sys.executable, "-m", "cli", "feast", "plan"],
        cwd=cwd,
        text=True,
        capture_output=True,
        env=env,
        timeout=240,
    )


def test_feast_reads_the_declarations_the_product_applied(tmp_path: Path, redis_base: str) -> None:
    """The registry was applied from the team's own file (a device view besides the
    shipped ones): without FRAUD_FEATURES_FILE the wrapper reads that file, so Feast's plan
    deletes nothing; with the file gone, or another one named, it refuses (exit 2)."""
    import yaml

    from fraud_scoring import declared as D

    cfg = SimConfig(cards=80, merchants=10, days=2, seed=5)
    simulate(cfg, tmp_path / "data" / "raw")
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["snapshots"].append(
        {
            "view": "device_7d",
            "entity": "device_id",
            "window": "7d",
            "features": [{"name": "device_amount_max_7d", "agg": "max", "value": "amount"}],
        }
    )
    ours = tmp_path / "ours.yaml"
    ours.write_text(yaml.safe_dump(doc))
    url = f"{redis_base}/2"
    day = cfg.start.isoformat()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    env.update(FRAUD_DATA_DIR="data", REDIS_URL=url, FRAUD_FEATURES_FILE=str(ours))
    batch = subprocess.run(
        [sys.executable, "-m", "cli", "batch", "--from", day, "--to", day],
        cwd=tmp_path,
        text=True,
        capture_output=True,
        env=env,
        timeout=240,
    )
    assert batch.returncode == 0, batch.stderr

    plan = _feast_plan(tmp_path, url)
    assert plan.returncode == 0, plan.stderr
    assert f"reading the declarations the registry was applied from: {ours}" in plan.stderr
    assert "device_7d" in plan.stdout and "Deleted" not in plan.stdout, plan.stdout

    other = tmp_path / "other.yaml"
    other.write_text(D.DEFAULT_PATH.read_text())
    refused = _feast_plan(tmp_path, url, FRAUD_FEATURES_FILE=str(other))
    assert refused.returncode == 2, refused.stderr
    assert f"the Feast registry was applied from {ours}, and this command would read " in (
        refused.stderr
    )
    ours.rename(tmp_path / "moved.yaml")
    refused = _feast_plan(tmp_path, url)
    assert refused.returncode == 2, refused.stderr
    assert f"applied from {ours} (not found here)" in refused.stderr
    assert "Deleted" not in refused.stdout
