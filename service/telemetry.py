"""OpenTelemetry traces and metrics for the scoring service.

Metrics are recorded once, through OpenTelemetry, and exported to Prometheus (served at
``/metrics``); names follow Prometheus base units (``_seconds``, ``_total``).
Traces are off unless ``OTEL_TRACES_EXPORTER`` names an exporter: ``console`` (stdout)
or ``otlp`` (needs ``opentelemetry-exporter-otlp``); ``OTEL_SERVICE_NAME`` and the other
standard ``OTEL_*`` variables apply as usual.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Instruments:
    queue_time: Histogram
    compute_time: Histogram
    batch_size: Histogram
    request_duration: Histogram
    rejections: Counter
    decisions: Counter


_queue_depth: Callable[[], int] | None = None


def observe_queue_depth(depth: Callable[[], int] | None) -> None:
    """Report ``depth()`` (the batcher's queue length) as ``fraud_batch_queue_depth``
    at each scrape; None stops reporting (batching off or shut down)."""
    global _queue_depth
    _queue_depth = depth


def _observe_depth(_options: CallbackOptions) -> Iterable[Observation]:
    return [] if _queue_depth is None else [Observation(_queue_depth())]


@cache
def setup() -> Instruments:
    """Install the process-wide providers once and return the service's instruments."""
    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", "fraud-scoring")}
    )
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=[PrometheusMetricReader()])
    )
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
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)

    m = metrics.get_meter("fraud_scoring.service")
    m.create_observable_gauge(
        "fraud_batch_queue_depth",
        callbacks=[_observe_depth],
        description="Requests waiting in the batcher's queue",
    )
    return Instruments(
        queue_time=m.create_histogram(
            "fraud_batch_queue_time",
            unit="s",
            description="Time a request waited for its batch",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        ),
        compute_time=m.create_histogram(
            "fraud_batch_compute_time",
            unit="s",
            description="Feature read + inference time of one batch",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        ),
        batch_size=m.create_histogram(
            "fraud_batch_size",
            unit="{request}",
            description="Requests per executed batch",
            explicit_bucket_boundaries_advisory=SIZE_BUCKETS,
        ),
        request_duration=m.create_histogram(
            "fraud_request_duration",
            unit="s",
            description="Scoring time per transaction",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        ),
        rejections=m.create_counter(
            "fraud_rejections", description="Requests refused before the model, by reason"
        ),
        decisions=m.create_counter(
            "fraud_decisions", description="Decisions returned, by decision"
        ),
    )


def tracer() -> trace.Tracer:
    return trace.get_tracer("fraud_scoring.service")
