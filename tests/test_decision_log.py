"""The decision loop: every decision in the log (with the vector the model saw), a log
outage that scoring does not feel, feedback labels, and the daily compaction into the
offline store with labels joined by arrival time. Real service over HTTP, real
Redis-protocol servers (the log on its own server, so a test can kill it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import redis

from batch_jobs.decisions import LABEL_SCHEMA
from cli.settings import Settings
from fraud_scoring.redis_server import embedded_redis
from service.core.model import load_configured
from tests.conftest import (
    Server,
    World,
    mark_declared,
    private_db,
    start_server,
    stop_server,
    wait_until,
)
from tests.test_service import TXN, held_out_day


@pytest.fixture(scope="module")
def log_url() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


@pytest.fixture(scope="module")
def logged(
    world: World, log_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(world, tmp_path_factory.mktemp("logged"), FRAUD_DECISION_LOG_URL=log_url)
    yield srv
    stop_server(srv)


def entries(url: str, stream: str = "decisions") -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(f[b"d"]) for _, f in client.xrange(stream)]
    finally:
        client.close()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_every_decision_is_logged_with_the_vector_the_model_saw(
    logged: Server, world: World, log_url: str
) -> None:
    rows = [{**r, "transaction_id": f"log-{r['transaction_id']}"} for r in held_out_day(world)]
    sent = rows[:60]
    with logged.client() as c:
        answers = {}
        for i in range(0, 50, 10):
            r = c.post("/v1/score/batch", json={"transactions": sent[i : i + 10]})
            assert r.status_code == 200, r.text
            answers.update({a["transaction_id"]: a for a in r.json()["results"]})
        for t in sent[50:]:
            r = c.post("/v1/score", json=t)
            assert r.status_code == 200, r.text
            answers[t["transaction_id"]] = r.json()
    ids = {t["transaction_id"] for t in sent}
    got = wait_until(
        lambda: (
            (e := [x for x in entries(log_url) if x["transaction_id"] in ids])
            and len(e) >= 60
            and e
        ),
        what="60 log entries",
    )
    assert len(got) == 60
    model = load_configured(Settings(model_repo=world.model_repo, execution_provider="cpu"))
    names = model.meta.feature_names
    x = np.array([[e["features"][n] for n in names] for e in got], dtype=np.float32)
    assert all(list(e["features"]) == names for e in got)  # the model's order
    # The logged vector is the one scored: the model gives the logged score back.
    np.testing.assert_allclose(model.predict(x), [e["score"] for e in got], rtol=1e-6)
    for e in got:
        a = answers[e["transaction_id"]]
        assert (e["score"], e["decision"], e["model_version"]) == (
            a["score"],
            a["decision"],
            a["model_version"],
        )
        assert e["reasons"] == [r["code"] for r in a["reasons"]]
        assert e["missing"] == a["features"]["missing"] and e["stale"] == a["features"]["stale"]
        assert e["transaction"]["card_id"] == next(
            t["card_id"] for t in sent if t["transaction_id"] == e["transaction_id"]
        )
        assert e["timing_ms"]["inference"] >= 0 and e["decided_at"] > 0
        assert e["challenger_score"] is None


def test_a_retried_transaction_id_is_one_entry(logged: Server, log_url: str) -> None:
    txn = {**TXN, "transaction_id": "retried-1"}
    with logged.client() as c:
        for _ in range(3):
            assert c.post("/v1/score", json=txn).status_code == 200
        # A marker after it: once it is in, the retries before it were handled too.
        assert (
            c.post("/v1/score", json={**TXN, "transaction_id": "retried-after"}).status_code == 200
        )
    wait_until(lambda: any(e["transaction_id"] == "retried-after" for e in entries(log_url)))
    assert sum(e["transaction_id"] == "retried-1" for e in entries(log_url)) == 1


def test_a_log_outage_does_not_fail_scoring(world: World, tmp_path: Path) -> None:
    rows = held_out_day(world)[:400]
    log_server = embedded_redis()  # entered by hand: the test stops it under load
    url = log_server.__enter__()
    srv = start_server(world, tmp_path, FRAUD_DECISION_LOG_URL=url, FRAUD_DECISION_LOG_BUFFER="100")
    try:
        with srv.client() as c, ThreadPoolExecutor(8) as pool:

            def score(t: dict) -> int:
                tid = f"out-{t['transaction_id']}"
                return c.post("/v1/score", json={**t, "transaction_id": tid}).status_code

            assert set(pool.map(score, rows[:100])) == {200}
            wait_until(lambda: len(entries(url)) >= 100, what="first 100 logged")
            during = pool.map(score, rows[100:250])  # requests keep coming ...
            log_server.__exit__(None, None, None)  # ... while the log's server dies
            # 150 more than the buffer's 100 after it died: some must be dropped.
            assert set(during) | set(pool.map(score, rows[250:400])) == {200}
            m = wait_until(
                lambda: (
                    (t := c.get("/metrics").text) and metric(t, "fraud_decision_log_up") == 0 and t
                ),
                what="the log marked down",
            )
            # Scoring went on: what the buffer could not hold waits in the spool's files
            # (tests/test_decision_log_durability.py ships them when the log is back).
            assert metric(m, "fraud_decision_log_dropped_total") == 0
            assert metric(m, "fraud_decision_log_buffered") <= 100
            ready = c.get("/readyz")
            assert ready.status_code == 200  # still serving
            assert ready.json()["decision_log"].startswith("unreachable")
            assert "spool file(s)" in ready.json()["decision_log"]
            after = {**TXN, "transaction_id": "after-outage"}
            assert c.post("/v1/score", json=after).status_code == 200
    finally:
        stop_server(srv)
        log_server.__exit__(None, None, None)


def test_feedback_validates_and_is_idempotent(logged: Server, log_url: str) -> None:
    good = {
        "transaction_id": "fb-1",
        "label": "fraud",
        "source": "analyst",
        "time": "2026-01-20T10:00:00+00:00",
    }
    with logged.client() as c:
        for bad, field in [
            ({**good, "label": "maybe"}, "label"),
            ({**good, "source": "bank"}, "source"),
            ({**good, "time": "2026-01-20T10:00:00"}, "time"),  # no time zone
            ({**good, "time": 0}, "time"),  # a number is not a date-time
            ({k: v for k, v in good.items() if k != "transaction_id"}, "transaction_id"),
            ({**good, "extra": 1}, "extra"),
        ]:
            r = c.post("/v1/feedback", json=bad)
            assert r.status_code == 422, r.text
            assert [e["field"] for e in r.json()["detail"]] == [field]
        first = c.post("/v1/feedback", json=good)
        again = c.post("/v1/feedback", json={**good, "time": "2026-01-21T00:00:00+00:00"})
        other = c.post("/v1/feedback", json={**good, "source": "customer"})
    assert first.status_code == again.status_code == other.status_code == 200
    assert (first.json()["duplicate"], again.json()["duplicate"]) == (False, True)
    assert other.json()["duplicate"] is False  # another source is another label
    stored = [e for e in entries(log_url, "feedback") if e["transaction_id"] == "fb-1"]
    assert [(e["source"], e["is_fraud"]) for e in stored] == [("analyst", True), ("customer", True)]
    assert stored[0]["label_time"] == int(first.json()["label_time"] * 1e6)


def test_compaction_is_idempotent_and_labels_join_by_arrival(
    logged: Server, log_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batch_jobs.decisions import decisions_with_labels
    from cli.main import main
    from fraud_scoring.settings import read_settings
    from fraud_scoring.storage import partition_file, read_partition, write_partition

    ids = [f"cmp-{i}" for i in range(4)]
    with logged.client() as c:
        for tid in [*ids, ids[0]]:  # the last one a retry
            assert c.post("/v1/score", json={**TXN, "transaction_id": tid}).status_code == 200
        for tid, label in [(ids[0], "fraud"), (ids[1], "legitimate")]:
            body = {
                "transaction_id": tid,
                "label": label,
                "source": "analyst",
                "time": TXN["event_time"],
            }
            assert c.post("/v1/feedback", json=body).status_code == 200
    wait_until(lambda: {e["transaction_id"] for e in entries(log_url)} >= set(ids))
    raw = tmp_path / "raw"
    today = datetime.now(UTC).date()
    # A chargeback for ids[2] arriving tomorrow, already in the label files.
    tomorrow = datetime.combine(today + timedelta(days=1), datetime.min.time(), UTC)
    write_partition(
        raw,
        "labels",
        tomorrow.date(),
        pa.Table.from_pylist(
            [
                {
                    "transaction_id": ids[2],
                    "label_time": tomorrow + timedelta(hours=1),
                    "is_fraud": True,
                }
            ],
            schema=LABEL_SCHEMA,
        ),
    )
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FRAUD_DECISION_LOG_URL", log_url)
    read_settings.cache_clear()
    try:
        assert main(["decisions", "compact", "--date", today.isoformat()]) == 0
        first = read_partition(raw, "decisions", today)
        first_labels = read_partition(raw, "labels", today)
        assert main(["decisions", "compact", "--date", today.isoformat()]) == 0
    finally:
        read_settings.cache_clear()
    assert read_partition(raw, "decisions", today).equals(first)
    assert read_partition(raw, "labels", today).equals(first_labels)
    assert partition_file(raw, "labels", tomorrow.date()).exists()
    ours = [r for r in first.to_pylist() if r["transaction_id"] in ids]
    assert sorted(r["transaction_id"] for r in ours) == ids  # the retry is not a row
    assert all(len(r["features"]) > 0 and r["card_id"] == TXN["card_id"] for r in ours)

    def labels_as_of(as_of: datetime) -> dict[str, bool | None]:
        t = decisions_with_labels(raw, today, today, as_of).to_pylist()
        return {r["transaction_id"]: r["is_fraud"] for r in t if r["transaction_id"] in ids}

    now = datetime.now(UTC)
    arrived = first_labels.column("label_time").to_pylist()
    before_any = min(arrived) - timedelta(microseconds=1)
    assert labels_as_of(before_any) == dict.fromkeys(ids)
    assert labels_as_of(now) == {ids[0]: True, ids[1]: False, ids[2]: None, ids[3]: None}
    assert labels_as_of(tomorrow + timedelta(hours=2))[ids[2]] is True


def test_a_matched_label_counts_in_the_label_states_when_it_arrives(
    world: World, log_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POST /v1/feedback for a transaction the service holds records the label in every
    label state at once: the transaction's first label only, with ``live: true`` in the
    log; the compaction keeps that in the label's source row, so training counts it from
    its arrival and the daily batch does not record it again. A second label, and one for
    a transaction the service never saw, wait for the batch (``live: false``)."""
    from batch_jobs.batch import record_day_labels
    from batch_jobs.declared_sql import load_label_events
    from cli.main import main
    from fraud_scoring import declared as D
    from fraud_scoring import features as F
    from fraud_scoring.labels import SOURCES_TABLE
    from fraud_scoring.settings import read_settings
    from fraud_scoring.storage import read_partition, write_partition
    from service.core.live_labels import labelled_key

    url = private_db(world, 10)  # its label states are this test's alone
    mark_declared(url)
    srv = start_server(
        world,
        tmp_path,
        REDIS_URL=url,
        FRAUD_DECISION_LOG_URL=log_url,
        FRAUD_IDEMPOTENCY_TTL_S="3600",  # its claim holds the transaction (as deployed)
    )
    tid, txn = "live-1", {**TXN, "transaction_id": "live-1"}
    label = {
        "transaction_id": tid,
        "label": "fraud",
        "source": "analyst",
        "time": TXN["event_time"],
    }
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json=txn).status_code == 200
            first = c.post("/v1/feedback", json=label)
            second = c.post("/v1/feedback", json={**label, "source": "customer"})
            unmatched = c.post("/v1/feedback", json={**label, "transaction_id": "live-never"})
    finally:
        stop_server(srv)
    assert first.status_code == second.status_code == unmatched.status_code == 200
    assert (first.json()["live"], second.json()["live"], unmatched.json()["live"]) == (
        True,
        False,
        False,
    )
    assert unmatched.json()["matched"] is False
    logged = [e for e in entries(log_url, "feedback") if e["transaction_id"] in (tid, "live-never")]
    assert [(e["transaction_id"], e["source"], e["live"]) for e in logged] == [
        (tid, "analyst", True),
        (tid, "customer", False),
        ("live-never", "analyst", False),
    ]
    arrived = logged[0]["label_time"]
    client = redis.Redis.from_url(url)
    assert client.get(labelled_key(tid)).startswith(b"1 ")  # recorded, the analyst's label
    event_us = int(datetime.fromisoformat(TXN["event_time"]).timestamp() * 1e6)
    specs = [s for s in F.declarations().specs if s.source == "labels"]
    assert specs
    for spec in specs:  # recorded once, at its arrival (or its transaction's time + delay)
        key = spec.key_value(txn)
        assert key is not None
        ids = client.zrange(spec.prefix(key) + ":ids", 0, -1, withscores=True)
        assert ids == [(tid.encode(), float(max(arrived, event_us + spec.delay_us)))], spec.id

    # The compaction keeps it; training counts it from its arrival; the batch skips it.
    raw = tmp_path / "raw"
    day = datetime.fromtimestamp(arrived / 1e6, UTC).date()
    event_time = datetime.fromisoformat(TXN["event_time"])
    write_partition(
        raw,
        "transactions",
        event_time.date(),
        pa.Table.from_pylist([{**txn, "event_time": event_time, "is_fraud": False}]),
    )
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FRAUD_DECISION_LOG_URL", log_url)
    read_settings.cache_clear()
    try:
        assert main(["decisions", "compact", "--date", day.isoformat()]) == 0
    finally:
        read_settings.cache_clear()
    sources = [
        r for r in read_partition(raw, SOURCES_TABLE, day).to_pylist() if r["transaction_id"] == tid
    ]
    assert sorted((r["source"], r["live"]) for r in sources) == [
        ("analyst", True),
        ("customer", False),
    ]
    got = load_label_events(raw, 300.0).set_index("transaction_id")
    assert (
        got.loc[tid, "live"] and got.loc[tid, "available_us"] == got.loc[tid, "label_us"] == arrived
    )
    before = {k: client.dump(k) for k in client.scan_iter(match="{agg:*")}
    assert record_day_labels(raw, [day], url, 300.0) == 0
    assert {k: client.dump(k) for k in client.scan_iter(match="{agg:*")} == before
    assert D.label_available_us(arrived, 300.0) > arrived  # what the batch would have said


