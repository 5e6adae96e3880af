"""The service speaks the ecosystem's protocols: real answers match the published OpenAPI
document, the docs render from local assets, and a real Open Inference Protocol v2
client (tritonclient) reaches the model. Real HTTP against ``fraud-scoring serve``."""

from __future__ import annotations

import json
import re
from typing import Any, get_args

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from jsonschema import Draft202012Validator
from tritonclient.utils import InferenceServerException

from fraud_scoring.model_repo import load_metadata, resolve
from service.core.decision import DECISIONS
from service.edge.schemas import Decision
from service.errors import ErrorCode, RejectReason
from tests.conftest import Server, World
from tests.test_service import TXN

CODES = {c.value for c in ErrorCode} | {r.value for r in RejectReason}


def check_against_openapi(spec: dict[str, Any], method: str, path: str, r: httpx.Response) -> None:
    """``r``'s status is documented for ``method path`` and its JSON body validates
    against the documented schema; an error body's codes are documented codes."""
    responses = spec["paths"][path][method.lower()]["responses"]
    assert str(r.status_code) in responses, (path, r.status_code, sorted(responses))
    schema = responses[str(r.status_code)]["content"]["application/json"]["schema"]
    validator = Draft202012Validator({**schema, "components": spec["components"]})
    body = r.json()
    errors = [e.message for e in validator.iter_errors(body)]
    assert not errors, (path, r.status_code, body, errors)
    if r.status_code >= 400 and path.startswith("/v1"):
        assert {p["code"] for p in body["detail"]} <= CODES, body


def test_decision_enum_is_the_policys() -> None:
    assert get_args(Decision) == DECISIONS


def test_every_answer_matches_the_published_schema(server: Server) -> None:
    """Valid calls and each error class, sent for real, validated against /openapi.json."""
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        assert spec["components"]["schemas"]["ScoreOut"]["properties"]["decision"]["enum"] == [
            "approve",
            "review",
            "decline",
        ]
        score = spec["paths"]["/v1/score"]["post"]
        assert {"401", "403", "408", "413", "415", "422", "503"} <= set(score["responses"])
        assert "example" in score["requestBody"]["content"]["application/json"]

        many = {"transactions": [TXN, {**TXN, "transaction_id": "p-2"}]}
        calls: list[tuple[str, str, httpx.Response]] = [
            ("POST", "/v1/score", c.post("/v1/score", json=TXN)),
            ("POST", "/v1/score/batch", c.post("/v1/score/batch", json=many)),
            ("POST", "/v1/score", c.post("/v1/score", json={**TXN, "amount": -1})),
            ("POST", "/v1/score", c.post("/v1/score", json={"card_id": "c1"})),
            (
                "POST",
                "/v1/score",
                c.post("/v1/score", content=b"{", headers={"content-type": "application/json"}),
            ),
            (
                "POST",
                "/v1/score",
                c.post("/v1/score", content=b"{}", headers={"content-type": "text/plain"}),
            ),
            (
                "POST",
                "/v1/score",
                c.post("/v1/score", json=TXN, headers={"X-Request-Timeout-Ms": "nope"}),
            ),
            # A deadline no micro-batch can meet: 503 with a reason code.
            (
                "POST",
                "/v1/score",
                c.post("/v1/score", json=TXN, headers={"X-Request-Timeout-Ms": "0.001"}),
            ),
            (
                "POST",
                "/v1/score/batch",
                c.post("/v1/score/batch", json={"transactions": [TXN] * 257}),
            ),
            (
                "POST",
                "/v1/models/reload",
                c.post("/v1/models/reload", headers={"Content-Type": "application/json"}),
            ),
            ("POST", "/v1/feedback", c.post("/v1/feedback", json={"label": "maybe"})),
        ]
    statuses = [r.status_code for _, _, r in calls]
    assert statuses == [200, 200, 422, 422, 422, 415, 422, 503, 413, 200, 422], statuses
    for method, path, r in calls:
        check_against_openapi(spec, method, path, r)
    assert calls[4][2].json()["detail"][0]["code"] == "invalid_json"
    assert calls[3][2].json()["detail"][0]["code"] == "missing"
    assert calls[7][2].json()["detail"][0]["code"] in ("deadline", "timeout")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_use_only_local_assets(server: Server, page: str) -> None:
    """The docs pages reference no other host (they render without internet), and every
    asset they reference answers 200."""
    with server.client() as c:
        html = c.get(page).text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
        urls += re.findall(r"""url:\s*['"]([^'"]+)['"]""", html)
        assert urls, html
        remote = [u for u in urls if re.match(r"(https?:)?//", u)]
        assert not remote, remote
        assert re.search(r"https?://", html) is None, "a remote URL in the page"
        for u in urls:
            assert c.get(u).status_code == 200, u


