"""The updater's crash paths and what its logs may say, against real Redis and Kafka.

An oversized event on Kafka, Redis answering OOM or READONLY, the input stream's
trimming, a fatal Kafka error, and secrets in REDIS_URL (never logged).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cli.settings import Settings
from fraud_scoring.redis_server import feast_connection_string, free_port, redact_url
from streaming.metrics import UpdaterMetrics
from streaming.sources import KafkaSource, RedisStreamSource, SourceFatal, raise_if_fatal
from streaming.state import SessionWriter
from streaming.updater import Updater
from tests.conftest_streaming import (
    connect,
    dump_state,
    encode,
    feed,
    kafka_bootstrap,
    start_updater,
    stream_redis,
    wait_for,
    xadd_all,
)
from tests.test_streaming import clean_run

__all__ = ["kafka_bootstrap", "stream_redis"]

STREAM = "transactions"


def retries(metrics: UpdaterMetrics, step: str) -> float:
    return sum(
        s.value
        for m in metrics.retries.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["step"] == step
    )


@contextmanager
def running(updater: Updater) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=updater.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        updater.stop()
        thread.join(timeout=10)


def dead_letters(bootstrap: str, topic: str, n: int) -> list[tuple[bytes, dict[str, str]]]:
    """The first ``n`` records of ``topic``'s dead-letter topic: (value, headers)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    dead = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dlq-{topic}"})
    dead.assign([TopicPartition(topic + ".dead-letter", 0, OFFSET_BEGINNING)])
    seen: list[tuple[bytes, dict[str, str]]] = []

    def enough() -> bool:
        for m in dead.consume(10, 0.5):
            if m.error() is None:
                pairs: Any = m.headers() or []
                headers = {k: v.decode() for k, v in pairs}
                seen.append((m.value() or b"", headers))
        return len(seen) >= n

    try:
        wait_for(enough, 30, "the dead letters")
    finally:
        dead.close()
    return seen


def produce_with_oversized(bootstrap: str, topic: str, huge: bytes) -> list[dict[str, Any]]:
    """Good events, one ``huge`` invalid event, then 707 good events, in one partition."""
    from confluent_kafka import Producer

    from streaming.sources import ensure_topic

    events = feed(cards=300, seed=31)[:1007]
    ensure_topic(bootstrap, topic, partitions=1)
    # The writer of the bad event allowed larger records than the updater's producer.
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 3_000_000})
    payloads = encode(events)
    for p in [*payloads[:300], huge, *payloads[300:]]:
        producer.produce(topic, value=p)
    assert producer.flush(30) == 0
    return events


def test_kafka_oversized_dead_letter_does_not_stall_the_partition(
    kafka_bootstrap: str, stream_redis: str, tmp_path: Path
) -> None:
    """A ~1 MB invalid event: its dead letter is truncated (reason and size recorded) and
    the 707 good events behind it are applied; the updater keeps running."""
    from confluent_kafka import Consumer, TopicPartition

    topic = "oversized"
    huge = json.dumps({"transaction_id": "t-huge", "note": "x" * 1_000_000}).encode()
    events = produce_with_oversized(kafka_bootstrap, topic, huge)
    total = len(events) + 1
    watcher = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "g"})

    def committed() -> int:
        return sum(
            max(tp.offset, 0) for tp in watcher.committed([TopicPartition(topic, 0)], timeout=5)
        )

    log = tmp_path / "updater.log"
    p = start_updater(
        stream_redis,
        log,
        *("--source", "kafka", "--kafka-bootstrap", kafka_bootstrap, "--stream", topic),
        *("--group", "g", "--batch-size", "100", "--kafka-session-timeout-ms", "6000"),
    )
    try:
        wait_for(lambda: committed() == total, 90, f"every offset committed (see {log})")
        assert p.poll() is None, log.read_text()
    finally:
        p.terminate()
        p.wait(timeout=30)
        watcher.close()
    [(value, headers)] = dead_letters(kafka_bootstrap, topic, 1)
    assert value == huge[:65_536]
    assert headers["original_size"] == str(len(huge)) and headers["truncated"] == "true"
    assert "card_id" in headers["reason"] and headers["source"] == f"{topic}/0/300"
    reference_url = stream_redis.rsplit("/", 1)[0] + "/1"
    clean_run(reference_url, events)
    assert dump_state(connect(stream_redis)) == dump_state(connect(reference_url))


