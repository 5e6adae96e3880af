"""The declared aggregations compiled to DuckDB: training's point-in-time values and the
tiles the online store is backfilled with (``fraud_scoring/declared.py`` holds the
language and the semantics both keep).

:func:`training_columns` computes, for each row (a transaction at ``t``), every
declared aggregation over the raw history exactly as serving reads it: one generated
range join per declaration (``ts`` from the window's snapped tile edge up to, not
including, ``t``), each transaction counted once. :func:`backfill_tiles` writes the
history's tiles and newest events into Redis with the same script the updater uses, so
a key's windows are full the day a declaration is added.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
from redis.cluster import RedisCluster

from batch_jobs.declared_arrivals import (  # the arrivals' events, also read from here
    ARRIVAL_COLUMNS as ARRIVAL_COLUMNS,
)
from batch_jobs.declared_arrivals import _label_rows, _send, _ts
from batch_jobs.declared_arrivals import decision_events as decision_events
from batch_jobs.declared_arrivals import label_events as label_events
from batch_jobs.declared_arrivals import labels_for as labels_for
from batch_jobs.declared_arrivals import load_decision_events as load_decision_events
from batch_jobs.declared_arrivals import load_label_events as load_label_events
from batch_jobs.declared_arrivals import record_labels as record_labels
from fraud_scoring import declared as D
from fraud_scoring.session import epoch_us
from fraud_scoring.storage import partition_days, partition_dir

log = logging.getLogger(__name__)
# The ``src`` of each source's rows in the events table every engine reads.
SRC = {"transactions": "t", "labels": "l", "decisions": "d"}


@dataclass(frozen=True)
class Dialect:
    """What differs between the engines' SQL in :func:`window_sql`'s one template:
    the views' names, literal suffixes, a text cast, the first-value aggregate, the
    tile edge at or before a time, and how a filter's values are passed."""

    q: str  # the query rows' view
    e: str  # the events' view
    long: str  # an integer literal's suffix
    double: str  # a double literal's suffix
    first: str  # an aggregate that takes one of a group's (equal) values
    text_type: str
    text: Callable[[str], str]  # an expression as text
    floor: Callable[[str, int], str]  # the tile edge of width u at or before x
    # The filter's values: inlined, or as named parameters added to ``params``.
    params: bool = False


DUCKDB = Dialect(
    q="q",
    e="e",
    long="",
    double="",
    first="any_value",
    text_type="VARCHAR",
    text=lambda x: f"CAST({x} AS VARCHAR)",
    floor=lambda x, u: f"({x} // {u}) * {u}",
)


def _key_sql(spec: D.Spec, alias: str, d: Dialect) -> str:
    cols = [d.text(f"{alias}.{c}") for c in spec.entity]
    return cols[0] if len(cols) == 1 else "concat_ws(chr(31), " + ", ".join(cols) + ")"


def _present_sql(spec: D.Spec, alias: str, d: Dialect, *, value: bool = False) -> str:
    """The key's columns (``value``: and the columns an event needs, :attr:`Spec.required`)
    are there: not null, and a text not empty."""
    texts = [*spec.entity, spec.value_column] if value and spec.categorical else spec.entity
    parts = [f"{alias}.{c} IS NOT NULL AND {d.text(f'{alias}.{c}')} <> ''" for c in texts]
    if value and not spec.categorical:  # declared number fields the value reads
        parts += [f"{alias}.{c} IS NOT NULL" for c in spec.required]
    return " AND ".join(parts)


def _filter_sql(spec: D.Spec, alias: str, d: Dialect, params: dict[str, Any]) -> str:
    """The filter, its allowed values inlined or (``d.params``) as named parameters
    added to ``params``."""
    parts = []
    for c, allowed in spec.filter.items():
        names = []
        for v in allowed:
            if d.params:
                name = f"f{len(params)}"
                params[name] = str(v)
                names.append(":" + name)
            else:
                names.append("'" + str(v).replace("'", "''") + "'")
        parts.append(f"{d.text(f'{alias}.{c}')} IN ({', '.join(names)})")
    return " AND ".join(parts) or "TRUE"


