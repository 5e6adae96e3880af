"""What one micro-batch's decision is, apart from how it is made (``scoring.py``): a
transaction as the micro-batcher carries it (:class:`ScoreRequest`), its result with
everything the answer, the decision log and a retry need (:class:`ScoreResult`), the
stages' clock, and the hooks told of every scored batch (:class:`OnScored`,
:data:`OnShadow`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fraud_scoring.events import Transaction
from service.core.decision import Reason


@dataclass
class ScoreResult:
    transaction_id: str
    decision: str
    score: float | None  # None: a rules-only (degraded) decision, no model score
    reasons: list[Reason]
    model_version: str
    missing: list[str]
    stale: list[str]
    timing_ms: dict[str, float] = field(default_factory=dict)
    # Wall-clock (ns) bounds of each stage, for per-request trace spans.
    spans_ns: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Degraded mode: why rules decided ("no_batch_features" | "feature_store"), else None.
    degraded: str | None = None
    # The challenger (service/core/challenger.py): which model decided ("champion" |
    # "challenger"; ``model_version`` names it), and both models' scores. For the log only.
    routed_to: str = "champion"
    champion_version: str | None = None
    champion_score: float | None = None
    challenger_version: str | None = None
    challenger_score: float | None = None
    # One id, one transaction (service/core/idempotency.py): a retry answered again (not
    # a new decision: not logged), or the refusal (409) of an id used for another one.
    repeat: bool = False
    refused: Exception | None = None
    # Declared features whose read was not exact (a replay behind its key's present):
    # the decision is flagged degraded (the model decided on them).
    inexact: list[str] = field(default_factory=list)
    # The rules (service/core/decision.py): what decided ("rule" | "list" | "model"), the
    # rules file's version, the active rules that matched (the decider first) and the
    # shadow rules that matched (never deciding).
    decided_by: str = "model"
    rules_version: str | None = None
    fired_rules: list[str] = field(default_factory=list)
    shadow_rules: list[Reason] = field(default_factory=list)

    @property
    def logged(self) -> bool:
        """A new decision, for the decision log and the drift monitor."""
        return self.refused is None and not self.repeat

    def answer(self) -> dict[str, Any]:
        """What a retry of this transaction is answered with (kept in the store)."""
        return {
            "decision": self.decision,
            "score": self.score,
            "reasons": [[r.code, r.message] for r in self.reasons],
            "model_version": self.model_version,
            "missing": self.missing,
            "stale": self.stale,
            "degraded": self.degraded,
            "inexact": self.inexact,
            "decided_by": self.decided_by,
            "rules_version": self.rules_version,
            "fired_rules": self.fired_rules,
            "shadow_rules": [[r.code, r.message] for r in self.shadow_rules],
        }

    @classmethod
    def repeated(cls, transaction_id: str, answer: dict[str, Any]) -> ScoreResult:
        return cls(
            transaction_id=transaction_id,
            decision=answer["decision"],
            score=answer["score"],
            reasons=[Reason(c, m) for c, m in answer["reasons"]],
            model_version=answer["model_version"],
            missing=answer["missing"],
            stale=answer["stale"],
            degraded=answer["degraded"],
            inexact=answer.get("inexact", []),
            decided_by=answer.get("decided_by", "model"),
            rules_version=answer.get("rules_version"),
            fired_rules=answer.get("fired_rules", []),
            shadow_rules=[Reason(c, m) for c, m in answer.get("shadow_rules", [])],
            timing_ms={"feature_read": 0.0, "inference": 0.0, "decision": 0.0, "batch_size": 1.0},
            repeat=True,
        )


class StageClock:
    """The stages' durations (``timing_ms``) and wall-clock bounds (``spans_ns``, for
    per-request trace spans) of one micro-batch."""

    def __init__(self) -> None:
        self.t0, self._wall = time.perf_counter(), time.time_ns()
        self._last = self.t0
        self.ms: dict[str, float] = {}
        self.spans: dict[str, tuple[int, int]] = {}

    def mark(self, stage: str) -> None:
        now, wall = time.perf_counter(), time.time_ns()
        self.ms[stage] = (now - self._last) * 1e3
        self.spans[stage] = (self._wall, wall)
        self._last, self._wall = now, wall

    def stamp(self, out: Sequence[ScoreResult], batch_size: int) -> None:
        """The batch's stages are every row's: one dict each, shared (read only)."""
        timing = {**self.ms, "batch_size": float(batch_size)}
        for r in out:
            r.timing_ms, r.spans_ns = timing, self.spans


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One transaction as the micro-batcher carries it. ``record``: join the card's
    session state as part of scoring (False for what-if and replay calls)."""

    txn: Transaction
    record: bool = True


class OnScored(Protocol):
    """Told of every scored micro-batch: the transactions, the model's input (one row
    each), the feature names in the model's order, the results; ``shadow``: a challenger's
    shadow run scores them after the answers (its results then go to an
    :data:`OnShadow`). Must not block (the decision log only buffers)."""

    def __call__(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
        shadow: bool = False,
    ) -> None: ...


# Told of a shadow run's results (each with its challenger score, or null when the run was
# dropped) for a micro-batch ``OnScored`` had with ``shadow``. Must not block.
OnShadow = Callable[[Sequence[ScoreResult]], None]
