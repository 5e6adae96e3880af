"""A small simulated world for benchmarks, built once under bench/results/ (gitignored).

Redis state does not survive the process, so every benchmark re-materializes the
features into its own Redis server (a few seconds) and reuses the parquet and model.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from batch_jobs.batch import day_range, run_batch
from batch_jobs.simulate import SimConfig, simulate
from batch_jobs.train import TrainConfig, train
from fraud_scoring.events import raw_row_to_event
from fraud_scoring.features import default_model_features
from fraud_scoring.model_repo import load_metadata, resolve, versions
from fraud_scoring.redis_server import redis_url
from fraud_scoring.storage import read_partition

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
