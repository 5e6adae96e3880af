"""Metrics (Prometheus) and traces (OpenTelemetry) for the scoring service.

Metrics are ``prometheus_client`` instruments, created once per process and served at
``/metrics``; the hot path records through label-bound children (:meth:`Instruments.bound`)
and records batch metrics once per micro-batch. With more than one uvicorn worker,
``service.server.serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` before any worker starts:
each worker then writes its values to files there and any worker's ``/metrics`` answers
for all of them (counters and histograms summed, the queue depth summed over live
workers). ``PROMETHEUS_MULTIPROC_DIR`` must be set before ``prometheus_client`` is
imported, which is why the server, not this module, sets it.

Traces are off unless ``OTEL_TRACES_EXPORTER`` names an exporter: ``console`` (stdout)
or ``otlp`` (needs ``opentelemetry-exporter-otlp``); ``OTEL_SERVICE_NAME`` and the other
standard ``OTEL_*`` variables apply as usual.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache, lru_cache

import prometheus_client
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Bound:
    """The per-model-version instruments, labels bound once (cheap to record)."""

    queue_time: Histogram
    compute_time: Histogram
    batch_size: Histogram
    request_duration: Histogram


@dataclass(frozen=True)
class Instruments:
    queue_time: Histogram
    compute_time: Histogram
    batch_size: Histogram
    request_duration: Histogram
    rejections: Counter
    decisions: Counter
    queue_depth: Gauge
    batch_features_present: Gauge
    degraded: Counter

    def bound(self, model_version: str) -> Bound:
        """The instruments labelled with ``model_version`` (cached per version)."""
        return _bind(self, model_version)

    def count_decisions(self, counts: dict[tuple[str, str], int]) -> None:
        """Add ``{(decision, model_version): n}`` to ``fraud_decisions_total``."""
        for (decision, version), n in counts.items():
            self.decisions.labels(decision=decision, model_version=version).inc(n)


@lru_cache(maxsize=16)  # a few versions over a process's life
def _bind(ins: Instruments, model_version: str) -> Bound:
    return Bound(
        ins.queue_time.labels(model_version=model_version),
        ins.compute_time.labels(model_version=model_version),
        ins.batch_size.labels(model_version=model_version),
        ins.request_duration.labels(model_version=model_version),
    )


@cache
def setup() -> Instruments:
    """Create the process's instruments (once) and install the tracer provider when
    ``OTEL_TRACES_EXPORTER`` asks for one."""
    _setup_traces()
    version = ("model_version",)
    return Instruments(
        queue_time=Histogram(
            "fraud_batch_queue_time_seconds",
            "Time a request waited for its batch",
            version,
            buckets=SECONDS_BUCKETS,
        ),
        compute_time=Histogram(
            "fraud_batch_compute_time_seconds",
            "Feature read + inference time of one batch",
            version,
            buckets=SECONDS_BUCKETS,
        ),
        batch_size=Histogram(
            "fraud_batch_size", "Requests per executed batch", version, buckets=SIZE_BUCKETS
        ),
        request_duration=Histogram(
            "fraud_request_duration_seconds",
            "Scoring time per transaction",
            version,
            buckets=SECONDS_BUCKETS,
        ),
        rejections=Counter(
            "fraud_rejections",
            "Requests refused before the model, by reason",
            ("reason", "model_version"),
        ),
        decisions=Counter(
            "fraud_decisions", "Decisions returned, by decision", ("decision", "model_version")
        ),
        # Sampled by the service a few times a second; with several workers, their sum.
        queue_depth=Gauge(
            "fraud_batch_queue_depth",
            "Requests waiting in the batcher's queue",
            multiprocess_mode="livesum",
        ),
        # 1: the batch job's marker for the view is in the store; 0: no batch features.
        batch_features_present=Gauge(
            "fraud_batch_features_present",
            "Whether the online store holds the view's batch features (its marker)",
            ("view",),
            multiprocess_mode="livemin",
        ),
        degraded=Counter(
            "fraud_degraded_decisions",
            "Rules-only decisions (FRAUD_DEGRADED_POLICY=rules), by cause",
            ("cause",),
        ),
    )


def exposition() -> bytes:
    """The ``/metrics`` body: this process's metrics, or every worker's in multiprocess
    mode."""
    if MULTIPROC_ENV in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return prometheus_client.generate_latest(registry)
    return prometheus_client.generate_latest()


def worker_exited() -> None:
    """In multiprocess mode, drop this worker's live gauges (call on shutdown)."""
    if MULTIPROC_ENV in os.environ:
        multiprocess.mark_process_dead(os.getpid())


_tracing = False


def tracing() -> bool:
    """Whether traces are exported; when not, the hot path skips making spans at all."""
    return _tracing


def _setup_traces() -> None:
    global _tracing
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    exporter = None
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore
                OTLPSpanExporter,
            )
        except ImportError:
            log.warning(
                "OTEL_TRACES_EXPORTER=otlp but opentelemetry-exporter-otlp-proto-http "
                "is not installed; traces are off"
            )
        else:
            exporter = OTLPSpanExporter()
    elif exporter_name not in ("none", ""):
        log.warning("unknown OTEL_TRACES_EXPORTER %r; traces are off", exporter_name)
    if exporter is not None:  # else the API's no-op tracer: spans cost nothing
        resource = Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "fraud-scoring")}
        )
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _tracing = True


def tracer() -> trace.Tracer:
    return trace.get_tracer("fraud_scoring.service")
