"""The Spark engine: the daily snapshots and training's point-in-time join on Apache Spark.

Nothing here defines a feature. The daily snapshots run the very statements DuckDB runs
(generated from the declared views by ``batch_jobs/daily_features.py``: same inputs,
same SQL; only the parameter marker
differs, ``$name`` in DuckDB and ``:name`` in Spark). The point-in-time join has the
semantics of ``batch_jobs/training_set.point_in_time_join`` (Feast's file offline
store, one view at a time) and a test holds the two equal.

Spark is optional (``pip install '.[spark]'``, Java 17+): this module is imported only
when the Spark engine is asked for. The session's master comes from ``spark-submit`` or
``FRAUD_SPARK_MASTER``; without either it is ``local[*]``. Every session runs in UTC.

A day's snapshot is collected to the driver as Arrow and written by the same atomic
writer as DuckDB's (one ``part-0.parquet`` per view and day): about 100 bytes per card,
so a 10-million-card day needs about 1 GB of driver memory.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pandas as pd
import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from batch_jobs.daily_features import conform, day_inputs, snapshot_sql
from fraud_scoring.features import view_features, views
from fraud_scoring.storage import DataError, partition_days, partition_file

log = logging.getLogger(__name__)


def spark_session(master: str | None = None, conf: dict[str, str] | None = None) -> SparkSession:
    """The active Spark session, or a new one on ``master`` (``None``: what spark-submit
    set, else ``local[*]``) with ``conf`` (Spark settings). Session time zone UTC:
    snapshot instants are UTC."""
    builder = (
        SparkSession.builder.appName("fraud-scoring")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")  # bars garble the CLI's output
    )
    if master:
        builder = builder.master(master)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark


@contextlib.contextmanager
def spark_run(
    master: str | None = None, conf: dict[str, str] | None = None
) -> Iterator[SparkSession]:
    """A Spark session for one command (see :func:`spark_session`), stopped when the
    block ends."""
    spark = spark_session(master, conf)
    try:
        yield spark
    finally:
        spark.stop()


# daily_features.LABEL_COLUMNS in Spark's terms: the labels view before any chargeback.
_LABELS_DDL = "transaction_id STRING, label_time TIMESTAMP, is_fraud BOOLEAN"


def _spark_sql(sql: str) -> str:
    return re.sub(r"\$(\w+)", r":\1", sql)  # DuckDB's named parameters -> Spark's


def compute_day_spark(spark: SparkSession, raw: Path, day: date) -> dict[str, pa.Table]:
    """Every declared view's snapshot for ``day`` on Spark, the same tables as
    ``daily_features.compute_day``. Raises DataError when the day's raw partition is
    missing or empty, or Spark cannot read the history."""
    inputs = day_inputs(raw, day)
    try:
        own = str(partition_file(raw, "transactions", day))
        if spark.read.parquet(own).isEmpty():
            raise DataError(f"{own}: no transactions on {day}")
        for name, files in inputs.views.items():
            frame = spark.read.parquet(*files) if files else spark.createDataFrame([], _LABELS_DDL)
            frame.createOrReplaceTempView(name)
        tables = {}
        for view in views():
            sql = snapshot_sql(view)
            tables[view.name] = spark.sql(_spark_sql(sql), args=inputs.params_of(sql)).toArrow()
    except PySparkException as exc:
        raise DataError(f"reading raw history for {day} on Spark: {exc}") from exc
    return conform(tables)


def point_in_time_join_spark(
    spark: SparkSession, features_dir: Path, sample: pd.DataFrame
) -> pd.DataFrame:
    """``batch_jobs.training_set.point_in_time_join`` on Spark: ``sample`` (one row per
    ``transaction_id``, ``event_timestamp`` tz-aware, each view's join key) plus every
    batch feature of the newest snapshot with ``t - TTL <= event_timestamp <= t``, each
    view joined on its own; a view with no such snapshot leaves its features null. No
    row is lost; rows come back in ``sample``'s order. ``features_dir`` holds the daily
    snapshot tables (``<view>/date=*/part-0.parquet``)."""
    if sample["transaction_id"].duplicated().any():
        raise DataError("the sample holds a transaction twice")
    keys = sorted({v.join_key for v in views()})
    entity = sample[["transaction_id", "event_timestamp", *keys]].copy()
    entity["event_timestamp"] = pd.to_datetime(entity["event_timestamp"], utc=True)
    entity.insert(0, "_row", range(len(entity)))
    spark.createDataFrame(entity).createOrReplaceTempView("entity_rows")
    joined: DataFrame = spark.table("entity_rows")
    for view in views():
        files = [
            str(partition_file(features_dir, view.name, d))
            for d in partition_days(features_dir, view.name)
        ]
        if not files:
            raise DataError(f"no snapshot of {view.name} under {features_dir}")
        spark.read.parquet(*files).createOrReplaceTempView(f"snap_{view.name}")
        feats = ", ".join(f"s.{f.name}" for f in view_features(view))
        ttl_us = int(view.ttl.total_seconds()) * 1_000_000
        # Newest usable snapshot per entity row; ties on the timestamp cannot occur (one
        # snapshot per entity and day).
        best = spark.sql(
            f"""
            SELECT _row, {", ".join(f.name for f in view_features(view))} FROM (
              SELECT e._row, {feats}, row_number() OVER (
                PARTITION BY e._row ORDER BY s.event_timestamp DESC) AS place
              FROM entity_rows e JOIN snap_{view.name} s
                ON s.{view.join_key} = e.{view.join_key}
               AND s.event_timestamp <= e.event_timestamp
               AND unix_micros(s.event_timestamp) >= unix_micros(e.event_timestamp) - {ttl_us}
            ) AS c WHERE place = 1
            """
        )
        joined = joined.join(best, on="_row", how="left")
    out = pd.DataFrame(joined.orderBy("_row").toPandas())
    feature_cols = [f.name for v in views() for f in view_features(v)]
    return sample.reset_index(drop=True).join(out[feature_cols])
