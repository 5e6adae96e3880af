"""``fraud-scoring score-stream``: decisions for every transaction on the event log.

The composition, on top of both app folders it joins (the import layers keep ``service``
and ``streaming`` apart): the scoring service's resources (:func:`service.resources.
open_resources`: the same model loading and watching, store clients, scorer, decision
log, drift and challenger as ``serve``), a micro-batcher (:class:`service.core.batching.
Batcher`) with the stream's own bounds in front of the same scoring path, and the
consumer :class:`streaming.score_stream.ScoreStream` on the updater's event log sources.
A decision is the API's ``ScoreOut`` (:meth:`service.edge.schemas.ScoreOut.wire`) plus
``source``, the entry id or ``topic/partition/offset`` it came from.

Settings: the service's (``FRAUD_``...: model, store, scoring, decision log), the event
log's (``FRAUD_STREAM_SOURCE``, ``FRAUD_STREAM_NAME``, ``FRAUD_KAFKA_BOOTSTRAP``...) and
its own ``FRAUD_SCORE_STREAM_*`` (``fraud_scoring/settings.py``'s
``StreamScoringSettings``); flags override them. See docs/stream-scoring.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from typing import Any

from fraud_scoring.commands import Command, UsageError, add_embedded_redis
from fraud_scoring.event_log import (
    KafkaProducer,
    Producer,
    RedisStreamProducer,
)
from fraud_scoring.events import Transaction
from fraud_scoring.redis_server import redis_url
from fraud_scoring.settings import StreamScoringSettings, UpdaterSettings
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

# Kafka: how long a write of decisions may wait for the brokers' acknowledgement.
KAFKA_WRITE_TIMEOUT_S = 10.0


class ScoreStreamSettings(ServiceSettings, UpdaterSettings, StreamScoringSettings):
    """What ``fraud-scoring score-stream`` reads."""


def _or(flag: Any, setting: Any) -> Any:
    return setting if flag is None else flag


def run_score_stream(args: argparse.Namespace, settings: ScoreStreamSettings) -> None:
    from fraud_scoring.features import declarations

    declarations()  # a bad declarations file refuses to start, naming the field
    overrides = {
        "score_stream_max_batch": args.max_batch,
        "score_stream_max_wait_ms": args.max_wait_ms,
        "score_stream_latency_budget_ms": args.latency_budget_ms,
        "score_stream_commit_interval_ms": args.commit_interval_ms,
        "score_stream_max_in_flight": args.max_in_flight,
        "score_stream_metrics_port": args.metrics_port,
        "score_stream_group": args.group,
        "score_stream_output": args.output,
        "score_stream_output_bootstrap": args.output_bootstrap,
        "stream_source": args.source,
        "stream_name": args.stream,
        "kafka_bootstrap": args.kafka_bootstrap,
    }
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    for name in ("score_stream_max_batch", "score_stream_max_in_flight"):
        if getattr(settings, name) < 1:
            raise UsageError(f"--{name[13:].replace('_', '-')} must be at least 1")
    if settings.score_stream_output_bootstrap is not None:
        if settings.stream_source != "kafka":
            raise UsageError(
                "--output-bootstrap (FRAUD_SCORE_STREAM_OUTPUT_BOOTSTRAP) is for a Kafka "
                "source; a Redis source's decisions go to FRAUD_SCORE_STREAM_OUTPUT_URL"
            )
        if not settings.score_stream_output_bootstrap.strip():
            raise UsageError(
                "--output-bootstrap (FRAUD_SCORE_STREAM_OUTPUT_BOOTSTRAP) is empty: give "
                "host:port[,host:port...], or leave it unset for --kafka-bootstrap's cluster"
            )
    if settings.score_stream_max_wait_ms >= settings.score_stream_latency_budget_ms:
        raise UsageError(
            f"--max-wait-ms ({settings.score_stream_max_wait_ms:g}) must be below the latency "
            f"budget ({settings.score_stream_latency_budget_ms:g} ms): the budget holds the "
            "wait for a batch plus the batch's feature read and inference"
        )
    with redis_url(settings.redis_url, allow_embedded=settings.embedded_redis) as url:
        # The resources connect to this one server (an embedded one is started once).
        settings = settings.model_copy(update={"redis_url": url, "embedded_redis": False})
        asyncio.run(_score_stream(args, settings))


async def _score_stream(args: argparse.Namespace, settings: ScoreStreamSettings) -> None:
    from prometheus_client import REGISTRY

    from service.core.batching import Batcher, BatchStats
    from service.resources import open_resources
    from streaming.commands import open_source, source_client
    from streaming.metrics import ScoreStreamMetrics, serve_http
    from streaming.score_stream import ScoreStream
    from streaming.sources import SourceFatal

    s = settings
    assert s.redis_url is not None
    # The scoring path without the service's own batcher: the stream's batcher below runs
    # it, and every decision it makes is answered (so the decision log takes each).
    service_settings = s.model_copy(update={"batching": False})
    metrics = ScoreStreamMetrics.create(REGISTRY)  # beside the service's own metrics
    client = source_client(s.redis_url)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(client.close)
        res = await stack.enter_async_context(open_resources(service_settings))
        batcher = Batcher(
            res.score_batch,
            max_batch_size=s.score_stream_max_batch,
            max_queue_delay_s=s.score_stream_max_wait_ms / 1e3,
            max_queue_size=max(s.score_stream_max_in_flight, s.score_stream_max_batch),
            # Wait for a full batch (or the time bound) rather than run the first of a
            # burst alone: the stream hands over many transactions at once.
            preferred_batch_sizes=[s.score_stream_max_batch],
            concurrency=s.model_instances,
            stats=BatchStats(on_batch=metrics.on_batch),
        )
        batcher.start()
        stack.push_async_callback(batcher.stop, drain_s=s.drain_seconds)
        source = open_source(
            s,
            client,
            kind=s.stream_source,
            stream=s.stream_name,
            group=s.score_stream_group,
            consumer=args.consumer,
            kafka_bootstrap=s.kafka_bootstrap,
            session_timeout_ms=s.kafka_session_timeout_ms,
            claim_idle_ms=s.claim_idle_ms,
            lateness_s=s.allowed_lateness_s,
            dead_letter_name=dead_letter_name(s.stream_source, s.stream_name),
        )
        stack.callback(source.close)
        output = await _open_output(stack, s)
        if s.score_stream_metrics_port:  # /metrics and /readyz ("consuming")
            server = serve_http(metrics, s.score_stream_metrics_port, client.ping)
            stack.callback(server.shutdown)
        stream = ScoreStream(
            source,
            decider(batcher, s.score_stream_latency_budget_ms / 1e3, metrics),
            output,
            metrics,
            max_in_flight=s.score_stream_max_in_flight,
            commit_interval_s=s.score_stream_commit_interval_ms / 1e3,
            poll_batch=s.score_stream_poll_batch,
            max_future_s=s.max_future_skew_s,
            model=res.door.model,  # the declared fields, PII hashed
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stream.stop)
        # Start-up objects (Feast, pandas, the model, numba) never die: out of the
        # collector's reach, as the service does, so full collections stay short while
        # thousands of events are in flight.
        gc.collect()
        gc.freeze()
        log.info(
            "score-stream %s: %s %r as group %r -> %r (max batch %d, max wait %.1f ms, "
            "latency budget %.0f ms, commit interval %.0f ms, in flight <= %d)",
            args.consumer,
            s.stream_source,
            s.stream_name,
            s.score_stream_group,
            s.score_stream_output,
            s.score_stream_max_batch,
            s.score_stream_max_wait_ms,
            s.score_stream_latency_budget_ms,
            s.score_stream_commit_interval_ms,
            s.score_stream_max_in_flight,
        )
        try:
            await stream.run(max_messages=args.max_messages, idle_exit_s=args.idle_exit_s)
        except SourceFatal as exc:
            log.error("score-stream stopped: %s", exc)
            raise SystemExit(1) from exc


def dead_letter_name(kind: str, stream: str) -> str:
    """score-stream's own dead letter (the updater's stays its own: both may read one log)."""
    return f"{stream}.scoring-dead-letter" if kind == "kafka" else f"{stream}:scoring-dead-letter"


# A transaction still waiting at the boundary this many latency budgets after it was
# handed over is refused (Rejected: scored again); the budget itself never drops one.
HARD_LIMIT_BUDGETS = 20.0


def decider(batcher: Any, budget_s: float, metrics: Any) -> Any:
    """``decide`` for :class:`~streaming.score_stream.ScoreStream`: the transaction
    through the micro-batcher; the API's answer (a dict), or the 409's reason; ScoreLater
    for a refusal that may pass (store down, no model).

    The latency budget is the boundary's target, not a deadline: a stream cannot drop a
    transaction, and scoring one again later would record it behind its card's later
    ones. Its time at the boundary (queueing + feature read + inference) is measured
    against the budget (``fraud_score_stream_boundary_seconds``, ``..._over_budget_total``)
    and the batcher's deadline is only a hard limit far past it."""
    from service.core.scoring import ScoreRequest
    from service.edge.schemas import ScoreOut
    from service.errors import Rejected
    from streaming.score_stream import ScoreLater

    limit_s = max(budget_s * HARD_LIMIT_BUDGETS, 30.0)

    async def decide(txn: Transaction) -> dict[str, Any] | str:
        start = time.perf_counter()
        try:
            result = await batcher.submit(ScoreRequest(txn), time.monotonic() + limit_s)
        except Rejected as exc:
            raise ScoreLater(str(exc)) from exc
        spent = time.perf_counter() - start
        metrics.observe_boundary(spent, budget_s)
        if result.refused is not None:
            return f"id_reused: {result.refused}"
        return ScoreOut.wire(result, spent * 1e3)

    return decide


