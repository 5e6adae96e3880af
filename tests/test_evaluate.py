"""Model-quality pieces on small synthetic data: thresholds in money, calibration
metrics, the calibrated ONNX export and the report files (no world needed)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import lightgbm as lgb
import numpy as np
import pandas as pd
import pytest

from batch_jobs.evaluate import (
    Holdout,
    choose_thresholds,
    decision_metrics,
    expected_calibration_error,
    quality,
    reliability,
    report_data,
    report_files,
    served_scores,
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


def test_report_files_hold_the_figures_and_the_same_numbers() -> None:
    rng = np.random.default_rng(2)
    n = 2000
    y = (rng.random(n) < 0.05).astype(np.int8)
    p = np.clip(rng.beta(1, 40, n) + 0.6 * y * rng.random(n), 0, 1)
    t0 = datetime(2026, 1, 10, tzinfo=UTC)
    pattern = rng.choice(["card_testing", "account_takeover"], n).astype(object)
    pattern[y == 0] = None
    h = Holdout(
        names=["f"],
        x=p.reshape(-1, 1).astype(np.float32),
        label=y,
        weight=np.ones(n),
        amount=rng.lognormal(4, 1, n),
        event_time=pd.Series(pd.date_range(t0, periods=n, freq="2min", tz="UTC")),
        fraud_pattern=pattern,
        transaction_id=np.array([f"t{i}" for i in range(n)], object),
    )
    th = Thresholds(review=0.05, decline=0.5)
    meta = ModelMetadata(
        name="fraud",
        version="1",
        created_at=t0,
        framework="test",
        features=[FeatureSpec(name="f")],
        training_window=(t0, t0),
        holdout_window=(t0, t0),
        thresholds=th,
        metrics={},
    )
    data = report_data(meta, h, p, None)
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
    assert "Recall per fraud pattern" in files["report.md"].decode()
