"""The Open Inference Protocol v2 (KServe / Triton / MLServer REST) on the raw model.

Clients of serving stacks reach the model here with no knowledge of transactions: the
input is an FP32 tensor ``[n, n_features]`` of the model's features in the model's
order (``GET /v2/models/{name}`` lists them under ``parameters.feature_names``); the
output ``probabilities`` is the FP32 fraud probability per row, shape ``[n]``. No
feature read, no decision policy, no session state, no decision log: that is
``/v1/score``.

The life of an inference request: admission (``service.edge.admission``: body bounds and
the in-flight bound, shared with ``/v1``) → the ``score`` scope → decode and check the
tensor → the model, on the scoring thread pool (never on the event loop) under the
request's deadline (``X-Request-Timeout-Ms`` as on ``/v1``) → encode. The micro-batcher
is not used: its items are transactions, and a tensor request is already a batch.

Errors are raised as ``service.errors``' types, as on ``/v1``, and answered in the
protocol's shape, ``{"error": "..."}`` (``service.edge.errors_http``, by path): 400 bad
request (:class:`~service.errors.BadRequest`), 401/403 auth, 404 unknown model or
version, 503 (Retry-After) when the model cannot serve now (counted under its reason in
``fraud_rejections_total``). The health endpoints are open, like ``/healthz``; metadata
and inference need the ``score`` scope.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from service.core.batching import TimedOut
from service.core.model import LoadedModel
from service.edge.auth import Scope, check_scope
from service.edge.routes import request_deadline
from service.errors import BadRequest, Invalid, NotFound, Rejected
from service.resources import Resources, resources

router = APIRouter(prefix="/v2", tags=["Open Inference Protocol v2"])

PLATFORM = "onnxruntime_onnx"


class TensorIn(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    # Row-major, flat or nested as the protocol allows.
    data: list[Any]
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
    data: list[float]


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


class OipErrorOut(BaseModel):
    error: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": OipErrorOut, "description": d}
    for s, d in {
        400: "The request or its tensor is not acceptable.",
        401: "No API key, or an unknown one (auth on only).",
        403: "The key lacks the 'score' scope (auth on only).",
        404: "No such model or version is served.",
    }.items()
}
_SERVE_ERRORS = {
    **_ERRORS,
    503: {"model": OipErrorOut, "description": "No model, overloaded or past the deadline."},
}


def _model(request: Request, name: str, version: str | None) -> tuple[Resources, LoadedModel]:
    """The serving model if it is ``name`` (and ``version``), after the scope check;
    else the key check's 401/403, :class:`~service.errors.NotFound`, or
    :class:`~service.errors.Rejected` (503 ``no_model``) when none serves."""
    check_scope(request, Scope.SCORE)
    res = resources(request)
    if name != res.settings.model_name:
        raise NotFound(f"unknown model {name!r}; this service serves {res.settings.model_name!r}")
    model = res.models.require()
    if version is not None and version != model.version:
        raise NotFound(f"model {name!r} version {version!r} is not served; {model.version!r} is")
    return res, model


@router.get("/health/live")
async def live() -> dict[str, bool]:
    """Always 200 while the process answers."""
    return {"live": True}


@router.get("/health/ready", responses={400: {"model": OipErrorOut}})
async def ready(request: Request) -> JSONResponse:
    """200 when a model serves (the raw model needs no feature store), else 400 as the
    protocol asks (a 4xx means "not ready")."""
    why = resources(request).models.readiness()
    if why is not None:
        raise BadRequest(f"model {why}", ready=False)
    return JSONResponse({"ready": True})


@router.get("")
async def server_metadata(request: Request) -> dict[str, Any]:
    """The server's name, version and protocol extensions (none)."""
    return {"name": "fraud-scoring", "version": request.app.version, "extensions": []}


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


@router.get("/models/{name}", response_model=ModelMetaOut, responses=_SERVE_ERRORS)
async def model_metadata(request: Request, name: str) -> JSONResponse:
    """The model's input (FP32 ``[-1, n_features]``) and output (FP32 ``[-1]``)."""
    return _metadata(request, name, None)


