"""Model-quality pieces on small synthetic data: thresholds in money, calibration
metrics and their intervals, the calibrated ONNX export and the report's data and
figures (no world needed)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from itertools import combinations

import lightgbm as lgb
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import precision_recall_curve

from batch_jobs.evaluate import (
    Z95,
    Holdout,
    choose_thresholds,
    decision_metrics,
    effective_rows,
    expected_calibration_error,
    figure_objects,
    figures,
    hours_with_rows,
    quality,
    reliability,
    report_data,
    report_files,
    score_histogram,
    served_scores,
    wilson_interval,
)
from batch_jobs.train import fit_platt, lightgbm_margin_onnx, onnx_margins, with_platt
from fraud_scoring.model_repo import DecisionCosts, FeatureSpec, ModelMetadata, Thresholds


def _brute_force(
    y: np.ndarray, p: np.ndarray, w: np.ndarray, amount: np.ndarray, c: DecisionCosts
) -> float:
    """The least total cost over every pair of cuts between distinct scores."""
    cuts = [1.0 + 1e-9, *np.unique(p)[::-1]]
    best = np.inf
    for i, d in enumerate(cuts):
        for r in cuts[i:]:
            th = Thresholds.model_construct(review=r, decline=d)
            m = decision_metrics(y, p, w, amount, th, c)
            if m["review_rate"] <= c.max_review_rate + 1e-12:
                best = min(best, m["cost_per_txn"])
    return float(best)


def test_thresholds_minimise_the_declared_cost_under_the_review_cap() -> None:
    rng = np.random.default_rng(3)
    costs = DecisionCosts(review_cost=5, false_decline_cost=10, max_review_rate=0.05)
    for _ in range(5):
        n = 400
        y = (rng.random(n) < 0.05).astype(int)
        p = np.round(np.clip(rng.normal(0.1 + 0.5 * y, 0.2), 0, 1), 2)  # many ties
        w = np.where(y == 1, 1.0, 2.0)
        amount = rng.lognormal(4, 1, n)
        th = choose_thresholds(y, p, w, amount, costs)
        got = decision_metrics(y, p, w, amount, th, costs)
        assert got["review_rate"] <= costs.max_review_rate + 1e-12
        assert got["cost_per_txn"] == pytest.approx(_brute_force(y, p, w, amount, costs))


def test_costs_move_the_thresholds_the_way_money_says() -> None:
    rng = np.random.default_rng(5)
    n = 3000
    y = (rng.random(n) < 0.03).astype(int)
    p = np.clip(rng.beta(1, 30, n) + 0.5 * y * rng.random(n), 0, 1)
    w, amount = np.ones(n), np.full(n, 100.0)
    cheap = choose_thresholds(y, p, w, amount, DecisionCosts(review_cost=1, max_review_rate=0.2))
    dear = choose_thresholds(y, p, w, amount, DecisionCosts(review_cost=50, max_review_rate=0.2))
    assert dear.review > cheap.review  # costlier reviews: review fewer
    capped = choose_thresholds(y, p, w, amount, DecisionCosts(review_cost=1, max_review_rate=0.0))
    assert capped.review == capped.decline  # no review capacity: nothing in review
    # Nothing to gain from flagging (no fraud): approve everything.
    none = choose_thresholds(np.zeros(n, int), p, w, amount, DecisionCosts())
    assert (none.review, none.decline) == (1.0, 1.0)


def test_calibration_metrics() -> None:
    rng = np.random.default_rng(1)
    p = rng.beta(0.5, 20, 200_000)
    y = (rng.random(len(p)) < p).astype(int)  # calibrated by construction
    w = np.ones(len(p))
    assert expected_calibration_error(reliability(y, p, w)) < 0.003
    q = quality(y, p, w)
    assert q["brier"] == pytest.approx(float(np.mean((p - y) ** 2)))
    off = quality(y, np.clip(p * 3, 0, 1), w)  # over-confident
    assert off["ece"] > 5 * q["ece"]
    # Weights count as repeated rows.
    rows = reliability(y[:1000], p[:1000], np.full(1000, 2.0))
    assert sum(b.rows for b in rows) == 2000


def test_calibrated_export_keeps_small_probabilities_and_matches_lightgbm() -> None:
    """The margin graph equals LightGBM's raw score; the served output is exactly
    sigmoid(a * margin + b), with resolution where LightGBM's own export says 0."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 4)).astype(np.float32)
    y = (x[:, 0] * 4 + rng.normal(size=len(x)) > 7).astype(int)
    model = lgb.LGBMClassifier(n_estimators=200, verbose=-1, random_state=0).fit(x, y)
    graph = lightgbm_margin_onnx(model, 4)
    margin = onnx_margins(graph, x)
    np.testing.assert_allclose(margin, model.predict(x, raw_score=True), rtol=1e-4, atol=1e-4)
    a, b = fit_platt(margin, y, np.ones(len(y)))
    p = served_scores(with_platt(graph, a, b), x)
    np.testing.assert_allclose(p, 1 / (1 + np.exp(-(a * margin + b))), rtol=1e-4, atol=1e-7)
    assert (p > 0).all() and len(np.unique(p)) > 0.5 * len(np.unique(margin))