# --- Open Inference Protocol v2 ------------------------------------------------------
def test_oip_client_reaches_the_model(server: Server, world: World) -> None:
    """tritonclient's HTTP client: health, metadata, and inference equal to ONNX Runtime
    on the same model file."""
    path = resolve(world.model_repo, "fraud")
    meta = load_metadata(path)
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("fraud")
        assert client.get_server_metadata()["name"] == "fraud-scoring"
        md = client.get_model_metadata("fraud")
        n = len(meta.features)
        assert md["versions"] == [meta.version]
        assert md["inputs"] == [{"name": meta.input_name, "datatype": "FP32", "shape": [-1, n]}]
        assert md["parameters"]["feature_names"] == meta.feature_names
        assert client.get_model_metadata("fraud", meta.version)["name"] == "fraud"

        x = np.random.default_rng(7).uniform(0, 50, size=(5, n)).astype(np.float32)
        inp = triton.InferInput(meta.input_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        out = triton.InferRequestedOutput(meta.output_name, binary_data=False)
        result = client.infer("fraud", [inp], outputs=[out], request_id="r-1")
        got = result.as_numpy(meta.output_name)
        session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
        want = session.run([meta.output_name], {meta.input_name: x})[0][:, 1]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert result.get_response()["id"] == "r-1"
        assert result.get_response()["model_version"] == meta.version

        versioned = client.infer("fraud", [inp], model_version=meta.version, outputs=[out])
        np.testing.assert_allclose(versioned.as_numpy(meta.output_name), want, rtol=1e-6)
        with pytest.raises(InferenceServerException, match="not served"):
            client.infer("fraud", [inp], model_version="999", outputs=[out])
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_model_metadata("other")
        bad = triton.InferInput(meta.input_name, [1, n - 1], "FP32")
        bad.set_data_from_numpy(x[:1, : n - 1], binary_data=False)
        with pytest.raises(InferenceServerException, match=rf"shape must be \[n, {n}\]"):
            client.infer("fraud", [bad], outputs=[out])
    finally:
        client.close()


def test_oip_errors_use_the_protocol_shape(server: Server) -> None:
    with server.client() as c:
        cases = [
            c.post("/v2/models/fraud/infer", content=b"{"),
            c.post("/v2/models/fraud/infer", json={"inputs": []}),
            c.post(
                "/v2/models/fraud/infer",
                json={
                    "inputs": [
                        {"name": "input", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}
                    ]
                },
            ),
            c.get("/v2/models/nope"),
            c.get("/v2/models/nope/ready"),
        ]
        assert [r.status_code for r in cases] == [400, 400, 400, 404, 404]
        for r in cases:
            assert set(r.json()) == {"error"} and r.json()["error"], r.text
        assert c.get("/v2/health/live").json() == {"live": True}


def test_oip_binary_tensors(server: Server, world: World) -> None:
    """tritonclient's default, the binary tensor extension, both ways and mixed with
    JSON: the same scores as ONNX Runtime; versioned readiness."""
    path = resolve(world.model_repo, "fraud")
    meta = load_metadata(path)
    n = len(meta.features)
    x = np.random.default_rng(8).uniform(0, 50, size=(4, n)).astype(np.float32)
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    want = session.run([meta.output_name], {meta.input_name: x})[0][:, 1]
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    try:
        for binary_in, binary_out in [(True, True), (True, False), (False, True)]:
            inp = triton.InferInput(meta.input_name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary_in)
            out = triton.InferRequestedOutput(meta.output_name, binary_data=binary_out)
            result = client.infer("fraud", [inp], outputs=[out], request_id="b-1")
            got = result.as_numpy(meta.output_name)
            assert got is not None and got.dtype == np.float32, (binary_in, binary_out)
            np.testing.assert_allclose(got, want, rtol=1e-6)
            assert result.get_response()["id"] == "b-1"
            tensor = result.get_response()["outputs"][0]
            assert ("binary_data_size" in tensor.get("parameters", {})) is binary_out
        # No outputs named: tritonclient asks for all of them in binary (binary_data_output).
        inp = triton.InferInput(meta.input_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        plain = client.infer("fraud", [inp], model_version=meta.version)
        np.testing.assert_allclose(plain.as_numpy(meta.output_name), want, rtol=1e-6)
        nan = x.copy()
        nan[2, 1] = np.nan
        inp.set_data_from_numpy(nan)
        element = rf"element {2 * n + 1} \(row 2, column 1: '{meta.feature_names[1]}'\) is NaN"
        with pytest.raises(InferenceServerException, match=element):
            client.infer("fraud", [inp])

        assert client.is_model_ready("fraud", meta.version)
        assert not client.is_model_ready("fraud", "999")
    finally:
        client.close()

    with server.client() as c:
        r = c.get(f"/v2/models/fraud/versions/{meta.version}/ready")
        assert r.status_code == 200 and r.json() == {"name": "fraud", "ready": True}
        r = c.get("/v2/models/fraud/versions/999/ready")
        assert r.status_code == 404 and set(r.json()) == {"error"} and "999" in r.json()["error"]
        head = {
            "inputs": [
                {
                    "name": meta.input_name,
                    "shape": [1, n],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 4 * n},
                }
            ]
        }
        text = json.dumps(head).encode()
        row = x[:1].astype("<f4").tobytes()
        cases = [
            # The length header past the body.
            ({"Inference-Header-Content-Length": "99999"}, text + row, "Inference-Header"),
            # Fewer bytes than binary_data_size.
            (
                {"Inference-Header-Content-Length": str(len(text))},
                text + row[:-4],
                "binary_data_size",
            ),
            # Binary data, but the header not sent: the body is not JSON.
            ({}, text + row, "body|JSON|json"),
            # The header sent, the input without binary_data_size.
            (
                {"Inference-Header-Content-Length": str(len(_no_size(head)))},
                _no_size(head) + row,
                "no parameters.binary_data_size",
            ),
        ]
        for headers, body, message in cases:
            r = c.post("/v2/models/fraud/infer", content=body, headers=headers)
            assert r.status_code == 400, (headers, r.text)
            assert set(r.json()) == {"error"} and re.search(message, r.json()["error"]), r.text


def _no_size(head: dict[str, Any]) -> bytes:
    inputs = [{k: v for k, v in i.items() if k != "parameters"} for i in head["inputs"]]
    return json.dumps({**head, "inputs": inputs}).encode()


def test_oip_refuses_elements_that_are_not_finite_numbers(server: Server, world: World) -> None:
    """null, NaN, infinities, numbers beyond FP32, strings and booleans: 400 naming the
    element (index, row, column, feature), never scored."""
    meta = load_metadata(resolve(world.model_repo, "fraud"))
    n = len(meta.features)
    values = ["1.0"] * (2 * n)
    where = rf"element {n + 3} \(row 1, column 3: '{meta.feature_names[3]}'\)"
    cases = {
        "null": "is null",
        "NaN": "is NaN",
        "Infinity": "is infinite",
        "-Infinity": "is infinite",
        "1e39": "is infinite",  # beyond FP32's range
        '"1.5"': "is '1.5', a str",
        "true": "is True, a bool",
    }
    with server.client() as c:
        for token, message in cases.items():
            data = values.copy()
            data[n + 3] = token
            tensor = {"name": meta.input_name, "shape": [2, n], "datatype": "FP32", "data": "@"}
            body = json.dumps({"inputs": [tensor]}).replace('"@"', f"[{', '.join(data)}]")
            r = c.post("/v2/models/fraud/infer", content=body.encode())
            assert r.status_code == 400, (token, r.text)
            assert re.search(where, r.json()["error"]) and message in r.json()["error"], r.text
        nested = {"name": meta.input_name, "shape": [2, n], "datatype": "FP32"}
        ragged = [[1.0] * n, [1.0] * (n - 1)]
        r = c.post("/v2/models/fraud/infer", json={"inputs": [{**nested, "data": ragged}]})
        assert r.status_code == 400 and "not a regular array" in r.json()["error"], r.text
        good = [[1.0] * n, [2.0] * n]
        r = c.post("/v2/models/fraud/infer", json={"inputs": [{**nested, "data": good}]})
        assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2], r.text


