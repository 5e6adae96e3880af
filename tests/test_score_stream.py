"""``fraud-scoring score-stream`` on real parts: the world's model and features, a real
Redis-protocol server (stream in, decisions out) and a real Kafka-protocol broker, the
command in a subprocess. End to end against the API, a poison event and a reused id,
SIGKILL x3 with restarts and a Kafka group rebalance (nothing lost, nothing counted
twice), an output log that refuses writes (Redis) or whose broker goes away (Kafka), a
broker that goes away, backpressure on both sources and a pause that holds over
rebalances; and the chart's HPA on each source's lag."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from fraud_scoring.redis_server import embedded_redis, free_port
from streaming.score_stream import InFlight
from streaming.sources import Message
from tests.conftest import World, private_db, start_server, stop_server, wait_until
from tests.conftest_streaming import kafka_bootstrap, sigkill
from tests.test_service import held_out_day

__all__ = ["kafka_bootstrap"]  # a fixture

STREAM, OUTPUT = "txns", "txn-decisions"
DEAD = STREAM + ":scoring-dead-letter"
# A day of simulated transactions trickled in a minute: a few seconds of disorder between
# partitions (a rebalance, the backlog after an outage) is an hour of event time, past the
# default lateness horizon (5 min + 1 h) of the merchant-keyed states, whose events come
# from every partition. The Kafka runs and their clean runs keep a day of lateness, so
# that they are compared on what is counted, not on what is dropped as late.
WIDE_LATENESS = {"FRAUD_ALLOWED_LATENESS_S": "86400"}


def events(world: World, n: int) -> list[dict[str, Any]]:
    """The held-out day's first ``n`` transactions in event-time order, labels dropped."""
    rows = sorted(held_out_day(world), key=lambda r: datetime.fromisoformat(r["event_time"]))[:n]
    return [{k: v for k, v in r.items() if k not in ("is_fraud", "fraud_pattern")} for r in rows]


def stream_env(world: World, url: str, tmp: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "REDIS_URL": url,
        "FRAUD_DATA_DIR": str(world.data_dir),
        "FRAUD_MODEL_REPO": str(world.model_repo),
        "FRAUD_MAX_EVENT_SKEW_S": "0",  # the simulated world lies in the past
        "FRAUD_DECISION_SPOOL_DIR": str(tmp / "spool"),
        "FRAUD_SCORE_STREAM_OUTPUT": OUTPUT,
        "FRAUD_STREAM_NAME": STREAM,
        **extra,
    }