def decayed_sql(spec: D.Spec, d: Dialect) -> tuple[str, str]:
    """A state's decayed sums in a window statement: ``agg``'s columns ``dec_<j>`` (per
    half-life, each event's value weighted by ``2^((ts - t) / half-life)``), and the
    final select's list of them."""
    x = d.double
    cols = [
        f"coalesce(sum(CASE WHEN ev.ts_us >= qk.lo THEN ev.v * pow(2.0{x}, "
        f"CAST(ev.ts_us - qk.t AS DOUBLE) / {h}.0{x}) END), 0.0{x}) AS dec_{j}"
        for j, h in enumerate(spec.half_lives)
    ]
    names = [f"agg.dec_{j}" for j in range(len(spec.half_lives))]
    return "".join(f",\n         {c}" for c in cols), "".join(f", {n}" for n in names)


def window_sql(
    spec: D.Spec, w: D.Window, d: Dialect = DUCKDB, params: dict[str, Any] | None = None
) -> str:
    """One window of one declaration, in ``d``'s SQL (DuckDB's, or Spark's:
    ``batch_jobs/declared_spark.py``): per row id, count, sum, squares, min, max,
    distinct values, the newest earlier event time within the exact window, the value
    at it, changed and the decayed sums (:func:`decayed_sql`). Reads the views ``d.q``
    (row_id, ts_us, key columns) and ``d.e`` (:func:`frames`: one row per transaction
    and per label, with ``src``, ``ev_us``, ``avail_us``, key columns and values); a
    filter's values go into ``params`` where the dialect passes them so."""
    u, n, lg, x = w.width_us, w.tiles, d.long, d.double
    params = {} if params is None else params
    ev_ts = f"greatest(e.avail_us, e.ev_us + {spec.delay_us}{lg})"
    # whole tiles (a delay, labels): the window ends at the tile edge at or before t
    hi = d.floor("q.ts_us", u) if spec.whole_tiles else "q.ts_us"
    if spec.categorical:  # a value is a category: kept (distinct, changed), not summed
        value, own = d.text(f"e.{spec.value_column}"), d.text(f"q.{spec.value_column}")
        num = "CAST(0.0 AS DOUBLE)"
    else:
        value = own = f"CAST(NULL AS {d.text_type})"
        num = f"CAST(e.{spec.value_sql} AS DOUBLE)" if spec.value_sql else f"1.0{x}"
    dec, dec_names = decayed_sql(spec, d)
    return f"""
WITH ev AS (
  SELECT {_key_sql(spec, "e", d)} AS k, {ev_ts} AS ts_us, {num} AS v, {value} AS cat
  FROM {d.e} e WHERE e.src = '{SRC[spec.source]}' AND {_present_sql(spec, "e", d, value=True)}
               AND {_filter_sql(spec, "e", d, params)}
), qk AS (
  SELECT q.row_id, {_key_sql(spec, "q", d)} AS k, {hi} AS hi, q.ts_us AS t,
         {d.floor("q.ts_us", u)} - {n * u}{lg} AS lo, q.ts_us - {w.us}{lg} AS last_lo,
         nullif({own}, '') AS own
  FROM {d.q} q WHERE {_present_sql(spec, "q", d)}
), agg AS (
  SELECT qk.row_id, {d.first}(qk.k) AS k, {d.first}(qk.own) AS own,
         count(CASE WHEN ev.ts_us >= qk.lo THEN 1 END) AS c,
         coalesce(sum(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END), 0.0{x}) AS s,
         coalesce(sum(CASE WHEN ev.ts_us >= qk.lo THEN ev.v * ev.v END), 0.0{x}) AS q,
         min(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END) AS mn,
         max(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END) AS mx,
         count(DISTINCT CASE WHEN ev.ts_us >= qk.lo THEN ev.cat END) AS d,
         max(CASE WHEN ev.ts_us >= qk.last_lo THEN ev.ts_us END) AS last_us{dec}
  FROM qk LEFT JOIN ev ON ev.k = qk.k AND ev.ts_us >= least(qk.lo, qk.last_lo)
                       AND ev.ts_us < qk.hi
  GROUP BY qk.row_id
), latest AS (  -- the values at each key's latest time before a row (for changed)
  SELECT DISTINCT k, ts_us, cat FROM ev
), lastv AS (  -- the largest value at each key's time (for last)
  SELECT k, ts_us, max(v) AS v FROM ev GROUP BY k, ts_us
)
SELECT agg.row_id, agg.c, agg.s, agg.q, agg.mn, agg.mx, agg.d, agg.last_us{dec_names},
       max(lastv.v) AS last_v,
       CASE WHEN agg.last_us IS NULL OR agg.own IS NULL THEN 0.0{x}
            WHEN bool_or(latest.cat IS NOT NULL) THEN 0.0{x} ELSE 1.0{x} END AS changed
FROM agg LEFT JOIN latest ON latest.k = agg.k AND latest.ts_us = agg.last_us
                          AND latest.cat = agg.own
          LEFT JOIN lastv ON lastv.k = agg.k AND lastv.ts_us = agg.last_us
GROUP BY agg.row_id, agg.c, agg.s, agg.q, agg.mn, agg.mx, agg.d, agg.last_us,
         agg.own{dec_names}
"""


