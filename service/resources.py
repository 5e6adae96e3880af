"""What the scoring service holds while it runs, made in one place and handed to handlers.

:func:`open_resources` runs one named builder per part (models, store clients, store
health, event log, challenger, drift, batcher) and closes them in reverse on exit; the
micro-batcher runs :meth:`ScoringPath.score_batch`, the scorer hands its decisions to
:meth:`Sinks.on_scored`. The app's lifespan yields the one :class:`Resources` object and
handlers read it back with :func:`resources`. Nothing connects at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from fraud_scoring.event_log import KafkaProducer, Producer, RedisStreamProducer
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import views
from fraud_scoring.fields import PLAIN, Door, door_for
from fraud_scoring.model_repo import ModelError, ModelNotFound
from fraud_scoring.redis_clients import async_client, is_cluster, packed_by_hiredis
from fraud_scoring.redis_server import redis_url
from service import telemetry
from service.core.batching import Batcher, BatchStats
from service.core.challenger import Challenger
from service.core.model import ModelHolder, load_configured, watch_models
from service.core.online_features import OnlineFeatureReader
from service.core.rules import RulesHolder, watch_rules
from service.core.scoring import Scorer, ScoreRequest, ScoreResult
from service.core.store_health import StoreHealth
from service.errors import RejectReason
from service.loop.decision_log import DecisionLog
from service.loop.drift import DriftMonitor
from service.loop.review_queue import ReviewQueue
from service.loop.spool import Spool
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

STATE_KEY = "fraud_scoring.resources"


@dataclass(frozen=True)
class Resources:
    settings: ServiceSettings
    redis: Any  # redis.asyncio.Redis, or its RedisCluster (fraud_scoring.redis_clients)
    models: ModelHolder
    scorer: Scorer
    # The scorer as both paths call it (decisions counted per call).
    score_batch: Callable[[Sequence[ScoreRequest]], Awaitable[list[ScoreResult]]]
    batcher: Batcher[ScoreRequest, ScoreResult] | None  # None: batching off (naive path)
    instruments: telemetry.Instruments
    # Decisions and labels go to the event log (None: FRAUD_DECISION_LOG=off).
    decision_log: DecisionLog | None = None
    feedback: Producer | None = None
    # The breaker and batch-marker state of the online store (readiness reads it).
    health: StoreHealth | None = None
    # The challenger in shadow / canary (service/core/challenger.py); none loaded by default.
    challenger: Challenger | None = None
    # Transactions decided 'review', for the analysts' page (None: the log is off).
    review: ReviewQueue | None = None
    # The request body's model: the contract's fields and the declared ones (PII hashed).
    door: Door = PLAIN

    def count_rejection(self, reason: RejectReason) -> None:
        self.instruments.rejections.labels(
            reason=reason.value, model_version=_version_label(self.models)
        ).inc()


def _zero_rejections(instruments: telemetry.Instruments, models: ModelHolder) -> None:
    """Export every counted refusal reason at 0 for the serving version from the start,
    so an alert on ``rate()`` sees the first refusal (a series born at 1 shows none)."""
    version = _version_label(models)
    for reason in RejectReason:
        if reason is not RejectReason.NOT_READY:  # the probe's own answer, never counted
            instruments.rejections.labels(reason=reason.value, model_version=version)


def _version_label(models: ModelHolder) -> str:
    """The serving version as a metric label ('none' while no model serves)."""
    current = models.current
    return current.version if current else "none"


def resources(scope: Mapping[str, Any]) -> Resources:
    """The running service's resources, from an ASGI scope (or a Request)."""
    res: Resources = scope["state"][STATE_KEY]
    return res


