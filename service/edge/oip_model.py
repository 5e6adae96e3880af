"""The Open Inference Protocol v2's model path, shared by its REST (``service.edge.oip``)
and gRPC (``service.edge.oip_grpc``) servers: which model a call names, the checks of
its input tensor, and the model run. Both protocols raise the same ``service.errors``
types from here and answer them in their own shape (REST ``{"error"}`` and its status,
gRPC a status code).

A tensor is refused (:class:`~service.errors.BadRequest`) unless it is the model's one
input, FP32, shape ``[n, n_features]`` with ``1 <= n <= max_rows``, and every element a
finite number: a ``null``, ``NaN`` or infinity (or a number beyond FP32's range) is
named by its element index, row, column and feature, never scored.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from service.core.batching import TimedOut
from service.core.model import LoadedModel
from service.edge.routes import TIMEOUT_HEADER, TIMEOUT_PROBLEM, timeout_ms
from service.errors import BadRequest, NotFound
from service.resources import Resources

PLATFORM = "onnxruntime_onnx"
FP32 = "FP32"
# On the wire (raw gRPC contents, REST binary data): little-endian FP32, unpadded.
WIRE_FP32 = np.dtype("<f4")


def served(res: Resources, name: str, version: str | None) -> LoadedModel:
    """The serving model if it is ``name`` (and ``version``, when given); else
    :class:`~service.errors.NotFound`, or :class:`~service.errors.Rejected` (503
    ``no_model``) when no model serves. The caller checks the key's scope first."""
    if name != res.settings.model_name:
        raise NotFound(f"unknown model {name!r}; this service serves {res.settings.model_name!r}")
    model = res.models.require()
    if version is not None and version != model.version:
        raise NotFound(f"model {name!r} version {version!r} is not served; {model.version!r} is")
    return model


def deadline(
    raw_ms: str | None, res: Resources, header: str = TIMEOUT_HEADER, start: float | None = None
) -> float:
    """The call's deadline (``time.monotonic()``): ``raw_ms`` milliseconds from ``start``
    (the request's arrival; None: now) (the ``X-Request-Timeout-Ms`` header or metadata,
    in (0, 60000]), else the configured default; :class:`~service.errors.BadRequest`
    naming ``header`` for another value."""
    if start is None:
        start = time.monotonic()
    if raw_ms is None:
        return start + res.settings.request_timeout_ms / 1e3
    ms = timeout_ms(raw_ms)
    if ms is None:
        raise BadRequest(f"{header}: " + TIMEOUT_PROBLEM.format(raw=raw_ms))
    return start + ms / 1e3


def check_input(
    model: LoadedModel, name: str, datatype: str, shape: Sequence[int], max_rows: int
) -> tuple[int, int]:
    """The input's ``(rows, columns)`` if it is the model's input as it must be sent."""
    meta = model.meta
    n_features = len(meta.features)
    if name != meta.input_name:
        raise BadRequest(f"input {name!r} unknown; the model's input is {meta.input_name!r}")
    if datatype != FP32:
        raise BadRequest(f"input {name!r}: datatype must be FP32, got {datatype!r}")
    if len(shape) != 2 or shape[1] != n_features or shape[0] < 1:
        raise BadRequest(f"input {name!r}: shape must be [n, {n_features}], got {list(shape)}")
    if shape[0] > max_rows:
        raise BadRequest(f"input {name!r}: {shape[0]} rows; at most {max_rows}")
    return int(shape[0]), int(shape[1])


def check_outputs(model: LoadedModel, names: Iterable[str]) -> None:
    """Every requested output is the model's one output."""
    want = model.meta.output_name
    for name in names:
        if name != want:
            raise BadRequest(f"output {name!r} unknown; the model's is {want!r}")


