"""Daily batch features: snapshots as of the end of a day, one SQL for every engine.

For day ``D`` the snapshot's ``event_timestamp`` is ``D+1 00:00 UTC`` and it is built
only from transactions with ``event_time`` strictly before that instant (and, for the
merchant fraud rate, only from labels that had *arrived* before it). A transaction at
time ``t`` may use the snapshot when ``event_timestamp <= t``: everything in it happened
strictly before ``t``.

Each feature is one SQL expression below, named after the feature in
``fraud_scoring.features``; a test checks the two lists agree. The statements are the
only definition of the batch features: DuckDB (the default, :func:`compute_day`) and
Spark SQL (``batch_jobs/spark_engine.py``) both run them as written, so they keep to
SQL the two dialects share. Each engine binds the same inputs (:class:`DayInputs`): the
views ``tx_30d``, ``tx_90d``, ``tx_all`` (raw transaction partitions) and ``labels``,
and the named parameters ``$snap``, ``$start30``, ``$start90`` (UTC instants) and
``$snap_s`` (epoch seconds); DuckDB gets a one-line ``unix_micros`` macro, the name
Spark has built in.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from fraud_scoring.features import CARD_VIEW, MERCHANT_VIEW, BatchView, view_features
from fraud_scoring.storage import DataError, partition_days, partition_file, write_partition

log = logging.getLogger(__name__)

CARD_SQL = """
WITH w AS (
  SELECT card_id, merchant_id, country, amount FROM tx_30d
  WHERE event_time >= $start30 AND event_time < $snap
), ranked AS (
  SELECT card_id, country,
    row_number() OVER (PARTITION BY card_id ORDER BY n DESC, country) AS place
  FROM (SELECT card_id, country, count(*) AS n FROM w GROUP BY card_id, country) AS c
), top AS (
  SELECT card_id, country AS top_country FROM ranked WHERE place = 1
), seen AS (
  SELECT card_id, min(event_time) AS first_seen FROM tx_all
  WHERE event_time < $snap GROUP BY card_id
)
SELECT w.card_id,
  $snap AS event_timestamp,
  CAST(count(*) AS BIGINT) AS card_txn_count_30d,
  CAST(sum(w.amount) AS FLOAT) AS card_amount_sum_30d,
  CAST(avg(w.amount) AS FLOAT) AS card_amount_mean_30d,
  CAST(coalesce(stddev_pop(w.amount), 0) AS FLOAT) AS card_amount_std_30d,
  CAST(count(DISTINCT w.merchant_id) AS BIGINT) AS card_distinct_merchants_30d,
  CAST(count(DISTINCT w.country) AS BIGINT) AS card_distinct_countries_30d,
  CAST(($snap_s - unix_micros(seen.first_seen) / 1e6) / 86400 AS FLOAT)
    AS card_days_since_first_seen,
  CAST($snap_s AS BIGINT) AS card_snapshot_time,
  top.top_country AS card_top_country_30d
FROM w JOIN top ON w.card_id = top.card_id JOIN seen ON w.card_id = seen.card_id
GROUP BY w.card_id, seen.first_seen, top.top_country ORDER BY w.card_id
"""

MERCHANT_SQL = """
WITH w90 AS (
  SELECT transaction_id, merchant_id, amount, event_time FROM tx_90d
  WHERE event_time >= $start90 AND event_time < $snap
), known AS (
  SELECT DISTINCT transaction_id FROM labels WHERE label_time < $snap AND is_fraud
)
SELECT w90.merchant_id,
  $snap AS event_timestamp,
  CAST(count(*) FILTER (WHERE w90.event_time >= $start30) AS BIGINT)
    AS merchant_txn_count_30d,
  CAST(coalesce(sum(w90.amount) FILTER (WHERE w90.event_time >= $start30), 0) AS FLOAT)
    AS merchant_amount_sum_30d,
  CAST(count(known.transaction_id) / count(*) AS FLOAT) AS merchant_fraud_rate_90d
