"""The declared aggregations on Spark (``batch_jobs/declared_spark.py``) equal their
DuckDB compilation (``batch_jobs/declared_sql.py``), feature for feature and row for
row: for the declarations the project ships and for the test declarations of
``tests/test_declared.py`` (a hot key, ties, a filter, a two-column entity, categorical
values, label states and a delay). Sums, means and deviations agree to 1e-9 relative
(the engines add in another order); counts, distinct counts, flags and seconds exactly.
Spark needs Java 17+ and ``pip install '.[spark]'``: without them these tests are
skipped."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from batch_jobs.declared_sql import training_columns
from fraud_scoring import declared as D
from fraud_scoring import features as F
from tests.test_declared import DECL, T0, arrivals, history

if shutil.which("java") is None:
    pytest.skip(
        "Spark tests need Java 17+ on PATH (e.g. apt-get install openjdk-17-jre-headless)",
        allow_module_level=True,
    )
pytest.importorskip("pyspark", reason="Spark tests need pyspark: pip install '.[spark]'")

# Aggregations over a float value: equal up to the order of summation.
SUMMED = {"sum", "mean", "std", "decayed_sum"}  # added in another order: the last bits


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local[2] Spark session for the module (tests/test_spark_engine.py's)."""
    from batch_jobs.spark_engine import spark_run

    conf = {
        "spark.sql.shuffle.partitions": "4",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }
    with spark_run("local[2]", conf) as session:
        session.sparkContext.setLogLevel("ERROR")
        yield session


def _queries(hist: pd.DataFrame) -> pd.DataFrame:
    """400 transactions of the last day (the hot merchant's among them), plus probes:
    rows at another transaction's exact event time, rows on a tile edge (a multiple of 1 day,
    hence of every tile width) and a second after it, and a row without a device."""
    q = hist[hist["event_time"] >= T0 - pd.Timedelta(days=1)].sample(400, random_state=2)
    ties = hist.iloc[[4, 5, 100, 3000]].assign(transaction_id=lambda d: d["transaction_id"] + "x")
    edge = T0 - pd.Timedelta(days=1)
    probes = hist.iloc[[-1, -2, -3]].copy()
    probes = pd.concat(
        [
            probes.assign(event_time=edge, transaction_id=lambda d: d["transaction_id"] + "e"),
            probes.assign(
                event_time=edge + pd.Timedelta(seconds=1),
                transaction_id=lambda d: d["transaction_id"] + "e1",
            ),
            hist.iloc[[-4]].assign(device_id=None, transaction_id="nodevice"),
        ]
    )
    return (
        pd.concat([q, ties, probes], ignore_index=True)
        .rename(columns={"event_time": "event_timestamp"})
        .reset_index(drop=True)
    )


def _decl(source: str) -> D.Declarations:
    return D.parse(yaml.safe_load(DECL), "test") if source == "test" else F.declarations()


@pytest.mark.parametrize("source", ["test", "project"])
def test_spark_equals_duckdb_for_every_declared_aggregation(spark: Any, source: str) -> None:
    from batch_jobs.declared_spark import spark_training_columns

    decl = _decl(source)
    hist = history()
    q = _queries(hist)
    events = arrivals(hist)
    duck = training_columns(decl, q, hist, labels=events)
    ours = spark_training_columns(spark, decl, q, hist, labels=events)
    assert set(ours) == set(duck) == set(decl.aggregate_names())
    agg_of = {f.name: f.agg for s in decl.specs for f in s.features}
    bad = {}
    for name in duck:
        want, got = duck[name], ours[name]
        assert got.dtype == np.float64 and got.shape == want.shape, name
        if agg_of[name] in SUMMED:
            ok = np.isclose(got, want, rtol=1e-9, atol=1e-9)
        else:
            ok = got == want
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            bad[name] = (
                f"{(~ok).sum()} of {len(ok)} rows, e.g. row {i} "
                f"({q['transaction_id'][i]}): duckdb {float(want[i])!r}, spark {float(got[i])!r}"
            )
    assert not bad, bad
    # The comparison means something: events in the windows, values kept and changed.
    if source == "test":
        assert max(duck["m_count_1h"]) > 2500 and max(duck["cm_count_30d"]) > 10
        assert max(duck["m_devices_1h"]) == D.DISTINCT_CAP
        assert 0 < duck["c_country_changed_1d"].sum() < len(q)
    else:
        assert duck["card_txn_count_7d"].sum() > 0 and duck["card_country_changed_24h"].sum() > 0


def test_the_tile_edge_is_floor_division_on_int64_microseconds(spark: Any) -> None:
    """The statement's tile edge ``t - pmod(t, u) - tiles * u`` is ``(t // u - tiles) *
    u`` with Python's floor division, exactly, far past 2**53 and before 1970."""
    ts = [0, 1, -1, 86_400 * D.US - 1, -86_400 * D.US - 1, 1_772_409_600_123_457, 2**62 + 7]
    u, n = 3600 * D.US, 24
    rows = spark.sql(
        "SELECT t, t - pmod(t, {u}L) - {nu}L AS lo FROM VALUES {vals} AS v(t)".format(
            u=u, nu=n * u, vals=", ".join(f"({t}L)" for t in ts)
        )
    ).collect()
    assert {r["t"]: r["lo"] for r in rows} == {t: (t // u - n) * u for t in ts}