async def _open_output(stack: contextlib.AsyncExitStack, s: ScoreStreamSettings) -> Producer:
    """The decisions' log: a Kafka topic beside a Kafka source (on the source's cluster, or
    ``score_stream_output_bootstrap``'s), else a Redis stream (idempotent per
    transaction_id for as long as the input stream keeps its events)."""
    output: Producer
    if s.stream_source == "kafka":
        from streaming.sources import ensure_topic

        bootstrap = s.score_stream_output_bootstrap or s.kafka_bootstrap
        await asyncio.to_thread(ensure_topic, bootstrap, s.score_stream_output, 1)
        output = KafkaProducer(bootstrap, s.score_stream_output, KAFKA_WRITE_TIMEOUT_S)
    else:
        assert s.redis_url is not None
        output = RedisStreamProducer(
            s.score_stream_output_url or s.redis_url,
            s.score_stream_output,
            retention_s=s.stream_retention_s,
            timeout_s=max(s.redis_timeout_s, 1.0),
        )
    stack.push_async_callback(output.close)
    return output


def configure_score_stream(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=("redis", "kafka"), help="default FRAUD_STREAM_SOURCE")
    p.add_argument("--stream", help="transactions stream / topic (default FRAUD_STREAM_NAME)")
    p.add_argument("--group", help="consumer group (default FRAUD_SCORE_STREAM_GROUP)")
    p.add_argument(
        "--consumer",
        default=socket.gethostname(),
        help="consumer name, unique per process in the group and stable across restarts "
        "(default: the host name)",
    )
    p.add_argument("--output", help="decisions stream / topic (default FRAUD_SCORE_STREAM_OUTPUT)")
    p.add_argument("--kafka-bootstrap", help="default FRAUD_KAFKA_BOOTSTRAP")
    p.add_argument(
        "--output-bootstrap",
        help="Kafka: bootstrap servers of the decisions topic's cluster, when not the "
        "transactions' (FRAUD_SCORE_STREAM_OUTPUT_BOOTSTRAP; default --kafka-bootstrap)",
    )
    p.add_argument(
        "--max-batch", type=int, help="micro-batch size bound (FRAUD_SCORE_STREAM_MAX_BATCH)"
    )
    p.add_argument(
        "--max-wait-ms",
        type=float,
        help="micro-batch time bound (FRAUD_SCORE_STREAM_MAX_WAIT_MS)",
    )
    p.add_argument(
        "--latency-budget-ms",
        type=float,
        help="the model boundary's budget per transaction (FRAUD_SCORE_STREAM_LATENCY_BUDGET_MS)",
    )
    p.add_argument(
        "--commit-interval-ms",
        type=float,
        help="offset commit interval (FRAUD_SCORE_STREAM_COMMIT_INTERVAL_MS)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        help="events read and not committed before reading pauses "
        "(FRAUD_SCORE_STREAM_MAX_IN_FLIGHT)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics and /readyz, 0: off (FRAUD_SCORE_STREAM_METRICS_PORT)",
    )
    p.add_argument("--max-messages", type=int, help="stop after reading this many events")
    p.add_argument(
        "--idle-exit-s", type=float, help="stop after this long without events in flight"
    )
    add_embedded_redis(p)


COMMAND: Command[Any] = Command(
    "score-stream",
    "score every transaction on the event log and write the decisions to a topic",
    run_score_stream,
    configure_score_stream,
    settings=ScoreStreamSettings,
)