def test_kafka_dead_letter_refused_as_too_large_is_sent_without_the_event(
    kafka_bootstrap: str, stream_redis: str
) -> None:
    """With a cap above what the producer may send, the record is refused
    (MSG_SIZE_TOO_LARGE) and sent again with the reason and size but no event bytes."""
    topic = "refused"
    huge = b"{" + b"x" * 1_500_000
    events = produce_with_oversized(kafka_bootstrap, topic, huge)
    client = connect(stream_redis)
    source = KafkaSource(
        kafka_bootstrap,
        topic,
        "g",
        extra={"session.timeout.ms": 6000},
        dead_letter_max_bytes=10_000_000,
        dead_letter_replication=-1,
    )
    updater = Updater(source, SessionWriter(client, 300), UpdaterMetrics.create())
    try:
        updater.run(max_messages=len(events) + 1, idle_exit_s=30)
    finally:
        source.close()
    assert updater.totals.messages == len(events) + 1 and updater.totals.dead_letters == 1
    [(value, headers)] = dead_letters(kafka_bootstrap, topic, 1)
    assert value == b"" and headers["truncated"] == "true"
    assert headers["original_size"] == str(len(huge)) and "JSON" in headers["reason"]


def test_fatal_kafka_errors_are_not_retried() -> None:
    """A fatal client error becomes SourceFatal (the updater ends, the orchestrator
    restarts it); a transient one does not. tansu never reports a fatal error (it has
    no static-membership fencing), so the errors are librdkafka's own KafkaError values."""
    from confluent_kafka import KafkaError

    raise_if_fatal(KafkaError(KafkaError._TRANSPORT, "broker down"), "consumer")
    with pytest.raises(SourceFatal, match=r"FENCED_INSTANCE_ID.*exits"):
        raise_if_fatal(KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced", fatal=True), "consumer")


def test_a_fatal_source_error_ends_the_run(stream_redis: str) -> None:
    """SourceFatal leaves Updater.run at once (no backoff loop), the batch unacknowledged."""
    from confluent_kafka import KafkaError

    class FencedAfterOneBatch(RedisStreamSource):
        """A real Redis source whose client is fenced after its first batch."""

        def poll(self, max_messages: int, timeout_s: float) -> list[Any]:
            if self._fenced:
                raise_if_fatal(KafkaError(KafkaError._FENCED, "fenced", fatal=True), "consumer")
            self._fenced = True
            return super().poll(max_messages, timeout_s)

        _fenced = False

    client = connect(stream_redis)
    xadd_all(client, STREAM, encode(feed(cards=20)[:50]))
    metrics = UpdaterMetrics.create()
    updater = Updater(
        FencedAfterOneBatch(client, STREAM, "g", "c"), SessionWriter(client, 300), metrics
    )
    with pytest.raises(SourceFatal):
        updater.run()
    assert updater.totals.messages == 50 and retries(metrics, "poll") == 0


def test_oom_and_readonly_replies_are_retried(stream_redis: str) -> None:
    """maxmemory reached (OOM), then a server turned replica (READONLY): the updater
    backs off and retries, and once Redis accepts writes again it loses nothing."""
    events = feed(cards=300, seed=41)
    half = len(events) // 2
    client = connect(stream_redis)
    uclient = connect(stream_redis, socket_timeout=5)

    def updater(metrics: UpdaterMetrics) -> Updater:
        return Updater(
            RedisStreamSource(uclient, STREAM, "g", "u"),
            SessionWriter(uclient, allowed_lateness_s=300),
            metrics,
            batch_size=100,
            backoff_initial_s=0.02,
            backoff_max_s=0.1,
            on_readonly=uclient.connection_pool.disconnect,
        )

    xadd_all(client, STREAM, encode(events[:half]))
    client.config_set("maxmemory", "1")  # every write is refused with OOM
    metrics = UpdaterMetrics.create()
    with running(first := updater(metrics)):
        try:
            # XREADGROUP is refused too (it may grow the group's pending list)
            wait_for(lambda: retries(metrics, "poll") >= 3, 30, "retries after OOM")
            assert first.totals.messages == 0
        finally:
            client.config_set("maxmemory", "0")
        wait_for(lambda: first.totals.messages == half, 30, "the first half")

    xadd_all(client, STREAM, encode(events[half:]))
    # A replica of a server that is not there: it keeps its data and refuses writes.
    client.replicaof("127.0.0.1", str(free_port()))
    metrics = UpdaterMetrics.create()
    with running(second := updater(metrics)):
        try:
            wait_for(lambda: retries(metrics, "poll") >= 3, 30, "retries after READONLY")
            assert second.totals.messages == 0
        finally:
            client.replicaof("NO", "ONE")
        wait_for(lambda: second.totals.messages == len(events) - half, 30, "the second half")
    group = client.xinfo_groups(STREAM)[0]
    assert group["pending"] == 0 and group["lag"] == 0
    reference_url = stream_redis.rsplit("/", 1)[0] + "/1"
    clean_run(reference_url, events)
    assert dump_state(client) == dump_state(connect(reference_url))


def test_input_stream_trimmed_by_age_never_past_the_group(stream_redis: str) -> None:
    """Entries appended before retention + lateness are trimmed (MINID) once the group
    has acknowledged them, never before."""
    import time

    client = connect(stream_redis)
    events = feed(cards=600, seed=51)[:1500]
    old, new = events[:1200], events[1200:]
    old_ms = int((time.time() - 3 * 86_400) * 1000)  # three days ago
    pipe = client.pipeline(transaction=False)
    for i, p in enumerate(encode(old)):
        pipe.xadd(STREAM, {"data": p}, id=f"{old_ms + i}-0")
    pipe.execute()
    xadd_all(client, STREAM, encode(new))
    source = RedisStreamSource(client, STREAM, "g", "c", keep_s=86_400 + 300, trim_interval_s=0)
    first = source.poll(100, 0.1)  # delivered, not acknowledged
    assert source.trim() == 0 and client.xlen(STREAM) == len(events)
    source.ack(first[:50])  # the oldest unacknowledged entry still bounds the trim
    assert client.xlen(STREAM) >= len(events) - 50
    assert client.xrange(STREAM, min=first[50].ref, max=first[50].ref)
    source.ack(first[50:])

    updater = Updater(source, SessionWriter(client, 300), UpdaterMetrics.create())
    updater.run(max_messages=len(events) - 100, idle_exit_s=10)
    left = client.xrange(STREAM)
    assert len(new) <= len(left) < len(new) + 100  # approximate: whole nodes only
    new_ids = {eid for eid, _ in left if int(eid.split(b"-")[0]) > old_ms + len(old)}
    assert len(new_ids) == len(new)
    assert client.xinfo_groups(STREAM)[0]["pending"] == 0


# --- secrets in logs and errors --------------------------------------------------------


def test_a_wrong_scheme_redis_url_never_prints_the_password(tmp_path: Path) -> None:
    secret = "s3cr3t-pw"
    bad = f"http://admin:{secret}@redis.internal:6379/0"
    with pytest.raises(ValidationError) as info:
        Settings(redis_url=bad)
    # str() leaves the input out (hide_input_in_errors); the message is redacted.
    assert secret not in str(info.value)
    assert all(secret not in e["msg"] for e in info.value.errors())
    assert "redis://" in str(info.value)
    env = {**os.environ, "REDIS_URL": bad}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "stream", "--metrics-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "REDIS_URL" in out.stderr and "admin:***@redis.internal" in out.stderr
    assert secret not in out.stdout + out.stderr


def test_redact_url_hides_passwords_in_any_shape() -> None:
    assert redact_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("rediss://:pw@h/0?password=pw&db=1") == "rediss://:***@h/0?password=***&db=1"
    assert redact_url("redis://pw@h") == "redis://***@h"
    assert redact_url("redis:pw@h") == "redis:***@h"  # no // at all
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ValueError) as info:
        feast_connection_string("redis+x://u:pw@h/0")
    assert "pw" not in str(info.value).replace("***", "")


