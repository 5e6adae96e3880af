"""The declared aggregations compiled to Spark SQL: training's point-in-time values on
the Spark engine, equal to their DuckDB compilation (``batch_jobs/declared_sql.py``).

:func:`spark_training_columns` is :func:`batch_jobs.declared_sql.training_columns` on
Spark. The statements are generated from the same :class:`fraud_scoring.declared.Spec`
and :class:`~fraud_scoring.declared.Window` objects, one range join per (state,
window), with the semantics of :func:`batch_jobs.declared_sql.window_sql` clause for
clause (``fraud_scoring/declared.py`` states them): events from the window's snapped
tile edge ``(t // u - tiles) * u`` up to, not including, ``t``; each
``transaction_id`` once; an event's key columns present (a categorical value too) and
inside the filter; ``seconds_since_last`` and ``changed`` over the exact window;
``distinct_count`` capped. The final columns come from :func:`fraud_scoring.declared.finish`,
so both engines share the arithmetic: sums may differ in the last bits only (Spark adds
in another order), counts, distinct counts, flags and seconds are equal.

Integer arithmetic stays on int64 microseconds: the tile edge is
``t - pmod(t, u) - tiles * u`` (floor division, exact for any sign; Spark's ``div``
truncates toward zero). All windows of all states run as one Spark job (a union).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from batch_jobs.declared_sql import SRC, decayed_columns, decayed_sql, frames
from fraud_scoring import declared as D

# Temporary views of one call: the query rows and the history's events.
_Q, _E = "declared_q", "declared_e"


def _key_sql(spec: D.Spec, alias: str) -> str:
    cols = [f"{alias}.{c}" for c in spec.entity]  # key columns are strings (see _arrow)
    return cols[0] if len(cols) == 1 else "concat_ws(chr(31), " + ", ".join(cols) + ")"


def _present_sql(spec: D.Spec, alias: str, *, value: bool = False) -> str:
    cols = [*spec.entity, spec.value_column] if value and spec.categorical else spec.entity
    return " AND ".join(f"{alias}.{c} IS NOT NULL AND {alias}.{c} <> ''" for c in cols)


def _filter_sql(spec: D.Spec, alias: str, params: dict[str, Any]) -> str:
    """The filter, its allowed values as named parameters (added to ``params``)."""
    parts = []
    for c, allowed in spec.filter.items():
        names = []
        for v in allowed:
            name = f"f{len(params)}"
            params[name] = str(v)
            names.append(":" + name)
        parts.append(f"{alias}.{c} IN ({', '.join(names)})")
    return " AND ".join(parts) or "TRUE"


def window_sql_spark(spec: D.Spec, w: D.Window, params: dict[str, Any]) -> str:
    """One window of one declaration in Spark SQL (``declared_sql.window_sql``'s
    statement): per row id, count, sum, squares, min, max, distinct values, the newest earlier
    event time within the exact window and changed. Reads the views ``declared_q``
    (row_id, ts_us, key columns) and ``declared_e`` (one row per transaction_id: ts_us,
    key columns, value); the filter's values go into ``params``."""
    u, n = w.width_us, w.tiles
    src = SRC[spec.source]
    ev_ts = f"greatest(e.avail_us, e.ev_us + {spec.delay_us}L)"
    # whole tiles (a delay, labels): the window ends at the tile edge at or before t
    hi = f"q.ts_us - pmod(q.ts_us, {u}L)" if spec.whole_tiles else "q.ts_us"
    if spec.categorical:  # a value is a category: kept (distinct, changed), not summed
        value, own = f"e.{spec.value_column}", f"q.{spec.value_column}"
        num = "CAST(0.0 AS DOUBLE)"
    else:
        value = own = "CAST(NULL AS STRING)"
        num = f"CAST(e.{spec.value_sql} AS DOUBLE)" if spec.value_sql else "1.0D"
    dec, dec_names = decayed_sql(spec, "D")
    return f"""
WITH ev AS (
  SELECT {_key_sql(spec, "e")} AS k, {ev_ts} AS ts_us, {num} AS v, {value} AS cat
  FROM {_E} e WHERE e.src = '{src}' AND {_present_sql(spec, "e", value=True)}
                    AND {_filter_sql(spec, "e", params)}
), qk AS (
  SELECT q.row_id, {_key_sql(spec, "q")} AS k, {hi} AS hi, q.ts_us AS t,
         q.ts_us - pmod(q.ts_us, {u}L) - {n * u}L AS lo, q.ts_us - {w.us}L AS last_lo,
         nullif({own}, '') AS own
  FROM {_Q} q WHERE {_present_sql(spec, "q")}
), agg AS (
  SELECT qk.row_id, max(qk.k) AS k, max(qk.own) AS own,
         count(CASE WHEN ev.ts_us >= qk.lo THEN 1 END) AS c,
         coalesce(sum(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END), 0.0D) AS s,
         coalesce(sum(CASE WHEN ev.ts_us >= qk.lo THEN ev.v * ev.v END), 0.0D) AS q,
         min(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END) AS mn,
         max(CASE WHEN ev.ts_us >= qk.lo THEN ev.v END) AS mx,
         count(DISTINCT CASE WHEN ev.ts_us >= qk.lo THEN ev.cat END) AS d,
         max(CASE WHEN ev.ts_us >= qk.last_lo THEN ev.ts_us END) AS last_us{dec}
  FROM qk LEFT JOIN ev ON ev.k = qk.k AND ev.ts_us >= least(qk.lo, qk.last_lo)
                       AND ev.ts_us < qk.hi
  GROUP BY qk.row_id
), latest AS (
  SELECT DISTINCT k, ts_us, cat FROM ev
), lastv AS (  -- the largest value at each key's time (for last)
  SELECT k, ts_us, max(v) AS v FROM ev GROUP BY k, ts_us
)
SELECT agg.row_id, agg.c, agg.s, agg.q, agg.mn, agg.mx, agg.d, agg.last_us{dec_names},
       max(lastv.v) AS last_v,
       CASE WHEN agg.last_us IS NULL OR agg.own IS NULL THEN 0.0D
            WHEN bool_or(latest.cat IS NOT NULL) THEN 0.0D ELSE 1.0D END AS changed
FROM agg LEFT JOIN latest ON latest.k = agg.k AND latest.ts_us = agg.last_us
                          AND latest.cat = agg.own
          LEFT JOIN lastv ON lastv.k = agg.k AND lastv.ts_us = agg.last_us
GROUP BY agg.row_id, agg.c, agg.s, agg.q, agg.mn, agg.mx, agg.d, agg.last_us,
         agg.own{dec_names}
"""


