"""The review queue (``service/loop/review_queue.py``): what it costs the decision log's writer,
how fast the page's reads are, and how many bytes an item holds.

Synthetic decisions with the default model's features (no world needed). Baselines from
the same run: the log's own write of the same batch (the writer's existing round trip),
and a bare PING (one round trip to the same server).

    python -m bench.bench_review [--items 20000] [--seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from fraud_scoring.event_log import LogRecord, RedisStreamProducer
from fraud_scoring.features import default_model_features
from fraud_scoring.redis_server import redis_url
from service.core.decision import Reason
from service.core.scoring import ScoreResult
from service.loop.review_queue import ReviewQueue

BATCH = 64  # decisions per writer call (the micro-batch)
REVIEW_SHARE = 0.02  # decisions that go to review (the README's holdout: ~1-2 %)


def decision(i: int, names: list[str], review: bool) -> tuple[ScoreResult, LogRecord]:
    """One decision and its log record, shaped as ``service.loop.decision_log.encode`` makes it."""
    rng = random.Random(i)
    tid = f"bench-{i:08d}"
    reasons = [Reason("MODEL_SCORE_REVIEW", "Model score 0.41 is at or above the review ...")]
    result = ScoreResult(
        tid, "review" if review else "approve", 0.41, reasons if review else [], "7", [], []
    )
    body = {
        "transaction_id": tid,
        "decided_at": time.time_ns() // 1000,
        "transaction": {
            "transaction_id": tid,
            "card_id": f"c{rng.randrange(10**7):07d}",
            "merchant_id": f"m{rng.randrange(10**5):05d}",
            "amount": round(rng.uniform(1, 3000), 2),
            "currency": "EUR",
            "event_time": "2026-11-30T07:00:00+01:00",
            "country": "DE",
            "channel": "ecom",
            "mcc": "5732",
            "device_id": None,
        },
        "features": {n: rng.random() * 100 for n in names},
        "missing": [],
        "stale": [],
        "score": 0.41,
        "model_version": "7",
        "decision": result.decision,
        "reasons": [r.code for r in result.reasons],
        "timing_ms": {"feature_read": 0.4, "inference": 0.2, "decision": 0.05, "batch_size": 64},
        "challenger_version": None,
        "challenger_score": None,
    }
    return result, LogRecord(tid, json.dumps(body, separators=(",", ":")).encode())


async def timed(fn: Callable[[], Awaitable[object]], seconds: float) -> np.ndarray:
    await fn()
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await fn()
        lat.append((time.perf_counter() - t0) * 1e3)
    return np.array(lat)


def line(name: str, ms: np.ndarray) -> str:
    p50, p99 = np.percentile(ms, [50, 99])
    return f"{name:<46} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   ({len(ms)} calls)"


async def run(url: str, items: int, seconds: float) -> None:
    names = default_model_features()
    stream = f"bench-review-{time.time_ns()}"
    queue = ReviewQueue(url, stream, retention_s=3 * 86_400, timeout_s=5)
    log = RedisStreamProducer(url, stream, retention_s=3 * 86_400, timeout_s=5)
    ping: Any = aioredis.Redis.from_url(url)

    # The writer's cost per micro-batch: the log's call, then the queue's.
    n_review = max(1, round(BATCH * REVIEW_SHARE))
    i = 0
    log_ms, queue_ms = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        batch = [decision(i + k, names, k < n_review) for k in range(BATCH)]
        i += BATCH
        t0 = time.perf_counter()
        await log.send([r for _, r in batch])
        t1 = time.perf_counter()
        await queue.add(batch)
        log_ms.append((t1 - t0) * 1e3)
        queue_ms.append((time.perf_counter() - t1) * 1e3)
    print(f"writer, per micro-batch of {BATCH} decisions ({n_review} review):")
    print("  " + line("decision log write (baseline)", np.array(log_ms)))
    print("  " + line("review queue add (after it)", np.array(queue_ms)))

    # Fill the queue to ``items`` (all review), as many as a busy day leaves.
    queued = await queue.page(0, 1)
    while queued[0] < items:
        todo = min(512, items - queued[0])
        await queue.add([decision(i + k, names, True) for k in range(todo)])
        i += todo
        queued = await queue.page(0, 1)
    sync: Any = redis.Redis.from_url(url)
    some = [m.decode() for m in sync.zrange(queue.key, 0, 199)]
    item_bytes = np.mean([sync.memory_usage(queue.item_key(t)) for t in some])
    zset_bytes = sync.memory_usage(queue.key) / sync.zcard(queue.key)
    print(
        f"queue of {queued[0]} items: {item_bytes:.0f} B per item + {zset_bytes:.0f} B in the set"
    )

    print("page reads:")
    print("  " + line("PING (one round trip, baseline)", await timed(lambda: ping.ping(), seconds)))
    print("  " + line("list: page(0, 50)", await timed(lambda: queue.page(0, 50), seconds)))
    deep = items - 50
    print(
        "  " + line(f"list: page({deep}, 50)", await timed(lambda: queue.page(deep, 50), seconds))
    )
    print("  " + line("open one: get(id)", await timed(lambda: queue.get(some[7]), seconds)))

    keys = [queue.key, stream, *sync.scan_iter(match=f"{{{stream}}}:*", count=10_000)]
    for s in range(0, len(keys), 10_000):
        sync.delete(*keys[s : s + 10_000])
    sync.close()
    await ping.aclose()
    await queue.close()
    await log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=20_000, help="items in the queue when read")
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    a = p.parse_args()
    with redis_url(os.environ.get("REDIS_URL"), allow_embedded=True) as url:
        asyncio.run(run(url, a.items, a.seconds))


if __name__ == "__main__":
    main()
