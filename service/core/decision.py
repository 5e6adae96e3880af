"""Decision policy: the rules (:mod:`fraud_scoring.rules`) and the model's thresholds, in
one documented order, with reasons that explain it (docs/rules.md).

:class:`Verdicts` decides a micro-batch at once: allow rules, then decline rules, then the
model's decline threshold, then review rules, then the model's review threshold, else
approve; the first matching active rule of the first stage that matches decides, shadow
rules never do. Thresholds come from the model metadata (chosen on the holdout by the
training job) and can be overridden in settings. The declared reasons (``reasons`` in
feature_repo/features.yaml) explain a decision and never make one; they fire on the
features the model saw, ordered by the model's feature importance when the metadata has it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring import rules as R

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
    """The reasons that fire on each of ``n`` rows (``rules``: the rules-only ones), as
    :meth:`Indicator.fires` says (one whose features are not all in ``cols`` never
    does), the conditions of those that can compiled together once (:func:`_firing`)."""
    inds, program = _firing(indicators(), frozenset(cols), rules)
    if not inds:
        return [[] for _ in range(n)]
    masks = program(cols, n)
    rows: list[list[bool]] = masks.T.tolist()  # per row, whether each fires
    return [[i for i, hit in zip(inds, row, strict=True) if hit] for row in rows]


@functools.lru_cache(maxsize=16)  # the same few sets of columns, micro-batch after batch
def _firing(
    every: tuple[Indicator, ...], given: frozenset[str], rules: bool
) -> tuple[tuple[Indicator, ...], Any]:
    """The indicators that can fire with the columns ``given`` (``rules``: the rules-only
    ones) and their conditions compiled together."""
    inds = tuple(i for i in every if (i.rules or not rules) and set(i.reads) <= given)
    return inds, (R.conditions(tuple(i.decl.when for i in inds)) if inds else None)


@dataclass(frozen=True)
class Policy:
    """The model's thresholds (``review_threshold`` <= ``decline_threshold``), the value
    of the rules' ``review_amount_limit`` and the model's feature importance (the
    declared reasons' order)."""

    review_threshold: float
    decline_threshold: float
    review_amount_limit: float
    importance: Mapping[str, float]


# A decision as a number per row, in the order of strictness.
APPROVE, REVIEW, DECLINE = 0, 1, 2
_NAMES = ("approve", "review", "decline")
_CODE = {"allow": APPROVE, "review": REVIEW, "decline": DECLINE}


@dataclass(frozen=True)
class Verdict:
    """One row's decision and its explanation."""

    decision: str
    decided_by: str  # "rule" | "list" (a rule that looks up a list) | "model"
    reasons: list[Reason]
    fired: list[str]  # the active rules that matched (codes), the decider first
    shadow: list[Reason]  # the shadow rules that matched


def _per_row(x: npt.ArrayLike, n: int) -> np.ndarray:
    """``x`` (a value or one per row) as one float64 per row (``broadcast_to`` costs more
    than the rest of a micro-batch of one's decision)."""
    a = np.asarray(x, dtype=np.float64)
    return a if a.shape == (n,) else np.full(n, a)


class Verdicts:
    """A micro-batch's decisions by the documented order, vectorized: allow rules, then
    decline rules, then the model's decline threshold, then review rules, then the
    model's review threshold, else approve. Within a stage the first matching active rule
    (in file order) decides. Shadow rules never decide. ``scores`` None: no model
    (rules-only mode), its stages are skipped. ``rules`` may be a subset of the rule set
    (rules-only mode: those whose inputs are available); ``masks`` is theirs."""

    def __init__(
        self,
        rules: Sequence[R.Rule],
        masks: np.ndarray,
        n: int,
        scores: np.ndarray | None = None,
        review_th: npt.ArrayLike = 1.0,
        decline_th: npt.ArrayLike = 1.0,
    ) -> None:
        self.rules, self.masks, self.scores = tuple(rules), masks, scores
        self._plan = _plan(self.rules)
        self.review_th = _per_row(review_th, n)
        self.decline_th = _per_row(decline_th, n)
        self.code = np.full(n, APPROVE, dtype=np.int8)
        self.decider = np.full(n, -1, dtype=np.int64)  # the deciding rule; -1: the model
        self._open = np.ones(n, dtype=bool)
        self._by_rules("allow")
        self._by_rules("decline")
        self._by_model(self.decline_th, DECLINE)
        self._by_rules("review")
        self._by_model(self.review_th, REVIEW)
        self.hit = np.zeros(n, dtype=bool)
        self._matched: list[int] = []  # the rules each row matched, row after row
        self._starts: list[int] = [0] * (n + 1)  # row i's: _matched[_starts[i]:_starts[i + 1]]
        if len(self.rules):
            self.hit = np.asarray(masks.any(axis=0), dtype=bool)
            if self.hit.any():
                rows, matched = np.nonzero(masks.T)  # by row, then by rule
                self._matched = matched.tolist()
                self._starts = np.searchsorted(rows, np.arange(n + 1)).tolist()

    def _by_rules(self, action: str) -> None:
        idx = self._plan.stages[action]
        if idx.size == 0:
            return
        m = self.masks[idx]
        won = m.any(axis=0) & self._open
        self.decider[won] = idx[m.argmax(axis=0)][won]
        self.code[won] = _CODE[action]
        self._open &= ~won

    def _by_model(self, threshold: np.ndarray, code: int) -> None:
        if self.scores is None:
            return
        won = (self.scores >= threshold) & self._open
        self.code[won] = code
        self._open &= ~won

    def row(
        self,
        i: int,
        values: Mapping[str, Any],
        head: Sequence[Reason] = (),
        tail: Sequence[Reason] = (),
    ) -> Verdict:
        """Row ``i``'s verdict: the deciding rule's reason first (``RULE_<CODE>``), then
        ``head`` (e.g. the model's threshold reason), the other active rules that
        matched, then ``tail`` (the declared reasons). ``values``: what messages name."""
        decision = _NAMES[self.code[i]]
        if not self.hit[i]:
            return Verdict(decision, "model", [*head, *tail], [], [])
        plan = self._plan
        d = int(self.decider[i])
        reasons, fired, shadow = [], [], []
        if d >= 0:
            rule = self.rules[d]
            reasons.append(Reason(plan.reason_codes[d], rule.message(values)))
            fired.append(rule.code)
        reasons.extend(head)
        for j in self._matched[self._starts[i] : self._starts[i + 1]]:
            if j == d:
                continue
            rule = self.rules[j]
            if plan.active[j]:
                reasons.append(Reason(plan.reason_codes[j], rule.message(values)))
                fired.append(rule.code)
            else:
                shadow.append(Reason(plan.reason_codes[j], rule.message(values)))
        by = "model" if d < 0 else ("list" if plan.reads_list[d] else "rule")
        return Verdict(decision, by, [*reasons, *tail], fired, shadow)


@dataclass(frozen=True)
class _Plan:
    """What :class:`Verdicts` reads of a sequence of rules, computed once per sequence:
    the active rules of each stage (indices, file order), and per rule whether it is
    active, its reason code and whether it reads a list."""

    stages: Mapping[str, np.ndarray]
    active: tuple[bool, ...]
    reason_codes: tuple[str, ...]
    reads_list: tuple[bool, ...]


_PLANS: dict[int, tuple[tuple[R.Rule, ...], _Plan]] = {}
_PLANS_LOCK = threading.Lock()


def _plan(rules: tuple[R.Rule, ...]) -> _Plan:
    """The plan of ``rules``, kept for the same tuple (a rule set's: the serving rules are
    one tuple per version); the last few tuples are kept."""
    with _PLANS_LOCK:
        got = _PLANS.get(id(rules))
    if got is not None and got[0] is rules:
        return got[1]
    plan = _Plan(
        stages={
            a: np.array(
                [i for i, r in enumerate(rules) if r.active and r.action == a], dtype=np.int64
            )
            for a in R.ACTIONS
        },
        active=tuple(r.active for r in rules),
        reason_codes=tuple(r.reason_code for r in rules),
        reads_list=tuple(r.reads_list for r in rules),
    )
    with _PLANS_LOCK:
        if len(_PLANS) >= 8:  # rules-only subsets and impact runs: a new tuple each time
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[id(rules)] = (rules, plan)
    return plan


def model_reason(score: float, policy: Policy) -> list[Reason]:
    """The model's threshold reason for ``score`` (none under the review threshold)."""
    if score >= policy.decline_threshold:
        return [
            Reason(
                "MODEL_SCORE_DECLINE",
                f"Model score {score:.3g} is at or "
                f"above the decline threshold {policy.decline_threshold:.3g}.",
            )
        ]
    if score >= policy.review_threshold:
        return [
            Reason(
                "MODEL_SCORE_REVIEW",
                f"Model score {score:.3g} is at or "
                f"above the review threshold {policy.review_threshold:.3g}.",
            )
        ]
    return []


NO_CARD_HISTORY = Reason(
    "NO_CARD_HISTORY", "No recent batch history for this card; defaults were used."
)
# The card's snapshot exists but is not usable as of this transaction: older than its
# view's TTL (the daily batch has not run since), or newer than the transaction (a replay
# of a day the batch has already run through). A different cause from a card without any.
STALE_CARD_HISTORY = Reason(
    "STALE_CARD_HISTORY",
    "The card's batch history is older than its time to live or newer than the "
    "transaction (a replay); defaults were used.",
)


def declared_reasons(
    fired: Sequence[Indicator], values: Mapping[str, float], policy: Policy
) -> list[Reason]:
    """The declared reasons that fired, by the model's feature importance."""
    if not fired:
        return []
    ranked = sorted(fired, key=lambda i: -policy.importance.get(i.feature, 0.0))
    return [i.reason(values) for i in ranked]


def degraded_reason(session: bool) -> Reason:
    return Reason(
        "DEGRADED_RULES_ONLY",
        "No batch features available; decided by rules on the request"
        + (" and session features." if session else " only."),
    )


def rules_only_rules(ruleset: R.RuleSet, available: set[str]) -> list[R.Rule]:
    """The rules that apply without a model and without the store's lists (rules-only
    mode): those reading neither ``score`` nor a list, and only ``available`` numbers."""
    have = available | {"amount", *R.SETTINGS_NAMES}
    return [
        r
        for r in ruleset.rules
        if not r.reads_score and not r.reads_list and set(r.numbers) <= have
    ]
