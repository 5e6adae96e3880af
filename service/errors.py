"""The service's failure types: one rejection type for every 503, and the start-up error.

A part that cannot serve a request raises :class:`Rejected` (or a subclass named after
where it happens: the batcher's ``QueueFull``, the scorer's ``FeatureStoreUnavailable``)
with a reason from the closed set :class:`RejectReason`. One handler turns it into
``503`` with ``Retry-After`` and counts it in ``fraud_rejections_total{reason}``. This
module imports nothing else from the service, so the batcher can raise these types and
stay free of HTTP and telemetry.

Every error answer of the ``/v1`` API has one shape, :class:`ErrorOut`: ``detail`` is a
list of :class:`Problem` (``field`` when one field is at fault, a stable ``code`` from
:class:`ErrorCode` or :class:`RejectReason`, and a human ``message``). Build it with
:func:`error_body`. (The ``/v2`` inference protocol has its own shape, ``{"error"}``.)
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar

from pydantic import BaseModel, Field


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
    INVALID = "invalid"  # 422: a field's value is not acceptable
    LOG_OFF = "log_off"  # 503 on /v1/feedback, /v1/review: the event log is off
    LOG_UNAVAILABLE = "log_unavailable"  # 503 on /v1/feedback, /v1/review: the log's server


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


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer with one problem."""
    problem: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        problem["field"] = field
    return {"detail": [problem]}


class RejectReason(StrEnum):
    """Why a scoring request got no decision: the ``reason`` label values of
    ``fraud_rejections_total`` (a closed set, so dashboards can rely on it)."""

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
    DISCONNECTED = "disconnected"  # the client left first (answered 499, not 503)
    NOT_READY = "not_ready"  # the readiness probe (not counted: not a scoring request)


class Rejected(Exception):
    """The request cannot be served now; the caller should retry after ``retry_after_s``
    or use its own fallback. Answered ``503`` with one problem whose ``code`` is
    ``reason``."""

    counted: ClassVar[bool] = True  # counted in fraud_rejections_total

    def __init__(self, reason: RejectReason, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s

    def content(self) -> dict[str, Any]:
        """The JSON body of the 503 answer."""
        return error_body(self.reason, self.detail)


class NotReady(Rejected):
    """``/readyz``: the process cannot serve yet; ``problems`` names each part and why
    (e.g. ``{"model": "not loaded"}``). A probe is not a refused scoring request, so it is
    not counted."""

    counted = False

    def __init__(self, problems: dict[str, str], retry_after_s: int = 5) -> None:
        super().__init__(RejectReason.NOT_READY, "not ready", retry_after_s)
        self.problems = problems

    def content(self) -> dict[str, Any]:
        return {"status": "not ready", **self.problems}


class ServiceStartError(RuntimeError):
    """The service refused to start (e.g. no REDIS_URL), or its process exited or did not
    become ready in time."""


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
    503: "Cannot be served now; retry after `Retry-After` seconds. `code` is the reason: "
    + ", ".join(f"`{r}`" for r in RejectReason if r not in ("disconnected", "not_ready"))
    + "; on /v1/feedback and /v1/review `log_off`, `log_unavailable`.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for ``statuses``, each with :class:`ErrorOut`."""
    return {s: {"model": ErrorOut, "description": _WHEN[s]} for s in statuses}
