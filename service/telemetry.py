"""Metrics (Prometheus) and traces (OpenTelemetry) for the scoring service.

Metrics are ``prometheus_client`` instruments, created once per process and served at
``/metrics``; the hot path records through label-bound children (:meth:`Instruments.bound`)
and records batch metrics once per micro-batch. With more than one uvicorn worker,
``service.edge.server.serve`` sets ``PROMETHEUS_MULTIPROC_DIR`` before any worker starts:
each worker then writes its values to files there and any worker's ``/metrics`` answers
for all of them (counters and histograms summed, the queue depth summed over live
workers). ``PROMETHEUS_MULTIPROC_DIR`` must be set before ``prometheus_client`` is
imported, which is why the server, not this module, sets it.

Traces are off unless ``OTEL_TRACES_EXPORTER`` names an exporter: ``console`` (stdout)
or ``otlp`` (OTLP over HTTP/protobuf; ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the other
standard ``OTEL_*`` variables apply as usual). Off, nothing is instrumented and the hot
path makes no spans at all. On, the project (not FastAPI's version) owns the telemetry:

* OpenTelemetry's ASGI middleware is a layer in front of admission (:func:`tracing_layer`;
  the stack keeps its shape, one layer more): one server span per request, refused
  ones included (``http.request.method``, ``http.route``, ``http.response.status_code``)
  continuing the caller's W3C ``traceparent``, and no span per ASGI ``receive``/``send``
  message (``exclude_spans``: they were more than half of all spans);
* redis-py calls are spans (the batch's pipelined feature read, the session writes)
  with the current database conventions: ``db.system.name``, ``db.query.text``,
  ``db.namespace``, ``server.address``, ``server.port`` (:func:`_opt_in_stable_semconv`);
* the resource carries ``service.name`` (``OTEL_SERVICE_NAME``, default
  ``fraud-scoring``) and ``service.version`` (the installed package's version).

gRPC calls (the OIP gRPC server) get the same two (:class:`RpcCalls`): a server span per
call with tracing on, continuing the ``traceparent`` from the call's metadata
(``rpc.system.name``, ``rpc.method``, ``rpc.response.status_code``), and
``rpc_server_call_duration_seconds{rpc_method, rpc_response_status_code}``
(OpenTelemetry's ``rpc.server.call.duration``) tracing on or off.

HTTP server metrics do not depend on tracing: :class:`HttpMetrics`, the app's outermost
layer, records ``http_server_request_duration_seconds`` (OpenTelemetry's
``http.server.request.duration`` as its Prometheus exporter names it: labels
``http_request_method``, ``http_route``, ``http_response_status_code``) with
prometheus_client, tracing on or off and summed over the workers like the rest.

``/metrics`` carries this project's families, the process/platform/GC ones and the HTTP
one; the ``feast_*`` families Feast registers on import (the service never records
them) are left out. This module's labelled counters are exported at 0 from the start for
every label value they can take (a series born at its first count looks flat to
``rate()``): ``service.resources`` zeroes the rejection reasons, the lifespan
(:meth:`Instruments.zero_decisions`) the serving version's decisions, :func:`setup` the
rest.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import metadata
from typing import Any

import numpy as np
import prometheus_client
from opentelemetry import propagate, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.semconv.attributes.db_attributes import DB_NAMESPACE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fraud_scoring.features import batch_features

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# HTTP requests also wait for slow bodies (FRAUD_BODY_TIMEOUT_S) and drains.
HTTP_BUCKETS = (*SECONDS_BUCKETS, 5.0, 10.0)


# Kept observations are added in bulk once a histogram holds this many.
KEEP_AT_MOST = 256


def observe_many(hist: Histogram, values: np.ndarray) -> None:
    """``hist.observe(v)`` for every v, with one bin count: what ``observe`` does per value
    (the first bucket whose upper bound is >= v, and the sum), added in bulk. Reaches into
    prometheus_client's histogram (``_upper_bounds``, ``_buckets``, ``_sum``);
    tests/test_drift.py fails if the library changes them."""
    if len(values) == 0:
        return
    idx = np.searchsorted(hist._upper_bounds, values, side="left")
    counts = np.bincount(idx, minlength=len(hist._upper_bounds))
    for i in np.flatnonzero(counts):
        hist._buckets[i].inc(float(counts[i]))
    hist._sum.inc(float(np.sum(values)))


_SCRAPE_HOOKS: list[Callable[[], None]] = []


def before_scrape(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` before each :func:`exposition` (e.g. to count what a hot path only
    kept aside); returns the function that removes it."""
    _SCRAPE_HOOKS.append(hook)
    return lambda: _SCRAPE_HOOKS.remove(hook)


