"""What the service knows about its online store between requests: a circuit breaker
around Redis reads, and whether the store holds batch features at all.

**Breaker.** After ``failures`` consecutive failed reads the breaker opens: no request
read is tried and :meth:`StoreHealth.admit` raises at once, so a hung server costs one
timeout, not one per request. Every ``open_s`` seconds the background watcher sends one
probe (the marker check) on its own ``probe_timeout_s``, never a request's: a request's
deadline can cancel its own read but never the probe, so an outage that ends always
ends for the service too. The probe's success closes the breaker, its failure keeps it
open for another ``open_s``. Each change of state is one log line. ``/readyz`` reads
:meth:`StoreHealth.problem`, so readiness agrees with the breaker instead of pinging
past it.

**Batch features present.** The batch job sets a marker key per view after it
materializes (:func:`fraud_scoring.feast_store.batch_marker_key`), and one per declared
state once its history is backfilled. Every micro-batch's read carries the markers (one
GET each, in the same round trip: :meth:`observed`), and :meth:`watch` checks the views'
every ``check_s`` seconds in the background (so readiness recovers without traffic); a
Redis that restarted without persistence lacks them, and :attr:`absent_views` (and
:attr:`absent_states`) name them from the first read until the next batch run.
Presence is reported through ``on_presence`` (the ``fraud_batch_features_present{view}``
gauge), so this module imports no telemetry.

**Read-only store.** A store that answers reads but refuses writes (``OOM`` at
``maxmemory`` with ``noeviction``, ``READONLY`` on a replica) does not stop decisions:
the scorer decides without recording and reports each refusal here
(:meth:`write_refused`): :attr:`read_only` names the cause for ``/readyz`` until a write
succeeds again (:meth:`write_succeeded`), and the log gets one line per
``log_every_s`` with the count, not one per micro-batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions

from fraud_scoring.feast_store import batch_marker_key
from fraud_scoring.redis_clients import STORE_ERRORS
from service.errors import Rejected, RejectReason

PROBE_ERRORS: tuple[type[Exception], ...] = (*STORE_ERRORS, TimeoutError)
# A store that reads but does not write: full (noeviction), or a replica after failover.
WRITE_REFUSED: tuple[type[Exception], ...] = (
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
)


def write_refused(reply: object) -> bool:
    """``reply`` is the store refusing a write (OOM, READONLY), not failing."""
    if isinstance(reply, WRITE_REFUSED):
        return True
    # Inside a script (EVALSHA) the refusal comes back as a plain error with its code.
    text = str(reply) if isinstance(reply, redis.exceptions.ResponseError) else ""
    return "OOM " in text or "READONLY " in text


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
        probe_timeout_s: float = 1.0,
        on_presence: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.views = list(views)
        self.markers = [batch_marker_key(project, v) for v in self.views]
        self.failures, self.open_s, self.check_s = failures, open_s, check_s
        self.probe_timeout_s = probe_timeout_s
        self.on_presence = on_presence
        self.clock = clock
        self._failed = 0
        self._open_until: float | None = None  # None: closed; else when the next probe is due
        # None until the first check: not known yet, so not reported absent.
        self.absent_views: list[str] | None = None
        # The declared states the serving models read, (name, backfilled marker): set
        # by the scorer, which knows the models; and those whose marker the last check
        # or read did not find.
        self.states: list[tuple[str, str]] = []
        self.absent_states: list[str] = []
        # The store refuses writes (why), since the last refusal without a success.
        self.read_only: str | None = None
        self.log_every_s = 60.0
        self._refused = 0  # refusals since the last log line
        self._logged_at: float | None = None

    # --- breaker ------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """True while request reads are refused without trying."""
        return self._open_until is not None

    def admit(self) -> None:
        """Call before a request's read: raises :class:`FeatureStoreUnavailable` at once
        while the breaker is open (only the watcher's probe may close it)."""
        if self._open_until is not None:
            raise FeatureStoreUnavailable("feature store unavailable (circuit open)")

    def succeeded(self) -> None:
        if self._open_until is not None:
            log.info("feature store answers again: circuit closed")
        self._failed, self._open_until = 0, None

    def failed(self) -> None:
        self._failed += 1
        if self._open_until is None and self._failed >= self.failures:
            log.warning("%d feature reads failed in a row: circuit open", self._failed)
            self._open_until = self.clock() + self.open_s
        elif self._open_until is not None:
            self._open_until = self.clock() + self.open_s

    def problem(self) -> str | None:
        """The readiness detail about the store, or None when it looks fine."""
        if self.is_open:
            return "feature store unreachable (circuit open)"
        if self.absent_views:
            return f"no batch features for {', '.join(self.absent_views)}"
        if self.absent_states:
            return f"not backfilled: {', '.join(self.absent_states)}"
        return None

    # --- writes -------------------------------------------------------------------------
    def write_refused(self, what: str, reply: object, n: int = 1) -> None:
        """The store refused ``n`` writes of ``what`` (claims, recording): decided, not
        recorded. Logged once per ``log_every_s`` with the count."""
        if self.read_only is None:
            log.warning("the online store refuses writes (%s): deciding without recording", reply)
        self.read_only = f"refuses writes: {str(reply)[:120]}"
        self._refused += n
        now = self.clock()
        if self._logged_at is None or now - self._logged_at >= self.log_every_s:
            if self._logged_at is not None:
                log.warning(
                    "the online store refused %d writes in the last %.0f s (%s, last: %s); "
                    "decisions are made but not recorded",
                    self._refused,
                    now - self._logged_at,
                    what,
                    reply,
                )
            self._logged_at, self._refused = now, 0

    def write_succeeded(self) -> None:
        if self.read_only is not None:
            log.info("the online store takes writes again")
            self.read_only, self._logged_at, self._refused = None, None, 0

    # --- markers ------------------------------------------------------------------------
    async def check(self) -> None:
        """One marker check, bounded by ``probe_timeout_s``; while the breaker is open it
        is the probe (skipped until the probe is due). A failed check leaves
        :attr:`absent_views` as it was."""
        if self._open_until is not None and self.clock() < self._open_until:
            return
        states = list(self.states)
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                # One GET each (not MGET): on a Redis Cluster the markers lie in other slots.
                pipe = self.redis.pipeline(transaction=False)
                for marker in self.all_markers():
                    pipe.get(marker)
                found = await pipe.execute()
        except PROBE_ERRORS as exc:
            if self._open_until is None:  # while open, the state change was logged once
                log.warning("batch marker check failed: %s", exc or "timed out")
            self.failed()
            return
        self.succeeded()
        self.observed(found, states)

    def all_markers(self) -> list[str]:
        """The views' markers, then the declared states' (what a check reads)."""
        return [*self.markers, *(m for _, m in self.states)]

    def observed(self, found: Sequence[Any], states: Sequence[tuple[str, str]]) -> None:
        """The markers as one read found them (None: absent), in :meth:`all_markers`
        order for ``states`` (the declared states when the read was queued): by the
        watcher's check, or by a micro-batch's read (which carries them)."""
        views = len(self.markers)
        self.absent_states = [
            name for (name, _), f in zip(states, found[views:], strict=True) if f is None
        ]
        found = found[:views]
        absent = [v for v, f in zip(self.views, found, strict=True) if f is None]
        if absent and absent != self.absent_views:
            log.warning("online store holds no batch features for %s", ", ".join(absent))
        self.absent_views = absent
        if self.on_presence is not None:
            for v, f in zip(self.views, found, strict=True):
                self.on_presence(v, f is not None)

    async def watch(self) -> None:
        """:meth:`check` every ``check_s`` seconds, and while the breaker is open each
        time a probe is due, forever (run it as a task)."""
        while True:
            await self.check()
            if self._open_until is None:
                await asyncio.sleep(self.check_s)
            else:
                await asyncio.sleep(min(self.check_s, max(0.0, self._open_until - self.clock())))
