"""Fraud labels as they stood at one instant: one label per transaction, by precedence,
and the decision log with them (:func:`decisions_with_labels`).

Labels arrive days after the transaction (``raw/labels/`` is partitioned by arrival
day), so "is this transaction fraud?" always has an as-of time. A transaction may have
several labels: a chargeback, an analyst's mark, a customer's report, a chargeback
cleared later. :func:`standing_labels` is the one rule that picks the label that stands,
among those that had arrived strictly before the as-of time:

1. by source: ``analyst`` > ``chargeback`` > any other (``customer``): an analyst's
   verdict overrules a chargeback or a report, a chargeback overrules a report;
2. within a source, the newest arrival (a later chargeback file clearing an earlier one,
   a second analyst's mark);
3. at one arrival instant within one source, fraud.

Training (``batch_jobs.labels.known_frauds``: ``train.load_transactions``, ``evaluate``'s
holdout refresh), the labelled view of the served decisions (:func:`decisions_with_labels`:
the served-traffic report, the champion/challenger comparison) and ``rules test`` (the
CLI's and the service's ``POST /v1/rules/test``) all take their labels from it.

A label's source: ``raw/label_sources/date=<arrival day>/part-0.parquet`` (written by
``fraud-scoring decisions compact`` for every label that came through the feedback log:
``transaction_id``, ``label_time``, ``is_fraud``, ``source``, ``key_id``, ``live``), matched on
(``transaction_id``, ``label_time``, ``is_fraud``). A label row without a match there (the
chargeback files ``ingest`` and ``simulate`` write, feedback compacted before sources
were kept) is a ``chargeback``. The label partitions themselves keep the data contract's
columns, so every label partition has the same columns whoever wrote it.

Everything here runs DuckDB (the jobs image's ``train`` extra, not the serving image's):
the service imports this module only when a rules test is asked
(``service.core.rule_log.log_reader``).
"""

from __future__ import annotations

from datetime import date, datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from fraud_scoring.storage import DataError, partition_days, partition_file

SOURCES_TABLE = "label_sources"
# The sources in their order of precedence; every other source ranks after them.
PRECEDENCE: tuple[str, ...] = ("analyst", "chargeback")
UNSOURCED = "chargeback"  # a label row that no source row matches
_TS = pa.timestamp("us", tz="UTC")
SOURCES_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string()),
        pa.field("label_time", _TS),
        pa.field("is_fraud", pa.bool_()),
        pa.field("source", pa.string()),
        pa.field("key_id", pa.string()),  # the key that sent it (None: before keys were kept)
        # The service recorded it in the label states when it arrived (the transaction's
        # first label, matched): it counts from its arrival, not from the next daily batch
        # (declared_sql.load_label_events). None: not recorded live, or before this field.
        pa.field("live", pa.bool_()),
    ]
)
# What :func:`standing_labels` answers, one row per transaction_id.
STANDING_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string()),
        pa.field("is_fraud", pa.bool_()),
        pa.field("label_time", _TS),
        pa.field("source", pa.string()),
    ]
)

_RANK = (
    "CASE source "
    + " ".join(f"WHEN '{s}' THEN {i}" for i, s in enumerate(PRECEDENCE))
    + f" ELSE {len(PRECEDENCE)} END"
)
_STANDING_SQL = f"""
WITH l AS (
  SELECT transaction_id, label_time, is_fraud FROM labels WHERE label_time < $as_of
), s AS (
  SELECT DISTINCT transaction_id, label_time, is_fraud, source FROM sources
), sourced AS (
  SELECT l.transaction_id, l.label_time, l.is_fraud, coalesce(s.source, '{UNSOURCED}') AS source
  FROM l LEFT JOIN s ON l.transaction_id = s.transaction_id
    AND l.label_time = s.label_time AND l.is_fraud = s.is_fraud
)
SELECT transaction_id, is_fraud, label_time, source FROM sourced
QUALIFY row_number() OVER (
  PARTITION BY transaction_id ORDER BY {_RANK}, label_time DESC, is_fraud DESC
) = 1
ORDER BY transaction_id
"""