def decayed_columns(spec: D.Spec, got: pd.DataFrame) -> dict[int, np.ndarray]:
    """A window statement's decayed sums by half-life (µs), from its ``dec_<j>``."""
    return {
        h: got[f"dec_{j}"].fillna(0.0).to_numpy(np.float64) for j, h in enumerate(spec.half_lives)
    }


def frames(
    rows: pd.DataFrame,
    history: pd.DataFrame,
    time_col: str,
    labels: pd.DataFrame | None = None,
    specs: Sequence[D.Spec] = (),
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The query rows ``q`` (row_id, ts_us, key columns) and the events ``e`` every
    engine reads: one row per transaction of ``history`` (``src`` "t", ``ev_us`` =
    ``avail_us`` = its event time) and per arrival of ``labels`` (:func:`labels_for`:
    labels, ``src`` "l", and decisions, ``src`` "d"; ``ev_us`` its transaction's event
    time, ``avail_us`` when the store has it), with key columns, ``amount``, the
    arrivals' own columns (``is_fraud``, ``score``, ``decision``) and the value of each
    of ``specs`` whose value is an expression (column
    :attr:`~fraud_scoring.declared.Spec.value_sql`, by :func:`fraud_scoring.declared.evaluate`,
    as the updater computes it)."""
    cols = [*D.KEY_COLUMNS, *D.VALUE_COLUMNS]
    fields = field_columns(specs)
    q = pd.DataFrame({c: rows.get(c) for c in D.KEY_COLUMNS})
    q = q.assign(**{c: _field(rows, c, t) for c, t in fields.items()})
    q["row_id"] = np.arange(len(rows))
    q["ts_us"] = epoch_us(rows[[time_col]])
    e_src = history.drop_duplicates("transaction_id")
    ev_us = epoch_us(e_src[["event_time"]])
    own = dict.fromkeys(D.ARRIVAL_VALUE_COLUMNS, np.nan) | dict.fromkeys(
        D.ARRIVAL_FILTER_COLUMNS, None
    )
    e = pd.DataFrame({c: e_src.get(c) for c in cols}).assign(
        **own,
        **{c: _field(e_src, c, t) for c, t in fields.items()},
        src="t",
        ev_us=ev_us,
        avail_us=ev_us,
    )
    if labels is not None and len(labels):
        source = labels["source"] if "source" in labels else pd.Series("labels", labels.index)
        arr = pd.DataFrame({c: labels.get(c) for c in cols}).assign(
            **{
                c: labels[c].astype(np.float64) if c in labels else np.nan
                for c in D.ARRIVAL_VALUE_COLUMNS
            },
            **{c: labels.get(c) for c in D.ARRIVAL_FILTER_COLUMNS},
            src=source.map(SRC).to_numpy(),
            ev_us=labels["event_us"].to_numpy(np.int64),
            avail_us=labels["available_us"].to_numpy(np.int64),
        )
        e = pd.concat([e, arr], ignore_index=True)
    for spec in specs:
        if spec.value_expr and spec.value_sql not in e:
            assert spec.value_column is not None and spec.value_sql is not None
            numbers = {c: e[c].to_numpy(np.float64) for c in D.value_names(spec.value_column)}
            with np.errstate(all="ignore"):  # a label's column is NaN on transactions
                e[spec.value_sql] = D.evaluate(spec.value_column, numbers)
    return q, e


def field_columns(specs: Sequence[D.Spec]) -> dict[str, str]:
    """The team's declared fields ``specs`` read, by name, their types (the raw
    partitions keep them; the events frame carries them)."""
    return {n: t for s in specs for n, t in s.fields}


def _field(frame: pd.DataFrame, name: str, kind: str) -> np.ndarray:
    """A declared field's column as every SQL engine reads it: a number as float64 (NaN:
    absent), a bool as the text ``true``/``false`` (what a filter names), else text
    (None: absent). A frame without the column: all absent."""
    n = len(frame)
    col = frame[name].to_numpy(object) if name in frame else np.full(n, None, object)
    absent = np.asarray(pd.isna(col), dtype=bool)
    if kind == "number":
        return np.where(absent, np.nan, col).astype(np.float64)
    out = np.empty(n, object)
    for i, (v, gone) in enumerate(zip(col, absent, strict=True)):
        if not gone:
            out[i] = ("true" if v else "false") if kind == "bool" else str(v)
    return out


def training_columns(
    decl: D.Declarations,
    rows: pd.DataFrame,
    history: pd.DataFrame,
    time_col: str = "event_timestamp",
    progress: Callable[[str], None] | None = None,
    labels: pd.DataFrame | None = None,
) -> dict[str, np.ndarray]:
    """Every declared aggregation for ``rows`` (their ``time_col`` is ``t``) over the
    raw ``history`` (transactions with ``event_time``) and ``labels``
    (:func:`labels_for`: needed by label and decision states), float64 columns."""
    out: dict[str, np.ndarray] = {}
    if not decl.specs:
        return out
    q, e = frames(rows, history, time_col, labels, decl.specs)
    t_us = q["ts_us"].to_numpy(np.int64)
    con = duckdb.connect()
    try:
        con.register("q", q)
        con.register("e", e)
        for spec in decl.specs:
            for w in spec.windows:
                got = con.sql(window_sql(spec, w)).df().set_index("row_id").reindex(q["row_id"])
                c = got["c"].fillna(0).to_numpy(np.float64)
                last = got["last_us"].to_numpy(np.float64)
                since = np.where(np.isnan(last), np.inf, (t_us - np.nan_to_num(last)) / D.US)
                out.update(
                    D.finish(
                        spec,
                        w,
                        c,
                        got["s"].fillna(0.0).to_numpy(np.float64),
                        got["q"].fillna(0.0).to_numpy(np.float64),
                        since,
                        got["d"].fillna(0).to_numpy(np.float64) if spec.keeps_values else None,
                        got["changed"].fillna(0).to_numpy(np.float64)
                        if spec.keeps_values
                        else None,
                        got["last_v"].to_numpy(np.float64),
                        got["mn"].to_numpy(np.float64),
                        got["mx"].to_numpy(np.float64),
                        decayed_columns(spec, got),
                    )
                )
            if progress:
                progress(f"declared aggregations: {', '.join(spec.feature_names())}")
    finally:
        con.close()
    return out


def backfill_tiles(
    client: Any,
    decl: D.Declarations,
    history: pd.DataFrame,
    horizon_s: float,
    progress: Callable[[str], None] | None = None,
    labels: pd.DataFrame | None = None,
) -> int:
    """Record every transaction of ``history`` (and every label of ``labels``, in the
    label states: :func:`load_label_events`) in the declared keys (the updater's own
    script: idempotent per transaction_id, so running it again, or after the stream
    already recorded some, changes nothing), then set each state's backfilled marker
    (:meth:`fraud_scoring.declared.Spec.backfilled_key`). Returns the events recorded.

    Only a key's events within :meth:`~fraud_scoring.declared.Spec.reach_us` of its
    newest are sent (older ones change nothing the key keeps: the features read after
    the backfill are the same), in event-time order, 100 a call (a call's cost grows
    with the square of its events), many keys a round trip, accepted however far
    behind the key's newest event they lie (live traffic may have reached a key first,
    e.g. after the store was flushed); a key records only events older than its oldest
    live one (the stream recorded the rest) and newer than an earlier backfill's newest,
    so each transaction counts once however often this runs. Only the events within
    ``horizon_s`` of the key's newest get markers (on a Cluster: the key's ids are trimmed
    back to that span), so a live replay of one of them is a duplicate. ``progress`` is told
    every 1,000 keys."""
    hist = history.drop_duplicates("transaction_id").sort_values("event_time")
    rows = hist.to_dict("records")
    ts = [int(x) for x in epoch_us(hist[["event_time"]])]
    span_s = (max(ts) - min(ts)) / D.US if ts else 0.0
    written = 0
    for script in D.SCRIPTS:  # on a cluster: on every primary
        client.script_load(script)
    cluster = isinstance(client, RedisCluster)
    label_rows = _label_rows(labels)
    for spec in decl.specs:
        live = D.Limits.for_spec(spec, horizon_s)
        accept = D.Limits(
            live.horizon_us + int(span_s * D.US),
            live.ttl_ms,
            backfill=True,
            mark_ttl_ms=live.mark_ttl_ms,  # markers live as long as the live ones
        )
        old = dataclasses.replace(accept, marks=False)
        by_key = (
            D.label_events_for(spec, label_rows) if spec.arrivals else D.events_for(spec, rows, ts)
        )
        reach = spec.reach_us(live.horizon_us)
        pipe, queued = client.pipeline(transaction=False), 0
        for n, key in enumerate(by_key):
            events = sorted(by_key[key], key=lambda e: e.ts_us)
            # What lies further behind the key's newest event changes nothing the state
            # keeps (its tiles are dropped from the rings, its ids and values too).
            events = events[bisect.bisect_left(events, events[-1].ts_us - reach, key=_ts) :]
            newest = events[-1].ts_us
            # Markers (which transactions a state holds) for the events within the live
            # horizon only: what a live replay could still bring again.
            recent = bisect.bisect_left(events, newest - live.horizon_us, key=_ts)
            for part, limits in ((events[:recent], old), (events[recent:], accept)):
                for chunk in _chunks(part, 100):
                    D.queue_apply(pipe, spec, {key: chunk}, limits, per_key=cluster)
            pipe.zremrangebyscore(spec.prefix(key) + ":ids", "-inf", f"({newest - live.horizon_us}")
            queued += len(events)
            if queued >= 2000:  # many keys a round trip
                written += _send(pipe)
                pipe, queued = client.pipeline(transaction=False), 0
            if progress and n % 1000 == 999:
                progress(f"{spec.id}: {n + 1:,} of {len(by_key):,} keys")
        written += _send(pipe)
        client.set(spec.backfilled_key(), datetime.now(UTC).isoformat())
    return written


def _chunks(events: list[D.Event], size: int) -> Iterator[list[D.Event]]:
    """``events`` (in time order) in calls of about ``size``, never splitting events of
    one time across calls (a call records only events newer than the last call's)."""
    i = 0
    while i < len(events):
        j = min(i + size, len(events))
        while j < len(events) and events[j].ts_us == events[j - 1].ts_us:
            j += 1
        yield events[i:j]
        i = j


def missing_states(client: Any, decl: D.Declarations) -> list[D.Spec]:
    """The states whose backfilled marker is not in the store (new, or the store was
    emptied)."""
    return [s for s in decl.specs if not client.exists(s.backfilled_key())]


def load_history(raw: Path, first: date, last: date) -> pd.DataFrame:
    """The raw transactions of ``first..last`` (what a backfill records)."""
    days = [d for d in partition_days(raw, "transactions") if first <= d <= last]
    if not days:
        return pd.DataFrame()
    files = [str(partition_dir(raw, "transactions", d) / "part-0.parquet") for d in days]
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        return con.sql("SELECT * FROM read_parquet($f)", params={"f": files}).df()
    finally:
        con.close()
