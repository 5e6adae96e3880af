"""The arrivals of the declared states of labels and decisions (``source: labels`` /
``decisions``): the events the daily batch and training read from the raw labels and the
compacted decisions, each available from when the online store has it
(:func:`load_label_events`, :func:`load_decision_events`, :func:`labels_for`), and their
recording in the store (:func:`record_labels`). The window SQL and the backfill that read
them are in :mod:`batch_jobs.declared_sql`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
from redis.cluster import RedisCluster

from fraud_scoring import declared as D
from fraud_scoring.labels import SOURCES_TABLE
from fraud_scoring.storage import DataError, partition_days, partition_dir

log = logging.getLogger(__name__)

# The columns of an arrivals frame (load_label_events, load_decision_events).
ARRIVAL_COLUMNS = [
    "source",
    "transaction_id",
    "event_us",
    "label_us",
    "available_us",
    *D.KEY_COLUMNS,
    "amount",
    *D.ARRIVAL_VALUE_COLUMNS,
    *D.ARRIVAL_FILTER_COLUMNS,
]


def _ts(e: D.Event) -> int:
    return e.ts_us


def _label_rows(labels: pd.DataFrame | None) -> list[dict[str, Any]]:
    if labels is None or not len(labels):
        return []
    return labels.to_dict("records")  # type: ignore[return-value]


def record_labels(client: Any, decl: D.Declarations, labels: pd.DataFrame, horizon_s: float) -> int:
    """Record newly arrived ``labels`` (:func:`labels_for`: labels and decisions) in
    the states of their source, as the daily batch does for each day's arrivals:
    idempotent per transaction_id, so a rerun (or one a backfill already recorded)
    changes nothing. Returns the events recorded."""
    rows = _label_rows(labels)
    specs = [s for s in decl.specs if s.arrivals]
    if not rows or not specs:
        return 0
    cluster = isinstance(client, RedisCluster)
    for script in D.SCRIPTS:
        client.script_load(script)
    pipe = client.pipeline(transaction=False)
    for spec in specs:
        by_key = {
            k: sorted(v, key=lambda e: e.ts_us) for k, v in D.label_events_for(spec, rows).items()
        }
        if by_key:
            D.queue_apply(pipe, spec, by_key, D.Limits.for_spec(spec, horizon_s), per_key=cluster)
    return _send(pipe)


def _columns(con: Any, relation: str, params: dict[str, Any]) -> set[str]:
    probe = f"SELECT * FROM {relation} LIMIT 0"
    used = {k: v for k, v in params.items() if "$" + k in probe}
    return set(con.sql(probe, params=used).columns)


def _label_join(
    con: Any,
    lab_from: str,
    txn_from: str,
    params: dict[str, Any],
    after_s: float,
    live_from: str | None = None,
) -> pd.DataFrame:
    """Each labelled transaction's first label (arrived before ``$before``) with its
    transaction's columns, from the relations ``lab_from`` and ``txn_from``, and when it
    counts from (``available_us``): its arrival when the service recorded it live (a row
    of ``live_from`` with ``live`` true at its ``transaction_id`` and ``label_time``: the
    label sources), else the daily batch after its arrival day."""
    have = _columns(con, txn_from, params)
    picked = [f"any_value(t.{c}) AS {c}" if c in have else f"NULL AS {c}" for c in D.KEY_COLUMNS]
    live = "SELECT NULL::VARCHAR AS transaction_id, NULL::TIMESTAMPTZ AS label_time LIMIT 0"
    if live_from is not None and "live" in _columns(con, live_from, params):
        live = f"SELECT DISTINCT transaction_id, label_time FROM {live_from} WHERE live"
    got = con.execute(
        f"""
        WITH l AS (
          SELECT transaction_id, min(label_time) AS label_time, bool_or(is_fraud) AS is_fraud
          FROM {lab_from} WHERE label_time < $before GROUP BY transaction_id
        ), t AS (
          SELECT * FROM {txn_from} WHERE transaction_id IN (SELECT transaction_id FROM l)
        ), v AS ({live})
        SELECT l.transaction_id, epoch_us(any_value(t.event_time)) AS event_us,
               epoch_us(any_value(l.label_time)) AS label_us, any_value(l.is_fraud) AS is_fraud,
               {", ".join(picked)}, any_value(t.amount) AS amount,
               bool_or(v.transaction_id IS NOT NULL) AS live
        FROM l JOIN t USING (transaction_id)
          LEFT JOIN v ON v.transaction_id = l.transaction_id AND v.label_time = l.label_time
        GROUP BY l.transaction_id
        ORDER BY label_us, l.transaction_id
        """,
        params,
    ).df()
    got["live"] = got["live"].astype(bool)
    got["available_us"] = [
        int(us) if live else D.label_available_us(int(us), after_s)
        for us, live in zip(got["label_us"], got["live"], strict=True)
    ]
    return got


def label_events(
    labels: pd.DataFrame,
    history: pd.DataFrame,
    after_s: float,
    arrived_before: datetime | None = None,
) -> pd.DataFrame:
    """:func:`load_label_events` over frames: ``labels`` (transaction_id, label_time,
    is_fraud, and optionally ``live``: the service recorded it when it arrived) joined to
    the transactions of ``history``."""
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        con.register("lab_frame", labels[["transaction_id", "label_time", "is_fraud"]])
        con.register("txn_frame", history)
        live = None
        if "live" in labels:
            con.register("live_frame", labels[["transaction_id", "label_time", "live"]])
            live = "live_frame"
        before = arrived_before or datetime.max.replace(tzinfo=UTC)
        return _label_join(con, "lab_frame", "txn_frame", {"before": before}, after_s, live)
    finally:
        con.close()


def labels_for(
    specs: Sequence[D.Spec], raw: Path, after_s: float, **which: Any
) -> pd.DataFrame | None:
    """The arrivals ``specs`` count, one frame (column ``source``):
    :func:`load_label_events` when any counts labels, :func:`load_decision_events` when
    any counts decisions (``which``: their ``first``/``last``/``arrived_before``); None
    when none does, reading nothing."""
    loaders = {"labels": load_label_events, "decisions": load_decision_events}
    parts = [
        loaders[src](raw, after_s, **which).assign(source=src)
        for src in D.ARRIVALS
        if any(s.source == src for s in specs)
    ]
    if not parts:
        return None
    full = [p for p in parts if len(p)]
    return pd.concat(full, ignore_index=True) if len(full) > 1 else (full or parts)[0]


def _days(raw: Path, table: str, first: date | None, last: date | None) -> list[date]:
    """``table``'s partition days in ``first..last`` (either end open when None)."""
    return [
        d
        for d in partition_days(raw, table)
        if (first is None or d >= first) and (last is None or d <= last)
    ]


