"""The Open Inference Protocol v2 over gRPC (service/edge/oip_grpc.py): Triton's real
client (``tritonclient.grpc``) and plain gRPC calls against ``fraud-scoring serve`` with
FRAUD_GRPC_PORT set, keys on. The model path is REST's: the same answers, the same
refusals (as status codes), the same counting in ``fraud_rejections_total``."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from google.protobuf.message import Message
from tritonclient.utils import InferenceServerException

from batch_jobs.batch import mark_materialized
from fraud_scoring.model_repo import ModelMetadata, load_metadata, resolve
from fraud_scoring.redis_server import embedded_redis, free_port
from service.edge.auth import KeyEntry, Scope, append_key, new_key
from service.edge.proto import grpc_predict_v2_pb2 as pb
from tests.conftest import (
    Server,
    World,
    mark_declared,
    paused,
    rejections,
    start_server,
    stop_server,
    wait_until,
)
from tests.test_service import TXN

SERVICE = "/inference.GRPCInferenceService/"
PROJECT = "fraud_scoring"  # feature_repo/feature_store.yaml


@dataclass
class GrpcServer:
    server: Server
    address: str  # host:port of the gRPC server
    score_key: str
    metrics_key: str

    def client(self) -> tgrpc.InferenceServerClient:
        return tgrpc.InferenceServerClient(url=self.address)

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.score_key}"}

    def metrics(self) -> str:
        headers = self.auth(self.metrics_key)
        return httpx.get(self.server.url + "/metrics", headers=headers, timeout=10).text


def _keys(path: Path) -> tuple[str, str]:
    made = []
    for key_id, scope in (("scorer", Scope.SCORE), ("scraper", Scope.METRICS)):
        key, digest = new_key(key_id)
        append_key(path, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({scope})))
        made.append(key)
    return made[0], made[1]


@pytest.fixture(scope="module")
def grpc_server(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    tmp = tmp_path_factory.mktemp("grpc")
    score_key, metrics_key = _keys(tmp / "keys.jsonl")
    port = free_port()
    srv = start_server(
        world,
        tmp,
        FRAUD_GRPC_PORT=str(port),
        FRAUD_AUTH="required",
        FRAUD_API_KEYS_FILE=str(tmp / "keys.jsonl"),
    )
    yield GrpcServer(srv, f"127.0.0.1:{port}", score_key, metrics_key)
    stop_server(srv)


@pytest.fixture(scope="module")
def meta(world: World) -> ModelMetadata:
    return load_metadata(resolve(world.model_repo, "fraud"))


def _onnx(world: World, meta: ModelMetadata, x: np.ndarray) -> np.ndarray:
    path = resolve(world.model_repo, "fraud") / "model.onnx"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out: np.ndarray = session.run([meta.output_name], {meta.input_name: x})[0][:, 1]
    return out


def _rows(meta: ModelMetadata, n: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(0, 50, size=(n, len(meta.features))).astype(np.float32)


def _infer_input(meta: ModelMetadata, x: np.ndarray) -> tgrpc.InferInput:
    inp = tgrpc.InferInput(meta.input_name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _status(exc: pytest.ExceptionInfo[InferenceServerException]) -> str:
    status: str = exc.value.status()
    return status.removeprefix("StatusCode.")


def test_tritonclient_grpc_reaches_the_model(
    grpc_server: GrpcServer, world: World, meta: ModelMetadata
) -> None:
    """Health, metadata and inference over gRPC; the scores are ONNX Runtime's on the
    same model file and the REST protocol's (binary tensors) to the bit."""
    client, headers = grpc_server.client(), grpc_server.auth()
    try:
        # Server health and metadata are open, like their REST twins.
        assert client.is_server_live() and client.is_server_ready()
        server_md = client.get_server_metadata(as_json=True)
        assert server_md["name"] == "fraud-scoring" and server_md["version"]
        assert client.is_model_ready("fraud", headers=headers)
        assert client.is_model_ready("fraud", meta.version, headers=headers)
        md = client.get_model_metadata("fraud", headers=headers, as_json=True)
        n = len(meta.features)
        assert md["versions"] == [meta.version] and md["platform"] == "onnxruntime_onnx"
        shape = ["-1", str(n)]  # int64 in JSON form: strings
        assert md["inputs"] == [{"name": meta.input_name, "datatype": "FP32", "shape": shape}]
        assert md["outputs"] == [{"name": meta.output_name, "datatype": "FP32", "shape": ["-1"]}]

        x = _rows(meta, 5)
        out = tgrpc.InferRequestedOutput(meta.output_name)
        result = client.infer(
            "fraud", [_infer_input(meta, x)], outputs=[out], request_id="g-1", headers=headers
        )
        got = result.as_numpy(meta.output_name)
        assert got is not None and got.dtype == np.float32 and got.shape == (5,)
        np.testing.assert_allclose(got, _onnx(world, meta, x), rtol=1e-6)
        response = result.get_response()
        assert response.id == "g-1" and response.model_version == meta.version
        # No outputs named: all of them (the one).
        plain = client.infer("fraud", [_infer_input(meta, x)], headers=headers)
        np.testing.assert_array_equal(plain.as_numpy(meta.output_name), got)
        versioned = client.infer(
            "fraud", [_infer_input(meta, x)], model_version=meta.version, headers=headers
        )
        np.testing.assert_array_equal(versioned.as_numpy(meta.output_name), got)
    finally:
        client.close()

    rest = thttp.InferenceServerClient(url=grpc_server.server.url.removeprefix("http://"))
    try:
        inp = thttp.InferInput(meta.input_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        over_rest = rest.infer("fraud", [inp], headers=headers)
        np.testing.assert_array_equal(over_rest.as_numpy(meta.output_name), got)
    finally:
        rest.close()


def test_refusals_are_status_codes_naming_the_field(
    grpc_server: GrpcServer, meta: ModelMetadata
) -> None:
    client, headers = grpc_server.client(), grpc_server.auth()
    n = len(meta.features)
    x = _rows(meta, 2)
    try:
        cases: list[tuple[str, str, dict[str, object]]] = [
            ("NOT_FOUND", "unknown model 'other'", {"model_name": "other"}),
            ("NOT_FOUND", "version '999' is not served", {"model_version": "999"}),
        ]
        for code, message, kwargs in cases:
            with pytest.raises(InferenceServerException, match=message) as exc:
                client.infer(
                    str(kwargs.get("model_name", "fraud")),
                    [_infer_input(meta, x)],
                    model_version=str(kwargs.get("model_version", "")),
                    headers=headers,
                )
            assert _status(exc) == code
        with pytest.raises(InferenceServerException, match="unknown model") as exc:
            client.get_model_metadata("other", headers=headers)
        assert _status(exc) == "NOT_FOUND"
        with pytest.raises(InferenceServerException, match="not served") as exc:
            client.is_model_ready("fraud", "999", headers=headers)
        assert _status(exc) == "NOT_FOUND"

        bad = _infer_input(meta, x[:, : n - 1])
        with pytest.raises(InferenceServerException, match=rf"shape must be \[n, {n}\]") as exc:
            client.infer("fraud", [bad], headers=headers)
        assert _status(exc) == "INVALID_ARGUMENT"
        nan = x.copy()
        nan[1, 2] = np.nan
        element = rf"element {n + 2} \(row 1, column 2: '{meta.feature_names[2]}'\) is NaN"
        with pytest.raises(InferenceServerException, match=element) as exc:
            client.infer("fraud", [_infer_input(meta, nan)], headers=headers)
        assert _status(exc) == "INVALID_ARGUMENT"
        inf = x.copy()
        inf[0, 0] = np.inf
        with pytest.raises(InferenceServerException, match=r"element 0 .* is infinite"):
            client.infer("fraud", [_infer_input(meta, inf)], headers=headers)
        wrong_type = tgrpc.InferInput(meta.input_name, [2, n], "FP64")
        wrong_type.set_data_from_numpy(x.astype(np.float64))
        with pytest.raises(InferenceServerException, match="datatype must be FP32") as exc:
            client.infer("fraud", [wrong_type], headers=headers)
        assert _status(exc) == "INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="output 'nope' unknown") as exc:
            client.infer(
                "fraud",
                [_infer_input(meta, x)],
                outputs=[tgrpc.InferRequestedOutput("nope")],
                headers=headers,
            )
        assert _status(exc) == "INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="x-request-timeout-ms") as exc:
            client.infer(
                "fraud",
                [_infer_input(meta, x)],
                headers={**headers, "x-request-timeout-ms": "nope"},
            )
        assert _status(exc) == "INVALID_ARGUMENT"

        # The score scope, from metadata.
        with pytest.raises(InferenceServerException, match="missing API key") as exc:
            client.infer("fraud", [_infer_input(meta, x)])
        assert _status(exc) == "UNAUTHENTICATED"
        with pytest.raises(InferenceServerException, match="invalid API key") as exc:
            client.get_model_metadata("fraud", headers=grpc_server.auth("scorer.forged"))
        assert _status(exc) == "UNAUTHENTICATED"
        scraper = grpc_server.auth(grpc_server.metrics_key)
        with pytest.raises(InferenceServerException, match="lacks scope 'score'") as exc:
            client.infer("fraud", [_infer_input(meta, x)], headers=scraper)
        assert _status(exc) == "PERMISSION_DENIED"
        assert client.is_server_ready(headers=scraper)  # health stays open

        # A deadline the model cannot meet: DEADLINE_EXCEEDED, counted as on REST.
        before = grpc_server.metrics()
        past = sum(rejections(before, r) for r in ("timeout", "deadline"))
        with pytest.raises(InferenceServerException, match="deadline exceeded") as exc:
            client.infer(
                "fraud",
                [_infer_input(meta, _rows(meta, 64))],
                headers={**headers, "x-request-timeout-ms": "0.001"},
            )
        assert _status(exc) == "DEADLINE_EXCEEDED"
        after = grpc_server.metrics()
        assert sum(rejections(after, r) for r in ("timeout", "deadline")) == past + 1
    finally:
        client.close()


def test_each_call_is_timed_by_method_and_status(
    grpc_server: GrpcServer, meta: ModelMetadata
) -> None:
    """``rpc_server_call_duration_seconds{rpc_method, rpc_response_status_code}``: one
    observation per call, under the full method name and the status code's name."""
    from tests.test_tracing import _sample

    infer = {"rpc_method": "inference.GRPCInferenceService/ModelInfer"}
    ok, bad = (
        {**infer, "rpc_response_status_code": "OK"},
        {
            **infer,
            "rpc_response_status_code": "INVALID_ARGUMENT",
        },
    )
    name = "rpc_server_call_duration_seconds_count"
    before = grpc_server.metrics()
    client, headers = grpc_server.client(), grpc_server.auth()
    try:
        x = _rows(meta, 2)
        for _ in range(3):
            client.infer("fraud", [_infer_input(meta, x)], headers=headers)
        with pytest.raises(InferenceServerException):
            client.infer("fraud", [_infer_input(meta, x[:, :1])], headers=headers)
        assert client.is_server_live()
    finally:
        client.close()
    after = grpc_server.metrics()
    assert (_sample(after, name, ok) or 0) == (_sample(before, name, ok) or 0) + 3
    assert (_sample(after, name, bad) or 0) == (_sample(before, name, bad) or 0) + 1
    live = {"rpc_method": "inference.GRPCInferenceService/ServerLive"}
    assert (_sample(after, name, {**live, "rpc_response_status_code": "OK"}) or 0) >= 1
    assert "# TYPE rpc_server_call_duration_seconds histogram" in after


def _call(channel: grpc.Channel, method: str, response: Any, request: Message, **kw: Any) -> Any:
    """``method`` called plainly, with this repo's own messages."""
    stub = channel.unary_unary(
        SERVICE + method,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response.FromString,
    )
    return stub(request, **kw)


def _raw_call(channel: grpc.Channel, method: str, body: bytes, **kw: Any) -> Any:
    """``method`` called with ``body`` as the request's bytes, as sent."""
    stub = channel.unary_unary(SERVICE + method, response_deserializer=lambda b: b)
    return stub(body, **kw)


def test_an_undecodable_request_is_invalid_argument_counted_and_logged_once(
    grpc_server: GrpcServer,
) -> None:
    """Bytes that do not parse as the call's message: ``INVALID_ARGUMENT`` (not grpc's
    ``UNKNOWN``), after the key check (no key: ``UNAUTHENTICATED``), timed under its
    code in ``rpc_server_call_duration_seconds``, and logged as one WARNING line with no
    traceback, however many arrive within a minute."""
    from tests.test_tracing import _sample

    name = "rpc_server_call_duration_seconds_count"

    def invalid(method: str) -> dict[str, str]:
        return {
            "rpc_method": f"inference.GRPCInferenceService/{method}",
            "rpc_response_status_code": "INVALID_ARGUMENT",
        }

    garbage = b"\xff\xff\xff"
    log_from = grpc_server.server.log.stat().st_size
    before = grpc_server.metrics()
    metadata = tuple(grpc_server.auth().items())
    with grpc.insecure_channel(grpc_server.address) as channel:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as exc:
                _raw_call(channel, "ModelInfer", garbage, metadata=metadata)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert exc.value.details() == (
                "the request does not parse as inference.ModelInferRequest (protobuf)"
            )
        with pytest.raises(grpc.RpcError) as exc:  # the open calls parse after no key
            _raw_call(channel, "ServerLive", garbage)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as exc:  # the key first: nothing parsed without
            _raw_call(channel, "ModelInfer", garbage)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The server still answers well-formed calls.
        live = _call(channel, "ServerLive", pb.ServerLiveResponse, pb.ServerLiveRequest())
        assert live.live is True
    after = grpc_server.metrics()
    assert _sample(after, name, invalid("ModelInfer")) == (
        (_sample(before, name, invalid("ModelInfer")) or 0) + 3
    )
    assert _sample(after, name, invalid("ServerLive")) == (
        (_sample(before, name, invalid("ServerLive")) or 0) + 1
    )

    def logged() -> str:
        with grpc_server.server.log.open("rb") as f:
            f.seek(log_from)
            text = f.read().decode()
        return text if "does not parse as" in text else ""

    text = wait_until(logged, timeout=10, what="the undecodable request's log line")
    lines = [line for line in text.splitlines() if "does not parse as" in line]
    assert len(lines) == 1, lines  # four calls, one line within the minute
    assert "WARNING" in lines[0] and "inference.ModelInferRequest" in lines[0]
    assert "Traceback" not in text and "ERROR" not in text, text


def test_undecodable_warnings_are_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At most one line per interval; the next says how many were not logged."""
    from service.edge.oip_grpc import Throttled

    now = [1000.0]
    throttled = Throttled(60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="service.edge.oip_grpc"):
        assert throttled.warning("bad %s", "one")
        now[0] += 30
        assert not throttled.warning("bad %s", "two")
        assert not throttled.warning("bad %s", "three")
        now[0] += 30
        assert throttled.warning("bad %s", "four")
        now[0] += 1
        assert not throttled.warning("bad %s", "five")
    assert [r.getMessage() for r in caplog.records] == [
        "bad one",
        "bad four (2 more since the last such line, not logged)",
    ]
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in caplog.records)


def test_long_values_are_cut_in_refusals(grpc_server: GrpcServer, meta: ModelMetadata) -> None:
    """A 10,000-character datatype (or header, or metadata value) is refused with a short
    message, over gRPC (where a whole echo would pass the status metadata's 8 KiB and
    reach the client as RESOURCE_EXHAUSTED) and over HTTP (/v2 and /v1)."""
    from service.errors import ECHO_LIMIT, MESSAGE_LIMIT, bounded

    long_type = "X" * 10_000
    n = len(meta.features)
    x = _rows(meta, 1)
    headers = grpc_server.auth()
    metadata = tuple(headers.items())
    Tensor = pb.ModelInferRequest.InferInputTensor
    odd = pb.ModelInferRequest(
        model_name="fraud",
        inputs=[Tensor(name=meta.input_name, datatype=long_type, shape=[1, n])],
        raw_input_contents=[x.tobytes()],
    )
    with grpc.insecure_channel(grpc_server.address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            _call(channel, "ModelInfer", pb.ModelInferResponse, odd, metadata=metadata)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        message = exc.value.details()
        assert "datatype must be FP32" in message
        # The value's first characters (the quote is one of the ECHO_LIMIT), then "…".
        assert f"got '{'X' * (ECHO_LIMIT - 1)}…" in message
        assert message.endswith("…") and len(message) < 200, message
        # A metadata value, echoed by the deadline's check.
        fine = pb.ModelInferRequest()
        fine.CopyFrom(odd)
        fine.inputs[0].datatype = "FP32"
        with pytest.raises(grpc.RpcError) as exc:
            long_timeout = (("x-request-timeout-ms", "9" * 5000),)
            _call(
                channel,
                "ModelInfer",
                pb.ModelInferResponse,
                fine,
                metadata=metadata + long_timeout,
            )
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-request-timeout-ms" in exc.value.details()
        assert len(exc.value.details()) < 300, exc.value.details()

    body = {"inputs": [{"name": meta.input_name, "shape": [1, n], "datatype": long_type}]}
    body["inputs"][0]["data"] = x.ravel().tolist()
    with httpx.Client(base_url=grpc_server.server.url, headers=headers, timeout=10) as c:
        r = c.post("/v2/models/fraud/infer", json=body)
        assert r.status_code == 400, r.text
        assert "datatype must be FP32" in r.json()["error"] and len(r.text) < 300, r.text
        r = c.post("/v1/score", json=TXN, headers={"X-Request-Timeout-Ms": "9" * 10_000})
        assert r.status_code == 422, r.text[:500]
        (problem,) = r.json()["detail"]
        assert problem["field"] == "header.X-Request-Timeout-Ms" and len(problem["message"]) < 300

    # Spaces do not get a value past the cut: the message as a whole is bounded.
    spaced = bounded("got " + "ab " * 10_000)
    assert len(spaced) == MESSAGE_LIMIT + 1 and spaced.endswith("…")
    assert bounded("input 'x': datatype must be FP32") == "input 'x': datatype must be FP32"


def _h2_settings(address: str) -> dict[int, int]:
    """The HTTP/2 SETTINGS the server at ``address`` sends a new connection (id: value)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # The client's connection preface and an empty SETTINGS frame.
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        buffer = b""

        def read(size: int) -> bytes:
            nonlocal buffer
            while len(buffer) < size:
                chunk = sock.recv(65536)
                assert chunk, "the server closed the connection"
                buffer += chunk
            out, buffer = buffer[:size], buffer[size:]
            return out

        while True:
            head = read(9)
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            payload = read(length)
            if kind == 4 and not flags & 1:  # SETTINGS, not an acknowledgement
                return {
                    int.from_bytes(payload[i : i + 2], "big"): int.from_bytes(
                        payload[i + 2 : i + 6], "big"
                    )
                    for i in range(0, length, 6)
                }


MAX_CONCURRENT_STREAMS = 0x3  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS


def test_a_connection_holds_at_most_max_concurrent_streams(grpc_server: GrpcServer) -> None:
    """FRAUD_GRPC_MAX_CONCURRENT_STREAMS (100 by default) is what the server tells each
    connection (another value: the flood test's server)."""
    assert _h2_settings(grpc_server.address)[MAX_CONCURRENT_STREAMS] == 100


def test_contents_are_read_as_raw_contents_are(
    grpc_server: GrpcServer, world: World, meta: ModelMetadata
) -> None:
    """``contents.fp32_contents`` (KServe's non-raw form) scores as raw bytes do; the
    answer is ``raw_output_contents``; other content fields are refused by name."""
    x = _rows(meta, 3, seed=11)
    metadata = tuple(grpc_server.auth().items())
    Tensor = pb.ModelInferRequest.InferInputTensor
    with grpc.insecure_channel(grpc_server.address) as channel:
        request = pb.ModelInferRequest(
            model_name="fraud",
            inputs=[
                Tensor(
                    name=meta.input_name,
                    datatype="FP32",
                    shape=list(x.shape),
                    contents=pb.InferTensorContents(fp32_contents=x.ravel().tolist()),
                )
            ],
        )
        answer = _call(channel, "ModelInfer", pb.ModelInferResponse, request, metadata=metadata)
        assert [o.name for o in answer.outputs] == [meta.output_name]
        assert list(answer.outputs[0].shape) == [3] and answer.outputs[0].datatype == "FP32"
        got = np.frombuffer(answer.raw_output_contents[0], dtype="<f4")
        np.testing.assert_allclose(got, _onnx(world, meta, x), rtol=1e-6)

        ints = pb.ModelInferRequest()
        ints.CopyFrom(request)
        ints.inputs[0].contents.int64_contents.extend([1] * x.size)
        with pytest.raises(grpc.RpcError) as exc:
            _call(channel, "ModelInfer", pb.ModelInferResponse, ints, metadata=metadata)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "inputs.0.contents.int64_contents" in exc.value.details()

        short = pb.ModelInferRequest()
        short.CopyFrom(request)
        del short.inputs[0].contents.fp32_contents[-1]
        with pytest.raises(grpc.RpcError) as exc:
            _call(channel, "ModelInfer", pb.ModelInferResponse, short, metadata=metadata)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{x.size - 1} elements" in exc.value.details()

        live = _call(channel, "ServerLive", pb.ServerLiveResponse, pb.ServerLiveRequest())
        assert live.live is True


def test_without_a_model_ready_is_false_and_inference_unavailable(
    world: World, tmp_path: Path
) -> None:
    """No model yet: ServerReady and ModelReady say false (status OK), REST's model ready
    is 400 ``ready: false``; inference is UNAVAILABLE with retry-after, counted as
    ``no_model`` like a REST 503."""
    empty = World(world.data_dir, tmp_path / "none", world.redis_url, world.start, world.days)
    port = free_port()
    srv = start_server(empty, tmp_path, wait_for="/healthz", FRAUD_GRPC_PORT=str(port))
    client = tgrpc.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        assert client.is_server_live() and not client.is_server_ready()
        assert client.is_model_ready("fraud") is False
        with pytest.raises(InferenceServerException, match="unknown model") as nf:
            client.is_model_ready("other")
        assert _status(nf) == "NOT_FOUND"
        with srv.client() as c:
            before = rejections(c.get("/metrics").text, "no_model")
            for path in ("/v2/models/fraud/ready", "/v2/models/fraud/versions/1/ready"):
                r = c.get(path)
                assert r.status_code == 400, (path, r.text)
                assert r.json()["ready"] is False and r.json()["error"], r.text
            x = np.zeros((1, 4), dtype=np.float32)
            inp = tgrpc.InferInput("input", [1, 4], "FP32")
            inp.set_data_from_numpy(x)
            with (
                grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
                pytest.raises(grpc.RpcError) as exc,
            ):
                _call(
                    channel,
                    "ModelInfer",
                    pb.ModelInferResponse,
                    pb.ModelInferRequest(model_name="fraud"),
                )
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no model loaded" in exc.value.details()
            trailing = dict(exc.value.trailing_metadata() or ())
            assert trailing["retry-after"] == "5" and trailing["fraud-reason"] == "no_model"
            with pytest.raises(InferenceServerException) as tc:
                client.infer("fraud", [inp])
            assert _status(tc) == "UNAVAILABLE"
            assert rejections(c.get("/metrics").text, "no_model") == before + 2
    finally:
        client.close()
        stop_server(srv)


def test_grpc_and_rest_calls_draw_on_one_admission_capacity(
    world: World, tmp_path: Path, meta: ModelMetadata
) -> None:
    """One admission state for both transports: with room for one call
    (``FRAUD_MAX_INFLIGHT=2``, a call's least weight), a REST scoring call held in
    process (its feature read waits on a hung Redis) makes a gRPC inference be refused
    ``UNAVAILABLE`` (reason ``inflight``, counted); once the REST call is answered, the
    gRPC call is admitted again."""
    port = free_port()
    with embedded_redis() as url:
        mark_materialized(url, PROJECT)
        mark_declared(url)
        srv = start_server(
            world,
            tmp_path,
            REDIS_URL=url,
            FRAUD_GRPC_PORT=str(port),
            FRAUD_MAX_INFLIGHT="2",
            # The REST call waits on the hung Redis up to 20 s (ends with the pause).
            FRAUD_REDIS_TIMEOUT_S="20",
            FRAUD_REQUEST_TIMEOUT_MS="30000",
        )
        client = tgrpc.InferenceServerClient(url=f"127.0.0.1:{port}")
        x = _rows(meta, 1)

        answers: list[int] = []

        def refused_inflight() -> bool:
            assert not answers, f"the REST call was answered first: {answers}"
            try:
                client.infer("fraud", [_infer_input(meta, x)])
            except InferenceServerException as exc:
                assert exc.status() == "StatusCode.UNAVAILABLE", exc
                assert "transactions in process" in str(exc.message()), exc
                return True
            return False

        try:
            with srv.client() as c:
                assert client.infer("fraud", [_infer_input(meta, x)]).as_numpy(meta.output_name)
                before = rejections(c.get("/metrics").text, "inflight")
                with paused(url):
                    rest = threading.Thread(
                        target=lambda: answers.append(
                            c.post("/v1/score", json=TXN, timeout=60).status_code
                        )
                    )
                    rest.start()
                    # The REST call holds the capacity once a body that fails validation
                    # (answered at once when admitted, never reaching Redis) is refused
                    # 503: only then probe with gRPC, which would hang if admitted first.
                    with srv.client() as probe:

                        def rest_in_process() -> bool:
                            assert not answers, f"the REST call was answered: {answers}"
                            r = probe.post("/v1/score", json={})
                            return r.status_code == 503

                        wait_until(rest_in_process, timeout=15, what="the REST call in process")
                    wait_until(refused_inflight, timeout=15, what="gRPC refused: REST in process")
                rest.join()
                assert len(answers) == 1  # answered (a 503 when the read timed out)
                assert rejections(c.get("/metrics").text, "inflight") >= before + 1
                # The REST call answered, its capacity given back: gRPC is admitted.
                got = client.infer("fraud", [_infer_input(meta, x)]).as_numpy(meta.output_name)
                assert got is not None and got.shape == (1,)
        finally:
            client.close()
            stop_server(srv)


def test_a_flood_from_one_key_does_not_starve_another(
    world: World, tmp_path: Path, meta: ModelMetadata
) -> None:
    """Per-key shares on gRPC as on REST: with room for two calls
    (``FRAUD_MAX_INFLIGHT=4``) and key ``flooder`` holding one (a REST scoring call held
    in process by a hung Redis), ``flooder``'s gRPC calls are refused ``UNAVAILABLE``
    (reason ``client_share``, counted) while key ``other`` calls, and ``other``'s gRPC
    calls are admitted throughout a flood of ``flooder``'s. The server also tells each
    connection its FRAUD_GRPC_MAX_CONCURRENT_STREAMS (the flood's connection is over
    it: some of its calls are refused by HTTP/2 before any handler, REFUSED_STREAM)."""
    keys_file = tmp_path / "keys.jsonl"
    keys: dict[str, str] = {}
    for key_id, scope in (
        ("flooder", Scope.SCORE),
        ("other", Scope.SCORE),
        ("scraper", Scope.METRICS),
    ):
        key, digest = new_key(key_id)
        append_key(keys_file, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({scope})))
        keys[key_id] = key
    auth = {k: (("authorization", f"Bearer {v}"),) for k, v in keys.items()}

    def shed_for_share() -> float:
        metrics = httpx.get(f"{srv.url}/metrics", headers=dict(auth["scraper"]), timeout=10)
        return rejections(metrics.text, "client_share")

    x = _rows(meta, 1)
    Tensor = pb.ModelInferRequest.InferInputTensor
    request = pb.ModelInferRequest(
        model_name="fraud",
        inputs=[Tensor(name=meta.input_name, datatype="FP32", shape=list(x.shape))],
        raw_input_contents=[x.tobytes()],
    )
    port = free_port()
    with embedded_redis() as url:
        mark_materialized(url, PROJECT)
        mark_declared(url)
        srv = start_server(
            world,
            tmp_path,
            REDIS_URL=url,
            FRAUD_GRPC_PORT=str(port),
            FRAUD_AUTH="required",
            FRAUD_API_KEYS_FILE=str(keys_file),
            FRAUD_MAX_INFLIGHT="4",
            FRAUD_GRPC_MAX_CONCURRENT_STREAMS="16",
            # The REST call waits on the hung Redis up to 20 s (ends with the pause).
            FRAUD_REDIS_TIMEOUT_S="20",
            FRAUD_REQUEST_TIMEOUT_MS="30000",
        )
        address = f"127.0.0.1:{port}"
        # A connection per key, as two clients would have.
        channels = {k: grpc.insecure_channel(address) for k in ("flooder", "other")}
        infer = {
            k: channel.unary_unary(
                SERVICE + "ModelInfer",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=pb.ModelInferResponse.FromString,
            )
            for k, channel in channels.items()
        }

        def refusal(exc: grpc.RpcError) -> str:
            """The status and the admission's reason; ``stream refused`` when the
            connection was over its streams (HTTP/2 REFUSED_STREAM, before any handler)."""
            reason = dict(exc.trailing_metadata() or ()).get("fraud-reason")
            if reason is None and "RST_STREAM" in (exc.details() or ""):
                reason = "stream refused"
            return f"{exc.code().name} {reason}"

        def outcome(key_id: str) -> str:
            """``OK``, or the refusal."""
            try:
                infer[key_id](request, metadata=auth[key_id], timeout=10)
            except grpc.RpcError as exc:
                return refusal(exc)
            return "OK"

        held: list[threading.Thread] = []
        answers: list[int] = []

        def post() -> None:
            headers = dict(auth["flooder"])
            r = httpx.post(f"{srv.url}/v1/score", json=TXN, headers=headers, timeout=60)
            answers.append(r.status_code)

        def hold() -> None:
            """A REST scoring call of ``flooder``'s, held in process by the hung Redis."""
            held.append(threading.Thread(target=post))
            held[-1].start()

        def flooder_over_its_share() -> bool:
            # Refused at once (503) when it came while a gRPC call of flooder's held
            # capacity: hold again.
            if not held[-1].is_alive():
                hold()
            assert outcome("other") == "OK"  # other is seen calling
            return outcome("flooder") == "UNAVAILABLE client_share"

        try:
            assert _h2_settings(address)[MAX_CONCURRENT_STREAMS] == 16
            assert outcome("flooder") == outcome("other") == "OK"
            before = shed_for_share()
            with paused(url):
                hold()
                wait_until(flooder_over_its_share, timeout=15, what="flooder over its share")
                # The flood: 64 calls at once (16 at a time on the connection) while
                # other keeps calling; each of other's calls is admitted.
                flooding = infer["flooder"].future
                flood = [flooding(request, metadata=auth["flooder"], timeout=10) for _ in range(64)]
                for _ in range(5):
                    wait_until(lambda: outcome("other") == "OK", timeout=10, what="other admitted")
                outcomes = []
                for call in flood:
                    try:
                        call.result()
                        outcomes.append("OK")
                    except grpc.RpcError as exc:
                        outcomes.append(refusal(exc))
                refused = {
                    f"UNAVAILABLE {r}" for r in ("client_share", "inflight", "stream refused")
                }
                assert set(outcomes) <= {"OK", *refused}, outcomes
                shed = outcomes.count("UNAVAILABLE client_share")
                assert shed >= 1, outcomes
            for thread in held:
                thread.join(timeout=60)
            assert shed_for_share() >= before + shed + 1  # the flood's and the wait's, counted
            assert outcome("flooder") == "OK"  # the REST call answered: admitted again
        finally:
            for channel in channels.values():
                channel.close()
            stop_server(srv)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for localhost/127.0.0.1 and its key, made with openssl here."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    san = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=localhost"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-addext", san),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_when_a_certificate_and_key_are_set(
    world: World, tmp_path: Path, meta: ModelMetadata
) -> None:
    """FRAUD_GRPC_TLS_CERT/_KEY: the port speaks TLS only; tritonclient with ``ssl=True``
    and the certificate as its root scores, a plaintext client gets UNAVAILABLE."""
    cert, key = _self_signed(tmp_path)
    port = free_port()
    srv = start_server(
        world,
        tmp_path,
        FRAUD_GRPC_PORT=str(port),
        FRAUD_GRPC_TLS_CERT=str(cert),
        FRAUD_GRPC_TLS_KEY=str(key),
    )
    secure = tgrpc.InferenceServerClient(
        url=f"localhost:{port}", ssl=True, root_certificates=str(cert)
    )
    plain = tgrpc.InferenceServerClient(url=f"localhost:{port}")
    try:
        assert secure.is_server_ready()
        x = _rows(meta, 3)
        got = secure.infer("fraud", [_infer_input(meta, x)]).as_numpy(meta.output_name)
        np.testing.assert_allclose(got, _onnx(world, meta, x), rtol=1e-6)
        with pytest.raises(InferenceServerException) as exc:
            plain.is_server_live(client_timeout=5)
        assert _status(exc) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        assert "(TLS)" in srv.log.read_text()
    finally:
        secure.close()
        plain.close()
        stop_server(srv)


