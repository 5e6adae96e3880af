"""The decision log into the offline store, and labels joined back by arrival time.

:func:`compact_day` reads one UTC day of the event log, *by the time the log stored each
entry* (the decision time, or a label's arrival; the transaction's own event time is in
the row), and writes:

* ``raw/decisions/date=D/part-0.parquet``: that day's decisions, one row per
  ``transaction_id`` (the first logged one; a retry the log let through is dropped, also
  across midnight: an id the day before's partition holds is not written again);
* the labels sent to ``POST /v1/feedback`` (and the review page) that day, merged into
  ``raw/labels/date=<arrival day>/part-0.parquet`` beside the chargebacks, in their
  columns (``card_id``, ``merchant_id``, ``event_time`` are null: a label carries only
  its id), one per (``transaction_id``, source), an analyst's per key too (the service's
  idempotence key); and their sources and key ids into
  ``raw/label_sources/date=<arrival day>/part-0.parquet`` (``fraud_scoring.labels``), which
  training's label precedence reads (analyst > chargeback > other).

Idempotent: a re-run rewrites the same rows (each partition replaced atomically, merged
with what it held: a re-run after the log dropped the day keeps the day's decisions; the
labels merge keeps the distinct rows). The stream keeps entries for
FRAUD_DECISION_LOG_RETENTION_S, so a day must be compacted within it.

:func:`decisions_with_labels` is the labelled view, with training's rules: a label counts
only if it had arrived strictly before ``as_of``, and of several the one that stands by
source. It lives in :mod:`fraud_scoring.labels` (the service's rules test reads it too) and
is re-exported here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa

from fraud_scoring import contract as C
from fraud_scoring.labels import SOURCES_SCHEMA, SOURCES_TABLE
from fraud_scoring.labels import decisions_with_labels as decisions_with_labels  # re-exported
from fraud_scoring.storage import (
    DataError,
    partition_file,
    read_partition,
    write_partition,
)

_TS = pa.timestamp("us", tz="UTC")
_STRINGS = pa.list_(pa.string())
DECISION_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string(), nullable=False),
        pa.field("decided_at", _TS),
        pa.field("event_time", _TS),
        pa.field("card_id", pa.string()),
        pa.field("merchant_id", pa.string()),
        pa.field("amount", pa.float64()),
        pa.field("currency", pa.string()),
        pa.field("country", pa.string()),
        pa.field("channel", pa.string()),
        pa.field("mcc", pa.string()),
        pa.field("device_id", pa.string()),
        pa.field("score", pa.float64()),
        pa.field("decision", pa.string()),
        pa.field("model_version", pa.string()),
        pa.field("reasons", _STRINGS),
        pa.field("missing", _STRINGS),
        pa.field("stale", _STRINGS),
        # Feature vectors differ between model versions: name -> value, in model order.
        pa.field("features", pa.map_(pa.string(), pa.float64())),
        pa.field("timing_ms", pa.map_(pa.string(), pa.float64())),
        pa.field("challenger_version", pa.string()),
        pa.field("challenger_score", pa.float64()),
        # Which model decided ("champion" | "challenger", the canary): model_version and
        # score are the decider's; the champion's are kept beside them.
        pa.field("routed_to", pa.string()),
        pa.field("champion_version", pa.string()),
        pa.field("champion_score", pa.float64()),
    ]
)
# The labels' columns (the data contract's, every field nullable as the compaction
# writes them): every label partition has exactly these, as the readers scan the
# partitions as one table.
LABEL_SCHEMA = pa.schema([f.with_nullable(True) for f in C.LABELS])


@dataclass(frozen=True)
class CompactReport:
    day: date
    decisions: int  # rows in the day's partition
    duplicates: int  # entries dropped as a repeated transaction_id
    labels: int  # feedback labels merged (after dedup)


def _time(v: str | int) -> datetime:
    if isinstance(v, int):  # epoch microseconds
        return datetime.fromtimestamp(v / 1e6, UTC)
    return datetime.fromisoformat(v).astimezone(UTC)


def decision_rows(payloads: Iterable[bytes]) -> tuple[list[dict], int]:
    """Decision log entries as rows of DECISION_SCHEMA, the first per transaction_id (in
    ``payloads``' order), sorted by (decided_at, transaction_id) so that a re-run writes
    the same file whatever order the log's partitions were read in; and how many repeats
    were dropped. Raises DataError naming a malformed entry."""
    rows: dict[str, dict] = {}
    dropped = 0
    for raw in payloads:
        try:
            e = json.loads(raw)
            t = e["transaction"]
            row = {
                "transaction_id": e["transaction_id"],
                "decided_at": _time(e["decided_at"]),
                "event_time": _time(t["event_time"]),
                **{k: t.get(k) for k in ("card_id", "merchant_id", "amount", "currency")},
                **{k: t.get(k) for k in ("country", "channel", "mcc", "device_id")},
                **{k: e[k] for k in ("score", "decision", "model_version", "reasons")},
                **{k: e[k] for k in ("missing", "stale")},
                "features": list(e["features"].items()),
                "timing_ms": list(e["timing_ms"].items()),
                "challenger_version": e.get("challenger_version"),
                "challenger_score": e.get("challenger_score"),
                # Entries from before the canary: the champion always decided.
                "routed_to": e.get("routed_to", "champion"),
                "champion_version": e.get("champion_version", e["model_version"]),
                "champion_score": e.get("champion_score", e["score"]),
            }
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"malformed decision log entry ({exc!r}): {raw[:200]!r}") from exc
        if row["transaction_id"] in rows:
            dropped += 1
        else:
            rows[row["transaction_id"]] = row
    return sorted(rows.values(), key=lambda r: (r["decided_at"], r["transaction_id"])), dropped


def feedback_labels(payloads: Iterable[bytes]) -> pa.Table:
    """Feedback entries as rows of ``fraud_scoring.labels.SOURCES_SCHEMA`` (the label's
    columns, its ``source`` and ``key_id``), the first per (transaction_id, source), for
    ``analyst`` per (transaction_id, source, key_id): the service's idempotence key
    (``service.edge.feedback.feedback_key``), so the compaction keeps what the Redis log
    keeps and drops what Kafka let through. Raises DataError naming a malformed entry."""
    seen: set[tuple[str, str, str | None]] = set()
    rows = []
    for raw in payloads:
        try:
            e = json.loads(raw)
            source, key_id = str(e["source"]), e.get("key_id")
            key = (e["transaction_id"], source, key_id if source == "analyst" else None)
            row = {
                "transaction_id": e["transaction_id"],
                "label_time": _time(e["label_time"]),
                "is_fraud": bool(e["is_fraud"]),
                "source": source,
                "key_id": key_id,
                "live": bool(e.get("live", False)),
            }
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"malformed feedback entry ({exc!r}): {raw[:200]!r}") from exc
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return pa.Table.from_pylist(rows, schema=SOURCES_SCHEMA)


def _merge(raw: Path, table: str, schema: pa.Schema, day: date, new: pa.Table) -> int:
    """Add ``new`` rows to ``day``'s partition of ``table`` (rows already there are kept
    once: a re-run adds nothing); returns the partition's row count."""
    if new.num_rows == 0:
        return 0
    old = schema.empty_table()
    if partition_file(raw, table, day).exists():
        held = read_partition(raw, table, day)
        # a column added since the partition was written (label_sources' live): null there
        old = pa.table(
            {
                f.name: held.column(f.name) if f.name in held.column_names else pa.nulls(len(held))
                for f in schema
            }
        ).cast(schema)
    con = duckdb.connect()
    try:
        con.register("rows", pa.concat_tables([old, new.select(schema.names).cast(schema)]))
        merged = con.sql(
            "SELECT DISTINCT * FROM rows ORDER BY label_time, transaction_id"
        ).to_arrow_table()
    finally:
        con.close()
    write_partition(raw, table, day, merged.cast(schema))
    return merged.num_rows


