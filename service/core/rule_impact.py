"""What a rules file would have done to past decisions (``fraud-scoring rules test``,
docs/rules.md#testing-a-rules-file): its rules evaluated over the decision log's rows by
the service's own compiled expressions (:meth:`fraud_scoring.rules.RuleSet.masks`) and
order (:class:`service.core.decision.Verdicts`), against what was decided.

:func:`impact` takes the logged decisions as columns (:class:`Logged`: each row's logged
feature vector, score, thresholds of the model that decided it, decision, the label
known now and whether the row is past the label delay) and answers per rule (matched, of
them fraud, false positives (legitimate, or unlabelled past the label delay: no
chargeback came in the time one takes), unlabelled still within the delay (not known
yet), and their amount volume; the rows it decides and how that changes the logged decision; for
an allow rule, the overrides) and for the whole file. A shadow rule is measured as if it
were active (what making it active would do); the whole file's effect is the file as
written (shadow rules never decide).

A number a rule reads that a row's log does not hold (a feature outside that row's model
vector, the score of a rules-only decision) makes the rule not match there; those rows
are counted per rule and name (``lacking``), never skipped silently. A number no row
holds is refused (:class:`InputNotLogged`), naming the rule and the number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fraud_scoring import rules as R
from service.core.decision import APPROVE, DECISIONS, Verdicts


class InputNotLogged(ValueError):
    """A rule reads a number that no logged decision in the range holds; the message
    names the rule and the number."""


@dataclass(frozen=True)
class Logged:
    """The logged decisions as columns, one row each (all arrays of one length)."""

    numbers: Mapping[str, np.ndarray]  # a feature, "amount", "score": NaN where not logged
    present: Mapping[str, np.ndarray]  # bool per name in ``numbers``: the row's log holds it
    strings: Mapping[str, np.ndarray]  # the string fields the rules test (object arrays)
    decision: np.ndarray  # as logged: "approve" | "review" | "decline"
    is_fraud: np.ndarray  # the label known now: 1.0 fraud, 0.0 legitimate, NaN none
    past_delay: np.ndarray  # bool: older than the label delay (an unlabelled row is legitimate)
    label_delay_days: int  # the delay ``past_delay`` was taken with
    amount: np.ndarray  # the transaction's amount (float64), for the volumes
    review_th: np.ndarray  # the thresholds of the model that decided each row
    decline_th: np.ndarray

    @property
    def n(self) -> int:
        return len(self.decision)


@dataclass(frozen=True)
class Counts:
    """Transactions, split by the label known now, and their amount volume. An
    unlabelled transaction past the label delay counts as legitimate (a false positive
    where it is stopped); one within it is not known yet."""

    transactions: int
    fraud: int
    false_positives: int  # legitimate + unlabelled_past_delay
    legitimate: int
    unlabelled_past_delay: int
    unlabelled_within_delay: int
    volume: float
    fraud_volume: float

    def text(self) -> str:
        return (
            f"{self.transactions:,} (fraud {self.fraud:,}, legitimate {self.legitimate:,}, "
            f"unlabelled {self.unlabelled_past_delay:,} past the label delay, "
            f"{self.unlabelled_within_delay:,} within; false positives "
            f"{self.false_positives:,}; volume {self.volume:,.2f}, "
            f"fraud {self.fraud_volume:,.2f})"
        )


@dataclass(frozen=True)
class RuleImpact:
    code: str
    action: str
    mode: str
    when: str
    matched: Counts
    decides: int  # rows it would decide in the file's order (a shadow rule: made active)
    # Among the rows it decides, the logged decision -> the new one ("approve -> decline").
    changes: dict[str, Counts]
    # An allow rule: the rows it approves that the file without it reviews or declines.
    overrides: Counts | None
    lacking: dict[str, int]  # number -> rows whose log does not hold it (no match there)


@dataclass(frozen=True)
class FileImpact:
    decisions: int
    label_delay_days: int  # an unlabelled decision older than this is taken as legitimate
    labels: Counts  # every row: its label mix and volume
    before: dict[str, int]  # the logged decision mix
    after: dict[str, int]  # the file's
    changes: dict[str, Counts]  # logged -> the file's, where they differ
    decided_by: dict[str, int]  # "rule" | "list" | "model"
    rules: list[RuleImpact] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _counts(logged: Logged, rows: np.ndarray) -> Counts:
    label = logged.is_fraud[rows]
    amount = logged.amount[rows]
    fraud = label == 1.0
    legitimate = int((label == 0.0).sum())
    unlabelled = np.isnan(label)
    past = int((unlabelled & logged.past_delay[rows]).sum())
    return Counts(
        transactions=int(rows.sum()),
        fraud=int(fraud.sum()),
        false_positives=legitimate + past,
        legitimate=legitimate,
        unlabelled_past_delay=past,
        unlabelled_within_delay=int(unlabelled.sum()) - past,
        volume=round(float(np.nansum(amount)), 2),
        fraud_volume=round(float(np.nansum(amount[fraud])), 2),
    )


def _changes(logged: Logged, before: np.ndarray, after: np.ndarray, rows: np.ndarray) -> dict:
    out = {}
    for b, old in enumerate(DECISIONS):
        for a, new in enumerate(DECISIONS):
            if a == b:
                continue
            hit = rows & (before == b) & (after == a)
            if hit.any():
                out[f"{old} -> {new}"] = _counts(logged, hit)
    return out


def _check_inputs(ruleset: R.RuleSet, logged: Logged) -> None:
    unheld = []
    for i, r in enumerate(ruleset.rules):
        for name in r.numbers:
            if name in R.SETTINGS_NAMES:
                continue
            if name not in logged.present or not logged.present[name].any():
                unheld.append(f"rules.{i} ({r.code}) reads {name}")
    if unheld:
        raise InputNotLogged(
            f"{ruleset.source}: no logged decision in the range holds what these rules "
            f"read: {'; '.join(unheld)} (the log keeps each decision's model inputs, "
            "the amount and the score)"
        )


@dataclass(frozen=True)
class Evaluation:
    """:func:`evaluate`'s answer: the report and, row by row, what it counted (for the
    matched transactions' CSV: ``cli/rules.py``)."""

    report: FileImpact
    logged: Logged  # the rows evaluated
    masks: np.ndarray  # (rules, rows) bool: the rule matches the row
    after: np.ndarray  # (rows,) int8: the file's decision (an index of DECISIONS)
    decides: list[np.ndarray]  # per rule, (rows,) bool: the rows it decides (see RuleImpact)