def flush_kept() -> None:
    """Run every :func:`before_scrape` hook: what hot paths kept aside reaches the metrics
    (:func:`exposition` does it first; the service also calls it once a second)."""
    for hook in list(_SCRAPE_HOOKS):
        hook()


class Kept:
    """One histogram child whose hot-path observations are kept aside and added in bulk
    (:func:`observe_many`): when :func:`keep_at_most` are kept, before each
    :func:`exposition`, and at every :func:`flush_kept` (the service calls it once a
    second). An ``observe`` is a list append instead of prometheus_client's lock, bucket
    search and two increments per value. With several workers nothing is kept."""

    def __init__(self, child: Histogram) -> None:
        self.child = child
        self.values: list[float] = []
        self.at_most = keep_at_most()
        before_scrape(self.flush)  # a few per process (one pair per model version)

    def observe(self, value: float) -> None:
        self.values.append(value)
        if len(self.values) >= self.at_most:
            self.flush()

    def flush(self) -> None:
        values, self.values = self.values, []
        if len(values) == 1:  # nothing kept (several workers): numpy would cost more
            self.child.observe(values[0])
        elif values:
            observe_many(self.child, np.asarray(values, dtype=np.float64))


def keep_at_most() -> int:
    """How many observations a hot path may keep aside: ``KEEP_AT_MOST``, or 1 (none)
    with several workers, where any worker's scrape must already count every worker's
    requests (the values live in shared files; a scrape flushes only its own worker)."""
    return 1 if _multiprocess() else KEEP_AT_MOST


@dataclass(frozen=True)
class Bound:
    """The per-model-version instruments, labels bound once (cheap to record); the two
    recorded per request keep their observations for a bulk add (:class:`Kept`)."""

    queue_time: Kept
    compute_time: Histogram
    batch_size: Histogram
    request_duration: Kept


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
    features_unavailable: Counter
    http_duration: Histogram
    rpc_duration: Histogram

    def bound(self, model_version: str) -> Bound:
        """The instruments labelled with ``model_version`` (cached per version)."""
        return _bind(self, model_version)

    def zero_decisions(self, model_version: str) -> None:
        """Export ``fraud_decisions_total`` at 0 for every decision of ``model_version``
        (the service calls it for the serving version at start; a version first counted
        later gets its other decisions at 0 then)."""
        _zero_decisions(self, model_version)

    def count_decisions(self, counts: dict[tuple[str, str], int]) -> None:
        """Add ``{(decision, model_version): n}`` to ``fraud_decisions_total``."""
        for (decision, version), n in counts.items():
            _zero_decisions(self, version)
            self.decisions.labels(decision=decision, model_version=version).inc(n)

    def count_unavailable(self, missing: Iterable[str], stale: Iterable[str]) -> None:
        """Add a batch's missing and stale feature names (one entry per decision that
        lacked the feature) to ``fraud_features_unavailable_total{feature, state}``."""
        for state, names in (("missing", missing), ("stale", stale)):
            for feature, n in collections.Counter(names).items():
                self.features_unavailable.labels(feature=feature, state=state).inc(n)


@lru_cache(maxsize=16)  # a few versions over a process's life
def _bind(ins: Instruments, model_version: str) -> Bound:
    return Bound(
        Kept(ins.queue_time.labels(model_version=model_version)),
        ins.compute_time.labels(model_version=model_version),
        ins.batch_size.labels(model_version=model_version),
        Kept(ins.request_duration.labels(model_version=model_version)),
    )


# fraud_decisions_total's decisions: service.core.decision.DECISIONS, which this module
# (below the core) cannot import; tests/test_tracing.py checks that they agree.
DECISIONS = ("approve", "review", "decline")