FROM w90 LEFT JOIN known ON w90.transaction_id = known.transaction_id
GROUP BY w90.merchant_id ORDER BY w90.merchant_id
"""

# The labels view when no chargeback has arrived yet (every fraud rate is then 0).
LABEL_COLUMNS = pa.schema(
    [
        pa.field("transaction_id", pa.string()),
        pa.field("label_time", pa.timestamp("us", tz="UTC")),
        pa.field("is_fraud", pa.bool_()),
    ]
)


@dataclass(frozen=True)
class DayInputs:
    """What both engines bind before running the SQL for one day: the parquet files of
    each input view (a view with no file is empty) and the named parameters."""

    views: dict[str, list[str]]
    params: dict[str, Any]

    def params_of(self, sql: str) -> dict[str, Any]:
        """The parameters ``sql`` names (DuckDB refuses any extra)."""
        return {k: self.params[k] for k in set(re.findall(r"\$(\w+)", sql))}


def snapshot_time(day: date) -> datetime:
    """The instant a day's snapshot describes: the end of ``day`` (next midnight, UTC)."""
    return datetime.combine(day + timedelta(days=1), datetime.min.time(), UTC)


def _files(raw: Path, table: str, first: date, last: date) -> list[str]:
    days = [d for d in partition_days(raw, table) if first <= d <= last]
    return [str(partition_file(raw, table, d)) for d in days]


def day_inputs(raw: Path, day: date) -> DayInputs:
    """The inputs of ``day``'s snapshot from the raw history under ``raw``: the files are
    the partitions each window can touch (the SQL bounds the window by event time).

    Raises DataError when the day's own raw partition is missing.
    """
    own = partition_file(raw, "transactions", day)
    if not own.exists():
        raise DataError(
            f"missing raw partition {own} (run `fraud-scoring ingest` or `fraud-scoring simulate`)"
        )
    snap = snapshot_time(day)
    return DayInputs(
        views={
            "tx_30d": _files(raw, "transactions", day - timedelta(days=29), day),
            "tx_90d": _files(raw, "transactions", day - timedelta(days=89), day),
            "tx_all": _files(raw, "transactions", date.min, day),
            "labels": _files(raw, "labels", date.min, day),
        },
        params={
            "snap": snap,
            "start30": snap - timedelta(days=30),
            "start90": snap - timedelta(days=90),
            "snap_s": int(snap.timestamp()),
        },
    )


def output_schema(view: BatchView) -> pa.Schema:
    """The snapshot table's schema, from the declarations: every engine's result is cast
    to it, so the parquet files are the same whichever engine wrote them."""
    types = {"float32": pa.float32(), "int64": pa.int64(), "string": pa.string()}
    return pa.schema(
        [
            pa.field(view.join_key, pa.string()),
            pa.field("event_timestamp", pa.timestamp("us", tz="UTC")),
            *(pa.field(f.name, types[f.dtype]) for f in view_features(view)),
        ]
    )


def compute_day(raw: Path, day: date) -> dict[str, pa.Table]:
    """Both views' snapshot for ``day`` from the raw history under ``raw``, on DuckDB.

    Raises DataError when the day's raw partition is missing, empty or unreadable.
    """
    inputs = day_inputs(raw, day)
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        con.execute("CREATE MACRO unix_micros(ts) AS epoch_us(ts)")  # Spark's name
        own = str(partition_file(raw, "transactions", day))
        n = con.sql("SELECT count(*) FROM read_parquet($f)", params={"f": [own]}).fetchall()
        if not n or n[0][0] == 0:
            raise DataError(f"{own}: no transactions on {day}")
        for name, files in inputs.views.items():
            if files:
                con.read_parquet(files).create_view(name)
            else:
                con.from_arrow(LABEL_COLUMNS.empty_table()).create_view(name)
        card = con.sql(CARD_SQL, params=inputs.params_of(CARD_SQL)).to_arrow_table()
        merchant = con.sql(MERCHANT_SQL, params=inputs.params_of(MERCHANT_SQL)).to_arrow_table()
    except duckdb.Error as exc:
        raise DataError(f"reading raw history for {day}: {exc}") from exc
    finally:
        con.close()
    return conform({CARD_VIEW.name: card, MERCHANT_VIEW.name: merchant})


def conform(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """Each view's table cast to :func:`output_schema` (raises DataError naming the view
    when a column is missing or cannot be cast)."""
    out = {}
    for view in (CARD_VIEW, MERCHANT_VIEW):
        schema = output_schema(view)
        try:
            out[view.name] = tables[view.name].select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise DataError(
                f"{view.name}: result does not fit its declared columns: {exc}"
            ) from exc
    return out


def write_day(features_root: Path, day: date, tables: dict[str, pa.Table]) -> None:
    """Replace the day's snapshot of every view (idempotent per day)."""
    for name, table in tables.items():
        write_partition(features_root, name, day, table)


def expected_columns(view: BatchView) -> list[str]:
    return [view.join_key, "event_timestamp", *(f.name for f in view_features(view))]
