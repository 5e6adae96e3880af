"""What the service knows about its online store between requests: a circuit breaker
around Redis reads, and whether the store holds batch features at all.

**Breaker.** After ``failures`` consecutive failed reads the breaker opens: for
``open_s`` seconds no read is tried and :meth:`StoreHealth.admit` raises at once, so a
hung server costs one timeout, not one per request. Then it is half-open: one read (a
request's, or the watcher's probe) goes through; success closes it, failure opens it
again for ``open_s``. ``/readyz`` reads :meth:`StoreHealth.problem`, so readiness agrees
with the breaker instead of pinging past it.

**Batch features present.** The batch job sets a marker key per view after it
materializes (:func:`fraud_scoring.feast_store.batch_marker_key`). :meth:`watch` checks
the markers every ``check_s`` seconds in the background (never per request); a Redis
that restarted without persistence lacks them, and :attr:`absent_views` names those views
until the next materialization. Presence is reported through ``on_presence`` (the
``fraud_batch_features_present{view}`` gauge), so this module imports no telemetry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from fraud_scoring.feast_store import batch_marker_key
from fraud_scoring.redis_clients import STORE_ERRORS
from service.errors import Rejected, RejectReason

log = logging.getLogger(__name__)


class FeatureStoreUnavailable(Rejected):
    """The online store (Redis) did not answer the batch's read, or the breaker is open:
    no decision is made on made-up features; under the 'refuse' policy the API answers
    503 so the caller applies its own fallback."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectReason.FEATURE_STORE, detail)


class NoBatchFeatures(Rejected):
    """The online store holds no batch features for some view (its marker is missing)
    and the policy is 'refuse'."""

    def __init__(self, views: Sequence[str]) -> None:
        super().__init__(
            RejectReason.NO_BATCH_FEATURES, f"no batch features in the store for {', '.join(views)}"
        )


class StoreHealth:
    """The breaker and the batch-feature markers of one online store (one per process).
    ``clock``: monotonic seconds (tests may pass their own)."""

    def __init__(
        self,
        redis: Any,
        project: str,
        views: Sequence[str],
        *,
        failures: int,
        open_s: float,
        check_s: float,
        on_presence: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.views = list(views)
        self.markers = [batch_marker_key(project, v) for v in self.views]
        self.failures, self.open_s, self.check_s = failures, open_s, check_s
        self.on_presence = on_presence
        self.clock = clock
        self._failed = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False  # half-open: one read is in flight
        # None until the first check: not known yet, so not reported absent.
        self.absent_views: list[str] | None = None

    # --- breaker ------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """True while reads are refused without trying (open, or half-open with its one
        probe in flight)."""
        if self._open_until is None:
            return False
        return self.clock() < self._open_until or self._probing

    def admit(self) -> None:
        """Call before a read: raises :class:`FeatureStoreUnavailable` at once while the
        breaker is open; in half-open lets exactly one read through (the caller must then
        call :meth:`succeeded` or :meth:`failed`)."""
        if self._open_until is None:
            return
        if self.clock() < self._open_until or self._probing:
            raise FeatureStoreUnavailable("feature store unavailable (circuit open)")
        self._probing = True

    def succeeded(self) -> None:
        if self._open_until is not None:
            log.info("feature store answers again: circuit closed")
        self._failed, self._open_until, self._probing = 0, None, False

    def failed(self) -> None:
        self._failed += 1
        self._probing = False
        if self._open_until is not None or self._failed >= self.failures:
            if self._open_until is None:
                log.warning("%d feature reads failed in a row: circuit open", self._failed)
            self._open_until = self.clock() + self.open_s

    def problem(self) -> str | None:
        """The readiness detail about the store, or None when it looks fine."""
        if self.is_open:
            return "feature store unreachable (circuit open)"
        if self.absent_views:
            return f"no batch features for {', '.join(self.absent_views)}"
        return None

    # --- markers ------------------------------------------------------------------------
    async def check(self) -> None:
        """One marker check (through the breaker, so it also serves as the half-open
        probe). A failed check leaves :attr:`absent_views` as it was."""
        try:
            self.admit()
        except FeatureStoreUnavailable:
            return
        try:
            # One GET each (not MGET): on a Redis Cluster the markers lie in other slots.
            pipe = self.redis.pipeline(transaction=False)
            for marker in self.markers:
                pipe.get(marker)
            found = await pipe.execute()
        except STORE_ERRORS as exc:
            log.warning("batch marker check failed: %s", exc)
            self.failed()
            return
        self.succeeded()
        absent = [v for v, f in zip(self.views, found, strict=True) if f is None]
        if absent and absent != self.absent_views:
            log.warning("online store holds no batch features for %s", ", ".join(absent))
        self.absent_views = absent
        if self.on_presence is not None:
            for v, f in zip(self.views, found, strict=True):
                self.on_presence(v, f is not None)

    async def watch(self) -> None:
        """:meth:`check` every ``check_s`` seconds, forever (run it as a task)."""
        while True:
            await self.check()
            await asyncio.sleep(self.check_s)
