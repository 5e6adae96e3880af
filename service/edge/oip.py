"""The Open Inference Protocol v2 (KServe / Triton / MLServer REST) on the raw model.

Clients of serving stacks reach the model here with no knowledge of transactions: the
input is an FP32 tensor ``[n, n_features]`` of the model's features in the model's
order (``GET /v2/models/{name}`` lists them under ``parameters.feature_names``); the
output ``probabilities`` is the FP32 fraud probability per row, shape ``[n]``. No
feature read, no decision policy, no session state, no decision log: that is
``/v1/score``.

Tensor data comes as JSON (``data``, flat or nested row-major) or, with the binary
tensor data extension (what ``tritonclient.http`` sends by default; the server metadata
lists it, ``binary_tensor_data``), as raw bytes after a JSON header: the body's first
``Inference-Header-Content-Length`` bytes are the JSON, the rest the input's elements
(little-endian FP32, row-major), ``binary_data_size`` of them in the input's
``parameters``. The output goes back the same way when asked for
(``parameters.binary_data`` on a requested output, or the request's
``binary_data_output``): an ``application/octet-stream`` answer with its own
``Inference-Header-Content-Length``. Every element must be a finite number: ``null``,
``NaN`` and infinities are refused (400) naming the element.

The body is read as JSON when its ``Content-Type`` is JSON, ``application/octet-stream``
(aiohttp's default for bytes: ``tritonclient.http.aio`` sends every body so) or absent
(``tritonclient.http`` sends none); any other (a form, ``multipart/*``, ``text/plain``:
what a page on another site may post without a CORS preflight) is refused with 415, as
every ``POST`` of ``/v1`` refuses it.

The life of an inference request: admission (``service.edge.admission``: body bounds and
the in-flight bound, shared with ``/v1``) → the ``score`` scope → the Content-Type →
decode and check the tensor (``service.edge.oip_model``, shared with the gRPC server,
``service.edge.oip_grpc``) → the model, on the scoring thread pool (never on the event
loop) under the request's deadline (``X-Request-Timeout-Ms`` as on ``/v1``) → encode.
The micro-batcher is not used: its items are transactions, and a tensor request is
already a batch.

Errors are raised as ``service.errors``' types, as on ``/v1``, and answered in the
protocol's shape, ``{"error": "..."}`` (``service.edge.errors_http``, by path, also for a
``/v2`` route that does not exist, 404, or a method a route does not take, 405): 400 bad
request (:class:`~service.errors.BadRequest`), 401/403 auth, 404 unknown model or
version, 415 a body that is not JSON (:class:`~service.errors.UnsupportedMediaType`), 503
(Retry-After) when the model cannot serve now (counted under its reason in
``fraud_rejections_total``). Model readiness answers 200 ``{"name", "ready": true}`` or,
with no model loaded, 400 ``{"error", "ready": false}`` (the protocol's "not ready" is a
4xx), 404 for another model or version. The server's health endpoints are open, like
``/healthz``; model readiness, metadata and inference need the ``score`` scope.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from service.core.model import LoadedModel
from service.edge.auth import Scope, check_scope
from service.edge.oip_model import (
    FP32,
    PLATFORM,
    WIRE_FP32,
    check_input,
    check_outputs,
    deadline,
    from_bytes,
    from_values,
    predict,
    served,
)
from service.edge.routes import MAX_TIMEOUT_MS, TIMEOUT_HEADER, arrived, header
from service.errors import BadRequest, Rejected, UnsupportedMediaType
from service.resources import Resources, resources
from service.settings import ServiceSettings

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])

HEADER_LENGTH = "Inference-Header-Content-Length"
_HEADER_LENGTH_KEY = HEADER_LENGTH.lower().encode()
_TIMEOUT_KEY = TIMEOUT_HEADER.lower().encode()
# The protocol extensions served, as Triton and KServe name them in the server metadata.
EXTENSIONS = ("binary_tensor_data",)
OCTET_STREAM = "application/octet-stream"


class TensorIn(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    # Row-major, flat or nested as the protocol allows; absent with binary data.
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferIn(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[TensorIn] = Field(min_length=1, max_length=1)
    outputs: list[RequestedOutput] | None = None


class TensorOut(BaseModel):
    name: str
    shape: list[int]
    datatype: Literal["FP32"] = "FP32"
    data: list[float] = Field(description="absent when sent as binary data")


class InferOut(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[TensorOut]


class TensorMeta(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetaOut(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    parameters: dict[str, Any] = Field(description="feature_names: the input's columns")


class ServerMetaOut(BaseModel):
    name: str
    version: str
    extensions: list[str] = Field(
        description="binary_tensor_data: the binary tensor data extension "
        "(Inference-Header-Content-Length)"
    )


class OipErrorOut(BaseModel):
    error: str


class NotReadyOut(OipErrorOut):
    ready: bool = Field(default=False, description="present when the model is not loaded")


def _errors(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` in the protocol's shape, each status with its description."""
    return {s: {"model": OipErrorOut, "description": d} for s, d in described.items()}


