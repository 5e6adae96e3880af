"""Traces as a collector sees them: the real server exports OTLP/HTTP to a receiver in
this process, with a caller's W3C ``traceparent`` on the request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.conftest import World, start_server, stop_server, wait_until
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
            metrics = c.get("/metrics").text

        wanted = {"feature_read", "inference", "decision", "validation", "score"}

        def whole_trace() -> dict[str, dict[str, Any]] | None:
            # Children end (and are exported) before their parents: wait for the root.
            with receiver.lock:
                ours = [s for s in receiver.spans if s["trace_id"] == CALLER_TRACE]
            by_name = {s["name"]: s for s in ours}
            server = [s for s in ours if s["parent"] == CALLER_SPAN]
            return by_name if server and wanted <= by_name.keys() else None

        spans = wait_until(whole_trace, timeout=20, what="the whole exported trace")
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

        assert wait_until(redis_spans, timeout=20, what="a Redis span")
        # The instrumentation's standard HTTP server metrics, ours, never Feast's.
        assert "http_server_request_duration_seconds_bucket" in metrics
        assert "fraud_request_duration_seconds" in metrics
        assert "feast_" not in metrics
    finally:
        stop_server(srv)
