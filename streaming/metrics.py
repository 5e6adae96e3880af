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
* ``fraud_stream_retries_total{step}``: backoff retries while Redis or the log is down.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> UpdaterMetrics:
        """Metrics on ``registry`` (default: a fresh one, so several updaters can coexist)."""
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
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
        )