def load_decision_events(
    raw: Path,
    after_s: float,
    first: date | None = None,
    last: date | None = None,
    arrived_before: datetime | None = None,
) -> pd.DataFrame:
    """The service's decisions made on ``first..last`` (the decision log's partitions
    under ``raw/decisions``, written by ``fraud-scoring decisions compact``; default
    all) and before ``arrived_before``: :func:`decision_events` of them."""
    days = _days(raw, "decisions", first, last)
    if not days:
        return pd.DataFrame(columns=[c for c in ARRIVAL_COLUMNS if c != "source"])
    files = [str(partition_dir(raw, "decisions", d) / "part-0.parquet") for d in days]
    try:
        return _decisions(
            "read_parquet($files, union_by_name => true)", {"files": files}, after_s, arrived_before
        )
    except duckdb.Error as exc:
        raise DataError(f"reading decisions under {raw / 'decisions'}: {exc}") from exc


def decision_events(
    decisions: pd.DataFrame, after_s: float, arrived_before: datetime | None = None
) -> pd.DataFrame:
    """Decisions (rows of the decision log's partitions: ``transaction_id``,
    ``decided_at``, ``event_time``, the transaction's columns as scored, ``score``,
    ``decision``) as arrivals: one per transaction (its first), with ``event_us``,
    ``label_us`` (when it was decided) and ``available_us`` (the daily batch after that
    day, as labels: ``declared.label_available_us`` with ``after_s``)."""
    cols = [c for c in (*D.KEY_COLUMNS, "amount") if c in decisions] + [
        "transaction_id",
        "decided_at",
        "event_time",
        "score",
        "decision",
    ]
    frame = decisions[cols].assign(
        **{c: None for c in (*D.KEY_COLUMNS, "amount") if c not in decisions}
    )
    return _decisions("dec_frame", {}, after_s, arrived_before, frame)