def test_tls_settings_name_the_variable_at_fault(tmp_path: Path) -> None:
    """Both or neither; a file that cannot be read or holds no PEM is named by its
    variable, before anything listens."""
    from pydantic import ValidationError

    from cli.settings import Settings
    from service.edge.oip_grpc import tls_credentials
    from service.errors import ServiceConfigError

    cert, key = _self_signed(tmp_path)
    with pytest.raises(ValidationError, match="FRAUD_GRPC_TLS_CERT is set but FRAUD_GRPC_TLS_KEY"):
        Settings(grpc_tls_cert=cert)
    with pytest.raises(ValidationError, match="FRAUD_GRPC_TLS_KEY is set but FRAUD_GRPC_TLS_CERT"):
        Settings(grpc_tls_key=key)
    assert tls_credentials(Settings()) is None
    assert tls_credentials(Settings(grpc_tls_cert=cert, grpc_tls_key=key)) is not None
    missing = tmp_path / "nope.pem"
    with pytest.raises(ServiceConfigError, match=r"cannot read FRAUD_GRPC_TLS_KEY '.*nope.pem'"):
        tls_credentials(Settings(grpc_tls_cert=cert, grpc_tls_key=missing))
    with pytest.raises(ServiceConfigError, match=r"FRAUD_GRPC_TLS_CERT '.*key.pem' holds no PEM"):
        tls_credentials(Settings(grpc_tls_cert=key, grpc_tls_key=key))