def merge_labels(raw: Path, day: date, new: pa.Table) -> int:
    """Add ``new`` label rows (:func:`feedback_labels`) to ``day``'s label partition, in
    the contract's columns, and their sources to its ``label_sources`` partition (rows
    already there are kept once: a re-run adds nothing); returns the label partition's
    row count."""
    if new.num_rows == 0:
        return 0
    labels = pa.table(
        {
            f.name: new.column(f.name) if f.name in new.column_names else pa.nulls(len(new))
            for f in LABEL_SCHEMA
        }
    )
    n = _merge(raw, "labels", LABEL_SCHEMA, day, labels)
    if "source" in new.column_names:
        _merge(raw, SOURCES_TABLE, SOURCES_SCHEMA, day, new)
    return n


def compact_day(
    raw: Path, day: date, decisions: Iterable[bytes], feedback: Iterable[bytes]
) -> CompactReport:
    """Write ``day``'s decisions and merge its feedback labels (the payloads the log
    stored that UTC day, in log order) under ``raw``; see the module's docstring."""
    rows, dropped = decision_rows(decisions)
    before = day - timedelta(days=1)
    if rows and partition_file(raw, "decisions", before).exists():
        seen = set(read_partition(raw, "decisions", before).column("transaction_id").to_pylist())
        kept = [r for r in rows if r["transaction_id"] not in seen]
        dropped += len(rows) - len(kept)
        rows = kept
    if partition_file(raw, "decisions", day).exists():
        # What an earlier run wrote stays: the log keeps a day only for its retention, so
        # a re-run after it (`batch` over past days) reads less, or nothing.
        old = read_partition(raw, "decisions", day).to_pylist()
        have = {r["transaction_id"] for r in old}
        new = [r for r in rows if r["transaction_id"] not in have]
        dropped += len(rows) - len(new)
        rows = sorted([*old, *new], key=lambda r: (r["decided_at"], r["transaction_id"]))
    write_partition(raw, "decisions", day, pa.Table.from_pylist(rows, schema=DECISION_SCHEMA))
    labels = feedback_labels(feedback)  # with their sources
    # A label belongs to its arrival day's partition (the log stores it a moment later,
    # so around midnight the two days can differ).
    arrival = [t.date() for t in labels.column("label_time").to_pylist()]
    for d in sorted(set(arrival)):
        merge_labels(raw, d, labels.filter(pa.array([a == d for a in arrival])))
    return CompactReport(day, len(rows), dropped, labels.num_rows)
