"""Online feature read: Feast's own ``get_online_features`` vs the service's reader.

Both read the same keys from the same Redis (Feast's layout); the service's reader
(``service.core.online_features.OnlineFeatureReader``) adds the TTL check and the session reads and
does it all in one pipelined round trip. Both are timed for batches of 1 and 64
transactions; that they return the same values is tested in tests/test_feast_layout.py.

With ``--cluster`` the store is a local Redis Cluster of three primaries (the embedded
server binary): the service's reader then sends one pipeline per node, concurrently on
asyncio (the service's path), one after the other's write on the sync client.

    python -m bench.bench_feature_read [--seconds 3] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.world import bench_world
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.redis_clients import async_client, sync_client
from fraud_scoring.redis_server import embedded_cluster
from service.core.online_features import OnlineFeatureReader


def timed(fn: Callable[[], object], seconds: float) -> np.ndarray:
    fn()
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e3)
    return np.array(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--cluster", action="store_true", help="a local 3-primary Redis Cluster")
    a = p.parse_args()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(embedded_cluster()).url if a.cluster else None
        world = stack.enter_context(bench_world(url))
        run(world, a.seconds)


def run(world: Any, seconds: float) -> None:
    store = open_store(world.data_dir, world.redis_url)
    reader = OnlineFeatureReader(store.project)
    client = sync_client(world.redis_url)
    for script in reader.scripts:  # the reader's scripts (every primary)
        client.script_load(script)
    loop = asyncio.new_event_loop()
    aclient = async_client(world.redis_url)
    txns = [Transaction.model_validate(r) for r in world.held_out(64)]
    service = store.get_feature_service("fraud_model")

    def feast_read(batch: list[Transaction]) -> dict:
        return store.get_online_features(
            features=service,
            entity_rows=[{"card_id": t.card_id, "merchant_id": t.merchant_id} for t in batch],
        ).to_dict()

    def own_read(batch: list[Transaction]) -> dict:
        pipe = client.pipeline(transaction=False)
        reader.queue(pipe, batch)
        return reader.parse(pipe.execute(), batch).columns

    async def read_async(batch: list[Transaction]) -> dict:
        pipe = aclient.pipeline(transaction=False)
        reader.queue(pipe, batch)
        return reader.parse(await pipe.execute(), batch).columns

    def own_read_async(batch: list[Transaction]) -> dict:
        return loop.run_until_complete(read_async(batch))

    print(f"{'reader':<36} {'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'rows/s':>10}")
    for n in (1, 64):
        batch = txns[:n]
        base = None
        for name, fn in (
            ("feast get_online_features (batch)", feast_read),
            ("service reader (batch + session)", own_read),
            ("service reader, asyncio (as served)", own_read_async),
        ):
            lat = timed(functools.partial(fn, batch), seconds)
            rate = n / (np.median(lat) / 1e3)
            ratio = "" if base is None else f"  {rate / base:.1f}x"
            base = base or rate
            print(
                f"{name:<36} {n:>5} {np.median(lat):>8.3f} "
                f"{np.quantile(lat, 0.99):>8.3f} {rate:>10,.0f}{ratio}"
            )

    loop.run_until_complete(aclient.aclose())
    loop.close()
    client.close()


if __name__ == "__main__":
    main()
