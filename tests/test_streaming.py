"""The streaming updater against a real Redis-protocol server and a real Kafka broker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fraud_scoring.events import Transaction
from streaming.metrics import UpdaterMetrics
from streaming.sources import KafkaSource, Message, RedisStreamSource
from streaming.state import CardEvent, SessionWriter, card_event
from streaming.updater import Updater, decode
from tests.conftest_streaming import (
    connect,
    dump_state,
    encode,
    feed,
    kafka_bootstrap,
    sigkill,
    start_updater,
    stream_redis,
    wait_for,
    xadd_all,
)

__all__ = ["kafka_bootstrap", "stream_redis"]

STREAM = "transactions"


def run_updater_in_process(url: str, n_messages: int, batch_size: int = 500) -> Updater:
    client = connect(url, socket_timeout=10)
    source = RedisStreamSource(client, STREAM, "g", "inproc")
    updater = Updater(
        source,
        SessionWriter(client, allowed_lateness_s=300),
        UpdaterMetrics.create(),
        batch_size=batch_size,
    )
    updater.run(max_messages=n_messages)
    return updater


def clean_run(url: str, events: list[dict[str, object]]) -> None:
    """The reference state: every event applied once, in arrival order, no crash."""
    writer = SessionWriter(connect(url), allowed_lateness_s=300)
    msgs = [card_event_of(e) for e in events]
    for start in range(0, len(msgs), 1000):
        writer.apply(msgs[start : start + 1000])


def card_event_of(e: dict[str, object]) -> CardEvent:
    return card_event(Transaction.model_validate_event(e))


def test_malformed_events_go_to_the_dead_letter(stream_redis: str) -> None:
    good = feed(cards=50)[:100]
    base = dict(good[0])
    bad_events: list[bytes] = [
        json.dumps({k: v for k, v in base.items() if k != "card_id"}).encode(),
        json.dumps({**base, "amount": "lots"}).encode(),
        json.dumps({**base, "amount": -5}).encode(),
        json.dumps({**base, "event_time": "yesterday-ish"}).encode(),
        b"{not json",
        b"[1, 2, 3]",
        b"[" * 100_000,  # too deep for the JSON parser: must not crash the updater
        json.dumps({**base, "merchant_id": "m\x1fx"}).encode(),  # breaks the state encoding
        json.dumps({**base, "event_time": "2099-01-01T00:00:00Z"}).encode(),  # would trim
    ]
    payloads = encode(good[:50]) + bad_events + encode(good[50:])
    client = connect(stream_redis)
    xadd_all(client, STREAM, payloads)
    updater = run_updater_in_process(stream_redis, len(payloads), batch_size=40)
    assert updater.totals.dead_letters == len(bad_events)
    assert updater.totals.applied.added == len({e["transaction_id"] for e in good})
    dead = client.xrange(STREAM + ":dead-letter")
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    # At most 64 KiB of an event is kept; its size and a flag say what was cut.
    assert [fields[b"data"] for _, fields in dead] == [b[:65_536] for b in bad_events]
    assert [int(fields[b"original_size"]) for _, fields in dead] == list(map(len, bad_events))
    assert [fields[b"truncated"] for _, fields in dead].count(b"true") == 1
    assert "card_id" in reasons[0] and "amount" in reasons[1] and "amount" in reasons[2]
    assert "event_time" in reasons[3] and "JSON" in reasons[4] and "object" in reasons[5]
    assert "JSON" in reasons[6] and "merchant_id" in reasons[7]
    assert "future" in reasons[8]
    group = client.xinfo_groups(STREAM)[0]
    assert group["pending"] == 0 and group["lag"] == 0
    assert decode_reason(b'{"amount": 1}').startswith("transaction_id")


def decode_reason(raw: bytes) -> str:
    reason = decode(Message(raw, 0.0, "x"))
    assert isinstance(reason, str)
    return reason


def test_sigkill_mid_stream_then_restart_equals_clean_run(
    stream_redis: str, tmp_path: Path
) -> None:
    events = feed(cards=5000, seed=9, late_fraction=0.1, duplicate_rate=0.05)
    n = len(events)
    client = connect(stream_redis)
    xadd_all(client, STREAM, encode(events))
    log = tmp_path / "updater.log"
    common = ("--source", "redis", "--stream", STREAM, "--group", "g", "--batch-size", "1500")

    def pending() -> int:
        return int(client.xpending(STREAM, "g")["pending"])

    def read() -> int:
        groups = client.xinfo_groups(STREAM)
        return int(groups[0]["entries-read"] or 0) if groups else 0

    # 1st crash: u1 dies holding pending entries; u2 (a new name) claims them.
    p = start_updater(stream_redis, log, *common, "--consumer", "u1")
    # Kill while a batch is in flight (read, not yet acknowledged): a large batch spends
    # tens of milliseconds there, far longer than the gap between the check and the kill.
    wait_for(lambda: read() >= n // 5 and pending() > 0, 60, "u1 to be mid-batch")
    sigkill(p)
    first_read, first_pending = read(), pending()
    # 2nd crash: u2 dies too; it comes back under its own name and re-reads its PEL.
    p = start_updater(stream_redis, log, *common, "--consumer", "u2", "--claim-idle-ms", "1")
    wait_for(lambda: read() >= first_read + n // 5 and pending() > 0, 60, "u2 to be mid-batch")
    sigkill(p)
    second_pending = pending()
    assert read() < n, f"the stream was finished before the kill; see {log}"
    p = start_updater(
        stream_redis,
        log,
        *common,
        "--consumer",
        "u2",
        "--claim-idle-ms",
        "1",
        "--idle-exit-s",
        "0.5",
    )

    def drained() -> bool:
        g = client.xinfo_groups(STREAM)[0]
        return g["lag"] == 0 and g["pending"] == 0

    wait_for(drained, 90, "the group to drain")
    assert p.wait(timeout=30) == 0, log.read_text()[-3000:]
    assert first_pending + second_pending > 0, "the kills left nothing to replay"

    reference = connect(stream_redis.rsplit("/", 1)[0] + "/1")
    clean_run(stream_redis.rsplit("/", 1)[0] + "/1", events)
    got, want = dump_state(client), dump_state(reference)
    assert len(want) > 1000
    assert got == want


def test_kafka_sigkill_mid_stream_then_restart_equals_clean_run(
    kafka_bootstrap: str, stream_redis: str, tmp_path: Path
) -> None:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

    from streaming.sources import ensure_topic

    topic = "txns"
    events = feed(cards=2000, seed=13, late_fraction=0.1, duplicate_rate=0.05)
    bad = [b'{"transaction_id": "x"}', b"\xff\xfe"]
    ensure_topic(kafka_bootstrap, topic, partitions=3)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for e, payload in zip(events, encode(events), strict=True):
        producer.produce(topic, value=payload, key=str(e["card_id"]).encode())
    for b in bad:
        producer.produce(topic, value=b, key=b"bad")
    assert producer.flush(30) == 0
    total = len(events) + len(bad)

    watcher = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "g"})
    parts = [TopicPartition(topic, i) for i in range(3)]

    def committed() -> int:
        return sum(max(tp.offset, 0) for tp in watcher.committed(parts, timeout=5))

    log = tmp_path / "updater.log"
    common = (
        "--source",
        "kafka",
        "--kafka-bootstrap",
        kafka_bootstrap,
        "--stream",
        topic,
        "--group",
        "g",
        "--batch-size",
        "200",
        "--kafka-session-timeout-ms",
        "6000",
    )
    p = start_updater(stream_redis, log, *common, "--consumer", "k1")
    wait_for(lambda: committed() > 0, 60, "the first commit")
    sigkill(p)
    assert committed() < total, f"the topic was finished before the kill; see {log}"
    p = start_updater(stream_redis, log, *common, "--consumer", "k2")
    try:
        wait_for(lambda: committed() == total, 90, "every offset to be committed")
    finally:
        p.terminate()
        p.wait(timeout=30)
    watcher.close()

    client = connect(stream_redis)
    reference_url = stream_redis.rsplit("/", 1)[0] + "/1"
    clean_run(reference_url, events)
    got, want = dump_state(client), dump_state(connect(reference_url))
    assert len(want) > 1000
    assert got == want

    dead = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "dlq-reader"})
    dead.assign([TopicPartition(topic + ".dead-letter", 0, OFFSET_BEGINNING)])
    seen: list[tuple[Any, Any]] = []

    def all_dead() -> bool:
        for m in dead.consume(10, 0.5):
            if m.error() is None:
                seen.append((m.value(), dict(m.headers() or [])["reason"]))
        return len({v for v, _ in seen}) >= len(bad)

    wait_for(all_dead, 30, "the dead letters")
    dead.close()
    assert {v for v, _ in seen} == set(bad)
    assert all(r for _, r in seen)


def test_kafka_source_keys_one_card_to_one_partition(kafka_bootstrap: str) -> None:
    """Several updaters share a topic safely because a card never spans partitions."""
    from confluent_kafka import Producer

    from streaming.sources import ensure_topic

    topic = "keyed"
    ensure_topic(kafka_bootstrap, topic, partitions=3)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    events = feed(cards=40)[:400]
    for e, payload in zip(events, encode(events), strict=True):
        producer.produce(topic, value=payload, key=str(e["card_id"]).encode())
    assert producer.flush(30) == 0
    source = KafkaSource(kafka_bootstrap, topic, "keyed-g", extra={"session.timeout.ms": 6000})
    got: list[Message] = []

    def all_polled() -> bool:
        got.extend(source.poll(500, 0.5))
        return len(got) >= len(events)

    try:
        wait_for(all_polled, 60, "all messages")
    finally:
        source.close()
    parts: dict[str, set[int]] = {}
    for m in got:
        parts.setdefault(json.loads(m.raw)["card_id"], set()).add(m.ref[1])
    assert all(len(p) == 1 for p in parts.values())
    assert len({p for ps in parts.values() for p in ps}) > 1


def test_redis_outage_pauses_retries_and_loses_nothing(stream_redis: str) -> None:
    import os
    import signal
    import threading

    events = feed(cards=2000, seed=21, duplicate_rate=0.05)
    client = connect(stream_redis)
    xadd_all(client, STREAM, encode(events))
    pid = int(client.info("server")["process_id"])
    # A short socket timeout so that the stopped server looks unavailable quickly.
    uclient = connect(stream_redis, socket_timeout=0.5)
    metrics = UpdaterMetrics.create()
    updater = Updater(
        RedisStreamSource(uclient, STREAM, "g", "u"),
        SessionWriter(uclient, allowed_lateness_s=300),
        metrics,
        batch_size=100,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    thread = threading.Thread(target=updater.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: updater.totals.messages >= 200, 30, "the first batches")
        os.kill(pid, signal.SIGSTOP)  # the server stops answering mid-stream
        try:
            assert updater.totals.messages < len(events)
            wait_for(
                lambda: (
                    sum(
                        s.value
                        for m in metrics.retries.collect()
                        for s in m.samples
                        if s.name.endswith("_total")
                    )
                    >= 2
                ),
                30,
                "the updater to back off",
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: updater.totals.messages >= len(events), 60, "the updater to resume")
    finally:
        updater.stop()
        thread.join(timeout=10)
    group = client.xinfo_groups(STREAM)[0]
    assert group["pending"] == 0 and group["lag"] == 0
    reference_url = stream_redis.rsplit("/", 1)[0] + "/1"
    clean_run(reference_url, events)
    assert dump_state(client) == dump_state(connect(reference_url))


def test_a_lost_consumer_group_is_created_again(stream_redis: str) -> None:
    """Redis restarted without persistence (or the stream was deleted): the updater
    recreates its group and goes on instead of crashing on NOGROUP."""
    events = feed(cards=50)
    half = len(events) // 2
    client = connect(stream_redis)
    xadd_all(client, STREAM, encode(events[:half]))
    updater = run_updater_in_process(stream_redis, half)
    client.delete(STREAM)  # the stream and its group are gone
    xadd_all(client, STREAM, encode(events[half:]))
    updater.backoff_initial_s = 0.01
    updater.run(max_messages=len(events), idle_exit_s=10)  # never hang the suite
    assert updater.totals.messages == len(events) and updater.totals.dead_letters == 0
    assert client.xinfo_groups(STREAM)[0]["pending"] == 0
