"""The service's failure types: one exception per meaning, each carrying its answer.

Every refusal is an :class:`ApiError`, raised where it happens: its class fixes the HTTP
``status``, the stable ``code`` (:class:`ErrorCode`; a 503's code is its
:class:`RejectReason`) and whether it is ``counted`` in ``fraud_rejections_total{reason}``
(every 503 but the readiness probe's). :data:`ERRORS` is the table (docs/api.md, "Error
answers", lists it for callers); ``service.edge.errors_http`` turns any of them into the
one answer. This module imports nothing else from the service and no HTTP framework, so
the core (the batcher, the scorer) raises these types too.

The ``/v1`` body is :class:`ErrorOut` (:meth:`ApiError.content`): ``detail``, a list of
:class:`Problem` (``field`` when one field is at fault, ``code``, a human ``message``).
The ``/v2`` inference protocol's body is ``{"error": message}``
(:meth:`ApiError.oip_content`), from the same types.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, Field

# Shown in a 422's problem list: more than this many problems end in a count, not a list.
MAX_PROBLEMS = 20
# An error message repeats at most this many characters of one value (a run without
# white space: a name, a datatype, a header's value, as sent), then "…"; and is at most
# MESSAGE_LIMIT characters in all (values with spaces). Whatever a client sends, the
# answer stays short: over gRPC the message travels in the status's trailing metadata,
# which a client refuses past 8 KiB (RESOURCE_EXHAUSTED instead of the refusal).
ECHO_LIMIT = 100
MESSAGE_LIMIT = 500
_LONG_RUN = re.compile(rf"\S{{{ECHO_LIMIT + 1},}}")


class ErrorCode(StrEnum):
    """Stable ``code`` values of 4xx problems (503s use :class:`RejectReason`)."""

    UNAUTHENTICATED = "unauthenticated"  # 401: no key, or an unknown one
    FORBIDDEN = "forbidden"  # 403: the key lacks the scope
    BODY_TIMEOUT = "body_timeout"  # 408: the body did not arrive in time
    NOT_FOUND = "not_found"  # 404: no review item with that transaction_id, or no route
    METHOD_NOT_ALLOWED = "method_not_allowed"  # 405: the route does not take the method
    MODEL_REJECTED = "model_rejected"  # 409: the new model failed to load or validate
    ID_REUSED = "id_reused"  # 409: the transaction_id was used for another transaction
    TOO_LARGE = "too_large"  # 413: body bytes or transactions over the limit
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # 415: not JSON
    INVALID_JSON = "invalid_json"  # 422: the body is not JSON
    MISSING = "missing"  # 422: a required field is absent
    INVALID = "invalid"  # 422: a field's value is not acceptable (400 on /v2)
    NOT_AVAILABLE = "not_available"  # 501: the route needs what this image does not install


class RejectReason(StrEnum):
    """Why a request cannot be served now: the ``code`` of its 503 and the ``reason``
    label values of ``fraud_rejections_total`` (a closed set, so dashboards can rely on
    it)."""

    INFLIGHT = "inflight"  # admission: the process holds its capacity in transactions
    CLIENT_SHARE = "client_share"  # admission: the caller's key holds its fair share
    QUEUE_FULL = "queue_full"  # the micro-batch queue is at max_queue_size
    DEADLINE = "deadline"  # the deadline passed, or cannot be met, before the model
    TIMEOUT = "timeout"  # the request's own deadline fired while it waited
    FEATURE_STORE = "feature_store"  # the online store (Redis) did not answer
    NO_BATCH_FEATURES = "no_batch_features"  # the store holds no batch features (refuse)
    NO_MODEL = "no_model"  # no model loaded (none published yet, or it cannot load)
    SHUTTING_DOWN = "shutting_down"  # still queued when the service stopped
    DRAINING = "draining"  # arrived on an open connection after SIGTERM
    LOG_OFF = "log_off"  # /v1/feedback, /v1/review: the event log is off
    LOG_UNAVAILABLE = "log_unavailable"  # /v1/feedback, /v1/review: the log's server is down
    DISCONNECTED = "disconnected"  # the client left first (nobody reads the answer)
    NOT_READY = "not_ready"  # the readiness probe (not counted: not a refused request)


class Problem(BaseModel):
    """One thing wrong with a request, or why it cannot be served now."""

    field: str | None = Field(
        default=None,
        description="the field or header at fault, dotted (e.g. 'transactions.3.amount'); "
        "absent when no single field is",
    )
    code: str = Field(description="stable, machine-readable; see docs/api.md, Error answers")
    message: str = Field(description="for people; may change between versions")


class ErrorOut(BaseModel):
    """Every error answer of the /v1 API."""

    detail: list[Problem]
    problems_total: int | None = Field(
        default=None, description="422 only, when more problems were found than listed"
    )
    serving_version: str | None = Field(
        default=None, description="409 only: the version that keeps serving"
    )


def bounded(message: str) -> str:
    """``message`` with every run of more than :data:`ECHO_LIMIT` non-space characters
    cut to that many and "…", then cut to :data:`MESSAGE_LIMIT` characters and "…":
    every refusal's message, on every transport (:class:`ApiError` applies it), so
    no value a client sends is echoed whole."""
    cut = _LONG_RUN.sub(lambda m: m.group()[:ECHO_LIMIT] + "…", message)
    return cut if len(cut) <= MESSAGE_LIMIT else cut[:MESSAGE_LIMIT] + "…"


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer with one problem."""
    problem: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        problem["field"] = field
    return {"detail": [problem]}