@lru_cache(maxsize=16)  # once per version (labels() on an existing child is harmless)
def _zero_decisions(ins: Instruments, model_version: str) -> None:
    for decision in DECISIONS:
        ins.decisions.labels(decision=decision, model_version=model_version)


# fraud_degraded_decisions_total's causes (service.core.scoring's rules-only modes), each
# exported at 0 from the start: a series born at its first count looks flat to rate(), so
# FraudScoringDegraded would miss the first degraded decisions.
DEGRADED_CAUSES = ("no_batch_features", "feature_store")


@cache
def setup() -> Instruments:
    """Create the process's instruments (once) and install the tracer provider when
    ``OTEL_TRACES_EXPORTER`` asks for one."""
    _setup_traces()
    version = ("model_version",)
    ins = Instruments(
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
        # Per feature: decisions that used its explicit default (missing) or that had
        # it past its view's TTL (stale); the flags each response carries, summed.
        features_unavailable=Counter(
            "fraud_features_unavailable",
            "Decisions made without a feature's value, by feature and state (missing|stale)",
            ("feature", "state"),
        ),
        # OpenTelemetry's http.server.request.duration under the name and labels its
        # Prometheus exporter gives it, recorded by HttpMetrics with tracing on or off.
        http_duration=Histogram(
            "http_server_request_duration_seconds",
            "Duration of HTTP server requests",
            ("http_request_method", "http_route", "http_response_status_code"),
            buckets=HTTP_BUCKETS,
        ),
        # OpenTelemetry's rpc.server.call.duration under its Prometheus name, recorded
        # by RpcCalls for the OIP gRPC server's calls, tracing on or off.
        rpc_duration=Histogram(
            "rpc_server_call_duration_seconds",
            "Duration of RPC server calls",
            ("rpc_method", "rpc_response_status_code"),
            buckets=HTTP_BUCKETS,
        ),
    )
    for cause in DEGRADED_CAUSES:
        ins.degraded.labels(cause=cause)
    # Exported at 0 from the start (an alert on rate() sees the first one): every
    # feature a snapshot can lack.
    for f in batch_features():
        for state in ("missing", "stale"):
            ins.features_unavailable.labels(feature=f.name, state=state)
    return ins


# Families other libraries register on import that this service never records.
_FOREIGN_PREFIXES = ("feast_",)


class _OwnFamilies(Collector):
    """``source``'s families less the foreign ones."""

    def __init__(self, source: Collector) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return (m for m in self._source.collect() if not m.name.startswith(_FOREIGN_PREFIXES))


def _multiprocess() -> bool:
    """Whether prometheus_client keeps values in files (decided once, when it was
    imported). Not the environment variable at scrape time: importing Feast sets
    ``PROMETHEUS_MULTIPROC_DIR`` to a directory of its own, after our metrics exist in
    memory, and reading that directory would answer an empty ``/metrics``."""
    return values.ValueClass is not values.MutexValue


def exposition() -> bytes:
    """The ``/metrics`` body: this process's metrics, or every worker's in multiprocess
    mode; never the ``feast_*`` families."""
    flush_kept()
    registry = CollectorRegistry(auto_describe=False)
    if _multiprocess():
        source = CollectorRegistry()
        multiprocess.MultiProcessCollector(source)
        registry.register(_OwnFamilies(source))
    else:
        registry.register(_OwnFamilies(prometheus_client.REGISTRY))
    return prometheus_client.generate_latest(registry)


def worker_exited() -> None:
    """In multiprocess mode, drop this worker's live gauges (call on shutdown)."""
    if _multiprocess():
        multiprocess.mark_process_dead(os.getpid())


_provider: TracerProvider | None = None


def tracing() -> bool:
    """Whether traces are exported; when not, the hot path skips making spans at all."""
    return _provider is not None


def _service_version() -> str:
    try:
        return metadata.version("fraud-scoring")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _exporter() -> SpanExporter | None:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name not in ("none", ""):
        log.warning("unknown OTEL_TRACES_EXPORTER %r; traces are off", name)
    return None


