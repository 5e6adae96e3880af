"""``fraud-scoring stream`` (the updater) and ``fraud-scoring emit`` (simulated live feed).

Both read the shared settings (``FRAUD_STREAM_SOURCE``, ``FRAUD_STREAM_NAME``,
``FRAUD_CONSUMER_GROUP``, ``FRAUD_KAFKA_BOOTSTRAP``, ``FRAUD_ALLOWED_LATENESS_S``,
``FRAUD_STREAM_BATCH_SIZE``, ``FRAUD_CLAIM_IDLE_MS``, ``FRAUD_KAFKA_SESSION_TIMEOUT_MS``,
``FRAUD_UPDATER_METRICS_PORT``, ``REDIS_URL``); flags override them. With ``REDIS_URL``
unset a private Redis-protocol server lives only as long as the command, which is only
useful for a quick look.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from types import FrameType
from typing import TypeVar

import redis

from fraud_scoring.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextmanager
def _redis_client(settings: Settings) -> Iterator[redis.Redis]:
    from fraud_scoring.redis_server import redis_url

    with redis_url(settings.redis_url) as url:
        # socket_timeout must exceed the XREADGROUP block time.
        client = redis.Redis.from_url(
            url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30
        )
        try:
            yield client
        finally:
            client.close()


def cmd_stream(args: argparse.Namespace, settings: Settings) -> None:
    from streaming.metrics import UpdaterMetrics
    from streaming.sources import KafkaSource, RedisStreamSource, Source
    from streaming.state import SessionWriter
    from streaming.updater import Updater

    source_kind = args.source or settings.stream_source
    stream = args.stream or settings.stream_name
    group = args.group or settings.consumer_group
    lateness = _or(args.allowed_lateness_s, settings.allowed_lateness_s)
    session_timeout_ms = _or(args.kafka_session_timeout_ms, settings.kafka_session_timeout_ms)
    metrics = UpdaterMetrics.create()
    metrics_port = _or(args.metrics_port, settings.updater_metrics_port)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, registry=metrics.registry)
    with _redis_client(settings) as client:
        source: Source
        if source_kind == "redis":
            source = RedisStreamSource(
                client,
                stream,
                group,
                args.consumer,
                claim_idle_ms=_or(args.claim_idle_ms, settings.claim_idle_ms),
            )
        elif source_kind == "kafka":
            source = KafkaSource(
                args.kafka_bootstrap or settings.kafka_bootstrap,
                stream,
                group,
                client_id=args.consumer,
                extra={
                    "session.timeout.ms": session_timeout_ms,
                    "heartbeat.interval.ms": max(100, session_timeout_ms // 5),
                },
            )
        else:
            raise ValueError(f"--source must be 'redis' or 'kafka', got {source_kind!r}")
        updater = Updater(
            source,
            SessionWriter(client, lateness),
            metrics,
            batch_size=_or(args.batch_size, settings.stream_batch_size),
            max_future_s=settings.max_future_skew_s,
        )

        def on_term(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: finishing the current batch", signum)
            updater.stop()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        log.info(
            "updater %s consuming %s %r as group %r", args.consumer, source_kind, stream, group
        )
        try:
            updater.run(max_messages=args.max_messages, idle_exit_s=args.idle_exit_s)
        finally:
            source.close()


def cmd_emit(args: argparse.Namespace, settings: Settings) -> None:
    from batch_jobs.simulate import SimConfig, live_events

    cfg = SimConfig.from_args(args)
    events = live_events(
        cfg,
        late_fraction=args.late_fraction,
        max_lateness_s=args.max_lateness_s,
        duplicate_rate=args.duplicate_rate,
    )
    payloads = [json.dumps(e).encode() for e in events]
    keys = [str(e["card_id"]).encode() for e in events]
    source_kind = args.source or settings.stream_source
    stream = args.stream or settings.stream_name
    t0 = time.perf_counter()
    if source_kind == "redis":
        with _redis_client(settings) as client:

            def send(batch: list[int]) -> None:
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    pipe.xadd(stream, {"data": payloads[i]})
                pipe.execute()

            _paced(len(payloads), args.events_per_s, send)
    elif source_kind == "kafka":
        from confluent_kafka import Producer

        from streaming.sources import ensure_topic

        bootstrap = args.kafka_bootstrap or settings.kafka_bootstrap
        ensure_topic(bootstrap, stream, args.partitions)
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})

        def send_kafka(batch: list[int]) -> None:
            for i in batch:
                producer.produce(stream, value=payloads[i], key=keys[i])
            producer.poll(0)

        _paced(len(payloads), args.events_per_s, send_kafka)
        if producer.flush(30):
            raise RuntimeError("kafka: not every event was delivered within 30 s")
    else:
        raise ValueError(f"--source must be 'redis' or 'kafka', got {source_kind!r}")
    dt = time.perf_counter() - t0
    print(f"emitted {len(payloads):,} events to {source_kind} {stream!r} in {dt:.1f}s")


def _paced(n: int, per_s: float, send: Callable[[list[int]], None]) -> None:
    """Call ``send`` with consecutive index batches, at ``per_s`` events/s (0: at once)."""
    if per_s <= 0:
        for start in range(0, n, 1000):
            send(list(range(start, min(n, start + 1000))))
        return
    t0 = time.perf_counter()
    sent = 0
    while sent < n:
        due = min(n, int((time.perf_counter() - t0) * per_s) + 1)
        if due > sent:
            send(list(range(sent, due)))
            sent = due
        else:
            time.sleep(min(0.001, (sent + 1) / per_s - (time.perf_counter() - t0)))


def _or(flag: T | None, setting: T) -> T:
    """A command-line flag when given, else the setting (from the environment)."""
    return setting if flag is None else flag


def _date(s: str) -> date:
    return date.fromisoformat(s)


def configure_stream(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        choices=("redis", "kafka"),
        help="event log (default: FRAUD_STREAM_SOURCE, 'redis')",
    )
    p.add_argument("--stream", help="Redis stream / Kafka topic (default FRAUD_STREAM_NAME)")
    p.add_argument("--group", help="consumer group (default FRAUD_CONSUMER_GROUP)")
    p.add_argument(
        "--consumer",
        default=socket.gethostname(),
        help="consumer name, unique per process in the group; keep it stable "
        "across restarts so the process re-reads its own pending entries "
        "(default: the host name)",
    )
    p.add_argument("--kafka-bootstrap", help="default FRAUD_KAFKA_BOOTSTRAP")
    p.add_argument(
        "--kafka-session-timeout-ms",
        type=int,
        help="Kafka: how soon a dead updater's partitions move to the others "
        "(default FRAUD_KAFKA_SESSION_TIMEOUT_MS, 10000)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="most events per batch (default FRAUD_STREAM_BATCH_SIZE, 1000)",
    )
    p.add_argument(
        "--allowed-lateness-s", type=float, help="default FRAUD_ALLOWED_LATENESS_S (300)"
    )
    p.add_argument(
        "--claim-idle-ms",
        type=int,
        help="Redis: claim other consumers' entries pending this long "
        "(default FRAUD_CLAIM_IDLE_MS, 30000)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics port, 0: off (default FRAUD_UPDATER_METRICS_PORT, 9108)",
    )
    p.add_argument("--max-messages", type=int, help="stop after this many messages")
    p.add_argument("--idle-exit-s", type=float, help="stop after this long without events")


def configure_emit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=("redis", "kafka"), help="default FRAUD_STREAM_SOURCE")
    p.add_argument("--stream", help="Redis stream / Kafka topic (default FRAUD_STREAM_NAME)")
    p.add_argument("--kafka-bootstrap", help="default FRAUD_KAFKA_BOOTSTRAP")
    p.add_argument("--partitions", type=int, default=3, help="Kafka: partitions if created")
    p.add_argument("--cards", type=int, default=1000)
    p.add_argument("--merchants", type=int, default=200)
    p.add_argument("--days", type=int, default=1)
    p.add_argument("--start", type=_date, default=date(2026, 1, 1))
    p.add_argument("--rate", type=float, default=3.0, help="mean transactions per card-day")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--late-fraction", type=float, default=0.05)
    p.add_argument("--max-lateness-s", type=float, default=60.0)
    p.add_argument("--duplicate-rate", type=float, default=0.02)
    p.add_argument("--events-per-s", type=float, default=0.0, help="0: as fast as possible")


COMMANDS: dict[
    str,
    tuple[
        Callable[[argparse.Namespace, Settings], None],
        str,
        Callable[[argparse.ArgumentParser], None],
    ],
] = {
    "stream": (
        cmd_stream,
        "run the streaming updater (session features into Redis)",
        configure_stream,
    ),
    "emit": (
        cmd_emit,
        "publish a simulated live transaction feed to the event log",
        configure_emit,
    ),
}
