"""The decision log on Kafka: the service writes it, a UTC day is read back by record
timestamp, and the daily compaction works on it as on Redis. A real Kafka-protocol broker
(tansu) and the real service over HTTP.

tansu (0.6) answers ListOffsets by timestamp with offset 0 (and "latest" with a wrong
offset), so against it :func:`read_kafka_day` reads each partition from the start and
keeps the day by record timestamp; a real broker's lookup only lets it start later. The
partition's end is found by fetching (end-of-partition), which tansu gets right.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fraud_scoring.event_log import LogUnavailable, day_bounds_ms, read_kafka_day
from fraud_scoring.redis_server import free_port
from streaming.sources import ensure_topic
from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.conftest_streaming import kafka_bootstrap  # noqa: F401 (fixture)
from tests.test_service import TXN

DAY = date(2026, 3, 10)


def produce(bootstrap: str, topic: str, records: list[tuple[str, int, int]]) -> None:
    """(key, partition, timestamp ms) records, the value the key, stamped as given."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, partition, ts in records:
        p.produce(topic, key=key.encode(), value=key.encode(), partition=partition, timestamp=ts)
    assert p.flush(15) == 0


def test_a_day_is_read_back_by_record_timestamp(kafka_bootstrap: str) -> None:  # noqa: F811
    topic = "day-read"
    ensure_topic(kafka_bootstrap, topic, 3)
    start, end = day_bounds_ms(DAY)
    hour = 3_600_000
    records = [
        ("before", 0, start - 60_000),
        ("first", 0, start),
        *((f"in-{i}", i % 3, start + i * hour + 17) for i in range(1, 24)),
        ("last", 1, end - 1),
        ("next-day", 0, end),
        # Behind a next-day record (another producer's clock), within the margin: kept.
        ("late-clock", 0, end - 5),
        ("past-margin", 0, end + 10 * 60_000),
        # Behind a record past the margin: the partition's read has stopped.
        ("too-late-clock", 0, end - 10),
        ("next-day-2", 2, end + hour),
    ]
    produce(kafka_bootstrap, topic, records)
    got = list(read_kafka_day(kafka_bootstrap, topic, DAY))
    assert all(start <= ts < end for ts, _ in got)
    keys = [v.decode() for _, v in got]
    assert sorted(keys) == sorted(
        ["first", "last", "late-clock", *(f"in-{i}" for i in range(1, 24))]
    )
    # Each partition in offset order.
    in_p0 = [
        k for k in keys if k in ("first", "late-clock") or k in {f"in-{i}" for i in range(3, 24, 3)}
    ]
    assert in_p0[0] == "first" and in_p0[-1] == "late-clock"
    # A day with nothing in it and a topic that does not exist are empty days.
    assert list(read_kafka_day(kafka_bootstrap, topic, DAY + timedelta(days=3))) == []
    assert list(read_kafka_day(kafka_bootstrap, "no-such-topic", DAY)) == []


def test_an_unreachable_broker_is_log_unavailable() -> None:
    with pytest.raises(LogUnavailable):
        list(read_kafka_day(f"127.0.0.1:{free_port()}", "decisions", DAY, timeout_s=2))


@pytest.fixture(scope="module")
def kafka_logged(
    world: World,
    kafka_bootstrap: str,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    for topic in ("k-decisions", "k-feedback"):
        ensure_topic(kafka_bootstrap, topic, 3)
    srv = start_server(
        world,
        tmp_path_factory.mktemp("kafka-logged"),
        FRAUD_DECISION_LOG="kafka",
        FRAUD_KAFKA_BOOTSTRAP=kafka_bootstrap,
        FRAUD_DECISION_LOG_STREAM="k-decisions",
        FRAUD_FEEDBACK_STREAM="k-feedback",
    )
    yield srv
    stop_server(srv)


def test_decisions_on_kafka_compact_like_redis(
    kafka_logged: Server,
    kafka_bootstrap: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cli.main import main
    from fraud_scoring.settings import read_settings
    from fraud_scoring.storage import read_partition

    ids = [f"kafka-{i}" for i in range(12)]
    unavailable: Counter[tuple[str, str]] = Counter()
    cards: dict[str, str] = {}
    with kafka_logged.client() as c:
        for i, tid in enumerate([*ids, ids[0], ids[1]]):  # two retries: Kafka keeps both
            # Every other one from a card the store has never seen: its features missing.
            card = TXN["card_id"] if i % 2 else f"new-card-{i}"
            cards.setdefault(tid, card)  # the first entry per id is the one compacted
            r = c.post("/v1/score", json={**TXN, "transaction_id": tid, "card_id": card})
            assert r.status_code == 200, r.text
            for state in ("missing", "stale"):
                unavailable.update((f, state) for f in r.json()["features"][state])
        for tid, label in [(ids[0], "fraud"), (ids[1], "legitimate")]:
            body = {"transaction_id": tid, "label": label, "source": "analyst"}
            r = c.post("/v1/feedback", json=body | {"time": TXN["event_time"]})
            assert r.status_code == 200, r.text
        metrics = c.get("/metrics").text
    assert "fraud_decision_log_up 1.0" in metrics
    # The responses' missing/stale flags, counted per feature on /metrics.
    counted = {
        (m.labels["feature"], m.labels["state"]): int(m.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "fraud_features_unavailable"
        for m in family.samples
        if m.name.endswith("_total") and m.value > 0  # every pair is exported from 0
    }
    assert unavailable and counted == dict(unavailable)
    today = datetime.now(UTC).date()

    def logged() -> list[dict]:
        return [json.loads(v) for _, v in read_kafka_day(kafka_bootstrap, "k-decisions", today)]

    entries = wait_until(lambda: (e := logged()) and len(e) >= len(ids) + 2 and e)
    assert sorted({e["transaction_id"] for e in entries}) == sorted(ids)
    assert all(e["features"] and e["model_version"] for e in entries)

    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FRAUD_DECISION_LOG", "kafka")
    monkeypatch.setenv("FRAUD_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("FRAUD_DECISION_LOG_STREAM", "k-decisions")
    monkeypatch.setenv("FRAUD_FEEDBACK_STREAM", "k-feedback")
    monkeypatch.delenv("REDIS_URL", raising=False)
    read_settings.cache_clear()
    raw = tmp_path / "raw"
    try:
        assert main(["decisions", "compact", "--date", today.isoformat()]) == 0
        first = read_partition(raw, "decisions", today)
        labels = read_partition(raw, "labels", today)
        assert main(["decisions", "compact", "--date", today.isoformat()]) == 0
    finally:
        read_settings.cache_clear()
    assert read_partition(raw, "decisions", today).equals(first)
    assert read_partition(raw, "labels", today).equals(labels)
    rows = first.to_pylist()
    assert sorted(r["transaction_id"] for r in rows) == sorted(ids)  # retries dropped
    assert all(r["card_id"] == cards[r["transaction_id"]] and r["features"] for r in rows)
    assert {r["transaction_id"]: r["is_fraud"] for r in labels.to_pylist()} == {
        ids[0]: True,
        ids[1]: False,
    }