def from_values(
    model: LoadedModel, name: str, values: list[Any], shape: tuple[int, int]
) -> np.ndarray:
    """JSON tensor data, flat or nested row-major, as float32 ``shape``; every element
    must be a number (not a bool, a string or ``null``) and finite."""
    try:
        arr = np.asarray(values)
    except ValueError:  # ragged nesting
        raise BadRequest(
            f"input {name!r}: data is not a regular array of shape {list(shape)}"
        ) from None
    _check_size(name, arr.size, shape)
    # numpy makes one type of them all (a bool turns 1.0, a number next to a string a
    # string): look at the elements as sent, ~50 us for 128 rows.
    flat = itertools.chain.from_iterable(values) if isinstance(values[0], list) else values
    if not set(map(type, flat)) <= {float, int}:
        for i, v in enumerate(np.asarray(values, dtype=object).reshape(-1).tolist()):
            if v is None or isinstance(v, bool) or not isinstance(v, int | float):
                raise BadRequest(f"input {name!r}: {_element(model, i, shape)} is {_shown(v)}")
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            x = arr.astype(np.float32).reshape(shape)
    except (OverflowError, ValueError, TypeError) as exc:  # e.g. an int beyond int64
        raise BadRequest(f"input {name!r}: data is not FP32: {exc}") from None
    return check_finite(model, name, x)


def from_floats(
    model: LoadedModel, name: str, values: Sequence[float], shape: tuple[int, int]
) -> np.ndarray:
    """Protobuf ``fp32_contents`` (floats already) as float32 ``shape``, finite."""
    arr = np.asarray(values, dtype=np.float32)
    _check_size(name, arr.size, shape)
    return check_finite(model, name, arr.reshape(shape))


def _check_size(name: str, size: int, shape: tuple[int, int]) -> None:
    if size != shape[0] * shape[1]:
        raise BadRequest(
            f"input {name!r}: {size} elements; shape {list(shape)} needs {shape[0] * shape[1]}"
        )


def from_bytes(model: LoadedModel, name: str, raw: bytes, shape: tuple[int, int]) -> np.ndarray:
    """Raw tensor bytes (little-endian FP32, row-major) as float32 ``shape``, finite."""
    want = shape[0] * shape[1] * WIRE_FP32.itemsize
    if len(raw) != want:
        raise BadRequest(
            f"input {name!r}: {len(raw)} bytes of data; FP32 shape {list(shape)} needs {want}"
        )
    x = np.frombuffer(raw, dtype=WIRE_FP32).astype(np.float32).reshape(shape)
    return check_finite(model, name, x)


def check_finite(model: LoadedModel, name: str, x: np.ndarray) -> np.ndarray:
    """``x`` if every element is finite, else :class:`~service.errors.BadRequest` naming
    the first that is not."""
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise BadRequest(
            f"input {name!r}: {_element(model, i, x.shape)} is {_shown(float(x.flat[i]))}"
        )
    return x


def _element(model: LoadedModel, i: int, shape: Sequence[int]) -> str:
    row, col = divmod(i, shape[1])
    return f"element {i} (row {row}, column {col}: {model.meta.feature_names[col]!r})"


def _shown(v: Any) -> str:
    if v is None:
        what = "null"
    elif isinstance(v, float) and np.isnan(v):
        what = "NaN"
    elif isinstance(v, float) and np.isinf(v):
        what = "infinite (or beyond FP32's range)"
    else:
        what = f"{v!r}, a {type(v).__name__}"
    return f"{what}; every element must be a finite number"


async def predict(res: Resources, model: LoadedModel, x: np.ndarray, until: float) -> np.ndarray:
    """The model's fraud probabilities for ``x`` (float32 ``[n]``), run on the scoring
    thread pool (never on the event loop) until the deadline ``until``
    (``time.monotonic()``): past it, :class:`~service.core.batching.TimedOut` (503
    ``timeout``, counted by whoever answers it)."""
    try:
        async with asyncio.timeout(max(until - time.monotonic(), 0)):
            scores = await asyncio.get_running_loop().run_in_executor(
                res.scorer.pool, model.predict, x
            )
    except TimeoutError:
        raise TimedOut() from None
    return np.asarray(scores, dtype=np.float32)
