"""Freshness metrics of the streaming updater (Prometheus).

* ``fraud_stream_event_to_servable_seconds`` (histogram): from the moment the log stored
  an event (Redis stream entry id / Kafka message timestamp) to the moment its effect
  was readable in Redis. Event *time* is not used: replays and simulations carry old
  event times.
* ``fraud_stream_events_total{outcome}``: applied, duplicate, dead_letter,
  dropped_too_late; ``rate(...{outcome="applied"}[1m])`` is events applied per second.
* ``fraud_stream_late_events_total``: events more than the allowed lateness behind
  their card's newest event (still applied at their own time).
* ``fraud_stream_consumer_lag``: events in the log not yet acknowledged by the group.
* ``fraud_stream_newest_event_time_seconds``: newest event time applied (epoch s);
  ``time() - it`` is the event-time lag of live traffic.
* ``fraud_stream_retries_total{step}``: backoff retries while Redis or the log is down
  (``step``: poll, dead_letter, apply, ack).
* ``fraud_stream_last_step_time_seconds``: when the loop last completed a step (a poll,
  and for a non-empty batch its apply and acknowledgement); it stops moving while the
  updater retries against a Redis or an event log that is down.

:func:`serve_http` serves ``/metrics`` and ``/readyz`` (see :func:`readiness`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from fraud_scoring.redis_clients import STORE_ERRORS

# /readyz: the loop must have completed a step this recently. An idle step takes the
# poll timeout (0.2 s); a full batch a few seconds at most.
READY_MAX_AGE_S = 30.0

# fraud_stream_events_total's outcomes, each exported at 0 from the start: a series born
# at its first count looks flat to increase() (FraudUpdaterDeadLetters would miss it).
OUTCOMES = ("applied", "duplicate", "dead_letter", "dropped_too_late")
# The steps streaming/updater.py's loop retries (``Updater._retry``'s names).
RETRY_STEPS = ("poll", "dead_letter", "apply", "ack")

LAG_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass
class UpdaterMetrics:
    registry: CollectorRegistry
    lag: Histogram
    events: Counter
    late: Counter
    consumer_lag: Gauge
    newest_event_time: Gauge
    retries: Counter
    last_step: Gauge
    last_step_s: float = 0.0  # epoch seconds; 0: no step completed yet

    def mark_step(self) -> None:
        """Record that the loop completed a step just now (the updater calls it)."""
        self.last_step_s = time.time()
        self.last_step.set(self.last_step_s)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> UpdaterMetrics:
        """Metrics on ``registry`` (default: a fresh one, so several updaters can coexist)."""
        reg = registry if registry is not None else CollectorRegistry()
        metrics = cls(
            registry=reg,
            lag=Histogram(
                "fraud_stream_event_to_servable_seconds",
                "Seconds from an event entering the log to its effect in Redis",
                buckets=LAG_BUCKETS,
                registry=reg,
            ),
            events=Counter(
                "fraud_stream_events", "Events handled by outcome", ["outcome"], registry=reg
            ),
            late=Counter(
                "fraud_stream_late_events", "Events later than the allowed lateness", registry=reg
            ),
            consumer_lag=Gauge(
                "fraud_stream_consumer_lag",
                "Events in the log not yet acknowledged by the group",
                registry=reg,
            ),
            newest_event_time=Gauge(
                "fraud_stream_newest_event_time_seconds",
                "Newest event time applied (epoch seconds)",
                registry=reg,
            ),
            retries=Counter(
                "fraud_stream_retries", "Retries after Redis/log failures", ["step"], registry=reg
            ),
            last_step=Gauge(
                "fraud_stream_last_step_time_seconds",
                "When the updater's loop last completed a step (epoch seconds)",
                registry=reg,
            ),
        )
        # Every known label value at 0 from the start: a series born at its first count
        # looks flat to rate()/increase(), so an alert would miss the first event.
        for outcome in OUTCOMES:
            metrics.events.labels(outcome)
        for step in RETRY_STEPS:
            metrics.retries.labels(step)
        return metrics


# score-stream (streaming/score_stream.py): outcomes and retried steps, each exported at 0.
SCORE_OUTCOMES = ("decided", "dead_letter", "id_reused")
SCORE_RETRY_STEPS = ("poll", "dead_letter", "score", "write", "commit")
EVENT_LAG_BUCKETS = (*LAG_BUCKETS, 120.0, 300.0, 900.0, 3600.0)


@dataclass
class ScoreStreamMetrics:
    """The stream scorer's metrics; its three numbers each on their own:

    * ``fraud_score_stream_event_time_lag_seconds`` (histogram): now minus the event
      time of each decided transaction, when its decision is in the output log;
      ``fraud_score_stream_newest_event_time_seconds``: the newest event time decided.
    * ``fraud_score_stream_queueing_delay_seconds`` (histogram): the time a transaction
      waited at the model boundary for its micro-batch (the budget's share not spent on
      the model); ``fraud_score_stream_boundary_seconds``: queueing plus the batch's
      feature read and inference, against the latency budget (``..._over_budget_total``);
      ``fraud_score_stream_batch_size``.
    * ``fraud_score_stream_commit_interval_seconds`` (histogram): between two commits;
      ``fraud_score_stream_oldest_uncommitted_age_seconds``: how long ago the oldest
      event not yet committed was read (0: none); ``..._last_commit_time_seconds``.

    Besides: ``..._events_total{outcome}``, ``..._in_flight`` and ``..._in_flight_limit``,
    ``..._paused`` (1 while the partitions are paused at the bound), ``..._pauses_total``,
    ``..._retries_total{step}``, ``..._consumer_lag``, ``..._last_step_time_seconds``.
    """

    registry: CollectorRegistry
    events: Counter
    event_lag: Histogram
    newest_event_time: Gauge
    queueing: Histogram
    boundary: Histogram
    over_budget: Counter
    batch_size: Histogram
    commit_interval: Histogram
    oldest_uncommitted: Gauge
    last_commit: Gauge
    in_flight: Gauge
    in_flight_limit: Gauge
    paused: Gauge
    pauses: Counter
    retries: Counter
    consumer_lag: Gauge
    last_step: Gauge
    last_step_s: float = 0.0

    def mark_step(self) -> None:
        """The loop went round just now (what /readyz reads)."""
        self.last_step_s = time.time()
        self.last_step.set(self.last_step_s)

    def observe_boundary(self, spent_s: float, budget_s: float) -> None:
        """One transaction's time at the model boundary (queueing, feature read,
        inference), against the latency budget."""
        self.boundary.observe(spent_s)
        if spent_s > budget_s:
            self.over_budget.inc()

    def on_batch(self, size: int, _compute_s: float, waits: list[float]) -> None:
        """A micro-batch ran at the model (``BatchStats.on_batch``)."""
        self.batch_size.observe(size)
        for w in waits:
            self.queueing.observe(w)

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ScoreStreamMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        p = "fraud_score_stream_"
        m = cls(
            registry=reg,
            events=Counter(p + "events", "Events by outcome", ["outcome"], registry=reg),
            event_lag=Histogram(
                p + "event_time_lag_seconds",
                "Now minus the event time of a decided transaction, at its decision's write",
                buckets=EVENT_LAG_BUCKETS,
                registry=reg,
            ),
            newest_event_time=Gauge(
                p + "newest_event_time_seconds", "Newest event time decided", registry=reg
            ),
            queueing=Histogram(
                p + "queueing_delay_seconds",
                "Time a transaction waited at the model boundary for its micro-batch",
                buckets=LAG_BUCKETS,
                registry=reg,
            ),
            boundary=Histogram(
                p + "boundary_seconds",
                "A transaction's time at the model boundary: queueing, feature read, inference",
                buckets=LAG_BUCKETS,
                registry=reg,
            ),
            over_budget=Counter(
                p + "over_budget",
                "Transactions whose time at the model boundary exceeded the latency budget",
                registry=reg,
            ),
            batch_size=Histogram(
                p + "batch_size",
                "Transactions per micro-batch at the model",
                buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                registry=reg,
            ),
            commit_interval=Histogram(
                p + "commit_interval_seconds",
                "Seconds between two commits",
                buckets=LAG_BUCKETS,
                registry=reg,
            ),
            oldest_uncommitted=Gauge(
                p + "oldest_uncommitted_age_seconds",
                "Seconds since the oldest event not yet committed was read (0: none)",
                registry=reg,
            ),
            last_commit=Gauge(
                p + "last_commit_time_seconds", "When offsets were last committed", registry=reg
            ),
            in_flight=Gauge(p + "in_flight", "Events read and not yet committed", registry=reg),
            in_flight_limit=Gauge(
                p + "in_flight_limit", "The in-flight bound (max_in_flight)", registry=reg
            ),
            paused=Gauge(p + "paused", "1 while reading is paused at the bound", registry=reg),
            pauses=Counter(p + "pauses", "Times reading paused at the bound", registry=reg),
            retries=Counter(p + "retries", "Retried steps", ["step"], registry=reg),
            consumer_lag=Gauge(
                p + "consumer_lag", "Events in the log not yet committed", registry=reg
            ),
            last_step=Gauge(
                p + "last_step_time_seconds", "When the loop last went round", registry=reg
            ),
        )
        for outcome in SCORE_OUTCOMES:
            m.events.labels(outcome)
        for step in SCORE_RETRY_STEPS:
            m.retries.labels(step)
        return m


class Stepping(Protocol):
    """What /readyz and /metrics read of a consumer's metrics."""

    registry: CollectorRegistry
    last_step_s: float


