"""A small simulated world for benchmarks, built once under bench/results/ (gitignored).

Redis state does not survive the process, so every benchmark re-materializes the
features into its own Redis server (a few seconds) and reuses the parquet and model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batch_jobs.batch import day_range, run_batch
from batch_jobs.simulate import SimConfig, simulate
from batch_jobs.train import TrainConfig, train
from fraud_scoring.events import raw_row_to_event
from fraud_scoring.features import default_model_features
from fraud_scoring.model_repo import load_metadata, resolve, versions
from fraud_scoring.redis_server import redis_url
from fraud_scoring.storage import read_partition

if TYPE_CHECKING:
    from service.core.model import LoadedModel
    from service.core.scoring import Scorer

ROOT = Path(__file__).resolve().parent / "results" / "world"
CFG = SimConfig(cards=3000, merchants=300, days=14, seed=21)


@dataclass(frozen=True)
class BenchWorld:
    data_dir: Path
    model_repo: Path
    redis_url: str

    def held_out(self, limit: int = 5000) -> list[dict]:
        last = CFG.start + timedelta(days=CFG.days - 1)
        rows = read_partition(self.data_dir / "raw", "transactions", last).to_pylist()[:limit]
        return [raw_row_to_event(r) for r in rows]


class StoreState:
    """A store's keys as they are now (every key but the streams: the event logs the
    servers under test read and write stay as they are), put back by :meth:`restore`
    before each measure. Every measure then records its transactions into the same
    state: each event after its keys' newest (the live path, as in production), not a
    replay behind the events an earlier measure recorded at the same times (the held-out
    transactions are the same each time, with ids of their own)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client: Any = redis.Redis.from_url(url)
        keys = [
            k for k, t in self._types(list(self.client.scan_iter(count=5000))) if t != b"stream"
        ]
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.dump(k)
            pipe.pttl(k)
        got = pipe.execute()
        self.keys: dict[bytes, tuple[bytes, int]] = {
            k: (got[2 * i], max(0, got[2 * i + 1]))
            for i, k in enumerate(keys)
            if got[2 * i] is not None
        }

    def _types(self, keys: list[bytes]) -> list[tuple[bytes, bytes]]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.type(k)
        return list(zip(keys, pipe.execute(), strict=True))

    def restore(self) -> None:
        """The store as it was (streams aside): keys written since go, the others get
        their values back (~1 s for the bench world's ~50,000 keys)."""
        new = [k for k in self.client.scan_iter(count=5000) if k not in self.keys]
        pipe = self.client.pipeline(transaction=False)
        for k, t in self._types(new):
            if t != b"stream":
                pipe.delete(k)
        for k, (value, ttl_ms) in self.keys.items():
            pipe.restore(k, ttl_ms, value, replace=True)
        pipe.execute()


@contextlib.contextmanager
def bench_world(configured_redis: str | None = None) -> Iterator[BenchWorld]:
    logging.getLogger("feast").setLevel(logging.WARNING)
    data, models = ROOT / "data", ROOT / "models"
    last = CFG.start + timedelta(days=CFG.days - 1)
    if versions(models, "fraud") and (
        load_metadata(resolve(models, "fraud", "latest")).feature_names != default_model_features()
    ):  # built by older code (other features, maybe another raw schema): start afresh
        shutil.rmtree(ROOT)
    with redis_url(configured_redis) as url:
        if not (data / "raw").exists():
            simulate(CFG, data / "raw")
        run_batch(data, day_range(CFG.start, last - timedelta(days=1)), url)
        run_batch(data, [last], url, materialize=False)
        if not versions(models, "fraud"):
            train(data, url, models, TrainConfig(holdout_days=3, warmup_days=5))
        yield BenchWorld(data, models, url)


def world_scorer(world: BenchWorld) -> tuple[Scorer, Any, LoadedModel]:
    """The service's scorer for ``world``, its asyncio client and its model, built as the
    service builds them (``service/resources.py``: a pooled client whose replies hiredis
    parses, the model of the repository's latest version): for benchmarks of the scorer
    without HTTP. Call from a running event loop; close the client when done."""
    import redis.asyncio as aioredis

    from fraud_scoring.feast_store import open_store
    from fraud_scoring.features import producible_features
    from fraud_scoring.redis_clients import packed_by_hiredis
    from service.core.model import ModelHolder, load_model
    from service.core.online_features import OnlineFeatureReader
    from service.core.scoring import Scorer
    from service.settings import ServiceSettings

    settings = ServiceSettings(
        redis_url=world.redis_url, data_dir=world.data_dir, model_repo=world.model_repo
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    pool = aioredis.BlockingConnectionPool.from_url(world.redis_url, max_connections=64)
    client = aioredis.Redis.from_pool(packed_by_hiredis(pool))
    reader = OnlineFeatureReader(store.project)
    scorer = Scorer(client, reader, ModelHolder(model), settings, ThreadPoolExecutor(1))
    return scorer, client, model


@contextlib.contextmanager
def pinned_world() -> Iterator[tuple[BenchWorld, bool]]:
    """:func:`bench_world` with its Redis-protocol server on core 1 and this process on
    core 0 (when the machine has two cores or more; the second value says whether it
    does), as the scorer benchmarks measure."""
    pin = (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the Redis server started below inherits core 1
    with bench_world() as world:
        if pin:
            os.sched_setaffinity(0, {0})
        yield world, pin
