"""The Spark engine against the local one, on a small world of its own.

Both engines run the same SQL (batch_jobs/daily_features.py), so the daily snapshots
must be equal value for value; training's point-in-time join on Spark must equal the
local (Feast) join, row for row. Spark needs Java 17+ and ``pip install '.[spark]'``:
without them these tests are skipped, saying which is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from batch_jobs.batch import run_batch
from batch_jobs.daily_features import compute_day, snapshot_time
from batch_jobs.simulate import SimConfig, simulate
from batch_jobs.training_set import point_in_time_join
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import view_features, views
from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.storage import partition_file

if shutil.which("java") is None:
    pytest.skip(
        "Spark tests need Java 17+ on PATH (e.g. apt-get install openjdk-17-jre-headless)",
        allow_module_level=True,
    )
pytest.importorskip("pyspark", reason="Spark tests need pyspark: pip install '.[spark]'")

CFG = SimConfig(cards=300, merchants=30, days=6, seed=17)


@dataclass(frozen=True)
class SparkWorld:
    spark: Any  # pyspark.sql.SparkSession
    data_dir: Path
    redis_url: str


@pytest.fixture(scope="module")
def spark_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkWorld]:
    """One local[2] Spark session for the module, and six simulated days whose
    snapshots DuckDB computed and Feast's registry knows."""
    from batch_jobs.spark_engine import spark_run

    root = tmp_path_factory.mktemp("spark-world")
    simulate(CFG, root / "raw")
    days = [CFG.start + timedelta(days=i) for i in range(CFG.days)]
    conf = {
        "spark.sql.shuffle.partitions": "4",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    with embedded_redis() as url, spark_run("local[2]", conf) as spark:
        spark.sparkContext.setLogLevel("ERROR")
        run_batch(root, days, url)
        yield SparkWorld(spark, root, url)


def test_spark_and_duckdb_compute_the_same_snapshots(spark_world: SparkWorld) -> None:
    from batch_jobs.spark_engine import compute_day_spark

    raw = spark_world.data_dir / "raw"
    # The first day (no label arrived yet: the empty labels view) and a later one.
    for day in (CFG.start, CFG.start + timedelta(days=CFG.days - 1)):
        ours, theirs = compute_day(raw, day), compute_day_spark(spark_world.spark, raw, day)
        for view in views():
            assert theirs[view.name].num_rows > 0
            assert theirs[view.name].equals(ours[view.name]), (day, view.name)


def test_batch_command_path_writes_the_same_files_on_spark(
    spark_world: SparkWorld, tmp_path: Path
) -> None:
    """run_batch with the Spark engine (what `batch --engine spark` does) writes files
    equal to the DuckDB run's."""
    import functools

    from batch_jobs.spark_engine import compute_day_spark

    shutil.copytree(spark_world.data_dir / "raw", tmp_path / "raw")
    day = CFG.start + timedelta(days=2)
    compute = functools.partial(compute_day_spark, spark_world.spark)
    run_batch(tmp_path, [day], "", materialize=False, compute=compute)
    for view in views():
        ours = pq.read_table(partition_file(spark_world.data_dir / "features", view.name, day))
        theirs = pq.read_table(partition_file(tmp_path / "features", view.name, day))
        assert theirs.equals(ours), view.name


def _sample(data_dir: Path) -> pd.DataFrame:
    """Transactions of every day, plus probes at the edges: exactly at a snapshot
    instant, a microsecond before it, before any snapshot, and past the TTL."""
    tx = pd.concat(
        pq.read_table(
            partition_file(data_dir / "raw", "transactions", CFG.start + timedelta(days=i)),
            columns=["transaction_id", "card_id", "merchant_id", "event_time"],
        ).to_pandas()
        for i in range(CFG.days)
    ).sample(600, random_state=5)
    first = tx.iloc[0]
    snap = pd.Timestamp(snapshot_time(CFG.start + timedelta(days=2)))
    edges = [
        snap,
        snap - pd.Timedelta(microseconds=1),
        pd.Timestamp(snapshot_time(CFG.start)) - pd.Timedelta(hours=1),
        snap + pd.Timedelta(days=200),
    ]
    probes = pd.DataFrame(
        {
            "transaction_id": [f"edge{i}" for i in range(len(edges))],
            "card_id": first.card_id,
            "merchant_id": first.merchant_id,
            "event_time": edges,
        }
    )
    out = pd.concat([tx, probes], ignore_index=True)
    return out.rename(columns={"event_time": "event_timestamp"})


def test_spark_point_in_time_join_equals_the_local_one(spark_world: SparkWorld) -> None:
    from batch_jobs.spark_engine import point_in_time_join_spark

    sample = _sample(spark_world.data_dir)
    store = open_store(spark_world.data_dir, spark_world.redis_url)
    local = point_in_time_join(store, sample).set_index("transaction_id")
    spark = point_in_time_join_spark(spark_world.spark, spark_world.data_dir / "features", sample)
    assert list(spark["transaction_id"]) == list(sample["transaction_id"])  # none lost
    spark = spark.set_index("transaction_id")
    assert pd.isna(local.loc["edge3", "card_txn_count_30d"])  # past the TTL
    assert pd.isna(local.loc["edge2", "merchant_txn_count_30d"])
    for f in (f for v in views() for f in view_features(v)):
        want, got = local.loc[sample["transaction_id"], f.name], spark[f.name]
        assert list(want.isna()) == list(got.isna()), f.name
        known = ~want.isna()
        if f.dtype == "string":
            assert list(want[known]) == list(got[known]), f.name
        else:
            np.testing.assert_array_equal(
                want[known].to_numpy(float), got[known].to_numpy(float), err_msg=f.name
            )
    assert spark["card_txn_count_30d"].notna().sum() > 300


def test_spark_reports_a_missing_partition(spark_world: SparkWorld) -> None:
    from batch_jobs.spark_engine import compute_day_spark
    from fraud_scoring.storage import DataError

    with pytest.raises(DataError, match="missing raw partition"):
        compute_day_spark(spark_world.spark, spark_world.data_dir / "raw", date(2020, 1, 1))