def readiness(
    metrics: Stepping, ping: Callable[[], Any], max_age_s: float = READY_MAX_AGE_S
) -> str | None:
    """Why the updater is not consuming, or None when it is: its loop completed a step
    within ``max_age_s`` (so the event log answered and, for a batch, Redis took it) and
    ``ping`` (the session-state Redis's PING) succeeds now.

    With Kafka, an idle consumer whose brokers are unreachable still completes (empty)
    steps: librdkafka reconnects in the background and reports no error to the poll.
    """
    if metrics.last_step_s == 0.0:
        return "no step completed yet"
    age = time.time() - metrics.last_step_s
    if age > max_age_s:
        return f"last step {age:.0f}s ago (limit {max_age_s:.0f}s): Redis or the log is down"
    try:
        ping()
    except STORE_ERRORS as exc:
        return f"Redis unreachable: {type(exc).__name__}"
    return None


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes and scrapes every few seconds: no access log."""


def serve_http(
    metrics: Stepping,
    port: int,
    ping: Callable[[], Any],
    addr: str = "0.0.0.0",
    max_age_s: float = READY_MAX_AGE_S,
) -> ThreadingWSGIServer:
    """Serve ``/metrics`` (Prometheus) and ``/readyz`` (200 ``consuming``, or 503 with
    the reason from :func:`readiness`) on ``addr:port`` from a daemon thread. Returns the
    server; ``shutdown()`` stops it."""
    prometheus = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/readyz":
            return prometheus(environ, start_response)  # type: ignore[no-any-return]
        reason = readiness(metrics, ping, max_age_s)
        status = "200 OK" if reason is None else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [(reason or "consuming").encode() + b"\n"]

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="updater-http", daemon=True).start()
    return server