def test_a_decision_logged_again_after_midnight_is_one_row(tmp_path: Path) -> None:
    """A retry the log let through on the next UTC day is not a second decision: the
    day's compaction drops an id the day before already holds, and the labelled view has
    one row per id (its first decision) whatever the partitions hold."""
    from datetime import date

    from batch_jobs.decisions import compact_day, decisions_with_labels

    def entry(tid: str, decided: str) -> bytes:
        return json.dumps(
            {
                "transaction_id": tid,
                "decided_at": decided,
                "transaction": {"event_time": decided, "card_id": "c1", "amount": 5.0},
                "features": {"amount": 5.0},
                "missing": [],
                "stale": [],
                "score": 0.1,
                "model_version": "1",
                "decision": "approve",
                "reasons": [],
                "timing_ms": {"total": 1.0},
            }
        ).encode()

    raw = tmp_path / "raw"
    d1, d2 = date(2026, 3, 1), date(2026, 3, 2)
    late = entry("t-midnight", "2026-03-01T23:59:59.900000+00:00")
    again = entry("t-midnight", "2026-03-02T00:00:00.200000+00:00")
    first = compact_day(raw, d1, [late, entry("t-a", "2026-03-01T10:00:00+00:00")], [])
    second = compact_day(raw, d2, [again, entry("t-b", "2026-03-02T10:00:00+00:00")], [])
    assert (first.decisions, second.decisions, second.duplicates) == (2, 1, 1)
    # Compacted in the other order (the later day first): both partitions hold the id,
    # and the labelled view still has one row for it, the first decision.
    other = tmp_path / "other"
    compact_day(other, d2, [again, entry("t-b", "2026-03-02T10:00:00+00:00")], [])
    compact_day(other, d1, [late, entry("t-a", "2026-03-01T10:00:00+00:00")], [])
    for where in (raw, other):
        view = decisions_with_labels(where, d1, d2, datetime(2026, 4, 1, tzinfo=UTC))
        ids, at = view.column("transaction_id").to_pylist(), view.column("decided_at").to_pylist()
        rows = dict(zip(ids, at, strict=True))
        assert sorted(rows) == ["t-a", "t-b", "t-midnight"] and len(view) == 3
        assert rows["t-midnight"].date() == d1


