"""Daily batch features: snapshots as of the end of a day, one generated SQL statement per
declared view for every engine.

For day ``D`` the snapshot's ``event_timestamp`` is ``D+1 00:00 UTC`` and it is built
only from transactions with ``event_time`` strictly before that instant (and, for the
fraud counts and rates, only from labels that had *arrived* before it). A transaction at
time ``t`` may use the snapshot when ``event_timestamp <= t``: everything in it happened
strictly before ``t``.

The views and their features are declared in the ``snapshots`` section of
``feature_repo/features.yaml`` (:mod:`fraud_scoring.snapshots`); :func:`snapshot_sql`
compiles each view into one statement, the only definition of its features: DuckDB
(the default, :func:`compute_day`) and Spark SQL (``batch_jobs/spark_engine.py``) both
run it as written, so it keeps to SQL the two dialects share. Each engine binds the same
inputs (:class:`DayInputs`): per view ``tx_<view>`` (the raw partitions its window can
touch), ``tx_all`` (all history, when a view reads a first-seen time) and ``labels``
(when it reads fraud labels), and the named parameters ``$snap`` and ``$start_<window>``
(UTC instants) and ``$snap_s`` (epoch seconds); DuckDB gets a one-line ``unix_micros``
macro, the name Spark has built in.
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

from fraud_scoring.declared import window_label
from fraud_scoring.feature_specs import BatchView, SnapshotAgg
from fraud_scoring.features import view_features
from fraud_scoring.features import views as views_declared
from fraud_scoring.snapshots import window_days
from fraud_scoring.storage import DataError, partition_days, partition_file, write_partition

log = logging.getLogger(__name__)


def _quote(v: str) -> str:
    return "'" + v.replace("'", "''") + "'"


def _condition(view: BatchView, a: SnapshotAgg) -> str | None:
    """The SQL condition that keeps ``a``'s transactions among the view's (None: all)."""
    parts = []
    if a.window_us and a.window_us != view.window_us:
        parts.append(f"w.event_time >= $start_{window_label(a.window_us)}")
    for col, allowed in a.filter:
        parts.append(f"w.{col} IN ({', '.join(_quote(x) for x in allowed)})")
    return " AND ".join(parts) or None


def _aggregate(view: BatchView, a: SnapshotAgg) -> str:
    """The aggregate expression of one of the view's features (not most_frequent,
    days_since_first_seen or snapshot_time: those are joined or constant)."""
    cond = _condition(view, a)
    v = f"w.{a.value}"
    pick = (lambda x: x) if cond is None else (lambda x: f"CASE WHEN {cond} THEN {x} END")
    n = "count(*)" if cond is None else f"count({pick('1')})"
    fraud = "count(known.transaction_id)"
    if cond is not None:
        fraud = f"count(CASE WHEN {cond} AND known.transaction_id IS NOT NULL THEN 1 END)"
    exprs = {
        "count": f"CAST({n} AS BIGINT)",
        "sum": f"CAST(coalesce(sum({pick(v)}), 0) AS FLOAT)",
        "mean": f"CAST(avg({pick(v)}) AS FLOAT)",
        "std": f"CAST(stddev_pop({pick(v)}) AS FLOAT)",
        "min": f"CAST(min({pick(v)}) AS FLOAT)",
        "max": f"CAST(max({pick(v)}) AS FLOAT)",
        "distinct_count": f"CAST(count(DISTINCT {pick(v)}) AS BIGINT)",
        "fraud_count": f"CAST({fraud} AS BIGINT)",
        # A rate over no transaction is no value: never a division by zero.
        "fraud_rate": f"CAST({fraud} / {n} AS FLOAT)"
        if cond is None
        else f"CAST(CASE WHEN {n} > 0 THEN {fraud} / {n} END AS FLOAT)",
    }
    return exprs[a.agg]


def snapshot_sql(view: BatchView) -> str:
    """``view``'s snapshot statement: one row per key with a transaction in the view's
    window, its key, ``event_timestamp`` and every declared feature (named after it)."""
    k = view.join_key
    used = {k, "event_time"}
    for a in view.aggs:
        used |= {a.value} if a.value else set()
        used |= {c for c, _ in a.filter}
    if any(a.agg.startswith("fraud_") for a in view.aggs):
        used.add("transaction_id")
    ctes = [
        f"w AS (\n  SELECT {', '.join(sorted(used))} FROM tx_{view.name}\n"
        f"  WHERE event_time >= $start_{window_label(view.window_us)} AND event_time < $snap\n"
        f"    AND {k} IS NOT NULL AND {k} <> ''\n)"
    ]
    joins_w, joins, selects = [], [], []
    if any(a.agg.startswith("fraud_") for a in view.aggs):
        ctes.append(
            "known AS (\n  SELECT DISTINCT transaction_id FROM labels\n"
            "  WHERE label_time < $snap AND is_fraud\n)"
        )
        joins_w.append("LEFT JOIN known ON w.transaction_id = known.transaction_id")
    grouped = [f"  {_aggregate(view, a)} AS {a.name}" for a in view.aggs if a.agg in AGGREGATES]
    for i, a in enumerate(view.aggs):
        if a.agg == "most_frequent":
            cond = _condition(view, a)
            where = f"w.{a.value} IS NOT NULL" + (f" AND {cond}" if cond else "")
            ctes.append(
                f"top{i} AS (\n  SELECT {k}, v FROM (\n"
                f"    SELECT {k}, v, row_number() OVER (PARTITION BY {k} ORDER BY n DESC, v)"
                " AS place\n"
                f"    FROM (SELECT w.{k}, w.{a.value} AS v, count(*) AS n FROM w WHERE {where}\n"
                f"          GROUP BY w.{k}, w.{a.value}) AS c\n"
                "  ) AS r WHERE place = 1\n)"
            )
            joins.append(f"LEFT JOIN top{i} ON top{i}.{k} = g.{k}")
            selects.append(f"  top{i}.v AS {a.name}")
        elif a.agg == "days_since_first_seen":
            if not any("seen AS" in c for c in ctes):
                ctes.append(
                    f"seen AS (\n  SELECT {k}, min(event_time) AS first_seen FROM tx_all\n"
                    f"  WHERE event_time < $snap GROUP BY {k}\n)"
                )
                joins.append(f"LEFT JOIN seen ON seen.{k} = g.{k}")
            selects.append(
                "  CAST(($snap_s - unix_micros(seen.first_seen) / 1e6) / 86400 AS FLOAT)"
                f" AS {a.name}"
            )
        elif a.agg == "snapshot_time":
            selects.append(f"  CAST($snap_s AS BIGINT) AS {a.name}")
    ctes.append(
        f"g AS (\nSELECT w.{k},\n"
        + ",\n".join(grouped or ["  count(*) AS _n"])
        + f"\nFROM w {' '.join(joins_w)}\nGROUP BY w.{k}\n)"
    )
    cols = [f"  g.{a.name}" for a in view.aggs if a.agg in AGGREGATES] + selects
    return (
        "WITH "
        + ",\n".join(ctes)
        + f"\nSELECT g.{k},\n  $snap AS event_timestamp,\n"
        + ",\n".join(cols)
        + f"\nFROM g {' '.join(joins)}\nORDER BY g.{k}\n"
    )


# The aggregations computed in the grouped query (the others are joined or constant).
AGGREGATES = {
    "count",
    "sum",
    "mean",
    "std",
    "min",
    "max",
    "distinct_count",
    "fraud_count",
    "fraud_rate",
}


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


def day_inputs(raw: Path, day: date, views: tuple[BatchView, ...] | None = None) -> DayInputs:
    """The inputs of ``day``'s snapshot of ``views`` (default: the declared ones) from the
    raw history under ``raw``: the files are the partitions each window can touch (the
    SQL bounds the window by event time).

    Raises DataError when the day's own raw partition is missing.
    """
    views = views_declared() if views is None else views
    own = partition_file(raw, "transactions", day)
    if not own.exists():
        raise DataError(
            f"missing raw partition {own} (run `fraud-scoring ingest` or `fraud-scoring simulate`)"
        )
    snap = snapshot_time(day)
    files = {
        f"tx_{v.name}": _files(raw, "transactions", day - timedelta(days=window_days(v) - 1), day)
        for v in views
    }
    aggs = [a for v in views for a in v.aggs]
    if any(a.agg == "days_since_first_seen" for a in aggs):
        files["tx_all"] = _files(raw, "transactions", date.min, day)
    if any(a.agg.startswith("fraud_") for a in aggs):
        files["labels"] = _files(raw, "labels", date.min, day)
    windows = {v.window_us for v in views} | {a.window_us for a in aggs if a.window_us}
    return DayInputs(
        views=files,
        params={
            "snap": snap,
            "snap_s": int(snap.timestamp()),
            **{f"start_{window_label(us)}": snap - timedelta(microseconds=us) for us in windows},
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
    """Every declared view's snapshot for ``day`` from the raw history under ``raw``, on
    DuckDB.

    Raises DataError when the day's raw partition is missing, empty or unreadable.
    """
    inputs = day_inputs(raw, day)
    con = duckdb.connect()
    tables = {}
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
        for view in views_declared():
            sql = snapshot_sql(view)
            tables[view.name] = con.sql(sql, params=inputs.params_of(sql)).to_arrow_table()
    except duckdb.Error as exc:
        raise DataError(f"reading raw history for {day}: {exc}") from exc
    finally:
        con.close()
    return conform(tables)


def conform(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """Each view's table cast to :func:`output_schema` (raises DataError naming the view
    when a column is missing or cannot be cast)."""
    out = {}
    for view in views_declared():
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