# Every route may answer 503 while the process stops (a request on an open connection
# after SIGTERM). The routes with a path parameter get FastAPI's 422 unless they list one:
# this one is listed so FastAPI adds none of its own, and the app's OpenAPI hook
# (service.edge.app._openapi_as_answered) takes it out of the document.
_DRAINING = "The process is stopping (`draining`): send the request to another instance."
_KEYED = _errors(
    {
        401: "No API key, or an unknown one (auth on only).",
        403: "The key lacks the 'score' scope (auth on only).",
        404: "No such model or version is served.",
        422: "Not answered (taken out of /openapi.json by the app).",
    }
)
_META_ERRORS = _KEYED | _errors({503: "No model loaded yet (`no_model`), or " + _DRAINING})
_SERVE_ERRORS = _KEYED | _errors(
    {
        400: "The request, its tensor or X-Request-Timeout-Ms is not acceptable.",
        408: "The body did not arrive within FRAUD_BODY_TIMEOUT_S.",
        413: "The body is over FRAUD_MAX_BODY_BYTES.",
        415: "The Content-Type is not JSON or application/octet-stream (a form, multipart or "
        "text/plain body).",
        503: "No model, overloaded or past the deadline (Retry-After), or " + _DRAINING,
    }
)
_OPEN_ERRORS = _errors({503: _DRAINING})


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its ``$defs`` written in place: a schema embedded in
    the OpenAPI document would resolve ``#/$defs/...`` against the document's root."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    inlined: dict[str, Any] = walk(schema)
    return inlined


# The JSON request, and the binary tensor extension's form: the same JSON as the body's
# first Inference-Header-Content-Length bytes, the input's raw FP32 data after it (see
# ``infer``). A body with no Content-Type is read as JSON too (tritonclient.http's).
_INFER_IN = {
    "parameters": [
        {
            "name": TIMEOUT_HEADER,
            "in": "header",
            "required": False,
            "description": "This request's deadline in milliseconds, in (0, 60000]; default: "
            "FRAUD_REQUEST_TIMEOUT_MS. Past it the answer is 503; another value is a 400.",
            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_MS},
        },
        {
            "name": HEADER_LENGTH,
            "in": "header",
            "required": False,
            "description": "The binary tensor data extension: the body's first this many "
            "bytes are the JSON request, the rest the input's raw data (little-endian FP32, "
            "row-major), as many bytes as the input's parameters.binary_data_size. Without "
            "it the whole body is the JSON request.",
            "schema": {"type": "integer", "minimum": 0},
        },
    ],
    "requestBody": {
        "required": True,
        "description": "One FP32 input of shape [n, n_features] (GET /v2/models/{name} lists "
        "the features), as JSON; or, with Inference-Header-Content-Length, this JSON as the "
        "body's first bytes and the input's raw FP32 data after it (application/octet-stream, "
        "or no Content-Type as tritonclient.http sends it).",
        "content": {
            "application/json": {"schema": _inlined(InferIn.model_json_schema())},
            OCTET_STREAM: {
                "schema": {"type": "string", "format": "binary"},
            },
        },
    },
}
# A binary output (the binary tensor extension) comes back as application/octet-stream.
_INFER_OK: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            OCTET_STREAM: {
                "schema": {"type": "string", "format": "binary"},
            }
        },
        "description": "JSON, or with a binary output the JSON header "
        "(Inference-Header-Content-Length bytes) followed by the scores as raw FP32.",
    }
}


def _model(request: Request, name: str, version: str | None) -> tuple[Resources, LoadedModel]:
    """The serving model if it is ``name`` (and ``version``), after the scope check;
    else the key check's 401/403, :class:`~service.errors.NotFound`, or
    :class:`~service.errors.Rejected` (503 ``no_model``) when none serves."""
    check_scope(request, Scope.SCORE)
    res = resources(request)
    return res, served(res, name, version)


@router.get("/health/live", responses=_OPEN_ERRORS)
async def live() -> dict[str, bool]:
    """Always 200 while the process answers."""
    return {"live": True}