@router.get(
    "/models/{name}/versions/{version}", response_model=ModelMetaOut, responses=_SERVE_ERRORS
)
async def model_version_metadata(request: Request, name: str, version: str) -> JSONResponse:
    """As ``/v2/models/{name}``, 404 unless ``version`` is the serving one."""
    return _metadata(request, name, version)


@router.get("/models/{name}/ready", responses={**_ERRORS, 400: {"model": OipErrorOut}})
async def model_ready(request: Request, name: str) -> JSONResponse:
    """200 when ``name`` serves, 400 (not ready) when no model is loaded yet."""
    try:
        _model(request, name, None)
    except Rejected as exc:
        # Not ready is a 4xx in this protocol, not a 503 (and a probe: not counted).
        raise BadRequest(exc.detail) from None
    return JSONResponse({"name": name, "ready": True})


@router.post("/models/{name}/infer", response_model=InferOut, responses=_SERVE_ERRORS)
async def infer(request: Request, name: str) -> JSONResponse:
    """Fraud probabilities for an FP32 ``[n, n_features]`` tensor (JSON tensor data;
    the binary tensor extension is not supported)."""
    return await _infer(request, name, None)


@router.post(
    "/models/{name}/versions/{version}/infer", response_model=InferOut, responses=_SERVE_ERRORS
)
async def infer_version(request: Request, name: str, version: str) -> JSONResponse:
    """As ``/v2/models/{name}/infer``, 404 unless ``version`` is the serving one."""
    return await _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None) -> JSONResponse:
    res, model = _model(request, name, version)
    try:
        deadline = request_deadline(request, res)
    except Invalid as exc:
        raise BadRequest(exc.message) from None  # the protocol's 400, not /v1's 422
    x, req = _decode(await request.body(), request, model, res.settings.batch_request_limit)
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
            scores = await asyncio.get_running_loop().run_in_executor(
                res.scorer.pool, model.predict, x
            )
    except TimeoutError:
        raise TimedOut() from None
    out = TensorOut(
        name=model.meta.output_name,
        shape=[len(scores)],
        data=np.asarray(scores, dtype=np.float32).tolist(),
    )
    body = InferOut(model_name=name, model_version=model.version, id=req.id, outputs=[out])
    return JSONResponse(body.model_dump(exclude_none=True))


def _decode(raw: bytes, request: Request, model: LoadedModel, max_rows: int) -> tuple[Any, InferIn]:
    """The request's tensor as float32 ``[n, n_features]``, or
    :class:`~service.errors.BadRequest` naming what is wrong."""
    if "inference-header-content-length" in request.headers:
        raise BadRequest("the binary tensor data extension is not supported; send JSON data")
    try:
        req = InferIn.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"{where}: {first['msg']}") from None
    meta = model.meta
    tensor = req.inputs[0]
    n_features = len(meta.features)
    if tensor.name != meta.input_name:
        raise BadRequest(f"input {tensor.name!r} unknown; the model's input is {meta.input_name!r}")
    if tensor.datatype != "FP32":
        raise BadRequest(f"input {tensor.name!r}: datatype must be FP32, got {tensor.datatype!r}")
    if len(tensor.shape) != 2 or tensor.shape[1] != n_features or tensor.shape[0] < 1:
        raise BadRequest(
            f"input {tensor.name!r}: shape must be [n, {n_features}], got {tensor.shape}"
        )
    if tensor.shape[0] > max_rows:
        raise BadRequest(f"input {tensor.name!r}: {tensor.shape[0]} rows; at most {max_rows}")
    for wanted in req.outputs or []:
        if wanted.name != meta.output_name:
            raise BadRequest(f"output {wanted.name!r} unknown; the model's is {meta.output_name!r}")
    try:
        x = np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    except (ValueError, TypeError) as exc:
        raise BadRequest(
            f"input {tensor.name!r}: data does not fit shape {tensor.shape}: {exc}"
        ) from None
    return x, req
