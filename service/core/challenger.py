"""The challenger: a second model version beside the serving one (the champion).

* **Shadow.** With ``FRAUD_CHALLENGER_VERSION`` set, every micro-batch is also scored by
  the challenger on the same feature values: the champion's matrix when the two models
  list the same features, else the challenger's own matrix assembled from the same
  columns. The score goes to the decision log (``challenger_score``), never into the
  decision or the response; the run happens after the batch's answers are released.
* **Canary.** ``FRAUD_CANARY_PERCENT`` routes that share of cards (:func:`canary_bucket`,
  a blake2b hash of ``card_id``: the same in every process and release) to the
  challenger: its score and its own thresholds decide, the response's ``model_version``
  names it, and the log records ``routed_to`` and the champion's score beside it. For a
  batch holding a routed card the challenger runs before the answers, on the whole batch.
* **Never at the decision's expense.** The challenger runs on a thread of its own. A run
  that fails, answers something other than one finite score per row, or takes longer
  than ``FRAUD_CHALLENGER_TIMEOUT_MS`` is counted in ``fraud_challenger_errors_total``
  (``reason``) and dropped: the champion decides, the shadow score is null. While
  :data:`MAX_PENDING` runs are unfinished (a hung model) new ones are skipped
  (``reason="busy"``) instead of queueing. A challenger that cannot load (missing
  version, unknown features, bad file) is refused with the reason (logged, ``load``
  counted, shown on ``/readyz``) and the champion serves alone.
* **Promotion and rollback.** ``POST /v1/models/reload`` with a :class:`LineupChange`
  body changes this process's champion version, challenger and canary share at once
  (both models loaded before either is swapped; on a failure nothing changes), or the
  same three settings change and the pods restart (docs/decision-loop.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import numpy as np
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import ModelError
from service.core.model import LoadedModel, ModelHolder, load_configured, load_model
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

CANARY_BUCKETS = 10_000  # the canary share moves in steps of 0.01 %
MAX_PENDING = 64  # unfinished challenger runs (micro-batches) before new ones are skipped
LOG_EVERY_S = 30.0  # dropped runs are logged at most this often per reason


@lru_cache(maxsize=65_536)
def canary_bucket(card_id: str) -> int:
    """The card's canary bucket in [0, 10000): blake2b of the id (not Python's ``hash``,
    which is salted per process), so a card is routed the same way by every replica."""
    digest = hashlib.blake2b(card_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % CANARY_BUCKETS


def routed_to_challenger(card_id: str, percent: float) -> bool:
    """Whether ``percent`` (0-100) routes this card's decisions to the challenger."""
    return canary_bucket(card_id) < round(percent * CANARY_BUCKETS / 100)


@dataclass(frozen=True)
class _Instruments:
    scored: Counter
    errors: Counter


# fraud_challenger_errors_total's reasons, each exported at 0 once a challenger is
# configured (a series born at its first count looks flat to rate()).
ERROR_REASONS = ("load", "inference", "invalid", "timeout", "busy")


@cache
def _instruments() -> _Instruments:
    ins = _Instruments(
        scored=Counter("fraud_challenger_scored", "Transactions the challenger scored"),
        errors=Counter(
            "fraud_challenger_errors",
            "Challenger loads refused and runs dropped (load, inference, invalid, timeout, busy)",
            ["reason"],
        ),
    )
    for reason in ERROR_REASONS:
        ins.errors.labels(reason=reason)
    return ins


def load_challenger(settings: ServiceSettings, version: str) -> LoadedModel:
    """The challenger model ``version``, validated as the serving model is (its features
    must all be producible, float32, its ONNX input must match, a warm-up must pass);
    raises ModelError naming it as the challenger."""
    try:
        return load_model(
            settings.model_repo,
            settings.model_name,
            version,
            producible=producible_features(),
            provider_setting=settings.execution_provider,
            instances=1,
            intra_op_threads=settings.intra_op_threads,
        )
    except ModelError as exc:
        raise ModelError(f"challenger refused: {exc}") from exc


