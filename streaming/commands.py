"""The streaming subcommand: ``fraud-scoring stream`` (the updater).

It reads the shared settings (``FRAUD_STREAM_SOURCE``, ``FRAUD_STREAM_NAME``,
``FRAUD_CONSUMER_GROUP``, ``FRAUD_KAFKA_BOOTSTRAP``, ``FRAUD_ALLOWED_LATENESS_S``,
``FRAUD_STREAM_BATCH_SIZE``, ``FRAUD_CLAIM_IDLE_MS``, ``FRAUD_KAFKA_SESSION_TIMEOUT_MS``,
``FRAUD_UPDATER_METRICS_PORT``, ``FRAUD_STREAM_RETENTION_S``, ``FRAUD_DEAD_LETTER_MAX_BYTES``,
``FRAUD_KAFKA_DEAD_LETTER_REPLICATION``, ``FRAUD_REDIS_WAIT_REPLICAS``, ``REDIS_URL``,
``FRAUD_REDIS_CA_FILE``, ``FRAUD_REDIS_CLUSTER``); flags
override them. With ``REDIS_URL`` unset it refuses to start unless ``--embedded-redis``
asks for a private server that lives only as long as the command (useful for a quick
look, nothing else).

A fatal event-log error ends the command with exit status 1 and one clear log line
(:class:`~streaming.sources.SourceFatal`), so that the orchestrator restarts it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

from fraud_scoring.commands import Command, add_embedded_redis
from fraud_scoring.fields import door_for
from fraud_scoring.redis_clients import drop_connections, sync_client
from fraud_scoring.redis_server import redis_url
from fraud_scoring.settings import UpdaterSettings
from streaming.settings import StreamSettings
from streaming.sources import KafkaSource, RedisStreamSource, Source

log = logging.getLogger(__name__)
T = TypeVar("T")


@contextmanager
def _redis_client(settings: StreamSettings) -> Iterator[Any]:
    with redis_url(settings.redis_url, allow_embedded=settings.embedded_redis) as url:
        client = source_client(url)
        try:
            yield client
        finally:
            client.close()


def source_client(url: str) -> Any:
    """The event log's Redis client (one Redis or a cluster): its socket timeout exceeds
    the XREADGROUP block time."""
    return sync_client(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30)


def run_stream(args: argparse.Namespace, settings: StreamSettings) -> None:
    from fraud_scoring.features import declarations
    from streaming.metrics import UpdaterMetrics, serve_http
    from streaming.sources import SourceFatal
    from streaming.state import SessionWriter
    from streaming.updater import Updater

    declarations()  # a bad declarations file refuses to start, naming the field
    model = door_for(settings).model  # so does a PII field without a hash key
    source_kind = args.source or settings.stream_source
    stream = args.stream or settings.stream_name
    group = args.group or settings.consumer_group
    lateness = _or(args.allowed_lateness_s, settings.allowed_lateness_s)
    session_timeout_ms = _or(args.kafka_session_timeout_ms, settings.kafka_session_timeout_ms)
    metrics = UpdaterMetrics.create()
    metrics_port = _or(args.metrics_port, settings.updater_metrics_port)
    with _redis_client(settings) as client:  # first: refuses when REDIS_URL is missing
        if metrics_port:  # /metrics and /readyz ("consuming")
            serve_http(metrics, metrics_port, client.ping)
        source = open_source(
            settings,
            client,
            kind=source_kind,
            stream=stream,
            group=group,
            consumer=args.consumer,
            kafka_bootstrap=args.kafka_bootstrap or settings.kafka_bootstrap,
            session_timeout_ms=session_timeout_ms,
            claim_idle_ms=_or(args.claim_idle_ms, settings.claim_idle_ms),
            lateness_s=lateness,
        )
        updater = Updater(
            source,
            SessionWriter(client, lateness, wait_replicas=settings.redis_wait_replicas),
            metrics,
            batch_size=_or(args.batch_size, settings.stream_batch_size),
            max_future_s=settings.max_future_skew_s,
            # After a failover, reconnect so the retry reaches the new primary.
            on_readonly=lambda: drop_connections(client),
            model=model,
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
        except SourceFatal as exc:
            log.error("updater stopped: %s", exc)
            raise SystemExit(1) from exc
        finally:
            source.close()


def open_source(
    settings: UpdaterSettings,
    client: Any,
    *,
    kind: str,
    stream: str,
    group: str,
    consumer: str,
    kafka_bootstrap: str,
    session_timeout_ms: int,
    claim_idle_ms: int,
    lateness_s: float,
    dead_letter_name: str | None = None,
) -> Source:
    """The event log consumer of ``kind`` ('kafka' or 'redis', on ``client``) in
    ``group``, as the updater and ``score-stream`` read it; ``dead_letter_name``: the
    dead letter's stream/topic (default ``<stream>:dead-letter`` / ``<topic>.dead-letter``)."""
    if kind == "kafka":
        return KafkaSource(
            kafka_bootstrap,
            stream,
            group,
            client_id=consumer,
            extra={
                "session.timeout.ms": session_timeout_ms,
                "heartbeat.interval.ms": max(100, session_timeout_ms // 5),
            },
            dead_letter_max_bytes=settings.dead_letter_max_bytes,
            dead_letter_replication=settings.kafka_dead_letter_replication,
            dead_letter_name=dead_letter_name,
        )
    return RedisStreamSource(  # "redis": the settings and --source admit no other value
        client,
        stream,
        group,
        consumer,
        claim_idle_ms=claim_idle_ms,
        dead_letter_max_bytes=settings.dead_letter_max_bytes,
        # Entries are trimmed past the retention the session state keeps.
        keep_s=settings.stream_retention_s + lateness_s if settings.stream_retention_s else None,
        dead_letter_name=dead_letter_name,
    )


def _or(flag: T | None, setting: T) -> T:
    """A command-line flag when given, else the setting (from the environment)."""
    return setting if flag is None else flag


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
        help="port of Prometheus /metrics and /readyz, 0: off "
        "(default FRAUD_UPDATER_METRICS_PORT, 9108)",
    )
    p.add_argument("--max-messages", type=int, help="stop after this many messages")
    p.add_argument("--idle-exit-s", type=float, help="stop after this long without events")
    add_embedded_redis(p)


COMMANDS: list[Command[Any]] = [
    Command(
        "stream",
        "run the streaming updater (windowed features into Redis)",
        run_stream,
        configure_stream,
        settings=StreamSettings,
    ),
]