def test_oip_unknown_routes_and_methods_answer_the_protocol_shape(server: Server) -> None:
    with server.client() as c:
        cases = [
            (c.get("/v2/nope"), 404),
            (c.get("/v2/models/fraud/versions/1/nope"), 404),
            (c.delete("/v2/models/fraud"), 405),
            (c.get("/v2/models/fraud/infer"), 405),
            (c.post("/v2/models/fraud/ready"), 405),
        ]
        for r, status in cases:
            assert r.status_code == status, r.request.url
            assert set(r.json()) == {"error"} and r.json()["error"], r.text


def _tensor(world: World, rows: int = 2) -> tuple[dict[str, Any], np.ndarray]:
    """A JSON inference request for ``rows`` rows, and its rows as FP32."""
    meta = load_metadata(resolve(world.model_repo, "fraud"))
    n = len(meta.features)
    x = np.random.default_rng(11).uniform(0, 50, size=(rows, n)).astype(np.float32)
    tensor = {"name": meta.input_name, "shape": [rows, n], "datatype": "FP32"}
    return {"inputs": [{**tensor, "data": x.reshape(-1).tolist()}]}, x


def test_oip_infer_refuses_a_body_that_is_not_json_with_415(server: Server, world: World) -> None:
    """As every /v1 POST: a form, multipart or text/plain body (what a page on another
    site can post without a preflight) is a 415 in the protocol's shape, documented. JSON,
    application/octet-stream (the binary form; tritonclient.http.aio sends every body so)
    and no Content-Type (tritonclient.http sends none) are read."""
    request, x = _tensor(world)
    text = json.dumps(request).encode()
    url = "/v2/models/fraud/infer"
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        refused = [
            c.post(url, content=text, headers={"content-type": "text/plain"}),
            c.post(url, content=text, headers={"content-type": "text/plain; charset=utf-8"}),
            c.post(url, data={"inputs": text.decode()}),  # application/x-www-form-urlencoded
            c.post(url, files={"inputs": ("r.json", text, "application/json")}),  # multipart
            c.post(url, content=text, headers={"content-type": "application/xml"}),
        ]
        for r in refused:
            assert r.status_code == 415, (r.request.headers["content-type"], r.text)
            assert set(r.json()) == {"error"} and "Content-Type" in r.json()["error"], r.text
            check_against_openapi(spec, "POST", "/v2/models/{name}/infer", r)
        version = load_metadata(resolve(world.model_repo, "fraud")).version
        r = c.post(
            f"/v2/models/fraud/versions/{version}/infer",
            content=text,
            headers={"content-type": "text/plain"},
        )
        assert r.status_code == 415 and set(r.json()) == {"error"}, r.text

        head = {"inputs": [{**request["inputs"][0], "parameters": {}}]}
        del head["inputs"][0]["data"]
        head["inputs"][0]["parameters"]["binary_data_size"] = x.nbytes
        head_bytes = json.dumps(head).encode()
        binary = {"Inference-Header-Content-Length": str(len(head_bytes))}
        accepted = [
            c.post(url, json=request),
            c.post(url, content=text, headers={"content-type": "application/json; charset=utf-8"}),
            c.post(url, content=text),  # no Content-Type
            c.post(url, content=text, headers={"content-type": "application/octet-stream"}),
            c.post(url, content=head_bytes + x.astype("<f4").tobytes(), headers=binary),
            c.post(
                url,
                content=head_bytes + x.astype("<f4").tobytes(),
                headers={**binary, "content-type": "application/octet-stream"},
            ),
        ]
    scores = [r.json()["outputs"][0]["data"] for r in accepted if r.status_code == 200]
    assert len(scores) == len(accepted), [(r.status_code, r.text) for r in accepted]
    assert all(s == scores[0] for s in scores), scores


