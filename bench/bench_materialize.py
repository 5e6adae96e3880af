"""Materialization throughput: Feast's ``FeatureStore.materialize`` vs the direct writer.

One day's snapshot of ``--cards`` cards and ``--merchants`` merchants (random values in
the declared schema, written where the daily job writes) is materialized by each path
into a fresh Redis of its own, in the same run (the direct writer ``--repeat`` times);
rows/s counts entity rows of both views. That the two leave the same Redis state is
tested in tests/test_materialize.py.

Besides wall-clock rows/s, each line gives rows per CPU-second of the writing process
(``time.process_time``) and of the Redis server (``INFO cpu``): on a machine shared with
other work the wall figure moves with the load, the CPU figures much less.

    python -m bench.bench_materialize [--cards 100000] [--merchants 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import redis

from batch_jobs.daily_features import output_schema, snapshot_time, write_day
from batch_jobs.materialize import materialize_days
from feature_repo.definitions import apply_definitions
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import BatchView, view_features, views
from fraud_scoring.redis_server import embedded_redis

DAY = date(2026, 1, 10)


def snapshot(view: BatchView, n: int, rng: np.random.Generator) -> pa.Table:
    schema = output_schema(view)
    cols: dict[str, pa.Array] = {
        view.join_key: pa.array([f"{view.entity[0]}{i:08d}" for i in range(n)]),
        "event_timestamp": pa.array([snapshot_time(DAY)] * n, schema.field(1).type),
    }
    for f in view_features(view):
        if f.dtype == "string":
            cols[f.name] = pa.array(rng.choice(["US", "GB", "DE", "FR"], n))
        elif f.dtype == "int64":
            cols[f.name] = pa.array(rng.integers(0, 500, n))
        else:
            cols[f.name] = pa.array(rng.random(n, dtype=np.float32) * 100)
    return pa.table(cols).cast(schema)


def _server_cpu(client: redis.Redis) -> float:
    """CPU seconds the Redis server has used (user + system)."""
    info: dict[str, Any] = client.info("cpu")  # type: ignore[assignment]
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cards", type=int, default=100_000)
    p.add_argument("--merchants", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3, help="runs of the direct writer")
    args = p.parse_args()
    logging.getLogger("feast").setLevel(logging.WARNING)
    rng = np.random.default_rng(1)
    sizes = {"card": args.cards, "merchant": args.merchants}
    rows = sum(sizes.values())
    start, end = snapshot_time(DAY), snapshot_time(DAY) + timedelta(seconds=1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        write_day(
            data / "features", DAY, {v.name: snapshot(v, sizes[v.entity], rng) for v in views()}
        )
        for name in ("feast", *["direct"] * args.repeat):
            with embedded_redis() as url:
                store = open_store(data, url)
                apply_definitions(store, data)
                server = redis.Redis.from_url(url)
                server_cpu0, cpu0, t0 = (
                    _server_cpu(server),
                    time.process_time(),
                    time.perf_counter(),
                )
                if name == "feast":
                    store.materialize(start_date=start, end_date=end)
                else:
                    materialize_days(store, url, data / "features", [DAY], start, end)
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                server_cpu = _server_cpu(server) - server_cpu0
                server.close()
            print(
                f"{name:>6}: {rows:,} rows in {wall:.2f}s = {rows / wall:,.0f} rows/s; "
                f"per CPU-second: writer {rows / cpu:,.0f}, Redis {rows / server_cpu:,.0f}, "
                f"both {rows / (cpu + server_cpu):,.0f} rows"
            )
        print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