@contextlib.asynccontextmanager
async def open_resources(
    settings: ServiceSettings, door: Door | None = None
) -> AsyncIterator[Resources]:
    """Create the service's resources and close them on exit (queued micro-batches get
    ``drain_seconds``). Raises ``RedisNotConfigured`` without REDIS_URL unless
    ``embedded_redis`` is set, and ``FieldError`` for a declared PII field without a hash
    key (``door``: the bodies' model, by default from the declarations file). A model
    that is missing or cannot load does not stop the start: the service is not ready,
    answers 503 and keeps looking.

    Each builder registers its own closing on the stack; the order below is the closing
    order reversed (the batcher drains first, then shadow runs, then the decision log)."""
    door = door or door_for(settings)
    instruments = telemetry.setup()
    async with contextlib.AsyncExitStack() as stack:
        url = stack.enter_context(
            redis_url(settings.redis_url, allow_embedded=settings.embedded_redis)
        )
        store = open_store(settings.data_dir, url, settings.feature_store_yaml)
        models = _open_models(stack, settings)
        rules = _open_rules(stack, settings)
        client, scoring_client = _open_store_clients(stack, url, settings)
        pool = _open_pool(stack, settings)
        health = _open_store_health(stack, client, store.project, settings, instruments)
        event_log = _open_event_log(stack, url, settings)
        challenger = await _open_challenger(stack, settings)
        drift = _open_drift(stack, models, settings)
        sinks = Sinks(drift, event_log.decisions)
        scorer = Scorer(
            scoring_client,
            OnlineFeatureReader(store.project, store.config.entity_key_serialization_version),
            models,
            settings,
            pool,
            on_scored=sinks.on_scored,
            on_shadow=sinks.on_shadow,
            health=health,
            challenger=challenger,
            rules=rules,
        )
        path = ScoringPath(scorer, instruments, models, event_log.decisions, settings.batching)
        batcher = _open_batcher(stack, path, settings, instruments)
        _start_metric_flush(stack)
        _zero_rejections(instruments, models)
        yield Resources(
            settings,
            client,
            models,
            scorer,
            path.score_batch,
            batcher,
            instruments,
            event_log.decisions,
            event_log.feedback,
            health,
            challenger,
            review=event_log.review,
            door=door,
        )


class Sinks:
    """Where a scored micro-batch goes after the answer (the scorer's ``on_scored`` and
    ``on_shadow``): the drift monitor takes new decisions, the decision log (when on)
    takes what :func:`_log_takes`, and a shadow run's scores. Each only counts or keeps
    aside: no I/O here."""

    def __init__(self, drift: DriftMonitor, decision_log: DecisionLog | None) -> None:
        self.drift, self.decision_log = drift, decision_log

    def on_scored(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
        shadow: bool = False,
    ) -> None:
        _take(self.drift.observe, _is_new, txns, x, names, results)
        if self.decision_log is not None:
            log = functools.partial(self.decision_log.submit, shadow=shadow)
            _take(log, _log_takes, txns, x, names, results)

    def on_shadow(self, results: Sequence[ScoreResult]) -> None:
        if self.decision_log is not None:
            self.decision_log.shadow_scored(results)


def _take(
    sink: Callable[..., None],
    takes: Callable[[ScoreResult], bool],
    txns: Sequence[Transaction],
    x: np.ndarray,
    names: Sequence[str],
    results: Sequence[ScoreResult],
) -> None:
    """Hand ``sink`` the rows it ``takes`` (retries and refusals are no new decisions)."""
    keep = [i for i, r in enumerate(results) if takes(r)]
    if len(keep) == len(results):
        sink(txns, x, names, results)
    elif keep:
        sink([txns[i] for i in keep], x[keep], names, [results[i] for i in keep])


def _is_new(r: ScoreResult) -> bool:
    """A new model decision (not a retry's kept answer, not a refusal, not rules-only:
    the drift monitor watches model inputs)."""
    return r.logged and r.degraded is None


def _log_takes(r: ScoreResult) -> bool:
    """A new decision, or a retry scored afresh because its first attempt's answer was
    never kept (that batch was cancelled or failed, so nothing was logged): the log takes
    it if it is answered. A kept answer (ScoreResult.repeated) carries no champion
    version."""
    return r.logged or (r.repeat and r.champion_version is not None)