def test_a_rerun_after_the_log_dropped_the_day_keeps_its_decisions(tmp_path: Path) -> None:
    """The log keeps a day for FRAUD_DECISION_LOG_RETENTION_S (3 days), and ``batch``
    compacts each day it runs: a re-run over past days (as ``features plan`` asks for a new
    snapshot feature) reads less of the log, or nothing, and must not replace the day's
    decisions with what is left; a re-run that reads more adds it."""
    from datetime import date

    from batch_jobs.decisions import compact_day
    from fraud_scoring.storage import read_partition

    def entry(tid: str, decided: str) -> bytes:
        t = {"event_time": decided, "card_id": "c1", "amount": 5.0}
        return json.dumps(
            {
                "transaction_id": tid,
                "decided_at": decided,
                "transaction": t,
                "features": {"amount": 5.0},
                **{k: [] for k in ("missing", "stale", "reasons")},
                "score": 0.1,
                "model_version": "1",
                "decision": "approve",
                "timing_ms": {"total": 1.0},
            }
        ).encode()

    raw, day = tmp_path / "raw", date(2026, 3, 1)
    logged = [entry(f"t{i}", f"2026-03-01T1{i}:00:00+00:00") for i in range(3)]
    assert compact_day(raw, day, logged, []).decisions == 3
    first = read_partition(raw, "decisions", day)
    assert compact_day(raw, day, [], []).decisions == 3  # the log no longer holds the day
    assert compact_day(raw, day, logged[2:], []).decisions == 3  # holds part of it
    assert read_partition(raw, "decisions", day).equals(first)
    later = entry("t-late", "2026-03-01T09:00:00+00:00")  # logged late, earlier time
    report = compact_day(raw, day, [*logged, later], [])
    assert (report.decisions, report.duplicates) == (4, 3)
    ids = read_partition(raw, "decisions", day).column("transaction_id").to_pylist()
    assert ids == ["t-late", "t0", "t1", "t2"]  # in decision-time order