def test_generated_stubs_are_current() -> None:
    """grpc_predict_v2_pb2.py(i) are what the .proto and the generator make."""
    from service.edge.proto.__main__ import main

    assert main(["--check"]) == 0


def test_chart_exposes_the_grpc_port_only_when_set() -> None:
    """``scoring.service.grpcPort``: a container port, FRAUD_GRPC_PORT, a Service port
    and the network policy's ingress port; none of them by default. Every object stays
    valid Kubernetes (strict)."""
    import kubernetes_validate

    from tests.test_helm import KUBE_VERSION, RELEASE, component, find, one, pod_spec, render

    def parts(docs: list[dict[str, Any]]) -> tuple[set[str], dict[str, str], set[str], set[Any]]:
        (c,) = pod_spec(component(docs, "scoring"))["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        scoring_services = [
            s for s in find(docs, "Service") if s["metadata"]["name"] == f"{RELEASE}-fraud-scoring"
        ]
        (service,) = scoring_services
        policy = one(docs, "NetworkPolicy", f"{RELEASE}-fraud-scoring-scoring")
        ingress = {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
        return (
            {p["name"] for p in c["ports"]},
            env,
            {p["name"] for p in service["spec"]["ports"]},
            ingress,
        )

    off = render({"networkPolicy": {"enabled": True}})
    ports, env, service_ports, ingress = parts(off)
    assert "grpc" not in ports and "FRAUD_GRPC_PORT" not in env
    assert service_ports == {"http"} and ingress == {"http"}

    on = render({"networkPolicy": {"enabled": True}, "scoring": {"service": {"grpcPort": 8081}}})
    ports, env, service_ports, ingress = parts(on)
    assert "grpc" in ports and env["FRAUD_GRPC_PORT"] == "8081"
    assert service_ports == {"http", "grpc"} and ingress == {"http", "grpc"}
    (c,) = pod_spec(component(on, "scoring"))["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == 8081
    for doc in on:
        if doc["kind"] not in {"ServiceMonitor", "PodMonitor", "PrometheusRule"}:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    assert "FRAUD_GRPC_TLS_CERT" not in env

    # scoring.service.grpcTlsSecret: the Secret's tls.crt/tls.key mounted, and named.
    tls = {"service": {"grpcPort": 8081, "grpcTlsSecret": "scoring-grpc-tls"}}
    docs = render({"scoring": tls})
    pod = pod_spec(component(docs, "scoring"))
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "grpc-tls"]
    assert env["FRAUD_GRPC_TLS_CERT"] == f"{mount['mountPath']}/tls.crt"
    assert env["FRAUD_GRPC_TLS_KEY"] == f"{mount['mountPath']}/tls.key"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "grpc-tls"]
    assert volume["secret"]["secretName"] == "scoring-grpc-tls"
    for doc in docs:
        if doc["kind"] not in {"ServiceMonitor", "PodMonitor", "PrometheusRule"}:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
