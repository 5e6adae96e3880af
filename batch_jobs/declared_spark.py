"""The declared aggregations on Spark: training's point-in-time values on the Spark
engine, equal to their DuckDB compilation. :func:`spark_training_columns` is
:func:`batch_jobs.declared_sql.training_columns` on Spark; both run the one window
template :func:`batch_jobs.declared_sql.window_sql`, here in the :data:`SPARK` dialect
(one range join per state and window: events from the window's snapped tile edge up
to, not including, ``t``; each ``transaction_id`` once; an event's key columns present
and inside the filter; ``seconds_since_last`` and ``changed`` over the exact window).
The final columns come from :func:`fraud_scoring.declared.finish`, so both engines share
the arithmetic: sums may differ in the last bits only (Spark adds in another order),
counts, distinct counts, flags and seconds are equal.

Integer arithmetic stays on int64 microseconds: the tile edge is ``t - pmod(t, u)``
(floor division, exact for any sign; Spark's ``div`` truncates toward zero). All
windows of all states run as one Spark job (a union).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from batch_jobs.declared_sql import Dialect, decayed_columns, field_columns, frames, window_sql
from fraud_scoring import declared as D

# Temporary views of one call: the query rows and the history's events.
_Q, _E = "declared_q", "declared_e"


# Spark's SQL for declared_sql.window_sql's template: key columns are strings already
# (see _arrow), the tile edge by pmod (exact floor division for any sign; Spark's div
# truncates toward zero), long and double literals marked, filter values as parameters.
SPARK = Dialect(
    q=_Q,
    e=_E,
    long="L",
    double="D",
    first="max",
    text_type="STRING",
    text=lambda x: x,
    floor=lambda x, u: f"{x} - pmod({x}, {u}L)",
    params=True,
)


def window_sql_spark(spec: D.Spec, w: D.Window, params: dict[str, Any]) -> str:
    """One window of one declaration in Spark SQL: :func:`batch_jobs.declared_sql.window_sql`
    in the :data:`SPARK` dialect (the filter's values go into ``params``)."""
    return window_sql(spec, w, SPARK, params)


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
    # The declared fields (frames: a number as float64, the others as text).
    fields = {
        c: pa.float64() if t == "number" else pa.string()
        for c, t in field_columns(decl.specs).items()
    }
    values |= fields
    spark.createDataFrame(
        _arrow(q, {"row_id": pa.int64(), "ts_us": pa.int64(), **fields})
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