class ScoringPath:
    """The scorer as both paths call it: :meth:`score_batch` is what the micro-batcher
    runs (and the naive path calls directly), :meth:`on_batch` and :attr:`on_answered`
    what it reports to."""

    def __init__(
        self,
        scorer: Scorer,
        instruments: telemetry.Instruments,
        models: ModelHolder,
        decision_log: DecisionLog | None,
        batching: bool,
    ) -> None:
        self.scorer = scorer
        self.instruments = instruments
        self.models = models
        self.batching = batching
        # The log takes a decision once its answer goes to a waiting caller (the batcher
        # says which, just before): a request answered 503 is never logged.
        self.on_answered = decision_log.answered if decision_log is not None else None

    async def score_batch(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """The scorer, plus the batch's decisions counted once per micro-batch."""
        results = await self.scorer.score_requests(items)
        if self.on_answered is not None and not self.batching:  # answered by the caller
            self.on_answered(results, [True] * len(results))
        ins = self.instruments
        ins.count_decisions(Counter((r.decision, r.model_version) for r in results))
        for cause, n in Counter(r.degraded for r in results if r.degraded).items():
            ins.degraded.labels(cause=cause).inc(n)
        ins.count_unavailable(
            (f for r in results for f in r.missing), (f for r in results for f in r.stale)
        )
        return results

    def on_batch(self, size: int, compute_s: float, waits: list[float]) -> None:
        """One micro-batch ran: its size, compute time and each item's queue time."""
        bound = self.instruments.bound(_version_label(self.models))
        bound.batch_size.observe(size)
        bound.compute_time.observe(compute_s)
        for w in waits:
            bound.queue_time.observe(w)


@dataclass(frozen=True)
class EventLog:
    """The decision log, the feedback producer and the review queue (all None when
    FRAUD_DECISION_LOG=off)."""

    decisions: DecisionLog | None = None
    feedback: Producer | None = None
    review: ReviewQueue | None = None


def _open_models(stack: contextlib.AsyncExitStack, settings: ServiceSettings) -> ModelHolder:
    """The model holder, loaded if it can be, and its watcher."""
    models = ModelHolder()
    try:
        models.swap(functools.partial(load_configured, settings))
    except ModelNotFound as exc:
        log.warning("%s; not ready until a model appears", exc)
    except ModelError as exc:
        log.error("no model can serve: %s; not ready, trying again", exc)
    stack.callback(watch_models(models, settings).cancel)
    return models


def _open_rules(stack: contextlib.AsyncExitStack, settings: ServiceSettings) -> RulesHolder:
    """The rules (a file that fails its checks stops the start, naming the field) and
    their watcher."""
    rules = RulesHolder.of(settings)
    log.info("rules %s from %s", rules.current.version, rules.path)
    stack.callback(watch_rules(rules, settings).cancel)
    return rules


def _open_store_clients(
    stack: contextlib.AsyncExitStack, url: str, settings: ServiceSettings
) -> tuple[Any, Any]:
    """The online store's clients: one with socket timeouts (handlers, health probes),
    one without (the scorer, which bounds each round trip as a whole)."""
    client = _store_client(url, settings)
    stack.push_async_callback(client.aclose)
    scoring_client = _store_client(url, settings, read_timeout=False)
    stack.push_async_callback(scoring_client.aclose)
    return client, scoring_client


def _open_pool(stack: contextlib.AsyncExitStack, settings: ServiceSettings) -> ThreadPoolExecutor:
    """The threads the model runs on, one per model instance."""
    pool = ThreadPoolExecutor(max_workers=settings.model_instances, thread_name_prefix="onnx")
    stack.callback(pool.shutdown, wait=True)
    return pool


def _open_store_health(
    stack: contextlib.AsyncExitStack,
    client: Any,
    project: str,
    settings: ServiceSettings,
    instruments: telemetry.Instruments,
) -> StoreHealth:
    """The online store's breaker and batch-marker state, and the task that watches it."""
    health = StoreHealth(
        client,
        project,
        [v.name for v in views()],
        failures=settings.breaker_failures,
        open_s=settings.breaker_open_s,
        check_s=settings.batch_marker_check_s,
        probe_timeout_s=settings.redis_timeout_s,
        on_presence=functools.partial(_set_presence, instruments),
    )
    watcher = asyncio.get_running_loop().create_task(health.watch(), name="batch-markers")
    stack.callback(watcher.cancel)
    return health


def _set_presence(instruments: telemetry.Instruments, view: str, present: bool) -> None:
    instruments.batch_features_present.labels(view=view).set(1 if present else 0)


def _open_event_log(
    stack: contextlib.AsyncExitStack, url: str, settings: ServiceSettings
) -> EventLog:
    """The decision log (its writer also feeds the review queue, on the log's Redis
    server) and the feedback producer; nothing with FRAUD_DECISION_LOG=off."""
    if settings.decision_log == "off":
        return EventLog()
    review = ReviewQueue(
        settings.decision_log_url or url,
        settings.decision_log_stream,
        settings.decision_log_retention_s,
        settings.redis_timeout_s,
    )
    stack.push_async_callback(review.close)
    # Registered before the batcher: on exit the batcher drains first, then the log.
    decisions = DecisionLog(
        log_producer(settings, url, settings.decision_log_stream),
        settings.decision_log_buffer,
        after_write=review.add,
        spool=_spool(settings),
    )
    decisions.start()
    stack.push_async_callback(decisions.stop, drain_s=settings.drain_seconds)
    feedback = log_producer(settings, url, settings.feedback_stream)
    stack.push_async_callback(feedback.close)
    return EventLog(decisions, feedback, review)


async def _open_challenger(
    stack: contextlib.AsyncExitStack, settings: ServiceSettings
) -> Challenger:
    """The challenger (none loaded by default)."""
    challenger = Challenger(settings)
    await asyncio.to_thread(challenger.load)
    # After the log, before the batcher: on exit shadow runs finish into the log.
    stack.push_async_callback(challenger.stop, drain_s=settings.drain_seconds)
    return challenger


def _open_drift(
    stack: contextlib.AsyncExitStack, models: ModelHolder, settings: ServiceSettings
) -> DriftMonitor:
    """The drift monitor, flushed at each scrape."""
    drift = DriftMonitor(models, settings.drift_window)
    stack.callback(drift.start().cancel)
    stack.callback(telemetry.before_scrape(drift.flush))
    return drift


def _open_batcher(
    stack: contextlib.AsyncExitStack,
    path: ScoringPath,
    settings: ServiceSettings,
    instruments: telemetry.Instruments,
) -> Batcher[ScoreRequest, ScoreResult] | None:
    """The micro-batcher running :meth:`ScoringPath.score_batch`, and its queue-depth
    sampler; None with batching off (the naive path calls the scoring path itself)."""
    if not settings.batching:
        return None
    batcher = Batcher(
        path.score_batch,
        max_batch_size=settings.max_batch_size,
        max_queue_delay_s=settings.max_queue_delay_ms / 1e3,
        max_queue_size=settings.max_queue_size,
        preferred_batch_sizes=settings.preferred_batch_sizes,
        concurrency=max(settings.batches_in_flight, settings.model_instances),
        stats=BatchStats(on_batch=path.on_batch, on_answered=path.on_answered),
    )
    batcher.start()
    stack.push_async_callback(batcher.stop, drain_s=settings.drain_seconds)
    sampler = asyncio.get_running_loop().create_task(
        _sample_depth(batcher, instruments), name="queue-depth"
    )
    stack.callback(sampler.cancel)
    return batcher


def _start_metric_flush(stack: contextlib.AsyncExitStack) -> None:
    """Kept-aside metrics flushed every second; this worker's gauges dropped on exit."""
    kept = asyncio.get_running_loop().create_task(_flush_kept(), name="kept-metrics")
    stack.callback(kept.cancel)
    stack.callback(telemetry.worker_exited)


def _store_client(url: str, settings: ServiceSettings, *, read_timeout: bool = True) -> Any:
    """The online store's asyncio client. One server: a blocking pool, so past 64
    connections a read waits (up to the Redis timeout) for a free one instead of failing,
    e.g. a large batch call on the naive path. A cluster: redis-py's cluster client (one
    pipeline per node, sent concurrently); its per-node limit is above the in-flight
    limit, which bounds the reads at once.

    ``read_timeout`` False: no socket timeout on reads and writes (the scorer bounds each
    micro-batch's round trip as a whole, with one timer): redis-py otherwise wraps every
    pipelined send in ``asyncio.wait_for`` (a task) and every reply in
    ``asyncio.timeout``, ~10 % of a scoring request's CPU."""
    timeouts = {
        "socket_timeout": settings.redis_timeout_s if read_timeout else None,
        "socket_connect_timeout": settings.redis_timeout_s,
    }
    if is_cluster(url):
        return async_client(url, max_connections=settings.max_inflight + 64, **timeouts)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=64, timeout=settings.redis_timeout_s, **timeouts
    )
    return aioredis.Redis.from_pool(packed_by_hiredis(pool))  # the client closes the pool