class ApiError(Exception):
    """A request refused: answered :attr:`status` with one problem (:attr:`code`,
    ``message``, ``field`` when one field is at fault). ``headers`` go with the answer;
    ``extra`` fields join the body (either shape). The message is :func:`bounded` (it
    may echo what the client sent) unless the type says it cannot (``bound_message``)."""

    status: ClassVar[int]
    code: str  # a class default; a 503's is its reason
    counted: ClassVar[bool] = False  # counted in fraud_rejections_total
    bound_message: ClassVar[bool] = True

    def __init__(
        self,
        message: str,
        field: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        if self.bound_message:
            message = bounded(message)
            field = None if field is None else bounded(field)
        super().__init__(message)
        self.message, self.field = message, field
        self.headers = dict(headers or {})
        self.extra = extra

    def problems(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = error_body(self.code, self.message, self.field)["detail"]
        return body

    def content(self) -> dict[str, Any]:
        """The ``/v1`` body (:class:`ErrorOut`)."""
        return {"detail": self.problems(), **self.extra}

    def oip_content(self) -> dict[str, Any]:
        """The ``/v2`` (Open Inference Protocol) body: ``{"error": message}``."""
        return {"error": self.message, **self.extra}


class BadRequest(ApiError):
    """``/v2`` only: the inference request or its tensor is not acceptable (the protocol
    answers 400 where ``/v1`` answers :class:`Invalid`)."""

    status, code = 400, ErrorCode.INVALID


class Unauthenticated(ApiError):
    """No API key, or an unknown one (``headers``: ``WWW-Authenticate``)."""

    status, code = 401, ErrorCode.UNAUTHENTICATED


class Forbidden(ApiError):
    """The key lacks the scope the route (or a header's mode) needs."""

    status, code = 403, ErrorCode.FORBIDDEN


class NotFound(ApiError):
    """No such route, review item, model or model version."""

    status, code = 404, ErrorCode.NOT_FOUND


class NotAvailable(ApiError):
    """The route needs a part this install lacks (``POST /v1/rules/test`` on the serving
    image: the decision log reader is the jobs image's)."""

    status, code = 501, ErrorCode.NOT_AVAILABLE


class MethodNotAllowed(ApiError):
    """The route does not take the method (``headers``: ``Allow``)."""

    status, code = 405, ErrorCode.METHOD_NOT_ALLOWED


class BodyTimeout(ApiError):
    """The body did not arrive whole within FRAUD_BODY_TIMEOUT_S."""

    status, code = 408, ErrorCode.BODY_TIMEOUT


class ModelRejected(ApiError):
    """A reload's new model failed to load or validate; ``serving_version`` keeps
    serving (it joins the body)."""

    status, code = 409, ErrorCode.MODEL_REJECTED
    # The model load's own error (paths, the runtime's text) for an admin: nothing the
    # caller sent, kept whole.
    bound_message = False

    def __init__(self, message: str, serving_version: str | None) -> None:
        super().__init__(message, serving_version=serving_version)


class TransactionIdReused(ApiError):
    """The ``transaction_id`` was already used for another transaction."""

    status, code = 409, ErrorCode.ID_REUSED


class TooLarge(ApiError):
    """The body's bytes, or the batch's transactions (or a tensor's rows on ``/v2``:
    :class:`BadRequest`), are over the limit."""

    status, code = 413, ErrorCode.TOO_LARGE


class UnsupportedMediaType(ApiError):
    """The request's Content-Type is not JSON."""

    status, code = 415, ErrorCode.UNSUPPORTED_MEDIA_TYPE


class Invalid(ApiError):
    """The body or a header is not valid: one problem per field (the first
    :data:`MAX_PROBLEMS`, then ``problems_total``). One problem:
    ``Invalid(message, field, code)``; pydantic's errors: :meth:`from_errors`."""

    status, code = 422, ErrorCode.INVALID

    def __init__(
        self, message: str, field: str | None = None, code: ErrorCode = ErrorCode.INVALID
    ) -> None:
        super().__init__(message, field)
        self.code = code
        self.listed = [{"field": self.field or "body", "code": code, "message": self.message}]
        self.total = 1

    @classmethod
    def from_errors(cls, errors: Sequence[Mapping[str, Any]], *prefix: str | int) -> Invalid:
        """pydantic's (or FastAPI's) errors, located under ``prefix``: ``loc`` without
        its ``body`` parts, dotted, is the ``field``; pydantic's ``json_invalid`` is
        ``invalid_json`` and ``missing`` is ``missing``, any other type ``invalid``."""
        listed = [_problem(e, prefix) for e in errors[:MAX_PROBLEMS]]
        first = listed[0]
        exc = cls(first["message"], first["field"], first["code"])
        exc.listed, exc.total = listed, len(errors)
        return exc

    def problems(self) -> list[dict[str, Any]]:
        return self.listed

    def content(self) -> dict[str, Any]:
        body: dict[str, Any] = {"detail": self.listed}
        if self.total > len(self.listed):
            body["problems_total"] = self.total
        return body


_PYDANTIC_CODES = {"json_invalid": ErrorCode.INVALID_JSON, "missing": ErrorCode.MISSING}


def _problem(e: Mapping[str, Any], prefix: Sequence[str | int]) -> dict[str, Any]:
    loc = [str(p) for p in (*prefix, *e["loc"]) if p != "body"]
    code, message = _PYDANTIC_CODES.get(e["type"], ErrorCode.INVALID), e["msg"]
    if e["type"] == "json_invalid":
        message = f"body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
    field = bounded(".".join(loc)) or "body"  # a key the client named may be in it
    return {"field": field, "code": code, "message": bounded(message)}


class Rejected(ApiError):
    """The request cannot be served now; the caller should retry after ``retry_after_s``
    (the ``Retry-After`` header) or use its own fallback. Answered ``503`` with one
    problem whose ``code`` is ``reason``, and counted under that reason. Subclasses are
    named after where it happens (the batcher's ``QueueFull``, the scorer's
    ``FeatureStoreUnavailable``)."""

    status = 503
    counted = True

    def __init__(self, reason: RejectReason, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})
        self.code = self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s


class NotReady(Rejected):
    """``/readyz``: the process cannot serve yet; ``problems`` names each part and why
    (e.g. ``{"model": "not loaded"}``), and is the body. A probe is not a refused
    request, so it is not counted."""

    counted = False

    def __init__(self, problems: dict[str, str], retry_after_s: int = 5) -> None:
        super().__init__(RejectReason.NOT_READY, "not ready", retry_after_s)
        self.ready_problems = problems

    def content(self) -> dict[str, Any]:
        return {"status": "not ready", **self.ready_problems}


# The table: every type a refusal is raised as (docs/api.md lists each status and code).
ERRORS: tuple[type[ApiError], ...] = (
    BadRequest,
    Unauthenticated,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    BodyTimeout,
    ModelRejected,
    TransactionIdReused,
    TooLarge,
    UnsupportedMediaType,
    Invalid,
    NotAvailable,
    Rejected,
    NotReady,
)


class ServiceStartError(RuntimeError):
    """The service refused to start (e.g. no REDIS_URL), or its process exited or did not
    become ready in time."""


class ServiceConfigError(ValueError):
    """The service cannot start as configured: its HTTP or gRPC port is taken, its host is
    not a local address, a TLS file cannot be read. The message names the setting (exit
    status 2, one line)."""


# 503 codes a caller can meet (``disconnected`` has no reader, ``not_ready`` is /readyz).
SERVING_REASONS = tuple(r for r in RejectReason if r not in ("disconnected", "not_ready"))

_WHEN = {
    401: "No API key, or an unknown one (`unauthenticated`); auth on only.",
    403: "The key lacks the route's scope (`forbidden`, naming it); auth on only.",
    408: "The body did not arrive within FRAUD_BODY_TIMEOUT_S (`body_timeout`).",
    404: "No review item with that transaction_id (`not_found`).",
    409: "The new model failed to load or validate (`model_rejected`; the old one serves), "
    "or the transaction_id was already used for another transaction (`id_reused`, naming "
    "the fields that differ; a retry with the same content gets the original answer).",
    413: "The body is over FRAUD_MAX_BODY_BYTES, or has too many transactions (`too_large`).",
    415: "Content-Type is not JSON (`unsupported_media_type`); every POST needs it, "
    "/v1/models/reload also without a body (no cross-site form can post).",
    422: "The body or a header is invalid (`invalid_json`, `missing`, `invalid`), one "
    "problem per field.",
    501: "This image lacks a part the route needs (`not_available`, naming it): "
    "`POST /v1/rules/test` reads the decision log with the jobs image's DuckDB.",
    503: "Cannot be served now; retry after `Retry-After` seconds. `code` is the reason: "
    + ", ".join(f"`{r}`" for r in SERVING_REASONS)
    + " (`log_off`, `log_unavailable` on /v1/feedback and /v1/review only).",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for ``statuses``, each with :class:`ErrorOut`."""
    return {s: {"model": ErrorOut, "description": _WHEN[s]} for s in statuses}