def standing_labels(labels: pa.Table, sources: pa.Table, as_of: datetime) -> pa.Table:
    """The label that stands for each transaction of ``labels`` (``transaction_id``,
    ``label_time``, ``is_fraud``; more columns are ignored) among those that arrived
    strictly before ``as_of`` (timezone-aware), by the module's precedence, with its
    source from ``sources`` (:data:`SOURCES_SCHEMA`'s first four columns; unmatched:
    ``chargeback``). Rows of :data:`STANDING_SCHEMA`, by ``transaction_id``."""
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        con.register("labels", labels.select(["transaction_id", "label_time", "is_fraud"]))
        con.register(
            "sources", sources.select(["transaction_id", "label_time", "is_fraud", "source"])
        )
        got = con.sql(_STANDING_SQL, params={"as_of": as_of}).to_arrow_table()
    finally:
        con.close()
    return got.cast(STANDING_SCHEMA)


def read_table(raw: Path, table: str, columns: list[str], where: str, as_of: datetime) -> pa.Table:
    files = [str(partition_file(raw, table, d)) for d in partition_days(raw, table)]
    if not files:
        return pa.table({c: pa.array([], SOURCES_SCHEMA.field(c).type) for c in columns})
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        return con.sql(
            f"SELECT {', '.join(columns)} FROM read_parquet($f, union_by_name = true) {where}",
            params={"f": files, **({"as_of": as_of} if "$as_of" in where else {})},
        ).to_arrow_table()
    except duckdb.Error as exc:
        raise DataError(f"reading {raw / table}: {exc}") from exc
    finally:
        con.close()


def known_labels(raw: Path, as_of: datetime) -> pa.Table:
    """Each labelled transaction's standing label as of ``as_of`` (timezone-aware), from
    the label partitions under ``raw`` and their sources (:func:`standing_labels`). No
    label partitions: an empty table."""
    cols = ["transaction_id", "label_time", "is_fraud"]
    labels = read_table(raw, "labels", cols, "WHERE label_time < $as_of", as_of)
    sources = read_table(raw, SOURCES_TABLE, [*cols, "source"], "", as_of)
    return standing_labels(labels, sources, as_of)


def decisions_with_labels(raw: Path, first: date, last: date, as_of: datetime) -> pa.Table:
    """The decisions made on days ``first``..``last`` with the label known at ``as_of``
    (timezone-aware): ``is_fraud``, its ``label_time`` and ``label_source`` from the label
    that stands among those that had arrived strictly before ``as_of``
    (:func:`known_labels`: analyst > chargeback > other, the newest within a source), all
    null when none had. One row per ``transaction_id`` (its first decision), whatever the
    partitions hold. Raises DataError when no decision partition is in the range."""
    days = [d for d in partition_days(raw, "decisions") if first <= d <= last]
    if not days:
        raise DataError(f"no decision partitions under {raw / 'decisions'} for {first}..{last}")
    dfiles = [str(partition_file(raw, "decisions", d)) for d in days]
    known = known_labels(raw, as_of)
    con = duckdb.connect()
    try:
        con.register("known", known)
        sql = """
        SELECT d.*, known.is_fraud, known.label_time, known.source AS label_source
        FROM read_parquet($d, union_by_name = true) d LEFT JOIN known USING (transaction_id)
        QUALIFY row_number() OVER (PARTITION BY d.transaction_id ORDER BY d.decided_at) = 1
        ORDER BY d.decided_at, d.transaction_id
        """
        return con.sql(sql, params={"d": dfiles}).to_arrow_table()
    except duckdb.Error as exc:
        raise DataError(f"joining decisions with labels under {raw}: {exc}") from exc
    finally:
        con.close()