@router.get(
    "/health/ready",
    responses={
        400: {"model": NotReadyOut, "description": "No model loaded yet (not ready)."},
        **_OPEN_ERRORS,
    },
)
async def ready(request: Request) -> JSONResponse:
    """200 when a model serves (the raw model needs no feature store), else 400 as the
    protocol asks (a 4xx means "not ready")."""
    why = resources(request).models.readiness()
    if why is not None:
        raise BadRequest(f"model {why}", ready=False)
    return JSONResponse({"ready": True})


@router.get("", response_model=ServerMetaOut, responses=_OPEN_ERRORS)
async def server_metadata(request: Request) -> JSONResponse:
    """The server's name, version and protocol extensions: ``binary_tensor_data`` (the
    binary tensor data extension, as Triton and KServe name it)."""
    body = ServerMetaOut(
        name="fraud-scoring", version=request.app.version, extensions=list(EXTENSIONS)
    )
    return JSONResponse(body.model_dump())


def _metadata(request: Request, name: str, version: str | None) -> JSONResponse:
    _, model = _model(request, name, version)
    meta = model.meta
    body = ModelMetaOut(
        name=meta.name,
        versions=[meta.version],
        platform=PLATFORM,
        inputs=[TensorMeta(name=meta.input_name, datatype="FP32", shape=[-1, len(meta.features)])],
        outputs=[TensorMeta(name=meta.output_name, datatype="FP32", shape=[-1])],
        parameters={"feature_names": meta.feature_names},
    )
    return JSONResponse(body.model_dump())


@router.get("/models/{name}", response_model=ModelMetaOut, responses=_META_ERRORS)
async def model_metadata(request: Request, name: str) -> JSONResponse:
    """The model's input (FP32 ``[-1, n_features]``) and output (FP32 ``[-1]``)."""
    return _metadata(request, name, None)


@router.get(
    "/models/{name}/versions/{version}", response_model=ModelMetaOut, responses=_META_ERRORS
)
async def model_version_metadata(request: Request, name: str, version: str) -> JSONResponse:
    """As ``/v2/models/{name}``, 404 unless ``version`` is the serving one."""
    return _metadata(request, name, version)


class ModelReadyOut(BaseModel):
    name: str
    ready: bool


_READY_ERRORS = {
    **_KEYED,
    400: {"model": NotReadyOut, "description": "No model loaded yet (not ready)."},
    **_OPEN_ERRORS,
}


def _ready(request: Request, name: str, version: str | None) -> JSONResponse:
    try:
        _model(request, name, version)
    except Rejected as exc:
        # Not ready is a 4xx in this protocol, not a 503 (and a probe: not counted).
        raise BadRequest(exc.detail, ready=False) from None
    return JSONResponse({"name": name, "ready": True})


@router.get("/models/{name}/ready", response_model=ModelReadyOut, responses=_READY_ERRORS)
async def model_ready(request: Request, name: str) -> JSONResponse:
    """200 ``{"ready": true}`` when ``name`` serves; 400 ``{"error", "ready": false}``
    (not ready) when no model is loaded yet."""
    return _ready(request, name, None)


@router.get(
    "/models/{name}/versions/{version}/ready",
    response_model=ModelReadyOut,
    responses=_READY_ERRORS,
)
async def model_version_ready(request: Request, name: str, version: str) -> JSONResponse:
    """As ``/v2/models/{name}/ready``; 404 unless ``version`` is the serving one."""
    return _ready(request, name, version)


@router.post(
    "/models/{name}/infer",
    response_model=InferOut,
    responses=_INFER_OK | _SERVE_ERRORS,
    openapi_extra=_INFER_IN,
)
async def infer(request: Request, name: str) -> Response:
    """Fraud probabilities for an FP32 ``[n, n_features]`` tensor. The binary tensor
    extension is supported: with ``Inference-Header-Content-Length`` the body is that
    many bytes of JSON, then the input's raw bytes (little-endian FP32, row-major; the
    input's ``parameters.binary_data_size`` says how many); an output asked for with
    ``parameters.binary_data: true`` (or the request's ``binary_data_output: true``)
    comes back so (``application/octet-stream``, with the answer's own
    ``Inference-Header-Content-Length``; then this schema is the JSON header's, its
    output carrying ``parameters.binary_data_size`` instead of ``data``)."""
    return await _infer(request, name, None)