def _setup_traces() -> None:
    global _provider
    exporter = _exporter()
    if exporter is None:  # the API's no-op tracer; nothing instrumented
        return
    _opt_in_stable_semconv()
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    resource = Resource.create(
        {
            SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "fraud-scoring"),
            SERVICE_VERSION: _service_version(),
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _namespace_inside_pipelines()  # before instrumenting: its span wraps this
    RedisInstrumentor().instrument(
        tracer_provider=provider, request_hook=_redis_namespace, response_hook=_redis_namespace
    )
    _provider = provider


@cache  # once per process
def _namespace_inside_pipelines() -> None:
    """``db.namespace`` on a pipeline's span before it runs, so that one that fails or
    times out carries it too: the instrumentation calls the response hook only after a
    pipeline returned. Wrapped before the instrumentation wraps the same methods, this
    runs inside its span."""
    import redis.asyncio.client
    import redis.client
    from wrapt import wrap_function_wrapper

    def sync(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        _redis_namespace(trace.get_current_span(), instance)
        return wrapped(*args, **kwargs)

    async def asynchronous(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        _redis_namespace(trace.get_current_span(), instance)
        return await wrapped(*args, **kwargs)

    wrap_function_wrapper(redis.client, "Pipeline.execute", sync)
    wrap_function_wrapper(redis.asyncio.client, "Pipeline.execute", asynchronous)


SEMCONV_OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"


def _opt_in_stable_semconv() -> None:
    """Ask the instrumentations for the current semantic conventions, HTTP and database,
    through their own switch (``OTEL_SEMCONV_STABILITY_OPT_IN``), not their old default:
    server spans with ``http.request.method``/``http.response.status_code``, Redis spans
    with ``db.system.name``/``db.query.text`` (``database``) and
    ``server.address``/``server.port``/``network.transport`` (redis reads those under
    ``http``) instead of ``db.system``/``db.statement``/``net.peer.*``. A mode the
    environment already names for a signal (``http/dup``, ``database/dup``: old and new
    names both) stays. The instrumentations read the variable once per process, at
    their first instrumentation: this runs before any."""
    chosen = [m.strip() for m in os.environ.get(SEMCONV_OPT_IN, "").split(",") if m.strip()]
    for signal in ("http", "database"):
        if signal not in chosen and f"{signal}/dup" not in chosen:
            chosen.append(signal)
    os.environ[SEMCONV_OPT_IN] = ",".join(chosen)


def _redis_namespace(span: trace.Span, instance: Any, *_: Any) -> None:
    """``db.namespace`` on a Redis span: the connection's database index, as the current
    conventions put it. opentelemetry-instrumentation-redis (0.66b2) only sets the old
    ``db.redis.database_index``, and only under the old names; everything else comes from
    the library's switch. The request hook (commands; also when the command fails), the
    response hook (pipelines, which get no request hook) and, for a pipeline that fails
    or times out, :func:`_namespace_inside_pipelines` call it. A Redis
    Cluster client has no pool's ``db`` (always 0): nothing is set."""
    if not span.is_recording():
        return
    kwargs = getattr(getattr(instance, "connection_pool", None), "connection_kwargs", None)
    if kwargs is not None:
        span.set_attribute(DB_NAMESPACE, str(kwargs.get("db") or 0))


def tracing_layer(
    span_details: Callable[[Scope], tuple[str, dict[str, str]]],
) -> Callable[[ASGIApp], ASGIApp] | None:
    """With tracing on (``OTEL_TRACES_EXPORTER``), OpenTelemetry's ASGI middleware as a
    layer for the front of the app: a server span per request continuing the
    ``traceparent``, named and attributed by ``span_details(scope)`` (method and route
    template), no span per ASGI ``receive``/``send`` message, no metrics
    (:class:`HttpMetrics` records the HTTP ones, tracing on or off) and the URLs of
    ``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS`` left out. None with tracing off. Sets the
    tracer up if :func:`setup` has not."""
    setup()
    if _provider is None:
        return None
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.util.http import get_excluded_urls

    def layer(app: ASGIApp) -> ASGIApp:
        return OpenTelemetryMiddleware(
            app,
            excluded_urls=get_excluded_urls("FASTAPI"),
            default_span_details=span_details,
            tracer_provider=_provider,
            meter_provider=NoOpMeterProvider(),
            exclude_spans=["receive", "send"],
        )

    return layer


# ASGI's types, as Starlette spells them (this module imports no web framework).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Methods recorded as themselves; any other is "_OTHER" (the conventions' bound on the
# label's values).
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)


class HttpMetrics:
    """Pure ASGI, the app's outermost layer: each HTTP request's duration, from its
    arrival at the app to its last message or its exception, in
    ``http_server_request_duration_seconds{http_request_method, http_route,
    http_response_status_code}``, tracing on or off. ``route_of(scope)``, asked after the
    request, is its route template (None: no route matched; the label is then empty).
    The status is the one sent, 500 when the app raised before answering (uvicorn then
    answers 500). The observations are kept for a bulk add per label set (:class:`Kept`):
    a list append per request, plus a wrapped ``send``."""

    def __init__(self, app: ASGIApp, route_of: Callable[[Scope], str | None]) -> None:
        self.app = app
        self.route_of = route_of
        self.histogram = setup().http_duration
        self.children: dict[tuple[str, str, int], Kept] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._observe(scope, status, time.perf_counter() - start)

    def _observe(self, scope: Scope, status: int, seconds: float) -> None:
        method = scope["method"]
        key = (
            method if method in HTTP_METHODS else "_OTHER",
            self.route_of(scope) or "",
            status,
        )
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = Kept(
                self.histogram.labels(
                    http_request_method=key[0], http_route=key[1], http_response_status_code=status
                )
            )
        child.observe(seconds)


def tracer() -> trace.Tracer:
    return trace.get_tracer("fraud_scoring.service")


# gRPC status codes a server span marks as errors (OpenTelemetry's gRPC conventions: the
# server's failures; the others are the caller's).
RPC_SERVER_ERRORS = frozenset(
    ("UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS")
)


@dataclass
class RpcOutcome:
    """How a call ended, set by the server's handler: the gRPC status code's name."""

    code: str = "OK"


class RpcCalls:
    """RPC server calls' telemetry, tracing on or off: each call's duration in
    ``rpc_server_call_duration_seconds{rpc_method, rpc_response_status_code}`` and, with
    tracing on, a server span named after the method that continues the caller's W3C
    ``traceparent`` from the call's metadata (the current RPC conventions:
    ``rpc.system.name``, ``rpc.method``, ``rpc.response.status_code``; an error status
    for :data:`RPC_SERVER_ERRORS`). ``system``: ``rpc.system.name`` (``grpc``)."""

    def __init__(self, system: str = "grpc") -> None:
        self.system = system
        self.histogram = setup().rpc_duration
        self.children: dict[tuple[str, str], Kept] = {}

    @contextlib.contextmanager
    def call(self, method: str, metadata: Mapping[str, str]) -> Iterator[RpcOutcome]:
        """The block is the call of ``method`` (``package.Service/Method``) whose
        metadata (names lower-case) is ``metadata``; the block sets the yielded outcome's
        ``code`` when the call does not end OK."""
        outcome = RpcOutcome()
        start = time.perf_counter()
        span_of: contextlib.AbstractContextManager[trace.Span | None] = contextlib.nullcontext()
        if _provider is not None:
            span_of = tracer().start_as_current_span(
                method,
                context=propagate.extract(metadata),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system.name": self.system, "rpc.method": method},
                # The outcome is the status code, not the exception that carries it.
                record_exception=False,
                set_status_on_exception=False,
            )
        try:
            with span_of as span:
                try:
                    yield outcome
                finally:
                    if span is not None:
                        span.set_attribute("rpc.response.status_code", outcome.code)
                        if outcome.code in RPC_SERVER_ERRORS:
                            span.set_attribute("error.type", outcome.code)
                            span.set_status(trace.StatusCode.ERROR)
        finally:
            self._observe(method, outcome.code, time.perf_counter() - start)

    def _observe(self, method: str, code: str, seconds: float) -> None:
        key = (method, code)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = Kept(
                self.histogram.labels(rpc_method=method, rpc_response_status_code=code)
            )
        child.observe(seconds)
