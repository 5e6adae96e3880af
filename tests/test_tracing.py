"""Traces as a collector sees them: the real server exports OTLP/HTTP to a receiver in
this process, with a caller's W3C ``traceparent`` on the request; and the telemetry that
does not depend on tracing (HTTP server metrics, counters exported at 0 from the start).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from fraud_scoring.features import batch_features
from service import telemetry
from service.core.decision import DECISIONS
from service.errors import RejectReason
from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_service import TXN

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP (protobuf) trace receiver: every exported span, with its resource."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        found = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "resource": resource,
                            "scope": ss.scope.name,
                        }
                    )
        with self.server.lock:
            self.server.spans.extend(found)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: not the test's output
        pass


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.serve_forever, daemon=True)
    thread.start()
    yield r
    r.shutdown()
    r.server_close()


def test_trace_continues_the_callers_and_nests_the_stages(
    world: World, tmp_path: Path, receiver: Receiver
) -> None:
    srv = start_server(
        world,
        tmp_path,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_port}",
        OTEL_BSP_SCHEDULE_DELAY="50",
        OTEL_SERVICE_NAME="fraud-scoring-test",
    )
    try:
        with srv.client() as c:
            r = c.post(
                "/v1/score",
                json={**TXN, "transaction_id": "traced"},
                headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
            )
            assert r.status_code == 200, r.text

        wanted = {"feature_read", "inference", "decision", "validation", "score"}

        def whole_trace() -> dict[str, dict[str, Any]] | None:
            # Children end (and are exported) before their parents: wait for the root.
            with receiver.lock:
                ours = [s for s in receiver.spans if s["trace_id"] == CALLER_TRACE]
            by_name = {s["name"]: s for s in ours}
            server = [s for s in ours if s["parent"] == CALLER_SPAN]
            return by_name if server and wanted <= by_name.keys() else None

        spans = wait_until(whole_trace, timeout=20, what="the whole exported trace")
        # No span per ASGI message ("POST /v1/score http send" and the like): the
        # request's trace is the server span and the project's own.
        with receiver.lock:
            ours = [s for s in receiver.spans if s["trace_id"] == CALLER_TRACE]
        asgi_events = [
            s["name"]
            for s in ours
            if "asgi.event.type" in s["attributes"] or s["name"].endswith((" send", " receive"))
        ]
        assert asgi_events == []
        assert len(ours) == len(spans)  # one span per name
        # The server span continues the caller's trace, with the HTTP attributes.
        (server,) = [s for s in spans.values() if s["parent"] == CALLER_SPAN]
        assert server["name"] == "POST /v1/score"
        assert server["attributes"]["http.request.method"] == "POST"
        assert server["attributes"]["http.route"] == "/v1/score"
        assert server["attributes"]["http.response.status_code"] == 200
        assert server["resource"]["service.name"] == "fraud-scoring-test"
        assert server["resource"]["service.version"]
        # score inside the server span, each stage inside score, in time as well.
        score = spans["score"]
        assert score["parent"] == server["span_id"]
        assert score["attributes"]["transaction_id"] == "traced"
        assert score["attributes"]["decision"] == r.json()["decision"]
        for parent, child in [(server, score)] + [(score, spans[n]) for n in wanted - {"score"}]:
            assert child["parent"] == parent["span_id"], child["name"]
            assert parent["start"] <= child["start"] <= child["end"] <= parent["end"], child["name"]

        # Redis calls are spans too (the batch's feature read runs in its own trace).
        def redis_spans() -> list[dict[str, Any]] | None:
            with receiver.lock:
                got = [s for s in receiver.spans if "redis" in s["scope"]]
            return got or None

        # With the current database conventions, not the old names.
        for span in wait_until(redis_spans, timeout=20, what="a Redis span"):
            attrs = span["attributes"]
            assert attrs["db.system.name"] == "redis", span
            assert attrs["db.query.text"], span  # the command, its arguments as "?"
            assert attrs["db.namespace"] == "0", span
            assert attrs["server.address"] and attrs["server.port"] > 0, span
            old = {"db.system", "db.statement", "db.redis.database_index"}
            old |= {"net.peer.name", "net.peer.port", "net.transport"}
            assert old.isdisjoint(attrs), span
        # The HTTP server metric (once: the instrumentation records none of its own),
        # ours, never Feast's.
        metrics = _scrape_when(srv, {"http_server_request_duration_seconds_count": SCORED})
        assert metrics.count("# TYPE http_server_request_duration_seconds histogram") == 1
        assert "fraud_request_duration_seconds" in metrics
        assert "feast_" not in metrics
    finally:
        stop_server(srv)


def test_grpc_call_is_a_server_span_continuing_the_callers(
    world: World, tmp_path: Path, receiver: Receiver
) -> None:
    """An OIP gRPC call with ``traceparent`` metadata is a server span in the caller's
    trace, with the current RPC attributes; a refused call's span carries its code."""
    import numpy as np
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    from fraud_scoring.model_repo import load_metadata, resolve
    from fraud_scoring.redis_server import free_port

    port = free_port()
    srv = start_server(
        world,
        tmp_path,
        FRAUD_GRPC_PORT=str(port),
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.server_port}",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    meta = load_metadata(resolve(world.model_repo, "fraud"))
    client = tgrpc.InferenceServerClient(url=f"127.0.0.1:{port}")
    traced = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    try:
        x = np.zeros((2, len(meta.features)), dtype=np.float32)
        inp = tgrpc.InferInput(meta.input_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer("fraud", [inp], headers=traced)
        with pytest.raises(InferenceServerException):
            client.infer("other", [inp], headers=traced)

        def server_spans() -> list[dict[str, Any]] | None:
            with receiver.lock:
                ours = [s for s in receiver.spans if s["trace_id"] == CALLER_TRACE]
            return ours if len(ours) >= 2 else None

        spans = wait_until(server_spans, timeout=20, what="the gRPC calls' spans")
        assert len(spans) == 2, spans
        by_code = {s["attributes"]["rpc.response.status_code"]: s for s in spans}
        assert by_code.keys() == {"OK", "NOT_FOUND"}
        for span in spans:
            assert span["name"] == "inference.GRPCInferenceService/ModelInfer"
            assert span["parent"] == CALLER_SPAN
            assert span["attributes"]["rpc.system.name"] == "grpc"
            assert span["attributes"]["rpc.method"] == span["name"]
            assert "error.type" not in span["attributes"]  # the caller's fault
    finally:
        client.close()
        stop_server(srv)


SCORED = {
    "http_request_method": "POST",
    "http_route": "/v1/score",
    "http_response_status_code": "200",
}


def _sample(text: str, name: str, labels: dict[str, str]) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name:
            have = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
            if labels.items() <= have.items():
                found.append(float(m[3]))
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _scrape_when(srv: Server, wanted: dict[str, dict[str, str]]) -> str:
    """``/metrics`` once each ``{name: labels}`` sample is 1: a request's duration is
    recorded when the app returns, which can be just after its client has the answer."""

    def scrape() -> str:
        with srv.client() as c:
            text = c.get("/metrics").text
        http = [line for line in text.splitlines() if line.startswith("http_server_request_d")]
        http = [line for line in http if "_count" in line]  # what failed shows these
        for name, labels in wanted.items():
            assert _sample(text, name, labels) == 1, (name, labels, http)
        return text

    text: str = wait_until(scrape, timeout=10, what="the request's metrics")
    return text


def test_http_metrics_and_zeroed_counters_without_tracing(world: World, tmp_path: Path) -> None:
    """Tracing off: the counters are at 0 before anything happened, and /metrics carries
    the HTTP server metric (it came from the tracing instrumentation only)."""
    srv = start_server(world, tmp_path, OTEL_TRACES_EXPORTER="none")
    try:
        with srv.client() as c:
            before = c.get("/metrics").text
            # Every known label value of every labelled counter, at 0.
            version = {"model_version": "1"}
            for decision in DECISIONS:
                labels = {"decision": decision, **version}
                assert _sample(before, "fraud_decisions_total", labels) == 0, decision
            for reason in RejectReason:
                if reason is not RejectReason.NOT_READY:  # never counted
                    labels = {"reason": reason.value, **version}
                    assert _sample(before, "fraud_rejections_total", labels) == 0, reason
            for cause in telemetry.DEGRADED_CAUSES:
                labels = {"cause": cause}
                assert _sample(before, "fraud_degraded_decisions_total", labels) == 0, cause
            for feature in batch_features():
                for state in ("missing", "stale"):
                    labels = {"feature": feature.name, "state": state}
                    assert _sample(before, "fraud_features_unavailable_total", labels) == 0
            for source in ("chargeback", "analyst", "customer"):
                for matched in ("true", "false"):
                    labels = {"source": source, "matched": matched}
                    assert _sample(before, "fraud_feedback_labels_total", labels) == 0
            # And the unlabelled counters of rare events.
            for rare in (
                "fraud_backdated_transactions_total",
                "fraud_declared_reads_inexact_total",
                "fraud_id_reused_total",
            ):
                assert _sample(before, rare, {}) == 0, rare
            assert _sample(before, "http_server_request_duration_seconds_count", SCORED) is None

            r = c.post("/v1/score", json={**TXN, "transaction_id": "untraced"})
            assert r.status_code == 200, r.text
            unknown_model = c.get("/v2/models/none-such")
            assert c.get("/no-such-page").status_code == 404
            assert c.get("/readyz").status_code == 200
        duration = "http_server_request_duration_seconds_count"
        after = _scrape_when(srv, {duration: SCORED})
        decided = {"decision": r.json()["decision"], "model_version": "1"}
        assert _sample(after, "fraud_decisions_total", decided) == 1
        ready = {"http_request_method": "GET", "http_route": "/readyz"}
        ready_ok = _sample(after, duration, {**ready, "http_response_status_code": "200"})
        assert ready_ok is not None and ready_ok >= 1  # the start's wait asked it too
        # A 404 has no route (the label is empty, not the path: no unbounded values).
        unmatched = {"http_route": "", "http_response_status_code": "404"}
        assert _sample(after, duration, unmatched) == 1
        assert "/no-such-page" not in after
        # A route with a parameter is labelled with its template, not the path.
        model = {"http_request_method": "GET", "http_route": "/v2/models/{name}"}
        status = str(unknown_model.status_code)
        assert _sample(after, duration, {**model, "http_response_status_code": status}) == 1
        assert "none-such" not in after
        assert "# TYPE http_server_request_duration_seconds histogram" in after
    finally:
        stop_server(srv)


def test_labelled_counters_start_at_zero_for_every_known_value() -> None:
    """The challenger's error reasons (once a challenger is configured), the feedback
    labels' sources and matches, the updater's retry steps: each at 0 when its counter is
    made, so rate()/increase() see the first event."""
    import inspect
    import typing

    from service.core import challenger
    from service.edge import feedback
    from streaming import updater
    from streaming.metrics import RETRY_STEPS, UpdaterMetrics

    challenger._instruments()
    for reason in challenger.ERROR_REASONS:
        labels = {"reason": reason}
        got = prometheus_client.REGISTRY.get_sample_value("fraud_challenger_errors_total", labels)
        assert got is not None, reason
    feedback.zero_counters()
    for source in typing.get_args(feedback.Source):
        labels = {"source": source, "matched": "false"}
        got = prometheus_client.REGISTRY.get_sample_value("fraud_feedback_labels_total", labels)
        assert got is not None, source
    metrics = UpdaterMetrics.create()
    for step in RETRY_STEPS:
        got = metrics.registry.get_sample_value("fraud_stream_retries_total", {"step": step})
        assert got == 0, step
    # The steps the updater retries are the ones zeroed.
    retried = re.findall(r'self\._retry\("(\w+)"', inspect.getsource(updater.Updater))
    assert sorted(retried) == sorted(RETRY_STEPS)


def test_decisions_named_as_the_core_names_them() -> None:
    assert telemetry.DECISIONS == DECISIONS


def test_http_metrics_layer_counts_failures_and_bounds_methods() -> None:
    """The layer itself: an app that raises before answering is a 500 (what uvicorn
    answers), an unknown method is _OTHER, a non-HTTP scope passes untouched."""
    calls: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        calls.append(scope["type"])
        if scope["type"] != "http":
            return
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    layer = telemetry.HttpMetrics(app, route_of=lambda scope: "/layer-test" + scope["path"])

    async def send(message: Any) -> None:
        pass

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def run() -> None:
        await layer({"type": "http", "method": "BREW", "path": "/ok"}, receive, send)
        with pytest.raises(RuntimeError):
            await layer({"type": "http", "method": "GET", "path": "/boom"}, receive, send)
        await layer({"type": "lifespan"}, receive, send)

    asyncio.run(run())
    assert calls == ["http", "http", "lifespan"]
    telemetry.flush_kept()

    def count(method: str, route: str, status: str) -> float | None:
        return prometheus_client.REGISTRY.get_sample_value(
            "http_server_request_duration_seconds_count",
            {
                "http_request_method": method,
                "http_route": route,
                "http_response_status_code": status,
            },
        )

    assert count("_OTHER", "/layer-test/ok", "204") == 1
    assert count("GET", "/layer-test/boom", "500") == 1


# Run in a process of its own: the instrumentation patches redis-py for the whole process.
_FAILING_PIPELINES = """
import asyncio, sys
import redis, redis.asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service import telemetry

exported = InMemorySpanExporter()
telemetry._exporter = lambda: exported  # the service's tracing, exported in memory
telemetry._setup_traces()
url = sys.argv[1]

async def failing() -> None:
    client = redis.asyncio.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("EVALSHA", "0" * 40, 0)  # no such script: the pipeline raises
    try:
        await pipe.execute()
    except redis.exceptions.NoScriptError:
        pass
    pipe = client.pipeline(transaction=False)
    pipe.get("x")
    try:
        async with asyncio.timeout(0):  # cancelled inside: times out
            await pipe.execute()
    except TimeoutError:
        pass
    await client.aclose()

asyncio.run(failing())
pipe = redis.Redis.from_url(url).pipeline(transaction=False)
pipe.execute_command("EVALSHA", "0" * 40, 0)
try:
    pipe.execute()
except redis.exceptions.NoScriptError:
    pass
telemetry._provider.force_flush()
for span in exported.get_finished_spans():
    print(span.name, span.attributes.get("db.namespace"))
"""


def test_a_failed_or_timed_out_pipeline_span_names_its_database(redis_server: str) -> None:
    """The instrumentation calls the response hook only after a pipeline returned: a
    pipeline that fails (a script the server lost) or times out carries db.namespace
    all the same (on a slow machine, the one span without it failed the test above)."""
    url = redis_server.rsplit("/", 1)[0] + "/5"
    out = subprocess.run(
        [sys.executable, "-c", _FAILING_PIPELINES, url],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    spans = [line.split() for line in out.splitlines() if line.startswith(("EVALSHA", "GET"))]
    assert len(spans) == 3, out
    assert all(ns == "5" for _, ns in spans), out
