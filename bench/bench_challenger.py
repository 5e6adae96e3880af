"""What a challenger costs the scoring path (no HTTP): the batcher and scorer as the
service runs them, with the decision log's hand-off, side by side:

* ``champion only``: no challenger;
* ``shadow``: a challenger (the same model loaded a second time) scores every batch
  after its answers are released;
* ``canary 10 %``: that share of cards is decided by the challenger, which then runs
  before the answers for every batch holding such a card.

Rows/s and latency per call of 64 closed-loop callers, plus the share of logged
decisions that carry a challenger score (a run dropped as busy or late logs none).

    python -m bench.bench_challenger [--seconds 5] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis.asyncio as aioredis

from bench.bench_executor import closed_loop, row
from bench.world import BenchWorld, bench_world
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import producible_features
from service.core.batching import Batcher
from service.core.challenger import Challenger
from service.core.model import ModelHolder, load_model
from service.core.online_features import OnlineFeatureReader
from service.core.scoring import Scorer, ScoreRequest, ScoreResult
from service.settings import ServiceSettings as Settings


async def run(world: BenchWorld, seconds: float, concurrency: int) -> None:
    settings = Settings(
        redis_url=world.redis_url, data_dir=world.data_dir, model_repo=world.model_repo
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    client = aioredis.Redis.from_url(world.redis_url, max_connections=concurrency + 8)
    pool = ThreadPoolExecutor(1)
    logged: list[ScoreResult] = []

    def on_scored(
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
        shadow: bool = False,
    ) -> None:
        if not shadow:  # what DecisionLog.submit is handed (it only buffers)
            logged.extend(results)

    items = [ScoreRequest(Transaction.model_validate(r), False) for r in world.held_out(4000)]
    print(f"model v{model.version}, {concurrency} concurrent callers, {seconds:.0f} s each")
    print(f"{'path':<28} {'rows/s':>10} {'ratio':>7}")
    base: float | None = None
    for title, challenger_on, pct in (
        ("champion only", False, 0.0),
        ("shadow", True, 0.0),
        ("canary 10 %", True, 10.0),
    ):
        s = settings.model_copy(update={"canary_percent": pct})
        challenger = Challenger(s)
        if challenger_on:
            challenger.models.current = load_model(
                world.model_repo, "fraud", "latest", producible_features()
            )
        scorer = Scorer(
            client,
            OnlineFeatureReader(store.project),
            ModelHolder(model),
            s,
            pool,
            on_scored=on_scored,
            on_shadow=logged.extend,  # what DecisionLog.shadow_scored is handed
            challenger=challenger,
        )
        b: Batcher[ScoreRequest, ScoreResult] = Batcher(
            scorer.score_requests, max_batch_size=64, max_queue_delay_s=0.002, max_queue_size=10_000
        )
        b.start()

        async def submit(i: int, b: Batcher[ScoreRequest, ScoreResult] = b) -> object:
            return await b.submit(items[i % len(items)], time.monotonic() + 10)

        await closed_loop(submit, concurrency, 0.5)  # warm-up
        logged.clear()
        rate, lat = await closed_loop(submit, concurrency, seconds)
        await b.stop()
        await challenger.stop(drain_s=5)
        base = base or rate
        with_score = np.mean([r.challenger_score is not None for r in logged]) if logged else 0.0
        print(
            row(title, rate, lat, None if title == "champion only" else base)
            + f"  logged with a challenger score {with_score:.1%}"
        )
    await client.aclose()
    pool.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()
    with bench_world() as world:
        asyncio.run(run(world, a.seconds, a.concurrency))


if __name__ == "__main__":
    main()