def test_oip_aio_client_reaches_the_model(server: Server, world: World) -> None:
    """tritonclient.http.aio (aiohttp: every body application/octet-stream), JSON and
    binary tensors: the same scores as the synchronous client's path."""
    import asyncio

    import tritonclient.http.aio as aio_triton

    meta = load_metadata(resolve(world.model_repo, "fraud"))
    request, x = _tensor(world)

    async def infer(binary: bool) -> np.ndarray:
        client = aio_triton.InferenceServerClient(url=server.url.removeprefix("http://"))
        try:
            inp = aio_triton.InferInput(meta.input_name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = aio_triton.InferRequestedOutput(meta.output_name, binary_data=binary)
            result = await client.infer("fraud", [inp], outputs=[out])
            got: np.ndarray = result.as_numpy(meta.output_name)
            return got
        finally:
            await client.close()

    with server.client() as c:
        want = c.post("/v2/models/fraud/infer", json=request).json()["outputs"][0]["data"]
    for binary in (False, True):
        np.testing.assert_allclose(asyncio.run(infer(binary)), want, rtol=1e-6)


def test_oip_documents_the_binary_form_its_headers_and_extensions(server: Server) -> None:
    """/openapi.json declares infer's binary tensor form (Inference-Header-Content-Length,
    an application/octet-stream body), the deadline header it honours and its 415; the
    server metadata lists the binary tensor data extension (Triton's and KServe's name),
    as tritonclient reads it."""
    with server.client() as c:
        spec = c.get("/openapi.json").json()
        meta = c.get("/v2")
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        op = spec["paths"][path]["post"]
        headers = {p["name"]: p for p in op["parameters"] if p["in"] == "header"}
        assert headers["Inference-Header-Content-Length"]["schema"] == {
            "type": "integer",
            "minimum": 0,
        }
        assert headers["X-Request-Timeout-Ms"]["schema"]["maximum"] == 60_000
        assert not any(h["required"] for h in headers.values())
        body = op["requestBody"]["content"]
        assert set(body) == {"application/json", "application/octet-stream"}, path
        assert body["application/octet-stream"]["schema"]["format"] == "binary"
        assert "415" in op["responses"], path
    assert meta.status_code == 200
    assert meta.json()["extensions"] == ["binary_tensor_data"]
    check_against_openapi(spec, "GET", "/v2", meta)
    assert spec["paths"]["/v2"]["get"]["responses"]["200"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/ServerMetaOut"}
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    try:
        assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    finally:
        client.close()