@router.post(
    "/models/{name}/versions/{version}/infer",
    response_model=InferOut,
    responses=_INFER_OK | _SERVE_ERRORS,
    openapi_extra=_INFER_IN,
)
async def infer_version(request: Request, name: str, version: str) -> Response:
    """As ``/v2/models/{name}/infer``, 404 unless ``version`` is the serving one."""
    return await _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None) -> Response:
    res, model = _model(request, name, version)
    _check_media(request)
    until = deadline(header(request, _TIMEOUT_KEY), res, start=arrived(request))
    x, req, binary_out = _decode(await request.body(), request, model, res.settings)
    scores = await predict(res, model, x, until)
    if not binary_out:
        out = TensorOut(name=model.meta.output_name, shape=[len(scores)], data=scores.tolist())
        body = InferOut(model_name=name, model_version=model.version, id=req.id, outputs=[out])
        return JSONResponse(body.model_dump(exclude_none=True))
    raw = scores.astype(WIRE_FP32).tobytes()
    head: dict[str, Any] = {"model_name": name, "model_version": model.version}
    if req.id is not None:
        head["id"] = req.id
    head["outputs"] = [
        {
            "name": model.meta.output_name,
            "datatype": FP32,
            "shape": [len(scores)],
            "parameters": {"binary_data_size": len(raw)},
        }
    ]
    text = json.dumps(head, separators=(",", ":")).encode()
    return Response(
        text + raw,
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(text))},
    )


def _decode(
    raw: bytes, request: Request, model: LoadedModel, settings: ServiceSettings
) -> tuple[np.ndarray, InferIn, bool]:
    """The request's tensor as float32 ``[n, n_features]``, the request, and whether the
    output goes back as binary data; or :class:`~service.errors.BadRequest` naming what
    is wrong."""
    head, binary = _split(raw, header(request, _HEADER_LENGTH_KEY))
    try:
        req = InferIn.model_validate_json(head)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"{where}: {first['msg']}") from None
    tensor = req.inputs[0]
    shape = check_input(
        model, tensor.name, tensor.datatype, tensor.shape, settings.batch_request_limit
    )
    binary_out = _flag(req.parameters, "binary_data_output", "parameters", False)
    for i, wanted in enumerate(req.outputs or []):
        check_outputs(model, [wanted.name])
        where = f"outputs.{i}.parameters"
        binary_out = _flag(wanted.parameters, "binary_data", where, binary_out)
        if wanted.parameters and wanted.parameters.get("classification"):
            raise BadRequest(
                f"{where}.classification: the classification extension is not "
                "supported; the output is the fraud probability"
            )
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        if binary:
            raise BadRequest(
                f"{len(binary)} bytes of binary data after the JSON header, but input "
                f"{tensor.name!r} has no parameters.binary_data_size"
            )
        if tensor.data is None:
            raise BadRequest(f"inputs.0.data: input {tensor.name!r} has no data")
        return from_values(model, tensor.name, tensor.data, shape), req, binary_out
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise BadRequest(
            f"inputs.0.parameters.binary_data_size: must be a byte count, got {size!r}"
        )
    if tensor.data is not None:
        raise BadRequest(f"inputs.0.data: input {tensor.name!r} has binary data; send no data")
    if size != len(binary):
        raise BadRequest(
            f"inputs.0.parameters.binary_data_size: {size} bytes, but {len(binary)} bytes of "
            "binary data follow the JSON header"
        )
    return from_bytes(model, tensor.name, binary, shape), req, binary_out


def _check_media(request: Request) -> None:
    """:class:`~service.errors.UnsupportedMediaType` (415) unless the body's Content-Type
    is JSON, ``application/octet-stream`` or absent (module docstring)."""
    ctype = header(request, b"content-type")
    if not ctype:
        return
    media = ctype.partition(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json") or media == OCTET_STREAM:
        return
    raise UnsupportedMediaType(
        f"Content-Type must be application/json (or {OCTET_STREAM}, the binary tensor "
        f"extension's), got {ctype!r}",
        "header.Content-Type",
    )


def _split(raw: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The body's JSON header and its binary data (none without the length header)."""
    if header_length is None:
        return raw, b""
    digits = header_length.isascii() and header_length.isdigit()  # not "+1" nor " 1"
    if not digits or int(header_length) > len(raw):
        raise BadRequest(
            f"{HEADER_LENGTH}: must be the JSON header's length in bytes, at most the body's "
            f"{len(raw)}, got {header_length!r}"
        )
    n = int(header_length)
    return raw[:n], raw[n:]


def _flag(params: dict[str, Any] | None, key: str, where: str, default: bool) -> bool:
    value = (params or {}).get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{where}.{key}: must be true or false, got {value!r}")
    return value