def test_embedded_server_log_line_hides_its_password(caplog: pytest.LogCaptureFixture) -> None:
    from fraud_scoring.redis_server import embedded_redis

    with caplog.at_level("INFO"), embedded_redis(password="hunter2-pw") as url:
        assert connect(url).ping()
    assert "hunter2-pw" not in caplog.text and ":***@127.0.0.1" in caplog.text


# --- TLS settings shared by the service, the updater and the batch job ----------------


def test_ca_file_reaches_every_redis_client(tmp_path: Path) -> None:
    """FRAUD_REDIS_CA_FILE goes into REDIS_URL (redis-py: service, updater, the batch
    job's own client) and from there into Feast's connection string (materialize)."""
    import redis

    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    s = Settings(redis_url="rediss://u:pw@redis.example:6380/2", redis_ca_file=ca)
    assert s.redis_url == f"rediss://u:pw@redis.example:6380/2?ssl_ca_certs={ca}"
    pool = redis.ConnectionPool.from_url(s.redis_url)
    assert pool.connection_kwargs["ssl_ca_certs"] == str(ca)
    assert feast_connection_string(s.redis_url) == (
        f"redis.example:6380,username=u,password=pw,db=2,ssl=true,ssl_ca_certs={ca}"
    )
    with pytest.raises(ValidationError, match="rediss://"):
        Settings(redis_url="redis://redis.example:6379/0", redis_ca_file=ca)
    with pytest.raises(ValidationError, match="no such file"):
        Settings(redis_url="rediss://redis.example:6379/0", redis_ca_file=tmp_path / "nope")
