"""The error answers: every failure as one of ``service.errors``' types, answered here.

:data:`EXCEPTION_HANDLERS` (the app's ``exception_handlers``) answers an
:class:`~service.errors.ApiError` and the framework's and other modules' own exceptions,
translated to one first (:func:`as_api_error`: FastAPI's validation errors, Starlette's
404/405, the key check's ``AuthError``, the idempotency check's ``IdReused``). The pure
ASGI layers that answer before the app (admission, the connection's drain) call
:func:`answer` themselves. :func:`answer` counts a counted type's reason in
``fraud_rejections_total`` and picks the shape by path: the Open Inference Protocol's
``{"error"}`` under ``/v2``, the ``/v1`` problem list anywhere else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from service.core.idempotency import IdReused
from service.edge.auth import AuthError
from service.errors import (
    ApiError,
    ErrorCode,
    Forbidden,
    Invalid,
    MethodNotAllowed,
    NotFound,
    Rejected,
    TransactionIdReused,
    Unauthenticated,
    bounded,
    error_body,
)
from service.resources import STATE_KEY, Resources

OIP_PREFIX = "/v2"


def is_oip(scope: Mapping[str, Any]) -> bool:
    """Whether the request is the Open Inference Protocol's (its own error shape)."""
    path: str = scope["path"]
    return path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/")


def answer(scope: Mapping[str, Any], exc: ApiError) -> JSONResponse:
    """The answer to ``exc``: its status, headers and body in the request's protocol;
    counted under its reason when its type is (not before the lifespan started: nothing
    to count with)."""
    if isinstance(exc, Rejected) and exc.counted:
        res: Resources | None = scope.get("state", {}).get(STATE_KEY)
        if res is not None:
            res.count_rejection(exc.reason)
    content = exc.oip_content() if is_oip(scope) else exc.content()
    return JSONResponse(content, exc.status, headers=exc.headers)


def as_api_error(exc: Exception, request: Request) -> ApiError:
    """``exc`` as the failure type it means (an :class:`ApiError` as it is)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):  # FastAPI's: query parameters, bodies
        return Invalid.from_errors(exc.errors())
    if isinstance(exc, AuthError):
        if exc.status == 401:
            return Unauthenticated(exc.detail, headers=exc.headers)
        return Forbidden(exc.detail, headers=exc.headers)
    if isinstance(exc, IdReused):
        return TransactionIdReused(str(exc), "transaction_id")
    if isinstance(exc, StarletteHTTPException):  # Starlette's: no such route, or method
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 405:
            return MethodNotAllowed(message, headers={**(exc.headers or {}), **_allow(request)})
        return NotFound(message, headers=exc.headers)
    raise TypeError(f"no failure type for {type(exc).__name__}")


def _allow(request: Request) -> dict[str, str]:
    """``Allow`` naming every method the document lists for the path: Starlette's 405
    names only the first route's, and a path may have one route per method
    (``/v1/lists/{name}/items``)."""
    path = request.url.path
    for template, ops in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), path):
            return {"Allow": ", ".join(m.upper() for m in ops if m != "parameters")}
    return {}


async def _answer(request: Request, exc: Exception) -> Response:
    if isinstance(exc, StarletteHTTPException) and exc.status_code not in (404, 405):
        # Not a refusal of this service's (none raises HTTPException): Starlette's status
        # as it is, in the one shape.
        if exc.status_code < 400 or exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        message = bounded(f"{request.method} {request.url.path}: {exc.detail}")
        body = error_body(ErrorCode.INVALID, message)
        return JSONResponse(body, exc.status_code, headers=exc.headers)
    return answer(request.scope, as_api_error(exc, request))


EXCEPTION_HANDLERS: dict[
    int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]
] = {
    t: _answer
    for t in (ApiError, RequestValidationError, AuthError, IdReused, StarletteHTTPException)
}