def _text(col: pd.Series | None, n: int) -> pa.Array:
    """A key column as strings (null where missing), whatever its pandas type."""
    if col is None:
        return pa.nulls(n, pa.string())
    return pa.array(
        [None if v is None or v is pd.NA or v != v else str(v) for v in col], pa.string()
    )


def _arrow(frame: pd.DataFrame, extra: dict[str, pa.DataType]) -> pa.Table:
    n = len(frame)
    cols: dict[str, pa.Array] = {c: _text(frame.get(c), n) for c in D.KEY_COLUMNS}
    for c, typ in extra.items():
        cols[c] = pa.array(frame[c].to_numpy(), typ, from_pandas=True)
    return pa.table(cols)


def spark_training_columns(
    spark: Any,
    decl: D.Declarations,
    rows: pd.DataFrame,
    history: pd.DataFrame,
    time_col: str = "event_timestamp",
    labels: pd.DataFrame | None = None,
) -> dict[str, np.ndarray]:
    """Every declared aggregation for ``rows`` (their ``time_col`` is ``t``) over the
    raw ``history`` (transactions with ``event_time``) on ``spark`` (a
    ``pyspark.sql.SparkSession``), float64 columns: the values of
    ``declared_sql.training_columns``."""
    out: dict[str, np.ndarray] = {}
    if not decl.specs:
        return out
    q, e = frames(rows, history, time_col, labels, decl.specs)
    t_us = q["ts_us"].to_numpy(np.int64)
    exprs = [s.value_sql for s in decl.specs if s.value_expr and s.value_sql]
    values: dict[str, pa.DataType] = {
        c: pa.float64() for c in (*D.VALUE_COLUMNS, *D.ARRIVAL_VALUE_COLUMNS, *exprs)
    }
    values |= {c: pa.string() for c in D.ARRIVAL_FILTER_COLUMNS}
    spark.createDataFrame(
        _arrow(q, {"row_id": pa.int64(), "ts_us": pa.int64()})
    ).createOrReplaceTempView(_Q)
    e_types = {**values, "src": pa.string(), "ev_us": pa.int64(), "avail_us": pa.int64()}
    spark.createDataFrame(_arrow(e, e_types)).createOrReplaceTempView(_E)
    try:
        parts = []
        windows = [(spec, w) for spec in decl.specs for w in spec.windows]
        for i, (spec, w) in enumerate(windows):
            params: dict[str, Any] = {}
            sql = window_sql_spark(spec, w, params)
            parts.append(spark.sql(sql, args=params).selectExpr(f"{i} AS part", "*"))
        # A state without decayed sums has no dec_<j> columns: null there.
        got = (
            functools.reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), parts)
            .toArrow()
            .to_pandas()
        )
    finally:
        spark.catalog.dropTempView(_Q)
        spark.catalog.dropTempView(_E)
    by_part = dict(tuple(got.groupby("part")))
    decs = [f"dec_{j}" for j in range(max((len(s.half_lives) for s in decl.specs), default=0))]
    empty = pd.DataFrame(
        columns=["row_id", "c", "s", "q", "mn", "mx", "d", "last_us", "last_v", "changed", *decs]
    )
    for i, (spec, w) in enumerate(windows):
        res = by_part.get(i, empty).set_index("row_id").reindex(q["row_id"])
        c = res["c"].fillna(0).to_numpy(np.float64)
        last = res["last_us"].to_numpy(np.float64)  # epoch µs < 2**53: exact
        since = np.where(np.isnan(last), np.inf, (t_us - np.nan_to_num(last)) / D.US)
        out.update(
            D.finish(
                spec,
                w,
                c,
                res["s"].fillna(0.0).to_numpy(np.float64),
                res["q"].fillna(0.0).to_numpy(np.float64),
                since,
                res["d"].fillna(0).to_numpy(np.float64) if spec.keeps_values else None,
                res["changed"].fillna(0).to_numpy(np.float64) if spec.keeps_values else None,
                res["last_v"].to_numpy(np.float64),
                res["mn"].to_numpy(np.float64),
                res["mx"].to_numpy(np.float64),
                decayed_columns(spec, res),
            )
        )
    return out
