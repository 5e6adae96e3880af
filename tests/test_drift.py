"""Drift on served traffic: the reference stored with a model, the vectorised bin counts
and PSI, and the service's gauges (real service over HTTP: requests shifted in one
feature raise that feature's PSI gauge while the others stay low)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram

from fraud_scoring.drift import Binner, load_reference, psi, reference_bins
from fraud_scoring.model_repo import load_metadata, resolve
from service.drift import SCORE_BUCKETS, observe_many
from tests.conftest import World, start_server, stop_server, wait_until
from tests.test_service import held_out_day


def test_bins_one_per_value_for_few_values_deciles_otherwise() -> None:
    rng = np.random.default_rng(1)
    flag = reference_bins(rng.integers(0, 2, 1000).astype(float))
    assert flag.kind == "discrete" and flag.edges == [1.0] and len(flag.proportions) == 2
    amount = rng.lognormal(3, 1, 10_000)
    b = reference_bins(amount)
    assert b.kind == "quantile" and len(b.edges) == 9
    np.testing.assert_allclose(b.proportions, 0.1, atol=1e-3)
    # A point mass (a default 0 for 60 % of rows) is a bin of its own, not six empty ones.
    zeros = np.r_[np.zeros(6000), rng.uniform(1, 2, 4000)]
    z = reference_bins(zeros)
    assert z.proportions[0] == pytest.approx(0.6) and z.edges[0] > 0
    # Weights count: the same rows weighted back give the weighted shares.
    w = reference_bins(np.r_[0.0, 1.0], np.r_[3.0, 1.0])
    assert w.proportions == [0.75, 0.25]


def test_binner_counts_each_column_as_searchsorted_and_psi_reads_shift() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(500, 3))
    bins = [reference_bins(x[:, j]) for j in range(3)]
    binner = Binner.of(bins)
    counts = binner.counts(x)
    for j, b in enumerate(bins):
        want = np.bincount(np.searchsorted(b.edges, x[:, j], side="right"), minlength=10)
        np.testing.assert_array_equal(counts[binner.offsets[j] : binner.offsets[j + 1]], want)
    expected = np.concatenate([b.proportions for b in bins])
    same = binner.psi(binner.counts(rng.normal(size=(5000, 3))), expected)
    assert np.all(same < 0.05)
    shifted = rng.normal(size=(5000, 3)) + np.array([0, 1.0, 0])
    values = binner.psi(binner.counts(shifted), expected)
    assert values[1] > 0.5 and values[0] < 0.05 and values[2] < 0.05
    assert psi([0.5, 0.5], [0.5, 0.5]) == 0.0


def test_bulk_observe_matches_observe_per_value() -> None:
    """Pins prometheus_client's histogram internals that observe_many relies on."""
    reg = CollectorRegistry()
    one = Histogram("one", "x", buckets=SCORE_BUCKETS, registry=reg)
    bulk = Histogram("bulk", "x", buckets=SCORE_BUCKETS, registry=reg)
    values = np.r_[0.0, 0.001, 0.0011, 0.05, 0.2, 0.99, 1.0, np.random.default_rng(3).random(50)]
    for v in values:
        one.observe(float(v))
    observe_many(bulk, values)

    def samples(name: str) -> list[tuple[str, dict, float]]:
        return [
            (s.name.removeprefix(name), s.labels, s.value)
            for m in reg.collect()
            if m.name == name
            for s in m.samples
            if not s.name.endswith("_created")
        ]

    got, want = samples("bulk"), samples("one")
    assert [(n, lab) for n, lab, _ in got] == [(n, lab) for n, lab, _ in want]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want])


def test_training_stores_the_reference_with_the_model(world: World) -> None:
    path = resolve(world.model_repo, "fraud")
    ref = load_reference(path)
    assert ref is not None
    meta = load_metadata(path)
    assert list(ref.features) == meta.feature_names
    assert set(ref.scores) == {"default", "tensor"}
    for b in (*ref.features.values(), *ref.scores.values()):
        assert len(b.proportions) == len(b.edges) + 1
        assert sum(b.proportions) == pytest.approx(1.0)
    assert ref.features["channel_ecom"].kind == "discrete"
    assert ref.features["amount"].kind == "quantile"
    assert load_reference(path / "no-such-version") is None  # "no reference": not an error


def _psi(text: str) -> dict[str, float]:
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^fraud_feature_psi\{feature="([^"]+)"\} (\S+)$', text, re.M)
    }


# Model inputs computed from the request without its amount: a shifted amount must leave
# them alone. (Not the card and merchant counts: in the 16-day test world they grow day by
# day, and the session features see a store no updater has filled; both drift for real.)
UNRELATED = (
    "channel_ecom",
    "channel_atm",
    "has_device_id",
    "hour_of_day_local",
    "is_foreign_country",
)


def test_psi_gauge_rises_for_the_shifted_feature_only(world: World, tmp_path: Path) -> None:
    # Spread over the whole day (the file is in event-time order: hours would shift).
    day = held_out_day(world)
    rows = [day[i] for i in np.random.default_rng(5).permutation(len(day))]
    window = 600
    srv = start_server(world, tmp_path, FRAUD_DRIFT_WINDOW=str(window), FRAUD_DECISION_LOG="off")
    replay = {"X-Fraud-Record": "false"}  # leave the cards' session state alone

    def send(batch: list[dict]) -> None:
        for i in range(0, len(batch), 200):
            body = {"transactions": batch[i : i + 200]}
            r = c.post("/v1/score/batch", json=body, headers=replay)
            assert r.status_code == 200, r.text

    try:
        with srv.client() as c:
            wait_until(lambda: "fraud_drift_reference 1.0" in c.get("/metrics").text)
            send(rows[:window])
            before = wait_until(
                lambda: (p := _psi(c.get("/metrics").text)) and len(p) > 20 and p,
                what="PSI gauges",
            )
            assert before["amount"] < 0.1 and all(before[f] < 0.1 for f in UNRELATED), before
            # The same transactions with twenty times the amount fill the next window.
            shifted = [
                {**t, "transaction_id": f"x-{t['transaction_id']}", "amount": t["amount"] * 20}
                for t in rows[window : 2 * window]
            ]
            send(shifted)
            after = wait_until(
                lambda: (p := _psi(c.get("/metrics").text)) and p["amount"] > 1.0 and p,
                what="the amount's PSI to rise",
            )
            assert all(after[f] < 0.1 for f in UNRELATED), after
            text = c.get("/metrics").text
            count = re.search(r'^fraud_score_count\{model_version="\d+"\} (\S+)$', text, re.M)
            assert count and float(count.group(1)) >= 2 * window
    finally:
        stop_server(srv)