def _decisions(
    rel: str,
    params: dict[str, Any],
    after_s: float,
    arrived_before: datetime | None,
    frame: pd.DataFrame | None = None,
) -> pd.DataFrame:
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        if frame is not None:
            con.register("dec_frame", frame)
        got = con.execute(
            f"""
            SELECT transaction_id, epoch_us(event_time) AS event_us,
                   epoch_us(decided_at) AS label_us, {", ".join(D.KEY_COLUMNS)},
                   CAST(amount AS DOUBLE) AS amount, CAST(score AS DOUBLE) AS score,
                   CAST(decision AS VARCHAR) AS decision
            FROM {rel}
            WHERE decided_at < $before
            QUALIFY row_number() OVER (PARTITION BY transaction_id ORDER BY decided_at) = 1
            ORDER BY label_us, transaction_id
            """,
            params | {"before": arrived_before or datetime.max.replace(tzinfo=UTC)},
        ).df()
    finally:
        con.close()
    got["available_us"] = [D.label_available_us(int(x), after_s) for x in got["label_us"]]
    return got


def load_label_events(
    raw: Path,
    after_s: float,
    first: date | None = None,
    last: date | None = None,
    arrived_before: datetime | None = None,
) -> pd.DataFrame:
    """The labels that arrived on ``first..last`` (their partition days; default all)
    and before ``arrived_before``, one per transaction (its first), each with its
    transaction's columns (key columns, ``amount``), ``event_us``, ``label_us`` and
    ``available_us``: when the online store has it, the daily batch after its arrival
    day (``declared.label_available_us`` with ``after_s``). Labels whose transaction is
    not in the raw history are left out."""
    days = _days(raw, "labels", first, last)
    tx_days = partition_days(raw, "transactions")
    if not days or not tx_days:
        cols = ["transaction_id", "event_us", "label_us", "is_fraud", *D.KEY_COLUMNS, "amount"]
        return pd.DataFrame(columns=[*cols, "live", "available_us"])
    params = {
        "lab": [str(partition_dir(raw, "labels", d) / "part-0.parquet") for d in days],
        "txn": [str(partition_dir(raw, "transactions", d) / "part-0.parquet") for d in tx_days],
        "before": arrived_before or datetime.max.replace(tzinfo=UTC),
    }
    # The label sources of those days (written by the compaction of the feedback log):
    # which labels the service recorded live.
    src_days = _days(raw, SOURCES_TABLE, first, last)
    if src_days:
        params["src"] = [
            str(partition_dir(raw, SOURCES_TABLE, d) / "part-0.parquet") for d in src_days
        ]
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        return _label_join(
            con,
            "read_parquet($lab, union_by_name => true)",
            "read_parquet($txn, union_by_name => true)",
            params,
            after_s,
            "read_parquet($src, union_by_name => true)" if src_days else None,
        )
    except duckdb.Error as exc:
        raise DataError(f"reading labels under {raw / 'labels'}: {exc}") from exc
    finally:
        con.close()


def _send(pipe: Any) -> int:
    replies: Sequence[Any] = pipe.execute(raise_on_error=False)
    n = 0
    for r in replies:
        if isinstance(r, Exception):
            raise r
        if isinstance(r, list):  # an APPLY reply (the ids' trim answers a count)
            n += sum(1 for per_key in r for x in per_key if int(x) == 1)
    return n
