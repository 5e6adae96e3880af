"""The service's failure types: one rejection type for every 503, and the start-up error.

A part that cannot serve a request raises :class:`Rejected` (or a subclass named after
where it happens: the batcher's ``QueueFull``, the scorer's ``FeatureStoreUnavailable``)
with a reason from the closed set :class:`RejectReason`. One handler turns it into
``503`` with ``Retry-After`` and counts it in ``fraud_rejections_total{reason}``. This
module imports nothing else from the service, so the batcher can raise these types and
stay free of HTTP and telemetry.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar


class RejectReason(StrEnum):
    """Why a scoring request got no decision: the ``reason`` label values of
    ``fraud_rejections_total`` (a closed set, so dashboards can rely on it)."""

    INFLIGHT = "inflight"  # admission limit: too many requests in the process
    QUEUE_FULL = "queue_full"  # the micro-batch queue is at max_queue_size
    DEADLINE = "deadline"  # the deadline passed, or cannot be met, before the model
    TIMEOUT = "timeout"  # the request's own deadline fired while it waited
    FEATURE_STORE = "feature_store"  # the online store (Redis) did not answer
    NO_BATCH_FEATURES = "no_batch_features"  # the store holds no batch features (refuse)
    NO_MODEL = "no_model"  # no model loaded (none published yet, or it cannot load)
    SHUTTING_DOWN = "shutting_down"  # still queued when the service stopped
    DISCONNECTED = "disconnected"  # the client left first (answered 499, not 503)
    NOT_READY = "not_ready"  # the readiness probe (not counted: not a scoring request)


class Rejected(Exception):
    """The request cannot be served now; the caller should retry after ``retry_after_s``
    or use its own fallback. Answered ``503`` with ``{"detail": detail}``."""

    counted: ClassVar[bool] = True  # counted in fraud_rejections_total

    def __init__(self, reason: RejectReason, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s

    def content(self) -> dict[str, Any]:
        """The JSON body of the 503 answer."""
        return {"detail": self.detail}


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
