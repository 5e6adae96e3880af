"""Model-quality pieces on small synthetic data: thresholds in money, calibration
metrics, bands and their intervals, the calibrated ONNX export (Platt and piecewise)
and the report's data and figures (no world needed)."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from itertools import combinations, pairwise

import lightgbm as lgb
import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import precision_recall_curve

from batch_jobs.calibration import (
    CalibrationPool,
    calibrated_logit,
    fit_calibration,
    fit_piecewise,
    fit_platt,
)
from batch_jobs.evaluate import (
    BAND_EDGES,
    BAND_MIN_FRAUDS,
    BAND_RATIO,
    Z95,
    Holdout,
    calibration_bands,
    choose_thresholds,
    decision_metrics,
    effective_rows,
    expected_calibration_error,
    hours_with_rows,
    quality,
    reliability,
    report_data,
    score_histogram,
    served_scores,
    wilson_interval,
)
from batch_jobs.evaluation_report import figure_objects, figures, report_files
from batch_jobs.onnx_export import lightgbm_margin_onnx, onnx_margins, with_calibration, with_platt
from batch_jobs.train import TrainConfig
from fraud_scoring.model_repo import (
    Calibration,
    DecisionCosts,
    FeatureSpec,
    ModelMetadata,
    Thresholds,
)


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


def test_a_threshold_lies_between_the_scores_it_separates() -> None:
    """Saturated validation scores (exactly 1.0) do not make the threshold 1.0: it lies
    halfway in log-odds to the next score, so a later 0.99998 is still declined."""
    y = np.r_[1, 1, np.zeros(18, int)]
    p = np.r_[1.0, 1.0, 0.3, np.full(17, 0.01)]
    w, amount = np.ones(20), np.full(20, 500.0)
    th = choose_thresholds(y, p, w, amount, DecisionCosts(max_review_rate=0.0))
    assert 0.3 < th.decline < 0.99998
    assert th.decline == pytest.approx(1 / (1 + np.exp(-(np.log(0.3 / 0.7) + 20.723) / 2)), 1e-3)


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


def test_calibration_bands_compare_observed_with_predicted() -> None:
    """Per band of BAND_EDGES: weighted counts, the observed/predicted ratio with its
    interval, and a verdict once a band holds BAND_MIN_FRAUDS frauds."""
    rng = np.random.default_rng(4)
    p = np.exp(rng.uniform(np.log(1e-4), 0, 400_000))
    y = (rng.random(len(p)) < p).astype(np.int8)  # calibrated by construction
    w = np.ones(len(p))
    bands = calibration_bands(y, p, w)
    assert [(b["lo"], b["hi"]) for b in bands] == list(pairwise(BAND_EDGES))
    inside = p >= BAND_EDGES[0]  # below the first edge: in no band
    assert sum(b["rows"] for b in bands) == pytest.approx(inside.sum())
    assert sum(b["frauds"] for b in bands) == pytest.approx(y[inside].sum())
    for b in bands:
        assert b["judged"] and b["frauds"] >= BAND_MIN_FRAUDS
        assert b["ratio"] == pytest.approx(b["fraud_rate"] / b["mean_probability"])
        assert b["ratio_low"] <= 1 <= b["ratio_high"] and b["within"]
    # Twice the probability: every judged band at about 0.5, outside BAND_RATIO.
    over = calibration_bands(y, np.clip(2 * p, 0, 1), w)
    assert all(b["ratio"] < BAND_RATIO[0] and b["within"] is False for b in over[:-1])
    # Negatives sampled 1 in 10 and weighted back: about the same ratios and counts.
    keep = (y == 1) | (rng.random(len(p)) < 0.1)
    sampled = calibration_bands(y[keep], p[keep], np.where(y[keep] == 1, 1.0, 10.0))
    for full, s in zip(bands, sampled, strict=True):
        assert s["ratio"] == pytest.approx(full["ratio"], rel=0.2)
        assert s["rows"] == pytest.approx(full["rows"], rel=0.1) and s["frauds"] == full["frauds"]
    # A band with too few frauds is not judged; an empty one has no ratio; 1.0 is in the
    # last band.
    few = calibration_bands(np.array([1, 0, 0]), np.array([0.002, 0.05, 1.0]), np.ones(3))
    assert few[0]["judged"] is False and few[0]["within"] is None
    assert few[2]["rows"] == 0 and few[2]["ratio"] is None
    assert few[-1]["rows"] == 1 and few[-1]["mean_probability"] == 1.0


def test_piecewise_calibration_fits_what_one_slope_cannot() -> None:
    """Frauds follow a flatter line below 0.1 than above it (the quiet patterns): Platt's
    one slope misses the middle bands, the piecewise logit holds them; its ONNX graph
    computes calibrated_logit, keeps the ranking and small probabilities."""
    rng = np.random.default_rng(8)
    margin = rng.normal(-9, 3, 300_000)
    true_logit = np.where(margin < -3, -3 + 0.4 * (margin + 3), -3 + 1.5 * (margin + 3))
    y = (rng.random(len(margin)) < 1 / (1 + np.exp(-true_logit))).astype(np.int8)
    w = np.ones(len(y))
    a, b = fit_platt(margin, y, w)
    pw = fit_piecewise(margin, y, w, a, b)
    now = datetime.now(UTC)
    cal = Calibration(
        method="piecewise",
        a=a,
        b=b,
        fitted_on=(now, now),
        rows=len(y),
        positives=int(y.sum()),
        knots=pw.knots,
        knot_logits=pw.logits,
        slope_below=pw.below,
        slope_above=pw.above,
    )
    platt = calibration_bands(y, 1 / (1 + np.exp(-(a * margin + b))), w)
    piecewise = calibration_bands(y, 1 / (1 + np.exp(-calibrated_logit(cal, margin))), w)
    assert not all(bb["within"] for bb in platt if bb["judged"])
    assert all(bb["within"] for bb in piecewise if bb["judged"])
    assert sum(bb["judged"] for bb in piecewise) == len(BAND_EDGES) - 1

    # The exported graph: a LightGBM margin graph with this calibration appended.
    x = rng.normal(size=(4000, 3)).astype(np.float32)
    yy = (x[:, 0] * 3 + rng.normal(size=len(x)) > 5).astype(int)
    graph = lightgbm_margin_onnx(lgb.LGBMClassifier(n_estimators=50, verbose=-1).fit(x, yy), 3)
    m = onnx_margins(graph, x)
    a, b = fit_platt(m, yy, np.ones(len(yy)))
    pw = fit_piecewise(m, yy, np.ones(len(yy)), a, b)
    cal = cal.model_copy(
        update={
            "a": a,
            "b": b,
            "knots": pw.knots,
            "knot_logits": pw.logits,
            "slope_below": pw.below,
            "slope_above": pw.above,
        }
    )
    served = served_scores(with_calibration(graph, cal), x)
    np.testing.assert_allclose(
        served, 1 / (1 + np.exp(-calibrated_logit(cal, m))), rtol=1e-4, atol=1e-7
    )
    order = np.argsort(m, kind="stable")
    assert (np.diff(served[order]) >= -1e-7).all()  # monotone in the margin
    assert (served > 0).all()


def _pool(frauds: int, seed: int = 1) -> CalibrationPool:
    rng = np.random.default_rng(seed)
    margin = rng.normal(-6, 3, 20_000)
    y = np.zeros(len(margin), np.int8)
    y[np.argsort(-margin + rng.normal(0, 2, len(margin)))[:frauds]] = 1
    return CalibrationPool(
        margin=margin,
        label=y,
        weight=np.ones(len(y)),
        first=date(2026, 1, 3),
        end=date(2026, 1, 10),
        source="test pool",
    )


def test_calibration_falls_back_to_platt_with_a_reason() -> None:
    cfg = TrainConfig(min_piecewise_positives=100)
    cal = fit_calibration(_pool(300), cfg)
    assert cal.method == "piecewise" and len(cal.knots) == 4 and cal.positives == 300
    assert "300 frauds (at least 100)" in cal.reason and cal.source == "test pool"
    assert cal.fitted_on == (datetime(2026, 1, 3, tzinfo=UTC), datetime(2026, 1, 10, tzinfo=UTC))
    few = fit_calibration(_pool(40), cfg)
    assert few.method == "platt" and few.knots == []
    assert "40 frauds, fewer than the 100" in few.reason
    forced = fit_calibration(_pool(300), TrainConfig(calibration_method="platt"))
    assert forced.method == "platt" and "configured" in forced.reason


def test_the_report_shows_thresholds_in_and_out_of_sample() -> None:
    """Thresholds chosen on the validation slice: the report holds their figures there
    (in-sample, from the metadata), on the holdout (out-of-sample, computed) and the
    holdout's own best in hindsight."""
    h, p = _holdout(negative_weight=2.0)
    th = Thresholds(review=0.04, decline=0.4)
    costs = DecisionCosts()
    before = decision_metrics(h.label[::-1], p, h.weight, h.amount, th, costs)  # any figures
    meta = _meta(th).model_copy(
        update={
            "costs": costs,
            "thresholds_chosen_on": (T0 - timedelta(days=2), T0),
            "metrics": {f"validation_{k}": v for k, v in before.items()},
        }
    )
    data = report_data(meta, h, p, None)
    choice = data["threshold_choice"]
    assert choice["chosen_slice"] == "validation"
    assert choice["in_sample"] == before
    after = decision_metrics(h.label, p, h.weight, h.amount, th, costs)
    assert choice["out_of_sample"] == pytest.approx(after)
    best = choose_thresholds(h.label, p, h.weight, h.amount, costs)
    assert choice["hindsight"]["thresholds"] == best.model_dump()
    assert choice["hindsight"]["cost_per_txn"] <= after["cost_per_txn"] + 1e-12
    md = report_files(data)["report.md"].decode()
    assert "validation 2026-01-08 .. 2026-01-09 (chosen here: in-sample)" in md
    assert "holdout, never seen by the choice (out-of-sample)" in md
    assert "in hindsight" in md and "## Calibration bands" in md
    # A version from before: thresholds chosen on the holdout, all in-sample.
    old = report_data(_meta(th), h, p, None)["threshold_choice"]
    assert old["chosen_slice"] == "holdout" and old["out_of_sample"] is None
    assert old["in_sample"] == pytest.approx(after)
    assert (
        "in-sample (this version predates"
        in report_files(report_data(_meta(th), h, p, None))["report.md"].decode()
    )
