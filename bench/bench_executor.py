"""Executor-only benchmark (no HTTP): rows/s and latency of the model boundary.

Same model, same inputs, same number of concurrent callers, side by side:

* ``per-request``: every caller runs its own feature read and ONNX call (the naive path);
* ``batched``: callers submit to the dynamic batcher, which reads features for the whole
  batch in one pipelined round trip and runs one ONNX call.

Also the bare ONNX call (``model-only``, no Redis) for both, to show where time goes.

    python -m bench.bench_executor [--seconds 5] [--concurrency 64] [--no-pin]

As the service runs: on uvloop, the Redis client packing commands in C, the executor
pinned to core 0 and the Redis server it starts to core 1 (when the machine has two
cores), so Redis's own CPU is not counted as the executor's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import uvloop

from bench.world import BenchWorld, bench_world
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import producible_features
from fraud_scoring.redis_clients import packed_by_hiredis
from service.core.batching import Batcher
from service.core.model import ModelHolder, load_model
from service.core.online_features import OnlineFeatureReader
from service.core.scoring import Scorer
from service.settings import ServiceSettings as Settings


async def closed_loop(
    call: Callable[[int], Awaitable[object]], concurrency: int, seconds: float
) -> tuple[float, np.ndarray]:
    """``concurrency`` callers calling back to back; returns (calls/s, latencies in ms)."""
    lat: list[float] = []
    end = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await call(i)
            lat.append((time.perf_counter() - t0) * 1e3)
            i += concurrency

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return len(lat) / (time.perf_counter() - t0), np.array(lat)


def row(name: str, rate: float, lat: np.ndarray, base: float | None) -> str:
    ratio = f"{rate / base:6.1f}x" if base else "   1.0x"
    return (
        f"{name:<28} {rate:>10,.0f} {ratio}  p50 {np.median(lat):7.2f} ms  "
        f"p99 {np.quantile(lat, 0.99):7.2f} ms"
    )


BatchFn = Callable[[Sequence[Any]], Awaitable[Sequence[Any]]]


async def run(world: BenchWorld, seconds: float, concurrency: int, batch: int) -> None:
    settings = Settings(
        redis_url=world.redis_url, data_dir=world.data_dir, model_repo=world.model_repo
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    # As the service's scorer builds it: commands packed by hiredis (redis_clients).
    client = aioredis.Redis.from_pool(
        packed_by_hiredis(
            aioredis.ConnectionPool.from_url(world.redis_url, max_connections=concurrency + 8)
        )
    )
    pool = ThreadPoolExecutor(1)
    scorer = Scorer(client, OnlineFeatureReader(store.project), ModelHolder(model), settings, pool)
    txns = [Transaction.model_validate(r) for r in world.held_out(4000)]
    x_all = np.random.default_rng(0).random((len(txns), len(model.meta.features)), dtype=np.float32)
    loop = asyncio.get_running_loop()

    async def predict_one(i: int) -> object:
        return await loop.run_in_executor(pool, model.predict, x_all[i % len(x_all)][None, :])

    async def predict_batch(rows: Sequence[int]) -> list[float]:
        return list(
            await loop.run_in_executor(pool, model.predict, x_all[[r % len(x_all) for r in rows]])
        )

    async def score_one(i: int) -> object:
        return await scorer.score_batch([txns[i % len(txns)]])

    def far() -> float:
        return time.monotonic() + 10

    print(
        f"model v{model.version}, {len(model.meta.features)} features, {concurrency} "
        f"concurrent callers, {seconds:.0f} s each, max_batch_size={batch}"
    )
    print(f"{'path':<28} {'rows/s':>10} {'ratio':>7}")
    paths: list[tuple[str, Callable[[int], Awaitable[object]], BatchFn]] = [
        ("model-only", predict_one, predict_batch),
        ("features+model", score_one, scorer.score_batch),
    ]
    for title, single, batched_fn in paths:
        await closed_loop(single, concurrency, 0.5)  # warm-up
        base_rate, base_lat = await closed_loop(single, concurrency, seconds)
        print(row(f"{title} per-request", base_rate, base_lat, None))
        b: Batcher = Batcher(
            batched_fn, max_batch_size=batch, max_queue_delay_s=0.002, max_queue_size=10_000
        )
        b.start()
        items = txns if title == "features+model" else list(range(len(txns)))

        async def submit(i: int, b: Batcher = b, items: list = items) -> object:
            return await b.submit(items[i % len(items)], far())

        await closed_loop(submit, concurrency, 0.5)
        rate, lat = await closed_loop(submit, concurrency, seconds)
        await b.stop()
        print(row(f"{title} batched", rate, lat, base_rate))
    await client.aclose()
    pool.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--no-pin", action="store_true", help="let the executor and Redis share cores")
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the Redis server started below inherits core 1
    with bench_world() as world:
        if pin:
            os.sched_setaffinity(0, {0})  # the executor alone on core 0, as the service
        print(f"(executor pinned to core 0, Redis to core 1: {pin}; event loop: uvloop)")
        # The service's event loop (uvicorn runs uvloop).
        uvloop.run(run(world, a.seconds, a.concurrency, a.max_batch_size))


if __name__ == "__main__":
    main()