def impact(
    ruleset: R.RuleSet,
    logged: Logged,
    members: Mapping[str, np.ndarray],
    review_amount_limit: float,
) -> FileImpact:
    """What ``ruleset`` would have decided on the ``logged`` rows (see the module's
    docstring). ``members``: per :func:`fraud_scoring.rules.member_column`, the rows whose
    value is on the list (a list not given matches no row). Raises InputNotLogged."""
    return evaluate(ruleset, logged, members, review_amount_limit).report


def evaluate(
    ruleset: R.RuleSet,
    logged: Logged,
    members: Mapping[str, np.ndarray],
    review_amount_limit: float,
) -> Evaluation:
    """:func:`impact` with the rows behind its figures."""
    _check_inputs(ruleset, logged)
    n = logged.n
    numbers: dict[str, Any] = {**logged.numbers, "review_amount_limit": review_amount_limit}
    masks = ruleset.masks(numbers, logged.strings, members, n)
    lacking: list[dict[str, int]] = []
    for i, r in enumerate(ruleset.rules):
        gaps = {x: ~logged.present[x] for x in r.numbers if x in logged.present}
        lacking.append({x: int(g.sum()) for x, g in gaps.items() if g.any()})
        for g in gaps.values():
            masks[i] &= ~g
    before = np.array([DECISIONS.index(d) for d in logged.decision], dtype=np.int8)
    scores = np.asarray(logged.numbers["score"], dtype=np.float64)

    def verdicts(rules: tuple[R.Rule, ...], m: np.ndarray) -> Verdicts:
        return Verdicts(rules, m, n, scores, logged.review_th, logged.decline_th)

    whole = verdicts(ruleset.rules, masks)
    every = np.ones(n, dtype=bool)
    by = np.where(whole.decider < 0, "model", "rule").astype(object)
    for i, r in enumerate(ruleset.rules):
        if r.reads_list:
            by[whole.decider == i] = "list"
    out = FileImpact(
        decisions=n,
        label_delay_days=logged.label_delay_days,
        labels=_counts(logged, every),
        before={d: int((before == k).sum()) for k, d in enumerate(DECISIONS)},
        after={d: int((whole.code == k).sum()) for k, d in enumerate(DECISIONS)},
        changes=_changes(logged, before, whole.code, every),
        decided_by={b: int((by == b).sum()) for b in ("rule", "list", "model")},
    )
    deciding: list[np.ndarray] = []
    for i, r in enumerate(ruleset.rules):
        v = whole
        if not r.active:  # measured as if active: the file with this rule made active
            decl = r.decl.model_copy(update={"mode": "active"})
            rules = list(ruleset.rules)
            rules[i] = dataclasses.replace(r, decl=decl)
            v = verdicts(tuple(rules), masks)
        decides = v.decider == i
        deciding.append(decides)
        overrides = None
        if r.action == "allow":
            without = masks.copy()
            without[i] = False
            rest = verdicts(v.rules, without)
            overrides = _counts(logged, decides & (rest.code != APPROVE))
        out.rules.append(
            RuleImpact(
                code=r.code,
                action=r.action,
                mode=r.decl.mode,
                when=r.decl.when,
                matched=_counts(logged, masks[i]),
                decides=int(decides.sum()),
                changes=_changes(logged, before, v.code, decides),
                overrides=overrides,
                lacking=lacking[i],
            )
        )
    return Evaluation(out, logged, masks, np.asarray(whole.code, dtype=np.int8), deciding)
