"""Drift and quality on served traffic: the reference stored with a model, the vectorised
bin counts and PSI, the service's gauges (real service over HTTP: requests shifted in one
feature raise that feature's PSI gauge while the others stay low) and ``evaluate
--served`` on the same decisions, logged and compacted."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram

from batch_jobs.decisions import compact_day
from batch_jobs.served_report import served_report, write_served_report
from fraud_scoring.drift import Binner, load_reference, psi, reference_bins
from fraud_scoring.event_log import read_redis_day
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.redis_server import embedded_redis
from service.loop.drift import SCORE_BUCKETS
from service.telemetry import observe_many
from tests.conftest import World, start_server, stop_server, wait_until
from tests.test_decision_log import metric
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


def samples(reg: CollectorRegistry, name: str) -> list[tuple[str, dict, float]]:
    """The histogram ``name``'s samples in ``reg``: (suffix, labels, value)."""
    return [
        (s.name.removeprefix(name), s.labels, s.value)
        for m in reg.collect()
        if m.name == name
        for s in m.samples
        if not s.name.endswith("_created")
    ]


def test_bulk_observe_matches_observe_per_value() -> None:
    """Pins prometheus_client's histogram internals that observe_many relies on."""
    reg = CollectorRegistry()
    one = Histogram("one", "x", buckets=SCORE_BUCKETS, registry=reg)
    bulk = Histogram("bulk", "x", buckets=SCORE_BUCKETS, registry=reg)
    values = np.r_[0.0, 0.001, 0.0011, 0.05, 0.2, 0.99, 1.0, np.random.default_rng(3).random(50)]
    for v in values:
        one.observe(float(v))
    observe_many(bulk, values)

    got, want = samples(reg, "bulk"), samples(reg, "one")
    assert [(n, lab) for n, lab, _ in got] == [(n, lab) for n, lab, _ in want]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want])


def test_per_request_histograms_are_kept_and_counted_in_bulk_by_the_next_scrape() -> None:
    """``telemetry.Kept``: a request's observation is a list append; the next scrape
    adds the kept values with the counts and sum one ``observe`` per value gives."""
    from service import telemetry

    reg = CollectorRegistry()
    one = Histogram("one", "x", buckets=telemetry.SECONDS_BUCKETS, registry=reg)
    kept = telemetry.Kept(Histogram("kept", "x", buckets=telemetry.SECONDS_BUCKETS, registry=reg))
    values = [0.0004, 0.001, 0.0031, 0.02, 0.7, 3.0]
    for v in values:
        one.observe(v)
        kept.observe(v)

    assert all(v == 0 for *_, v in samples(reg, "kept"))  # kept aside, nothing counted yet
    telemetry.exposition()
    got, want = samples(reg, "kept"), samples(reg, "one")
    assert [(n, lab) for n, lab, _ in got] == [(n, lab) for n, lab, _ in want]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want])
    for _ in range(telemetry.KEEP_AT_MOST):  # past the bound: added at once
        kept.observe(0.001)
    assert kept.values == [] and kept.child._sum.get() == pytest.approx(sum(values) + 0.256)


def test_kept_micro_batches_are_counted_by_the_next_scrape() -> None:
    """The drift monitor only keeps a scored micro-batch aside; the next ``/metrics``
    answer (or ``FLUSH_ROWS`` kept transactions) counts it into ``fraud_score``."""
    from service import telemetry
    from service.core.scoring import ScoreResult
    from service.loop.drift import FLUSH_ROWS, DriftMonitor

    version = "kept-aside-test"
    mon = DriftMonitor(models=None, window=0)  # type: ignore[arg-type]  # no window: no model

    def observe(scores: list[float]) -> None:
        results = [
            ScoreResult(f"t{i}", "approve", s, [], version, [], []) for i, s in enumerate(scores)
        ]
        mon.observe([], np.zeros((len(scores), 2), np.float32), ["a", "b"], results)

    hist = mon.ins.score.labels(model_version=version)
    observe([0.002, 0.2])
    observe([0.9])
    assert hist._sum.get() == 0  # kept, not counted yet
    remove = telemetry.before_scrape(mon.flush)
    try:
        text = telemetry.exposition().decode()
    finally:
        remove()
    assert f'fraud_score_count{{model_version="{version}"}} 3.0' in text
    assert hist._sum.get() == pytest.approx(1.102)
    observe([0.5] * FLUSH_ROWS)  # past FLUSH_ROWS: counted at once
    assert hist._sum.get() == pytest.approx(1.102 + 0.5 * FLUSH_ROWS)


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


@dataclass(frozen=True)
class Drifted:
    """A real service that scored a window of the held-out day, then the same number of
    transactions with twenty times their amount; its /metrics after each half, and its
    decision log compacted into ``raw`` (with the world's chargebacks beside it)."""

    before: dict[str, float]
    after: dict[str, float]
    metrics: str
    raw: Path
    day: date
    window: int