def _spool(settings: ServiceSettings) -> Spool | None:
    """The decision log's spool (FRAUD_DECISION_SPOOL_DIR), None when 'off'."""
    if settings.decision_spool_dir == "off":
        return None
    directory = Path(settings.decision_spool_dir or settings.data_dir / "decision-spool")
    try:
        return Spool(directory, fsync_s=settings.decision_spool_fsync_s)
    except OSError as exc:  # e.g. a read-only root filesystem: scoring goes on
        log.error(
            "decision spool %s unusable (%s): decisions are held in memory only; set "
            "FRAUD_DECISION_SPOOL_DIR to a writable volume",
            directory,
            exc,
        )
        return None


def log_producer(settings: ServiceSettings, redis_url: str, name: str) -> Producer:
    """A producer for the stream/topic ``name`` of the configured event log (the log's own
    Redis server when FRAUD_DECISION_LOG_URL is set, else ``redis_url``)."""
    if settings.decision_log == "kafka":
        return KafkaProducer(settings.kafka_bootstrap, name, timeout_s=settings.redis_timeout_s)
    return RedisStreamProducer(
        settings.decision_log_url or redis_url,
        name,
        retention_s=settings.decision_log_retention_s,
        timeout_s=settings.redis_timeout_s,
    )


async def _flush_kept() -> None:
    """What hot paths keep aside (``telemetry.Kept`` histograms, the drift monitor)
    reaches the metrics at least once a second, not only at this worker's scrapes."""
    while True:
        await asyncio.sleep(1.0)
        telemetry.flush_kept()


async def _sample_depth(
    batcher: Batcher[ScoreRequest, ScoreResult], ins: telemetry.Instruments
) -> None:
    """Keep ``fraud_batch_queue_depth`` current (10 times a second): a gauge that is
    set, unlike a scrape-time callback, also works across worker processes."""
    while True:
        ins.queue_depth.set(batcher.depth)
        await asyncio.sleep(0.1)
