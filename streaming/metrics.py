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
from typing import Any
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


def readiness(
    metrics: UpdaterMetrics, ping: Callable[[], Any], max_age_s: float = READY_MAX_AGE_S
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
    metrics: UpdaterMetrics,
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