class Challenger:
    """The challenger model (or why none runs) and the one guarded way to run it.

    ``settings`` is the process's own object: ``challenger_version``, ``canary_percent``
    and ``model_version`` are read from it on every batch and changed by
    :meth:`apply` (the reload endpoint)."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.models = ModelHolder()
        self.problem: str | None = None  # why the configured challenger is not running
        self.ins = _instruments()
        self._pool: ThreadPoolExecutor | None = None  # made on the first run
        self._pending = 0
        self._dropped: dict[str, int] = {}  # runs dropped per reason since the last log line
        self._logged_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._apply_lock = threading.Lock()

    @property
    def current(self) -> LoadedModel | None:
        return self.models.current

    def load(self) -> None:
        """Load the configured challenger, if any. A refusal is logged, counted and kept
        in :attr:`problem` (shown on /readyz); it never raises."""
        version = self.settings.challenger_version
        if version is None:
            return
        try:
            self.models.swap(lambda: load_challenger(self.settings, version))
        except ModelError as exc:
            self.problem = str(exc)
            self.ins.errors.labels(reason="load").inc()
            log.error("%s; the serving model decides alone", exc)
            return
        self.problem = None
        log.info("challenger v%s loaded (canary %g %%)", version, self.settings.canary_percent)

    def readiness(self) -> str | None:
        """None when no challenger is configured or it runs; else why it was refused
        (information only: the champion decides alone)."""
        return self.problem

    def canary(self, card_ids: list[str]) -> np.ndarray | None:
        """Per row, whether its card is routed to the challenger; None when none is."""
        pct = self.settings.canary_percent
        if pct <= 0 or self.models.current is None:
            return None
        mask = np.fromiter((routed_to_challenger(c, pct) for c in card_ids), bool, len(card_ids))
        return mask if mask.any() else None

    async def run(self, model: LoadedModel, x: np.ndarray) -> np.ndarray | None:
        """The challenger's score per row of ``x``, or None (counted by reason) when it is
        busy, fails, answers badly or is slower than ``challenger_timeout_ms``. Never
        raises (but a cancelled caller is cancelled)."""
        if self._pending >= MAX_PENDING:
            self._failed("busy", f"{MAX_PENDING} runs unfinished")
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="challenger")
        fut = asyncio.get_running_loop().run_in_executor(self._pool, model.predict, x)
        self._pending += 1
        fut.add_done_callback(self._finished)
        try:
            # shield: on a timeout the run goes on in its thread and still counts as pending.
            scores = await asyncio.wait_for(
                asyncio.shield(fut), self.settings.challenger_timeout_ms / 1e3
            )
        except TimeoutError:
            self._failed("timeout", f"slower than {self.settings.challenger_timeout_ms} ms")
            return None
        except Exception as exc:  # ONNX Runtime raises its own types
            self._failed("inference", f"inference failed: {exc}")
            return None
        if scores.shape != (x.shape[0],) or not np.all(np.isfinite(scores)):
            self._failed("invalid", "output is not one finite score per row")
            return None
        self.ins.scored.inc(len(scores))
        return np.asarray(scores)

    def _finished(self, fut: asyncio.Future[np.ndarray]) -> None:
        self._pending -= 1
        if not fut.cancelled():
            fut.exception()  # retrieved: a late failure is already counted as a timeout

    def _failed(self, reason: str, why: str) -> None:
        self.ins.errors.labels(reason=reason).inc()
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        now = time.monotonic()
        # At most one line per reason every LOG_EVERY_S, not one per batch.
        if now - self._logged_at.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            log.warning(
                "challenger: %d run(s) dropped (%s) since the last report, the last: %s; "
                "the serving model decides",
                self._dropped[reason],
                reason,
                why,
            )
            self._logged_at[reason], self._dropped[reason] = now, 0

    def later(self, job: Coroutine[Any, Any, None]) -> None:
        """Run ``job`` (a shadow run and its logging) after the batch's answers."""
        task = asyncio.get_running_loop().create_task(job, name="challenger-shadow")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, drain_s: float) -> None:
        """Let the shadow runs still going log their decisions (up to ``drain_s``)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=drain_s)
        for task in self._tasks:
            task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def apply(self, models: ModelHolder, change: LineupChange) -> Lineup:
        """Load the champion (the version ``change`` names, else the configured one) and
        the challenger ``change`` names, then swap both and set the three settings; on a
        failure (ModelError, naming the model) nothing changes. Blocking: call it from a
        thread."""
        s = self.settings
        with self._apply_lock:
            version = change.version or s.model_version
            challenger = (
                change.challenger_version
                if "challenger_version" in change.model_fields_set
                else s.challenger_version
            )
            percent = s.canary_percent if change.canary_percent is None else change.canary_percent
            if challenger is None:
                new_challenger = None
            elif "challenger_version" in change.model_fields_set or self.current is None:
                new_challenger = load_challenger(s, challenger)
            else:
                new_challenger = self.current  # unchanged: keep the running one
            # Last, so that a champion that fails leaves everything as it was.
            pinned = s.model_copy(update={"model_version": version})
            champion = models.swap(lambda: load_configured(pinned))
            self.models.current = new_challenger
            self.problem = None
            s.model_version, s.challenger_version, s.canary_percent = version, challenger, percent
        log.info(
            "lineup: champion v%s, challenger %s, canary %g %%",
            champion.version,
            f"v{challenger}" if challenger else "none",
            percent,
        )
        return Lineup(champion.version, challenger, percent)


class LineupChange(BaseModel):
    """The optional body of ``POST /v1/models/reload``: what to serve from now on in this
    process. An absent field keeps the current value; ``challenger_version: null`` removes
    the challenger."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(
        default=None,
        pattern=r"^([0-9]+|latest)$",
        description="the champion's version (a number or 'latest'); absent: the current "
        "setting, reloaded",
    )
    challenger_version: str | None = Field(
        default=None,
        pattern=r"^[0-9]+$",
        description="the challenger's version; null: no challenger; absent: unchanged",
    )
    # Strict: a JSON boolean or a string is not a share (lax mode would read false as 0).
    canary_percent: float | None = Field(
        default=None, ge=0, le=100, strict=True, description="share of cards the challenger decides"
    )


@dataclass(frozen=True)
class Lineup:
    serving_version: str
    challenger_version: str | None
    canary_percent: float