@pytest.fixture(scope="module")
def drifted(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drifted]:
    # Spread over the whole day (the file is in event-time order: hours would shift).
    day = held_out_day(world)
    rows = [day[i] for i in np.random.default_rng(5).permutation(len(day))]
    window = 600
    tmp = tmp_path_factory.mktemp("drift")
    replay = {"X-Fraud-Record": "false"}  # leave the cards' session state alone
    with embedded_redis() as log_url:
        srv = start_server(
            world, tmp, FRAUD_DRIFT_WINDOW=str(window), FRAUD_DECISION_LOG_URL=log_url
        )
        try:
            with srv.client() as c:

                def send(batch: list[dict]) -> None:
                    for i in range(0, len(batch), 64):  # the largest call by default
                        body = {"transactions": batch[i : i + 64]}
                        r = c.post("/v1/score/batch", json=body, headers=replay)
                        assert r.status_code == 200, r.text

                wait_until(lambda: "fraud_drift_reference 1.0" in c.get("/metrics").text)
                send(rows[:window])
                before = wait_until(
                    lambda: (p := _psi(c.get("/metrics").text)) and len(p) > 20 and p,
                    what="PSI gauges",
                )
                # The same kind of transactions with twenty times the amount fill the window.
                shifted = [
                    {**t, "transaction_id": f"x-{t['transaction_id']}", "amount": t["amount"] * 20}
                    for t in rows[window : 2 * window]
                ]
                send(shifted)
                after = wait_until(
                    lambda: (p := _psi(c.get("/metrics").text)) and p["amount"] > 1.0 and p,
                    what="the amount's PSI to rise",
                )
                metrics = c.get("/metrics").text
                wait_until(
                    lambda: (
                        metric(c.get("/metrics").text, "fraud_decision_log_written_total")
                        >= 2 * window
                    ),
                    what="every decision logged",
                )
        finally:
            stop_server(srv)
        raw = tmp / "raw"
        shutil.copytree(world.data_dir / "raw" / "labels", raw / "labels")
        today = datetime.now(UTC).date()
        for d in (today - timedelta(days=1), today):  # a run across midnight
            compact_day(
                raw,
                d,
                (p for _, p in read_redis_day(log_url, "decisions", d)),
                (p for _, p in read_redis_day(log_url, "feedback", d)),
            )
    yield Drifted(before, after, metrics, raw, today, window)


def test_psi_gauge_rises_for_the_shifted_feature_only(drifted: Drifted) -> None:
    before, after = drifted.before, drifted.after
    assert before["amount"] < 0.1 and all(before[f] < 0.1 for f in UNRELATED), before
    assert after["amount"] > 1.0 and all(after[f] < 0.1 for f in UNRELATED), after
    count = re.search(r'^fraud_score_count\{model_version="\d+"\} (\S+)$', drifted.metrics, re.M)
    assert count and float(count.group(1)) >= 2 * drifted.window


def test_served_report_on_the_logged_decisions(
    drifted: Drifted, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli.main import main
    from fraud_scoring.settings import read_settings

    monkeypatch.setenv("FRAUD_DATA_DIR", str(drifted.raw.parent))
    monkeypatch.setenv("FRAUD_MODEL_REPO", str(world.model_repo))
    read_settings.cache_clear()
    out = tmp_path / "report"
    day = drifted.day.isoformat()
    try:
        args = ["evaluate", "--served", "--from", day, "--to", day, "--out", str(out)]
        assert main(args) == 0
        assert main(["evaluate", "--from", day]) == 2  # --from goes with --served
    finally:
        read_settings.cache_clear()
    data = json.loads((out / "served.json").read_text())
    assert data["rows"] == 2 * drifted.window
    assert sum(r["approve"] + r["review"] + r["decline"] for r in data["decisions_per_day"]) == (
        2 * drifted.window
    )
    (version, v), *others = data["versions"].items()
    assert not others and v["rows"] == 2 * drifted.window
    # The held-out day's chargebacks (simulated, long arrived) label its frauds.
    assert v["frauds"] == data["labels"]["fraud"] > 0
    assert 0 < v["as_decided"]["flagged_recall"] <= 1 and "pr_auc" in v["metrics"]
    assert v["reliability"] and v["metrics"]["ece"] >= 0
    drift = v["drift"]
    assert drift["reference"] and "amount" in drift["shifted"]
    assert all(drift["features"][f] < 0.1 for f in UNRELATED)
    for name in ("report.md", "decisions_per_day.png", f"v{version}-psi.png"):
        assert (out / name).stat().st_size > 0
    assert (out / f"v{version}-reliability.png").read_bytes()[:4] == b"\x89PNG"


def test_served_report_without_a_reference(drifted: Drifted, world: World, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(world.model_repo, repo)
    for f in repo.glob("fraud/*/reference.json"):
        f.unlink()  # as a version trained before references were stored
    data = served_report(drifted.raw, drifted.day, drifted.day, datetime.now(UTC), repo, "fraud")
    (v,) = data["versions"].values()
    assert v["drift"] == {
        "reference": False,
        "why": "no reference (trained before references were stored)",
    }
    assert v["at_thresholds"]["flagged_recall"] >= 0  # the rest of the report stands
    write_served_report(tmp_path / "out", data)
    assert "no reference" in (tmp_path / "out" / "report.md").read_text()