T0 = datetime(2026, 1, 10, tzinfo=UTC)


def _holdout(
    n: int = 2000, seed: int = 2, negative_weight: float = 1.0
) -> tuple[Holdout, np.ndarray]:
    """A holdout whose one feature is the score, one row every 2 minutes from T0: two
    whole days and a third cut short at 18:38 (hours 0-18 hold rows)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.05).astype(np.int8)
    p = np.clip(rng.beta(1, 40, n) + 0.6 * y * rng.random(n), 0, 1)
    pattern = rng.choice(["card_testing", "account_takeover"], n).astype(object)
    pattern[y == 0] = None
    h = Holdout(
        names=["f"],
        x=p.reshape(-1, 1).astype(np.float32),
        label=y,
        weight=np.where(y == 1, 1.0, negative_weight),
        amount=rng.lognormal(4, 1, n),
        event_time=pd.Series(pd.date_range(T0, periods=n, freq="2min", tz="UTC")),
        fraud_pattern=pattern,
        transaction_id=np.array([f"t{i}" for i in range(n)], object),
    )
    return h, p


def _meta(th: Thresholds) -> ModelMetadata:
    return ModelMetadata(
        name="fraud",
        version="1",
        created_at=T0,
        framework="test",
        features=[FeatureSpec(name="f")],
        training_window=(T0, T0),
        holdout_window=(T0, T0),
        thresholds=th,
        metrics={},
    )


def test_report_files_hold_the_figures_and_the_same_numbers() -> None:
    h, p = _holdout()
    y = h.label
    th = Thresholds(review=0.05, decline=0.5)
    data = report_data(_meta(th), h, p, None)
    files = report_files(data)
    assert {
        "evaluation.json",
        "report.md",
        "pr_curve.png",
        "reliability.png",
        "score_histogram.png",
        "decisions_per_day.png",
    } <= set(files)
    assert all(files[f].startswith(b"\x89PNG") for f in files if f.endswith(".png"))
    back = json.loads(files["evaluation.json"])
    assert back["metrics"]["pr_auc"] == pytest.approx(quality(y, p, h.weight)["pr_auc"])
    assert set(back["pattern_recall"]) == {"card_testing", "account_takeover"}
    for name, r in back["pattern_recall"].items():
        m = (y == 1) & (h.fraud_pattern == name)
        assert r["recall_flagged"] == pytest.approx(float((p[m] >= th.review).mean()))
    assert sum(d["frauds"] for d in back["decisions_per_day"]) == int(y.sum())
    md = files["report.md"].decode()
    assert "Recall per fraud pattern" in md
    assert "| 2026-01-12 partial (19 h) |" in md and "95 % interval" in md


def test_operating_points_are_the_thresholds_precision_and_recall_on_the_curve() -> None:
    h, p = _holdout(negative_weight=3.0)
    y, w = h.label, h.weight
    th = Thresholds(review=0.05, decline=0.3)
    data = report_data(_meta(th), h, p, None)
    prec, rec, _ = precision_recall_curve(y, p, sample_weight=w)
    ops = {op["name"]: op for op in data["operating_points"]}
    assert set(ops) == {"flagged", "declined"}
    for name, t in (("flagged", th.review), ("declined", th.decline)):
        m = p >= t
        op = ops[name]
        assert op["threshold"] == t
        assert op["share"] == pytest.approx(w[m].sum() / w.sum()) and op["share"] > 0
        assert op["precision"] == pytest.approx((y * w)[m].sum() / w[m].sum())
        assert op["recall"] == pytest.approx((y * w)[m].sum() / (y * w).sum())
        # The point lies on the (full) precision-recall curve.
        assert np.any(np.isclose(prec, op["precision"]) & np.isclose(rec, op["recall"]))
    assert ops["declined"]["recall"] < ops["flagged"]["recall"]
    # A threshold nothing reaches flags nothing: share 0 (the figure plots no point).
    none = report_data(_meta(Thresholds(review=1.0, decline=1.0)), h, p, None)
    assert all(op["share"] == 0 for op in none["operating_points"])


def test_wilson_interval() -> None:
    low, high = wilson_interval(0.5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert wilson_interval(0.0, 10) == (0.0, pytest.approx(Z95**2 / (10 + Z95**2)))
    assert wilson_interval(1.0, 10) == (pytest.approx(10 / (10 + Z95**2)), 1.0)
    assert wilson_interval(0.3, 0) == (0.0, 1.0)
    narrow = wilson_interval(0.02, 10_000)
    assert narrow[0] < 0.02 < narrow[1] and narrow[1] - narrow[0] < 0.006


def test_weighted_intervals_cover_the_true_rate() -> None:
    """Frauds kept, negatives sampled 1 in 10 and weighted 10 (the holdout's sampling):
    the interval on the effective rows covers the population's rate about 95 % of the
    time, at a small rate (driven by the fraud count) and a large one (by the sample)."""
    rng = np.random.default_rng(11)
    assert effective_rows(np.array([0, 1, 0, 0]), np.ones(4)) == pytest.approx(4)
    for rate, population in ((0.005, 20_000), (0.5, 4000)):
        hits = 0
        for _ in range(400):
            y = (rng.random(population) < rate).astype(np.int8)
            keep = (y == 1) | (rng.random(population) < 0.1)
            ys, ws = y[keep], np.where(y[keep] == 1, 1.0, 10.0)
            observed = float((ys * ws).sum() / ws.sum())
            low, high = wilson_interval(observed, effective_rows(ys, ws))
            hits += low <= rate <= high
        assert 0.91 <= hits / 400 <= 0.99, (rate, hits)


def test_reliability_bins_carry_counts_and_intervals() -> None:
    h, p = _holdout(negative_weight=3.0)
    y, w = h.label, h.weight
    data = report_data(_meta(Thresholds(review=0.05, decline=0.5)), h, p, None)
    rel = data["reliability"]
    assert sum(b["rows"] for b in rel) == pytest.approx(w.sum())
    assert sum(b["sampled_rows"] for b in rel) == len(p)
    assert sum(b["frauds"] for b in rel) == pytest.approx(y.sum())
    # The table's own numbers are reliability()'s, unchanged.
    for b, plain in zip(rel, reliability(y, p, w), strict=True):
        assert {k: b[k] for k in plain.model_dump()} == plain.model_dump()
        assert b["fraud_rate_low"] <= b["fraud_rate"] <= b["fraud_rate_high"]
        m = (p >= b["lo"]) & ((p < b["hi"]) | (b["hi"] == 1.0))
        assert (b["fraud_rate_low"], b["fraud_rate_high"]) == pytest.approx(
            wilson_interval(b["fraud_rate"], effective_rows(y[m], w[m]))
        )


def test_partial_days() -> None:
    h, p = _holdout()
    data = report_data(_meta(Thresholds(review=0.05, decline=0.5)), h, p, None)
    per_day = data["decisions_per_day"]
    assert [(r["day"], r["hours"], r["partial"]) for r in per_day] == [
        ("2026-01-10", 24, False),
        ("2026-01-11", 24, False),
        ("2026-01-12", 19, True),  # the last row is at 18:38
    ]
    for r in per_day:
        assert r["frauds_flagged"] + r["frauds_missed"] == r["frauds"]
    # A day starting late and a day with an hour without rows are partial too.
    t = pd.date_range(T0, periods=3 * 24 * 6, freq="10min", tz="UTC")
    t = t[~((t.day == 11) & (t.hour < 5)) & ~((t.day == 12) & (t.hour == 12))]
    assert hours_with_rows(pd.Series(t)) == {"2026-01-10": 24, "2026-01-11": 19, "2026-01-12": 23}


def test_figures_mark_the_thresholds_without_overprinting() -> None:
    h, p = _holdout()
    th = Thresholds(review=0.05, decline=0.051)  # close: labels beside the lines collided
    figs = figure_objects(report_data(_meta(th), h, p, None))
    fig = figs["score_histogram.png"]
    fig.canvas.draw()
    ax = fig.axes[0]
    texts = [t for t in (*ax.texts, *ax.get_legend().get_texts()) if t.get_text()]
    labels = [t.get_text() for t in texts]
    assert any("review" in s and "0.05" in s for s in labels)
    assert any("decline" in s and "0.051" in s for s in labels)
    boxes = [t.get_window_extent(fig.canvas.get_renderer()) for t in texts]
    assert not any(a.overlaps(b) for a, b in combinations(boxes, 2))
    pr = [t.get_text() for t in figs["pr_curve.png"].axes[0].get_legend().get_texts()]
    assert sum("precision" in s and "recall" in s for s in pr) == 2
    per_day = figs["decisions_per_day.png"].axes[1]
    ticks = [t.get_text() for t in per_day.get_xticklabels()]
    assert ["partial" in s for s in ticks] == [False, False, True]
    hatched = [bar.get_hatch() for bar in per_day.patches]
    assert "//" in hatched and None in hatched
    rel = figs["reliability.png"]
    assert len(rel.axes) == 2 and len(rel.axes[1].patches) == len(
        report_data(_meta(th), h, p, None)["reliability"]
    )


def test_figures_of_data_without_the_new_fields() -> None:
    """The served report (batch_jobs/served_report.py) draws with the same code from
    rows without operating points, intervals or day coverage: every figure still comes,
    the operating points from its decision metrics."""
    h, p = _holdout()
    y, w = h.label, h.weight
    th = Thresholds(review=0.05, decline=0.5)
    prec, rec, _ = precision_recall_curve(y, p)
    served = {
        "metrics": {"ece": expected_calibration_error(reliability(y, p, w))},
        "reliability": [b.model_dump() for b in reliability(y, p, w)],
        "score_histogram": score_histogram(y, p, w),
        "pr_curve": {"precision": prec.tolist(), "recall": rec.tolist()},
        "thresholds": th.model_dump(),
        "at_thresholds": decision_metrics(y, p, w, h.amount, th, DecisionCosts()),
        "decisions_per_day": [
            {"day": "2026-01-10", "approve": 5, "review": 1, "decline": 2, "frauds": 3}
            | {"frauds_flagged": 2}
        ],
    }
    figs = figure_objects(served, rows="served")
    pr = [t.get_text() for t in figs["pr_curve.png"].axes[0].get_legend().get_texts()]
    assert sum("precision" in s and "recall" in s for s in pr) == 2
    files = figures(served, rows="served")
    assert set(files) == {
        "pr_curve.png",
        "reliability.png",
        "score_histogram.png",
        "decisions_per_day.png",
    }
    assert all(blob.startswith(b"\x89PNG") for blob in files.values())
