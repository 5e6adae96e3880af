"""Decision policy: model thresholds, then hard rules, with reasons that explain it.

Thresholds come from the model metadata (chosen on the holdout by the training job) and
can be overridden in settings. Hard rules apply after the model and can only make a
decision stricter. Reason codes are the declared reasons (``reasons`` in
feature_repo/features.yaml) that fire on the features the model saw, ordered by the
model's feature importance when the metadata has it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fraud_scoring import declared as D
from fraud_scoring import features as F

DECISIONS = ("approve", "review", "decline")


@dataclass(frozen=True)
class Reason:
    code: str
    message: str


@dataclass(frozen=True)
class Indicator:
    """A declared reason (``reasons`` in feature_repo/features.yaml) ready to fire."""

    decl: D.ReasonDecl
    rules: bool  # reads streaming features only: it applies in rules-only mode too
    reads: tuple[str, ...]  # decl.reads(), kept: read per micro-batch

    @property
    def code(self) -> str:
        return self.decl.code

    @property
    def feature(self) -> str:
        """The feature the reason is about (the first it reads)."""
        return self.reads[0] if self.reads else "amount"

    def fires(self, cols: Mapping[str, npt.ArrayLike], n: int) -> np.ndarray:
        """Where it fires over ``n`` rows (nowhere when a feature it reads is absent)."""
        if not all(r in cols for r in self.reads):
            return np.zeros(n, dtype=bool)
        v = D.evaluate(self.decl.when, cols)
        if v.shape != (n,):  # a constant expression
            v = np.full(n, v)
        return (v != 0) & ~np.isnan(v)

    def reason(self, row: Mapping[str, float]) -> Reason:
        return Reason(self.code, D.reason_message(self.decl, row))


@functools.cache
def indicators() -> tuple[Indicator, ...]:
    """The declared reasons (loaded with the declarations, once per process)."""
    decl = F.declarations()
    streaming = {*decl.aggregate_names(), *(d.name for d in decl.derived), "amount"}
    out = []
    for r in decl.reasons:
        needed = decl.needed(set(r.reads()))
        out.append(Indicator(r, rules=needed <= streaming, reads=r.reads()))
    return tuple(out)


@functools.cache
def features_read() -> frozenset[str]:
    """The features the decision reads (the amount rule and the reasons): the scorer
    hands it these alone, not every column."""
    return frozenset({"amount", *(f for i in indicators() for f in i.reads)})


def fired(cols: Mapping[str, npt.ArrayLike], n: int, rules: bool = False) -> list[list[Indicator]]:
    """The reasons that fire on each of ``n`` rows (``rules``: the rules-only ones)."""
    inds = [i for i in indicators() if i.rules or not rules]
    masks = [i.fires(cols, n) for i in inds]
    return [[i for i, m in zip(inds, masks, strict=True) if m[k]] for k in range(n)]


@dataclass(frozen=True)
class Policy:
    review_threshold: float
    decline_threshold: float
    review_amount_limit: float
    importance: Mapping[str, float]

    def decide(
        self,
        score: float,
        features: Mapping[str, float],
        card_known: bool,
        fired: Sequence[Indicator] = (),
    ) -> tuple[str, list[Reason]]:
        """Decision and reasons for one transaction (``features`` as the model saw them,
        ``fired``: the declared reasons that fire on it)."""
        reasons: list[Reason] = []
        if score >= self.decline_threshold:
            decision = "decline"
            reasons.append(
                Reason(
                    "MODEL_SCORE_DECLINE",
                    f"Model score {score:.3g} is at or "
                    f"above the decline threshold {self.decline_threshold:.3g}.",
                )
            )
        elif score >= self.review_threshold:
            decision = "review"
            reasons.append(
                Reason(
                    "MODEL_SCORE_REVIEW",
                    f"Model score {score:.3g} is at or "
                    f"above the review threshold {self.review_threshold:.3g}.",
                )
            )
        else:
            decision = "approve"
        if features["amount"] > self.review_amount_limit:
            reasons.append(
                Reason(
                    "RULE_AMOUNT_OVER_LIMIT",
                    f"Amount {features['amount']:.2f} "
                    f"is over the review limit {self.review_amount_limit:.2f}.",
                )
            )
            if decision == "approve":
                decision = "review"
        if not card_known:
            reasons.append(
                Reason(
                    "NO_CARD_HISTORY", "No recent batch history for this card; defaults were used."
                )
            )
        ranked = sorted(fired, key=lambda i: -self.importance.get(i.feature, 0.0))
        reasons.extend(i.reason(features) for i in ranked)
        return decision, reasons


def rules_only(
    amount: float,
    session: Mapping[str, float],
    review_amount_limit: float,
    fired: Sequence[Indicator] = (),
) -> tuple[str, list[Reason]]:
    """The degraded-mode decision without a model score: 'review' when the amount is over
    the limit or a declared reason over streaming features fires (``fired``, with the
    values it reads in ``session``), else 'approve'; never 'decline' (no model has
    judged it). ``session`` may be empty (store unreachable)."""
    reasons = [
        Reason(
            "DEGRADED_RULES_ONLY",
            "No batch features available; decided by rules on the request"
            + (" and session features." if session else " only."),
        )
    ]
    decision = "approve"
    if amount > review_amount_limit:
        decision = "review"
        reasons.append(
            Reason(
                "RULE_AMOUNT_OVER_LIMIT",
                f"Amount {amount:.2f} is over the review limit {review_amount_limit:.2f}.",
            )
        )
    for i in fired:
        decision = "review"
        reasons.append(i.reason({**session, "amount": amount}))
    return decision, reasons
