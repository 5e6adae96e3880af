"""Daily batch features: snapshots as of the end of a day, computed with DuckDB.

For day ``D`` the snapshot's ``event_timestamp`` is ``D+1 00:00 UTC`` and it is built
only from transactions with ``event_time`` strictly before that instant (and, for the
merchant fraud rate, only from labels that had *arrived* before it). A transaction at
time ``t`` may use the snapshot when ``event_timestamp <= t``: everything in it happened
strictly before ``t``.

Each feature is one SQL expression below, named after the feature in
``fraud_scoring.features``; a test checks the two lists agree.
"""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa

from fraud_scoring.features import CARD_VIEW, MERCHANT_VIEW, BatchView, view_features
from fraud_scoring.storage import DataError, partition_days, partition_file, write_partition

log = logging.getLogger(__name__)

CARD_SQL = """
WITH w AS (
  SELECT card_id, merchant_id, country, amount FROM read_parquet($files30)
  WHERE event_time >= $start30 AND event_time < $snap
), top AS (
  SELECT card_id, first(country ORDER BY n DESC, country) AS top_country
  FROM (SELECT card_id, country, count(*) AS n FROM w GROUP BY ALL) GROUP BY card_id
), seen AS (
  SELECT card_id, min(event_time) AS first_seen FROM read_parquet($files_all)
  WHERE event_time < $snap GROUP BY card_id
)
SELECT w.card_id,
  $snap::TIMESTAMPTZ AS event_timestamp,
  count(*)::BIGINT AS card_txn_count_30d,
  sum(amount)::FLOAT AS card_amount_sum_30d,
  avg(amount)::FLOAT AS card_amount_mean_30d,
  coalesce(stddev_pop(amount), 0)::FLOAT AS card_amount_std_30d,
  count(DISTINCT merchant_id)::BIGINT AS card_distinct_merchants_30d,
  count(DISTINCT country)::BIGINT AS card_distinct_countries_30d,
  (epoch($snap::TIMESTAMPTZ) - epoch(any_value(seen.first_seen)))::FLOAT / 86400
    AS card_days_since_first_seen,
  epoch($snap::TIMESTAMPTZ)::BIGINT AS card_snapshot_time,
  any_value(top.top_country) AS card_top_country_30d
FROM w JOIN top USING (card_id) JOIN seen USING (card_id)
GROUP BY w.card_id ORDER BY w.card_id
"""

MERCHANT_SQL = """
WITH w90 AS (
  SELECT transaction_id, merchant_id, amount, event_time FROM read_parquet($files90)
  WHERE event_time >= $start90 AND event_time < $snap
), known AS (
  SELECT DISTINCT transaction_id FROM read_parquet($label_files)
  WHERE label_time < $snap AND is_fraud
)
SELECT merchant_id,
  $snap::TIMESTAMPTZ AS event_timestamp,
  count(*) FILTER (WHERE event_time >= $start30)::BIGINT AS merchant_txn_count_30d,
  coalesce(sum(amount) FILTER (WHERE event_time >= $start30), 0)::FLOAT
    AS merchant_amount_sum_30d,
  (count(known.transaction_id)::DOUBLE / count(*))::FLOAT AS merchant_fraud_rate_90d
FROM w90 LEFT JOIN known USING (transaction_id)
GROUP BY merchant_id ORDER BY merchant_id
"""


def snapshot_time(day: date) -> datetime:
    """The instant a day's snapshot describes: the end of ``day`` (next midnight, UTC)."""
    return datetime.combine(day + timedelta(days=1), datetime.min.time(), UTC)


def _files(raw: Path, table: str, first: date, last: date) -> list[str]:
    days = [d for d in partition_days(raw, table) if first <= d <= last]
    return [str(partition_file(raw, table, d)) for d in days]


def compute_day(raw: Path, day: date) -> dict[str, pa.Table]:
    """Both views' snapshot for ``day`` from the raw history under ``raw``.

    Raises DataError when the day's raw partition is missing, empty or unreadable.
    """
    own = partition_file(raw, "transactions", day)
    if not own.exists():
        raise DataError(f"missing raw partition {own} (run `fraud-scoring simulate` or ingest)")
    snap = snapshot_time(day)
    all_files = _files(raw, "transactions", date.min, day)
    label_files = _files(raw, "labels", date.min, day) or []
    common = {"snap": snap, "start30": snap - timedelta(days=30)}
    card_params = {
        **common,
        "files30": _files(raw, "transactions", day - timedelta(days=29), day),
        "files_all": all_files,
    }
    params = {
        **common,
        "start90": snap - timedelta(days=90),
        "files90": _files(raw, "transactions", day - timedelta(days=89), day),
    }
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        n = con.sql("SELECT count(*) FROM read_parquet($f)", params={"f": [str(own)]}).fetchall()
        if not n or n[0][0] == 0:
            raise DataError(f"{own}: no transactions on {day}")
        card = con.sql(CARD_SQL, params=card_params).to_arrow_table()
        if label_files:
            merchant = con.sql(MERCHANT_SQL, params={**params, "label_files": label_files})
        else:  # no chargeback has arrived yet: every rate is 0
            sql = MERCHANT_SQL.replace(
                "read_parquet($label_files)",
                "(SELECT NULL::VARCHAR AS "
                "transaction_id, NULL::TIMESTAMPTZ AS label_time, "
                "NULL::BOOLEAN AS is_fraud)",
            )
            merchant = con.sql(sql, params=params)
        merchant_t = merchant.to_arrow_table()
    except duckdb.Error as exc:
        raise DataError(f"reading raw history for {day}: {exc}") from exc
    finally:
        con.close()
    return {CARD_VIEW.name: card, MERCHANT_VIEW.name: merchant_t}


def write_day(features_root: Path, day: date, tables: dict[str, pa.Table]) -> None:
    """Replace the day's snapshot of every view (idempotent per day)."""
    for name, table in tables.items():
        write_partition(features_root, name, day, table)


def expected_columns(view: BatchView) -> list[str]:
    return [view.join_key, "event_timestamp", *(f.name for f in view_features(view))]