def score_stream(
    env: dict[str, str], log: Path, *args: str, wait: bool = True
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "score-stream", "--metrics-port", "0", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if wait:
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    return proc


def xadd(url: str, payloads: Sequence[bytes | str]) -> None:
    client = redis.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    for p in payloads:
        pipe.xadd(STREAM, {"data": p})
    pipe.execute()


def decisions(url: str) -> dict[str, dict[str, Any]]:
    """The output stream as a consumer keeping the last value per key sees it."""
    out: dict[str, dict[str, Any]] = {}
    for _, fields in redis.Redis.from_url(url).xrange(OUTPUT):
        out[fields[b"k"].decode()] = json.loads(fields[b"d"])
    return out


def recorded_state(url: str) -> dict[bytes, Any]:
    """Every session and declared key with its content (TTLs left out): what velocity
    and the declared windows read."""
    client = redis.Redis.from_url(url)
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(match="{*", count=1000):
        if not key.startswith((b"{card:", b"{agg:")):
            continue
        kind = client.type(key)
        if kind == b"hash":
            out[key] = sorted(client.hgetall(key).items())
        elif kind == b"zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"string":
            out[key] = client.get(key)
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        else:
            out[key] = kind
    return out


def same_state(a: dict[bytes, Any], b: dict[bytes, Any]) -> None:
    """The same keys and contents; packed float tiles (counts, sums, squares) hold the
    same values up to the rounding of summing in another order (a micro-batch or one at
    a time) and the order of their ring slots: a transaction counted twice moves a count
    by one."""
    assert sorted(a) == sorted(b)
    for key in a:
        if a[key] == b[key]:
            continue
        fields_a, fields_b = dict(a[key]), dict(b[key])
        assert sorted(fields_a) == sorted(fields_b), key
        for f, va in fields_a.items():
            vb = fields_b[f]
            if va != vb:
                assert len(va) == len(vb) and len(va) % 8 == 0, (key, f)
                np.testing.assert_allclose(  # ring slots may lie in another order
                    np.sort(np.frombuffer(va, "<f8")),
                    np.sort(np.frombuffer(vb, "<f8")),
                    rtol=1e-9,
                    err_msg=str(key),
                )


def same_decision(a: dict[str, Any], b: dict[str, Any], *, replayed: bool = False) -> None:
    """``a`` and ``b`` are the same decision. ``replayed``: ``a`` decided again later (a
    moved partition or a restart replays what its owner decided but had not committed;
    answered from the id's kept answer, or, when the owner died before keeping it, scored
    again): scored again seconds later, behind keys that took more events since (a busy
    merchant), its reads may be flagged inexact where the first were not, never the
    reverse. A replay scored while the store did not answer in time (a restarted member
    on a loaded machine) is a rules-only decision (``degraded``), by design: only its
    id is compared."""
    assert a["transaction_id"] == b["transaction_id"]
    if replayed and a["degraded"] and not b["degraded"]:
        return
    assert a["decision"] == b["decision"], (a, b)
    assert [r["code"] for r in a["reasons"]] == [r["code"] for r in b["reasons"]], (a, b)
    assert a["model_version"] == b["model_version"]
    if replayed:
        fa, fb = dict(a["features"]), dict(b["features"])
        assert set(fb.pop("inexact", [])) <= set(fa.pop("inexact", [])), (a, b)
        assert fa == fb
    else:
        assert a["features"] == b["features"]
    assert a["degraded"] == b["degraded"]
    assert a["score"] == pytest.approx(b["score"], rel=1e-5, abs=1e-7)


# -- refused settings (no world) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (("--output-bootstrap", "127.0.0.1:9092"), {}, "is for a Kafka source"),
        (("--output-bootstrap", " "), {"FRAUD_STREAM_SOURCE": "kafka"}, "is empty"),
    ],
)
def test_output_bootstrap_refused_where_it_means_nothing(
    args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    """``--output-bootstrap`` names the decisions' Kafka cluster: with a Redis source, or
    empty, the command refuses to start (exit 2) and says why."""
    r = subprocess.run(
        [sys.executable, "-m", "cli", "score-stream", "--metrics-port", "0", *args],
        env={**os.environ, "FRAUD_STREAM_SOURCE": "redis", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]


# -- the offsets tracker (no world) -----------------------------------------------------


def test_in_flight_commits_only_the_done_head_of_each_partition() -> None:
    flight = InFlight()
    msgs = [Message(b"", 0.0, ("t", p, o)) for p in (0, 1) for o in range(3)]
    for m in msgs:
        assert flight.add(m, now=1.0)
    assert not flight.add(msgs[0], now=2.0)  # already in flight: read twice, tracked once
    flight.done(msgs[1])  # partition 0, offset 1: behind offset 0, not committable
    flight.done(msgs[3])  # partition 1, offset 0
    assert flight.committable() == [msgs[3]]
    flight.done(msgs[0])
    assert flight.committable() == [msgs[0], msgs[1]]
    assert len(flight) == 3 and flight.oldest_age(now=4.0) == 3.0
    for m in (msgs[2], msgs[4], msgs[5]):
        flight.done(m)
    assert len(flight.committable()) == 3 and len(flight) == 0 and flight.oldest_age(5.0) == 0


# -- Redis Streams ----------------------------------------------------------------------


def test_redis_end_to_end_equals_the_api(world: World, tmp_path: Path) -> None:
    """N events in, N distinct decisions out, equal to what POST /v1/score answers for
    the same transactions sent in the same order to a copy of the same world; a poison
    event and a reused id with other content dead-lettered with the reason; every entry
    acknowledged; the recorded state (velocity, declared windows) equal to the API's."""
    txns = events(world, 240)
    url = private_db(world, 12)
    reused = {**txns[10], "amount": txns[10]["amount"] + 1.0}
    payloads = [json.dumps(t) for t in txns]
    payloads[50:50] = [b"{not json"]
    payloads.append(json.dumps(reused))
    xadd(url, payloads)
    log = tmp_path / "score-stream.log"
    score_stream(
        stream_env(world, url, tmp_path),
        log,
        "--consumer",
        "c1",
        "--max-batch",
        "32",
        "--commit-interval-ms",
        "100",
        "--idle-exit-s",
        "2",
    )
    got = decisions(url)
    assert sorted(got) == sorted(t["transaction_id"] for t in txns)
    assert redis.Redis.from_url(url).xlen(OUTPUT) == len(txns)  # one entry per key
    ids = {f[b"data"]: f for _, f in redis.Redis.from_url(url).xrange(STREAM)}
    assert {d["source"] for d in got.values()} <= {
        i.decode() for i, _ in redis.Redis.from_url(url).xrange(STREAM)
    }
    assert len(ids) == len(payloads)
    dead = [f for _, f in redis.Redis.from_url(url).xrange(DEAD)]
    assert len(dead) == 2
    assert dead[0][b"data"] == b"{not json" and b"invalid JSON" in dead[0][b"reason"]
    assert dead[1][b"reason"].startswith(b"id_reused") and b"amount" in dead[1][b"reason"]
    pending = redis.Redis.from_url(url).xpending(STREAM, "score-stream")
    assert pending["pending"] == 0
    summary = [ln for ln in log.read_text().splitlines() if "score-stream stopping" in ln]
    assert summary and f"{len(txns)} decided" in summary[-1] and "event-time lag" in summary[-1]

    api_url = private_db(world, 13)
    srv = start_server(world, tmp_path, REDIS_URL=api_url)
    try:
        with srv.client() as c:
            for t in txns:
                r = c.post("/v1/score", json=t)
                assert r.status_code == 200, r.text
                same_decision(got[t["transaction_id"]], r.json())
    finally:
        stop_server(srv)
    same_state(recorded_state(url), recorded_state(api_url))


def test_redis_sigkill_three_times_loses_nothing_counts_nothing_twice(
    world: World, tmp_path: Path
) -> None:
    """Killed three times mid-run and restarted under the same consumer name: every
    transaction has one decision, the same as a clean run's, and the recorded state is
    the clean run's (no transaction counted twice in velocity or a declared window)."""
    txns = events(world, 600)
    payloads = [json.dumps(t) for t in txns]
    clean = private_db(world, 14)
    xadd(clean, payloads)
    args = ("--consumer", "c1", "--max-batch", "16", "--commit-interval-ms", "200")
    score_stream(
        stream_env(world, clean, tmp_path), tmp_path / "clean.log", *args, "--idle-exit-s", "2"
    )

    url = private_db(world, 15)
    xadd(url, payloads)
    env = stream_env(world, url, tmp_path)
    log = tmp_path / "killed.log"
    client = redis.Redis.from_url(url)
    for k in (1, 2, 3):
        proc = score_stream(env, log, *args, wait=False)
        wait_until(
            lambda k=k: client.exists(OUTPUT) and client.xlen(OUTPUT) >= k * len(txns) // 4,
            timeout=90,
            what=f"{k}/4 of the decisions",
            proc=proc,
        )
        sigkill(proc)
    assert client.xpending(STREAM, "score-stream")["pending"] > 0  # killed mid-flight
    score_stream(env, log, *args, "--idle-exit-s", "2")

    got, want = decisions(url), decisions(clean)
    assert sorted(got) == sorted(want) == sorted(t["transaction_id"] for t in txns)
    assert client.xpending(STREAM, "score-stream")["pending"] == 0
    same_state(recorded_state(url), recorded_state(clean))
    for tid, d in got.items():
        same_decision(d, want[tid])


# -- Kafka ------------------------------------------------------------------------------


def kafka_records(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[Any]:
    """Every record of ``topic``, read from the start to its end (a reader assigned, never
    joined nor committed)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    out: list[Any] = []
    open_parts = set(parts)
    end = time.monotonic() + timeout_s
    while open_parts and time.monotonic() < end:
        for m in consumer.consume(500, 1.0):
            if m.error() is not None:
                open_parts.discard(m.partition())
                continue
            out.append(m)
    consumer.close()
    return out


def kafka_decisions(bootstrap: str, topic: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The topic read from the start to its end, keeping the last value per key."""
    return {m.key().decode(): json.loads(m.value()) for m in kafka_records(bootstrap, topic)}


def kafka_decisions_per_key(bootstrap: str, topic: str) -> dict[str, list[dict[str, Any]]]:
    """Every value of every key of the decisions topic, in the topic's order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for m in kafka_records(bootstrap, topic):
        out.setdefault(m.key().decode(), []).append(json.loads(m.value()))
    return out


def produce(bootstrap: str, topic: str, txns: Sequence[dict[str, Any]]) -> None:
    """``txns`` keyed by card (one card, one partition), acknowledged by the broker."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for t in txns:
        producer.produce(topic, key=t["card_id"].encode(), value=json.dumps(t).encode())
    assert producer.flush(10) == 0


class Trickle:
    """Produces transactions in order, ``rate`` a second, from a thread, until
    :meth:`stop` (or the list's end); ``count``: how many so far."""

    def __init__(self, bootstrap: str, topic: str, txns: Sequence[dict[str, Any]], rate: float):
        from confluent_kafka import Producer

        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self.topic, self.txns, self.rate = topic, txns, rate
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        for i, t in enumerate(self.txns):
            # Paced by the clock (sleeps do not add up); stopped within one interval.
            if self._stop.wait(max(0.0, start + i / self.rate - time.monotonic())):
                return
            self.producer.produce(
                self.topic, key=t["card_id"].encode(), value=json.dumps(t).encode()
            )
            self.producer.poll(0)
            self.count = i + 1

    def stop(self) -> list[dict[str, Any]]:
        """Stop producing; the transactions produced, each acknowledged by the broker."""
        self._stop.set()
        self._thread.join()
        assert self.producer.flush(10) == 0
        return list(self.txns[: self.count])


def kafka_env(
    world: World, url: str, tmp: Path, bootstrap: str, topic: str, out: str, **extra: str
) -> dict[str, str]:
    return stream_env(
        world,
        url,
        tmp,
        FRAUD_STREAM_SOURCE="kafka",
        FRAUD_KAFKA_BOOTSTRAP=bootstrap,
        FRAUD_STREAM_NAME=topic,
        FRAUD_SCORE_STREAM_OUTPUT=out,
        **extra,
    )


def offsets(bootstrap: str, group: str, topic: str) -> tuple[list[int], list[int]]:
    """The group's committed offset and the end offset (the last record's + 1) of each
    partition of ``topic`` (a committed offset of -1: none yet). The ends are read from
    the records: tansu 0.6's ListOffsets answers a partition whose last produce was one
    batch of n records with its first offset + 1, not the last + 1."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
    finally:
        consumer.close()
    ends = dict.fromkeys(parts, 0)
    for m in kafka_records(bootstrap, topic):
        ends[m.partition()] = max(ends[m.partition()], m.offset() + 1)
    return [max(tp.offset, -1) for tp in committed], [ends[p] for p in parts]


def metric(port: int, sample: str) -> float | None:
    """One sample (``name{labels}`` as exposed) of a command's /metrics (None: not up)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
    except httpx.TransportError:
        return None
    for ln in text.splitlines():
        if ln.startswith(sample + " "):
            return float(ln.split()[1])
    return None


def decision_log_ids(url: str) -> Counter[str]:
    """How often each transaction is in the decision log (the Redis stream ``decisions``)."""
    client: Any = redis.Redis.from_url(url)
    return Counter(f[b"k"].decode() for _, f in client.xrange("decisions"))


def test_kafka_end_to_end_with_a_poison_event(
    world: World, tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Three partitions keyed by card: every valid transaction decided once (last value
    per key), the poison event in the dead letter with its reason, every offset committed."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from streaming.sources import ensure_topic

    topic, out_topic = "k-txns", "k-decisions"
    ensure_topic(kafka_bootstrap, topic, 3)
    txns = events(world, 200)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, t in enumerate(txns):
        producer.produce(topic, key=t["card_id"].encode(), value=json.dumps(t).encode())
        if i == 30:
            producer.produce(topic, key=b"x", value=b"\x00poison")
    assert producer.flush(10) == 0
    url = private_db(world, 12)
    env = stream_env(
        world,
        url,
        tmp_path,
        FRAUD_STREAM_SOURCE="kafka",
        FRAUD_KAFKA_BOOTSTRAP=kafka_bootstrap,
        FRAUD_STREAM_NAME=topic,
        FRAUD_SCORE_STREAM_OUTPUT=out_topic,
    )
    log = tmp_path / "kafka.log"
    # The group's first join takes seconds: stop after the events, not when idle.
    score_stream(env, log, "--consumer", "k1", "--max-batch", "32", "--max-messages", "201")
    got = kafka_decisions(kafka_bootstrap, out_topic)
    assert sorted(got) == sorted(t["transaction_id"] for t in txns), log.read_text()[-3000:]
    assert all(d["source"].startswith(topic + "/") for d in got.values())
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "score-stream"})
    committed = consumer.committed([TopicPartition(topic, p) for p in range(3)], timeout=10)
    consumer.close()
    # A fresh topic's offsets start at 0: every event read is committed.
    assert sum(tp.offset for tp in committed) == len(txns) + 1
    assert "dead-lettered" in log.read_text() and "invalid JSON" in log.read_text()


def test_kafka_rebalance_a_consumer_joins_one_is_killed_and_restarts(
    world: World, tmp_path: Path, kafka_bootstrap: str
) -> None:
    """Transactions trickle onto four partitions while the group changes under them: k1
    alone, k2 joins (its partitions taken from k1 with k1's uncommitted tail), k1 is
    SIGKILLed (k2 takes every partition once k1's session expires) and restarts (joins
    again, ships the decisions its spool holds), then both stop on SIGTERM. Every
    transaction has one decision keeping the last value per key, a transaction decided
    twice has the same answer both times, the decision log holds each once, every offset
    is committed, and the recorded state is a clean run's (nothing counted twice)."""
    from streaming.sources import ensure_topic

    topic, out_topic, group = "rb-txns", "rb-decisions", "rb-score"
    ensure_topic(kafka_bootstrap, topic, 4)
    url = private_db(world, 12)
    env = kafka_env(
        world,
        url,
        tmp_path,
        kafka_bootstrap,
        topic,
        out_topic,
        # A dead member's partitions move after 3 s; a join takes about 2 s with tansu.
        FRAUD_KAFKA_SESSION_TIMEOUT_MS="3000",
        **WIDE_LATENESS,
    )
    ports = {"k1": free_port(), "k2": free_port()}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> None:
        procs[name] = score_stream(
            env,
            tmp_path / f"{name}.log",
            *("--consumer", name, "--group", group, "--metrics-port", str(ports[name])),
            # Offsets are committed only as a member leaves (the interval is longer than the
            # test): every partition that moves replays what its last owner decided, so the
            # replay is certain, not a race with a 1 s timer (CI once saw none).
            *("--max-batch", "16", "--commit-interval-ms", "600000"),
            wait=False,
        )

    def decided(name: str) -> float:
        return metric(ports[name], 'fraud_score_stream_events_total{outcome="decided"}') or 0.0

    def output_has(ids: set[str]) -> bool:
        return ids <= set(kafka_decisions(kafka_bootstrap, out_topic, timeout_s=5))

    feed = Trickle(kafka_bootstrap, topic, events(world, 2000), rate=30.0)
    try:
        start("k1")
        wait_until(lambda: decided("k1") >= 30, timeout=90, what="k1 deciding", proc=procs["k1"])
        start("k2")
        wait_until(
            lambda: decided("k2") >= 10, timeout=90, what="k2 given partitions", proc=procs["k2"]
        )
        sigkill(procs["k1"])
        # Produced from here on: only k2 is left to decide them, on every partition.
        after_kill = feed.count + 60
        wait_until(lambda: feed.count >= after_kill, timeout=30, what="60 more events")
        wait_until(
            lambda: output_has({t["transaction_id"] for t in feed.txns[:after_kill]}),
            # tansu has taken 3 to 35 s to expire a killed member and move its partitions.
            timeout=90,
            what="k2 deciding k1's partitions",
            proc=procs["k2"],
        )
        start("k1")  # restarted, as its orchestrator would
        wait_until(
            lambda: decided("k1") >= 10, timeout=90, what="k1 back in the group", proc=procs["k1"]
        )
        txns = feed.stop()
        wait_until(
            lambda: output_has({t["transaction_id"] for t in txns}),
            timeout=60,
            what="every transaction decided",
            proc=procs["k2"],
        )
        for name in ("k2", "k1"):  # one leaves, then the other
            procs[name].terminate()
            assert procs[name].wait(timeout=60) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]
    finally:
        feed.stop()
        for proc in procs.values():
            if proc.poll() is None:
                sigkill(proc)

    per_key = kafka_decisions_per_key(kafka_bootstrap, out_topic)
    assert sorted(per_key) == sorted(t["transaction_id"] for t in txns)
    twice = {k: v for k, v in per_key.items() if len(v) > 1}
    assert twice, "no transaction decided twice: no rebalance or kill replayed anything"
    for values in twice.values():
        for d in values[1:]:
            same_decision(d, values[0], replayed=True)
            assert d["source"] == values[0]["source"]  # the same event read again
    assert decision_log_ids(url) == Counter({t["transaction_id"]: 1 for t in txns})
    committed, ends = offsets(kafka_bootstrap, group, topic)
    assert committed == ends and sum(ends) == len(txns)

    same_state(recorded_state(url), clean_run_state(world, tmp_path, txns))


def clean_run_state(world: World, tmp_path: Path, txns: Sequence[dict[str, Any]]) -> Any:
    """The state recorded by one uninterrupted run over ``txns`` in their order (on a Redis
    stream, db 13; ``WIDE_LATENESS``): a card's transactions arrive in the order of its
    partition."""
    clean = private_db(world, 13)
    xadd(clean, [json.dumps(t) for t in txns])
    score_stream(
        stream_env(world, clean, tmp_path / "clean", **WIDE_LATENESS),
        tmp_path / "clean.log",
        *("--consumer", "c1", "--max-batch", "16", "--idle-exit-s", "2"),
    )
    return recorded_state(clean)


def tansu(port: int, *args: str) -> subprocess.Popen[bytes]:
    """``tansu <args>`` in a session of its own, once it listens on ``port``."""
    from tests.conftest_streaming import tansu_binary

    proc = subprocess.Popen(
        [tansu_binary(), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_until(up, timeout=20, what=f"port {port} listening", proc=proc)
    return proc


def tansu_broker(port: int) -> subprocess.Popen[bytes]:
    """A tansu broker on ``port`` with memory storage (its topics die with it)."""
    address = f"127.0.0.1:{port}"
    return tansu(
        port,
        "broker",
        f"--listener-url=tcp://{address}",
        f"--advertised-listener-url=tcp://{address}",
        "--storage-engine=memory://tansu/",
    )


def kill_tansu(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL (tansu ignores SIGTERM): every connection to it drops at once."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    if proc is not None:
        proc.wait()


class ProxiedBroker:
    """A Kafka-protocol broker reached two ways: ``direct`` (the test's producer and
    readers) and ``proxied``, through a Kafka-protocol proxy (``tansu proxy``, which
    advertises itself in metadata, so a client of it reaches the broker only through it).
    Killing the proxy makes the broker go away for its clients (connections refused) while
    it keeps the topics, offsets and groups: tansu's storage engines here are memory (lost
    with the process) and S3, so a restarted broker would have lost them."""

    def __init__(self) -> None:
        self.broker_port, self.proxy_port = free_port(), free_port()
        self.direct = f"127.0.0.1:{self.broker_port}"
        self.proxied = f"127.0.0.1:{self.proxy_port}"
        self.broker = tansu_broker(self.broker_port)
        self.proxy: subprocess.Popen[bytes] | None = None
        self.start_proxy()

    def start_proxy(self) -> None:
        self.proxy = tansu(
            self.proxy_port,
            "proxy",
            f"--listener-url=tcp://{self.proxied}",
            f"--advertised-listener-url=tcp://{self.proxied}",
            f"--origin-url=tcp://{self.direct}",
        )

    def stop_proxy(self) -> None:
        kill_tansu(self.proxy)
        self.proxy = None

    def close(self) -> None:
        self.stop_proxy()
        kill_tansu(self.broker)


def committed_undecided(
    bootstrap: str, group: str, topic: str, decisions: Callable[[], Collection[str]]
) -> list[str]:
    """The transactions below the group's committed offsets on ``topic`` without a
    decision among ``decisions()``, the ids the decisions topic holds (committed first,
    decisions read after: a decision written after its commit would be missed, never one
    written before)."""
    committed, _ = offsets(bootstrap, group, topic)
    decided = set(decisions())
    return [
        tid
        for m in kafka_records(bootstrap, topic, timeout_s=5)
        if m.offset() < committed[m.partition()]
        and (tid := json.loads(m.value())["transaction_id"]) not in decided
    ]


def test_kafka_broker_gone_then_back_keeps_running_and_decides_everything(
    world: World, tmp_path: Path
) -> None:
    """The broker goes away for 14 s mid-run (its proxy killed: every connection refused)
    while transactions keep arriving on it: score-stream keeps running and stays ready,
    commits no offset past an event without its decision (checked during the outage and
    the catch-up), and once the broker is back decides every transaction once (last value
    per key; a transaction decided twice, the same answer), commits every offset, the
    decision log holds each once and the recorded state is a clean run's. 14 s and not
    the issue's 30: it outlasts every timeout of the path (the group session, 3 s; a write
    of decisions waits 10 s for the broker's acknowledgement, then is retried), and
    nothing in the code counts past it."""
    from streaming.sources import ensure_topic

    topic, out_topic, group = "bo-txns", "bo-decisions", "score-stream"
    broker = ProxiedBroker()
    url = private_db(world, 12)
    port = free_port()
    log = tmp_path / "outage.log"
    violations: list[list[str]] = []

    def decided() -> float:
        return metric(port, 'fraud_score_stream_events_total{outcome="decided"}') or 0.0

    def commits_behind_decisions() -> None:
        decided = functools.partial(kafka_decisions, broker.direct, out_topic, timeout_s=5)
        if bad := committed_undecided(broker.direct, group, topic, decided):
            violations.append(bad)

    try:
        ensure_topic(broker.direct, topic, 3)
        feed = Trickle(broker.direct, topic, events(world, 2000), rate=40.0)
        env = kafka_env(
            world,
            url,
            tmp_path,
            broker.proxied,
            topic,
            out_topic,
            FRAUD_KAFKA_SESSION_TIMEOUT_MS="3000",
            **WIDE_LATENESS,
        )
        proc = score_stream(
            env,
            log,
            *("--consumer", "k1", "--metrics-port", str(port), "--max-batch", "16"),
            *("--commit-interval-ms", "500"),
            wait=False,
        )
        try:
            wait_until(lambda: decided() >= 40, timeout=90, what="deciding", proc=proc)
            broker.stop_proxy()
            gone = time.monotonic()
            commits_behind_decisions()
            wait_until(
                lambda: time.monotonic() - gone >= 14 and proc.poll() is None,
                timeout=30,
                what="14 s of outage",
                proc=proc,
            )
            commits_behind_decisions()
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            assert ready.status_code == 200, ready.text
            broker.start_proxy()
            back = decided()
            wait_until(lambda: decided() >= back + 40, timeout=90, what="deciding again", proc=proc)
            txns = feed.stop()

            def all_decided() -> bool:
                commits_behind_decisions()
                want = {t["transaction_id"] for t in txns}
                return want <= set(kafka_decisions(broker.direct, out_topic, timeout_s=5))

            wait_until(all_decided, timeout=90, what="every transaction decided", proc=proc)
            proc.terminate()
            assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        finally:
            feed.stop()
            if proc.poll() is None:
                sigkill(proc)
        assert not violations, violations[:3]
        per_key = kafka_decisions_per_key(broker.direct, out_topic)
        committed, ends = offsets(broker.direct, group, topic)
    finally:
        broker.close()
    assert sorted(per_key) == sorted(t["transaction_id"] for t in txns)
    for values in per_key.values():
        for d in values[1:]:
            same_decision(d, values[0], replayed=True)
    assert committed == ends and sum(ends) == len(txns)
    assert decision_log_ids(url) == Counter({t["transaction_id"]: 1 for t in txns})
    assert "score-stream stopping" in log.read_text()
    same_state(recorded_state(url), clean_run_state(world, tmp_path, txns))


# -- an output log that refuses writes; backpressure ---------------------------------------


IN_FLIGHT, LAG = "fraud_score_stream_in_flight", "fraud_score_stream_consumer_lag"


def scrape_until_exit(
    proc: subprocess.Popen[bytes], port: int, samples: Sequence[str], timeout_s: float = 180
) -> dict[str, list[float]]:
    """``samples`` scraped from the command's /metrics every 20 ms until it exits."""
    seen: dict[str, list[float]] = {name: [] for name in samples}
    end = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < end:
        for name in samples:
            if (v := metric(port, name)) is not None:
                seen[name].append(v)
        time.sleep(0.02)
    return seen


def acknowledged_ids(url: str) -> set[str]:
    """The transaction ids of the entries the group has acknowledged: delivered (up to
    its last-delivered-id) and no longer pending."""
    client: Any = redis.Redis.from_url(url)
    last = next(g for g in client.xinfo_groups(STREAM) if g["name"] == b"score-stream")[
        "last-delivered-id"
    ]
    pending = {
        p["message_id"] for p in client.xpending_range(STREAM, "score-stream", "-", "+", 10**6)
    }
    out = set()
    for eid, fields in client.xrange(STREAM, max=last):
        if eid not in pending:
            out.add(json.loads(fields[b"data"])["transaction_id"])
    return out


def test_redis_output_refusing_writes_acknowledges_nothing_then_resumes(
    world: World, tmp_path: Path
) -> None:
    """The decisions stream on a server of its own that refuses every write (maxmemory 1
    byte, noeviction: each write answered OOM): nothing is acknowledged, reading stops at
    the in-flight bound; once the server takes writes again every transaction gets its
    decision and every entry is acknowledged."""
    txns = events(world, 200)
    url = private_db(world, 12)
    xadd(url, [json.dumps(t) for t in txns])
    bound = 48
    with embedded_redis() as out_url:
        out: Any = redis.Redis.from_url(out_url)
        out.config_set("maxmemory-policy", "noeviction")
        out.config_set("maxmemory", 1)
        log = tmp_path / "refused.log"
        env = stream_env(world, url, tmp_path, FRAUD_SCORE_STREAM_OUTPUT_URL=out_url)
        proc = score_stream(
            env,
            log,
            "--consumer",
            "c1",
            "--max-batch",
            "16",
            "--commit-interval-ms",
            "100",
            "--max-in-flight",
            str(bound),
            "--idle-exit-s",
            "2",
            wait=False,
        )
        try:
            wait_until(
                lambda: (
                    "reading paused" in log.read_text() and "decisions failed" in log.read_text()
                ),
                timeout=90,
                what="the writes refused and reading paused",
                proc=proc,
            )
            # Several refused writes (and commit intervals) while the log refuses.
            wait_until(
                lambda: log.read_text().count("decisions failed") >= 3,
                timeout=60,
                what="three refused writes",
                proc=proc,
            )
            client: Any = redis.Redis.from_url(url)
            assert not out.exists(OUTPUT)
            assert acknowledged_ids(url) == set()  # nothing acknowledged without a decision
            assert client.xpending(STREAM, "score-stream")["pending"] == bound  # stopped reading
            out.config_set("maxmemory", 0)  # the output log takes writes again
            assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        got = {f[b"k"].decode() for _, f in out.xrange(OUTPUT)}
    assert got == {t["transaction_id"] for t in txns}
    assert client.xpending(STREAM, "score-stream")["pending"] == 0
    assert acknowledged_ids(url) == got
    summary = [ln for ln in log.read_text().splitlines() if "score-stream stopping" in ln][-1]
    assert f"{len(txns)} decided" in summary and f"in flight at most {bound};" in summary
    assert "used memory > 'maxmemory'" in log.read_text()  # the refusal, retried


def test_kafka_output_broker_gone_commits_nothing_pauses_then_decides_everything(
    world: World, tmp_path: Path, kafka_bootstrap: str
) -> None:
    """The decisions topic on a broker of its own (``--output-bootstrap``), killed while the
    transactions' broker stays up and transactions keep arriving on it: score-stream
    commits no offset past the decisions written before (the group's offsets stay put
    through two failed writes), reads up to the in-flight bound, pauses its partitions
    and stays ready. A tansu restarted on the same port (memory storage: the decisions
    topic is created again, so the decisions written before the outage are read before
    it) takes the writes again: then every transaction has exactly one decision keeping
    the last value per key, every offset is committed, the decision log holds each once
    and the recorded state is a clean run's."""
    from streaming.sources import ensure_topic

    topic, out_topic, group = "oo-txns", "oo-decisions", "oo-score"
    ensure_topic(kafka_bootstrap, topic, 3)
    out_port = free_port()
    out_bootstrap = f"127.0.0.1:{out_port}"
    out_broker: subprocess.Popen[bytes] | None = tansu_broker(out_port)
    txns = events(world, 360)
    first, later = txns[:120], txns[120:]
    url = private_db(world, 12)
    port, bound = free_port(), 48
    log = tmp_path / "output-outage.log"
    env = kafka_env(
        world,
        url,
        tmp_path,
        kafka_bootstrap,
        topic,
        out_topic,
        FRAUD_KAFKA_SESSION_TIMEOUT_MS="3000",
        **WIDE_LATENESS,
    )
    violations: list[list[str]] = []

    def all_committed(n: int) -> bool:
        committed, ends = offsets(kafka_bootstrap, group, topic)
        return committed == ends and sum(ends) == n

    try:
        produce(kafka_bootstrap, topic, first)
        proc = score_stream(
            env,
            log,
            *("--consumer", "k1", "--group", group, "--metrics-port", str(port)),
            *("--output-bootstrap", out_bootstrap, "--max-batch", "16"),
            *("--commit-interval-ms", "300", "--max-in-flight", str(bound)),
            wait=False,
        )
        try:
            wait_until(
                lambda: all_committed(len(first)),
                timeout=90,
                what="the first transactions decided and committed",
                proc=proc,
            )
            # Read before the broker takes them with it: nothing is left to write.
            before = kafka_decisions_per_key(out_bootstrap, out_topic)
            assert sorted(before) == sorted(t["transaction_id"] for t in first)
            committed_before = offsets(kafka_bootstrap, group, topic)[0]

            kill_tansu(out_broker)
            out_broker = None
            mark = len(log.read_text())
            produce(kafka_bootstrap, topic, later)  # the input broker stays up
            wait_until(
                lambda: (
                    log.read_text()[mark:].count("decisions failed") >= 2
                    and metric(port, "fraud_score_stream_paused") == 1
                    and metric(port, IN_FLIGHT) == bound
                ),
                timeout=90,
                what="two refused writes, reading paused at the bound",
                proc=proc,
            )
            assert offsets(kafka_bootstrap, group, topic)[0] == committed_before
            assert "reading paused" in log.read_text()[mark:]
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            assert ready.status_code == 200, ready.text

            out_broker = tansu_broker(out_port)  # back, empty
            ensure_topic(out_bootstrap, out_topic, 1)

            def decided() -> set[str]:
                return set(before) | set(kafka_decisions(out_bootstrap, out_topic, timeout_s=5))

            def all_decided() -> bool:
                if bad := committed_undecided(kafka_bootstrap, group, topic, decided):
                    violations.append(bad)
                return {t["transaction_id"] for t in txns} <= decided()

            wait_until(all_decided, timeout=120, what="every transaction decided", proc=proc)
            wait_until(lambda: all_committed(len(txns)), timeout=30, what="all committed")
            proc.terminate()
            assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                sigkill(proc)
        after = kafka_decisions_per_key(out_bootstrap, out_topic)
    finally:
        kill_tansu(out_broker)
    assert not violations, violations[:3]
    per_key = {k: before.get(k, []) + after.get(k, []) for k in {*before, *after}}
    assert sorted(per_key) == sorted(t["transaction_id"] for t in txns)
    for values in per_key.values():
        for d in values[1:]:
            same_decision(d, values[0], replayed=True)
    assert decision_log_ids(url) == Counter({t["transaction_id"]: 1 for t in txns})
    summary = [ln for ln in log.read_text().splitlines() if "score-stream stopping" in ln][-1]
    assert f"in flight at most {bound};" in summary, summary
    same_state(recorded_state(url), clean_run_state(world, tmp_path, txns))


def in_flight_within_bound(gauge: list[float], log: Path, bound: int) -> None:
    """The in-flight gauge and the summary's high-water mark reached and never passed
    ``bound``, and reading paused at it."""
    assert gauge and 0 < max(gauge) <= bound, gauge[-20:]
    summary = [ln for ln in log.read_text().splitlines() if "score-stream stopping" in ln][-1]
    high = int(summary.split("in flight at most ")[1].split(";")[0])
    assert 0 < high <= bound, summary
    assert int(summary.split("paused ")[1].split(" times")[0]) > 0, summary


@contextlib.contextmanager
def store_slowed(url: str, pause_ms: int, every_s: float) -> Iterator[list[int]]:
    """The store's writes (scripts included: the scorer's feature read and record, the
    decisions, the acknowledgements) paused for ``pause_ms`` every ``every_s`` with
    CLIENT PAUSE WRITE, from a thread, until the block ends; yields the count of pauses."""
    client: Any = redis.Redis.from_url(url)
    count = [0]
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            client.execute_command("CLIENT", "PAUSE", pause_ms, "WRITE")
            count[0] += 1
            stop.wait(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join()
        client.execute_command("CLIENT", "UNPAUSE")


def test_redis_backpressure_in_flight_bound_holds_while_the_store_is_slowed(
    world: World, tmp_path: Path
) -> None:
    """A backlog of 400 behind an in-flight bound of 24 while the store pauses its
    writes 150 ms in every 250 (the scorer's reads and records, the decisions' writes
    and the acknowledgements all wait): the in-flight gauge scraped from /metrics and
    the summary's high-water mark never pass the bound, reading paused at it, and every
    transaction is decided once and acknowledged."""
    txns = events(world, 400)
    url = private_db(world, 12)
    xadd(url, [json.dumps(t) for t in txns])
    bound, port = 24, free_port()
    log = tmp_path / "backpressure.log"
    env = stream_env(world, url, tmp_path)
    with store_slowed(url, pause_ms=150, every_s=0.25) as pauses:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "cli", "score-stream", "--metrics-port", str(port)),
                *("--consumer", "c1", "--max-batch", "8", "--commit-interval-ms", "200"),
                *("--max-in-flight", str(bound), "--idle-exit-s", "2"),
            ],
            env=env,
            stdout=open(log, "wb"),  # noqa: SIM115  # closed with the process
            stderr=subprocess.STDOUT,
        )
        try:
            seen = scrape_until_exit(proc, port, (IN_FLIGHT, LAG))
            assert proc.wait(timeout=5) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert pauses[0] >= 4  # the store was slowed throughout
    in_flight_within_bound(seen[IN_FLIGHT], log, bound)
    # The consumer lag is the group's backlog (XINFO GROUPS lag + pending), not what this
    # consumer holds: above the bound while the backlog lasts, falling as it is decided.
    lags = seen[LAG]
    top = lags.index(max(lags))
    assert bound < lags[top] <= len(txns) and min(lags[top:]) < lags[top] / 2, lags
    got = decisions(url)
    assert sorted(got) == sorted(t["transaction_id"] for t in txns)
    client: Any = redis.Redis.from_url(url)
    assert client.xlen(OUTPUT) == len(txns)
    assert client.xpending(STREAM, "score-stream")["pending"] == 0


def test_kafka_backpressure_pauses_partitions_while_the_store_is_slowed(
    world: World, tmp_path: Path, kafka_bootstrap: str
) -> None:
    """The Kafka version: 300 transactions on three partitions behind an in-flight bound of
    24 while the store pauses its writes 150 ms in every 250: the partitions are paused
    at the bound (``pause``/``resume``), the in-flight gauge and the summary's high-water
    mark never pass it, every transaction is decided and every offset committed."""
    from streaming.sources import ensure_topic

    topic, out_topic, group = "bp-txns", "bp-decisions", "bp-score"
    ensure_topic(kafka_bootstrap, topic, 3)
    txns = events(world, 300)
    produce(kafka_bootstrap, topic, txns)
    url = private_db(world, 12)
    bound, port = 24, free_port()
    log = tmp_path / "backpressure.log"
    env = kafka_env(
        world,
        url,
        tmp_path,
        kafka_bootstrap,
        topic,
        out_topic,
        FRAUD_KAFKA_SESSION_TIMEOUT_MS="3000",
    )
    with store_slowed(url, pause_ms=150, every_s=0.25) as pauses:
        proc = score_stream(
            env,
            log,
            *("--consumer", "k1", "--group", group, "--metrics-port", str(port)),
            *("--max-batch", "8", "--commit-interval-ms", "200", "--max-in-flight", str(bound)),
            # The group's first join takes seconds: stop after the events, not when idle.
            *("--max-messages", str(len(txns))),
            wait=False,
        )
        try:
            seen = scrape_until_exit(proc, port, (IN_FLIGHT,))
            assert proc.wait(timeout=5) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert pauses[0] >= 4
    in_flight_within_bound(seen[IN_FLIGHT], log, bound)
    assert sorted(kafka_decisions(kafka_bootstrap, out_topic)) == sorted(
        t["transaction_id"] for t in txns
    )
    committed, ends = offsets(kafka_bootstrap, group, topic)
    assert committed == ends and sum(ends) == len(txns)


def test_kafka_source_pause_holds_the_partitions_a_rebalance_assigns(kafka_bootstrap: str) -> None:
    """Backpressure's pause over rebalances (KafkaSource, no world): a paused consumer
    given partitions it did not hold when it paused (its group mate leaves) fetches
    nothing from any of them until it resumes; a partition taken away while paused and
    given back after the resume (a mate joins, then leaves) is fetched again."""
    from confluent_kafka import Producer

    from streaming.sources import KafkaSource, ensure_topic

    topic, group = "rp-txns", "rp-score"
    ensure_topic(kafka_bootstrap, topic, 4)

    def produce_each(n: int) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for p in range(4):
            for i in range(n):
                producer.produce(topic, value=b"%d" % i, partition=p)
        assert producer.flush(10) == 0

    def member(name: str) -> KafkaSource:
        fast = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 300}
        return KafkaSource(kafka_bootstrap, topic, group, client_id=name, extra=fast)

    def parts(src: KafkaSource) -> set[int]:
        return {tp.partition for tp in src.consumer.assignment()}

    def read(src: KafkaSource, seconds: float) -> set[int]:
        """The partitions of what ``src`` fetches in ``seconds``."""
        seen: set[int] = set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seen |= {m.ref[1] for m in src.poll(100, 0.1)}
        return seen

    def polled_until(cond: Any, *members: KafkaSource, what: str) -> set[int]:
        """Poll every member until ``cond()``; the partitions the first one fetched."""
        seen: set[int] = set()

        def step() -> bool:
            seen.update(m.ref[1] for m in members[0].poll(100, 0.05))
            for other in members[1:]:
                other.poll(100, 0.05)
            return bool(cond())

        wait_until(step, timeout=60, what=what)
        return seen

    a, b = member("a"), member("b")
    c: KafkaSource | None = None
    try:
        polled_until(lambda: len(parts(a)) == 2 and len(parts(b)) == 2, a, b, what="a 2+2 split")
        a.pause()
        produce_each(3)  # something to fetch on every partition
        b.close()  # leaves the group: its two partitions go to the paused a
        fetched = polled_until(lambda: len(parts(a)) == 4, a, what="a given every partition")
        fetched |= read(a, 3.0)
        assert not fetched, f"paused, yet fetched from partitions {sorted(fetched)}"
        a.resume()
        assert read(a, 5.0) == {0, 1, 2, 3}

        # Taken away while paused, given back after the resume: fetched again.
        a.pause()
        c = member("c")
        polled_until(lambda: len(parts(a)) == 2 and len(parts(c)) == 2, a, c, what="a 2+2 split")
        gone = {0, 1, 2, 3} - parts(a)
        a.resume()
        c.close()
        c = None
        polled_until(lambda: len(parts(a)) == 4, a, what="a given every partition again")
        produce_each(3)
        assert gone <= read(a, 5.0), gone
    finally:
        a.close()
        if c is not None:
            c.close()


# -- the chart's HPA on lag ---------------------------------------------------------------


def test_chart_scales_on_each_pods_lag_on_kafka_and_the_groups_lag_on_redis() -> None:
    """On Kafka the HPA reads the Pods metric (each pod's partitions' lag, averaged); on
    Redis Streams, where every pod reports the whole group's lag, an External metric the
    HPA divides among the replicas (a Pods average of it would never fall as pods join)."""
    import kubernetes_validate

    from tests.test_helm import KUBE_VERSION, component, one, render

    autoscaling = {"enabled": True, "targetLagPerPod": 3000}
    kafka = render(
        {
            "streaming": {"source": "kafka", "kafka": {"bootstrapServers": "k:9092"}},
            "scoreStream": {"enabled": True, "autoscaling": autoscaling},
        }
    )
    name = component(kafka, "score-stream")["metadata"]["name"]
    assert one(kafka, "HorizontalPodAutoscaler", name)["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "fraud_score_stream_consumer_lag"},
                "target": {"type": "AverageValue", "averageValue": "3000"},
            },
        }
    ]
    redis_hpa = one(
        render({"scoreStream": {"enabled": True, "autoscaling": autoscaling}}),
        "HorizontalPodAutoscaler",
        name,
    )
    assert redis_hpa["spec"]["metrics"] == [
        {
            "type": "External",
            "external": {
                "metric": {"name": "fraud_score_stream_consumer_lag"},
                "target": {"type": "AverageValue", "averageValue": "3000"},
            },
        }
    ]
    selected = {**autoscaling, "groupLagMetric": "score_lag", "groupLagSelector": {"job": "s"}}
    (metric_spec,) = one(
        render({"scoreStream": {"enabled": True, "autoscaling": selected}}),
        "HorizontalPodAutoscaler",
        name,
    )["spec"]["metrics"]
    assert metric_spec["external"]["metric"] == {
        "name": "score_lag",
        "selector": {"matchLabels": {"job": "s"}},
    }
    kubernetes_validate.validate(redis_hpa, KUBE_VERSION, strict=True)
