"""fraud_scoring/rules.py and the decision order (service/core/decision.py): the language
and its checks, the order (allow, decline, the model's decline threshold, review, the
model's review threshold), shadow rules, the shipped amount rule, and a reload that keeps
the old rules on a bad file. No world, no server."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fraud_scoring import rules as R
from service.core.decision import Verdicts
from service.core.rules import RulesHolder, known_features

KNOWN = set(known_features())

ORDERED = b"""
lists:
  blocked_cards: {key: card_id}
  trusted_merchants: {key: merchant_id}
rules:
  - {code: TRUSTED, action: allow, when: merchant_id in trusted_merchants, message: trusted}
  - {code: BLOCKED, action: decline, when: card_id in blocked_cards, message: blocked}
  - {code: BIG, action: review, when: amount > 1000, message: "big {amount:.0f}"}
  - {code: BIG_FOREIGN, action: decline, when: "amount > 1000 and country != 'US'",
     message: "big abroad", mode: shadow}
"""


def _columns(rs: R.RuleSet, amount: list[float], country: list[str], blocked: list[int],
             trusted: list[int]) -> np.ndarray:  # fmt: skip
    n = len(amount)
    strings = {"country": np.array(country, dtype=object)}
    members = {
        R.member_column("blocked_cards", "card_id"): np.array(blocked, dtype=bool),
        R.member_column("trusted_merchants", "merchant_id"): np.array(trusted, dtype=bool),
    }
    return rs.masks({"amount": np.array(amount)}, strings, members, n)


def test_allow_beats_decline_beats_review_beats_the_thresholds() -> None:
    rs = R.parse(ORDERED, "t.yaml", KNOWN)
    # rows: trusted+blocked+big | blocked+big | big (model approves) | big, model declines
    #       | nothing, model reviews | nothing, model declines
    amount = [5000.0, 5000.0, 5000.0, 5000.0, 10.0, 10.0]
    masks = _columns(rs, amount, ["US"] * 6, [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0])
    scores = np.array([0.99, 0.0, 0.0, 0.95, 0.5, 0.95])
    v = Verdicts(rs.rules, masks, 6, scores, 0.4, 0.9)
    got = [v.row(i, {"amount": a}) for i, a in enumerate(amount)]
    assert [g.decision for g in got] == [
        "approve", "decline", "review", "decline", "review", "decline"
    ]  # fmt: skip
    assert [g.decided_by for g in got] == ["list", "list", "rule", "model", "model", "model"]
    assert got[0].reasons[0].code == "RULE_TRUSTED"  # the decider first
    assert got[0].fired == ["TRUSTED", "BLOCKED", "BIG"]
    assert got[2].reasons[0].message == "big 5000"
    # a review rule does not lower the model's decline (its stage comes after)
    assert [r.code for r in got[3].reasons] == ["RULE_BIG"]
    assert got[3].fired == ["BIG"]


def test_a_shadow_rule_matches_and_is_listed_but_never_decides() -> None:
    rs = R.parse(ORDERED, "t.yaml", KNOWN)
    masks = _columns(rs, [5000.0, 5000.0], ["FR", "US"], [0, 0], [0, 0])
    v = Verdicts(rs.rules, masks, 2, np.array([0.0, 0.0]), 0.4, 0.9)
    abroad, home = v.row(0, {"amount": 5000.0}), v.row(1, {"amount": 5000.0})
    assert abroad.decision == home.decision == "review"  # the active BIG, not the shadow
    assert [r.code for r in abroad.shadow] == ["RULE_BIG_FOREIGN"]
    assert home.shadow == [] and "BIG_FOREIGN" not in abroad.fired


def test_the_shipped_amount_rule_keeps_the_hard_limit() -> None:
    rs = R.load(R.DEFAULT_PATH, KNOWN)
    rule = next(r for r in rs.rules if r.code == "AMOUNT_OVER_LIMIT")
    assert (rule.action, rule.active, rule.reason_code) == (
        "review",
        True,
        "RULE_AMOUNT_OVER_LIMIT",
    )
    amount = np.array([4999.0, 5000.0, 5001.0, 9000.0])
    masks = rs.masks(
        {"amount": amount, "review_amount_limit": 5000.0},
        R.string_columns([], ()),
        {R.member_column(n, f): np.zeros(4, dtype=bool) for n, f in rs.list_reads},
        4,
    )
    scores = np.array([0.0, 0.0, 0.0, 0.99])
    v = Verdicts(rs.rules, masks, 4, scores, 0.5, 0.9)
    rows = [v.row(i, {"amount": a, "review_amount_limit": 5000.0}) for i, a in enumerate(amount)]
    assert [r.decision for r in rows] == ["approve", "approve", "review", "decline"]
    assert rows[2].reasons[0].message == "Amount 5001.00 is over the review limit 5000.00."


@pytest.mark.parametrize(
    ("when", "words"),
    [
        ("amount", "rules.0.when: not a condition"),
        ("card_txn_count_1x > 2", "rules.0.when: unknown name 'card_txn_count_1x'"),
        ("card_id in stolen_cards", "rules.0.when: unknown list 'stolen_cards'"),
        ("merchant_id in blocked_cards", "holds card_id values, not merchant_id"),
        ("country > 'US'", "only ==, !=, in and not in"),
        ("amount > 'x'", "constants must be numbers"),
        ("amount >", "not an expression"),
        ("starts_with(amount, '4')", "'amount' is not one of"),
        ("starts_with(mcc)", "one or more non-empty strings"),
        ("ends_with(mcc, 7)", "one or more non-empty strings"),
    ],
)
def test_a_rule_the_language_cannot_check_is_refused_naming_the_field(
    when: str, words: str
) -> None:
    rule = f"{{code: X, action: review, when: {when!r}, message: m}}"
    doc = f"lists: {{blocked_cards: {{key: card_id}}}}\nrules: [{rule}]\n"
    with pytest.raises(R.RulesError) as err:
        R.parse(doc.encode(), "r.yaml", KNOWN)
    assert str(err.value).startswith("r.yaml: ") and words in str(err.value), err.value


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ("rules: [{code: X, action: block, when: amount > 1, message: m}]", "rules.0.action"),
        ("rules: [{code: X, action: review, when: amount > 1, message: '{nope}'}]",
         "rules.0.message"),
        ("rules: [{code: X, action: review, when: amount > 1, message: m},"
         " {code: X, action: review, when: amount > 2, message: m}]", "rules.1.code"),
        ("lists: {cards: {key: pan}}", "lists.cards.key"),
        ("rules: [{code: X, action: review, when: amount > 1, message: m, mode: dry}]",
         "rules.0.mode"),
    ],
)  # fmt: skip
def test_a_bad_field_is_refused_by_name(doc: str, words: str) -> None:
    with pytest.raises(R.RulesError) as err:
        R.parse(doc.encode(), "r.yaml", KNOWN)
    assert words in str(err.value), err.value


def test_string_tests_and_boolean_words() -> None:
    rs = R.parse(
        b"rules: [{code: X, action: review, message: m, "
        b"when: \"not (channel == 'pos') and (mcc in ('7995', '4829') or amount >= 900)\"}]",
        "r.yaml",
        KNOWN,
    )
    strings = {
        "channel": np.array(["ecom", "pos", "ecom", "atm"], dtype=object),
        "mcc": np.array(["7995", "7995", "5411", "5411"], dtype=object),
    }
    m = rs.masks({"amount": np.array([10.0, 10.0, 10.0, 950.0])}, strings, {}, 4)
    assert m[0].tolist() == [True, False, False, True]


def _write(path: Path, body: str) -> None:
    path.write_text(body)
    st = path.stat()  # a new mtime even within the clock's resolution
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_a_bad_file_keeps_the_old_rules_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    _write(path, "rules: [{code: A, action: review, when: amount > 1, message: m}]\n")
    holder = RulesHolder(path)
    first = holder.current
    _write(path, "rules: [{code: A, action: review, when: amount > nope, message: m}]\n")
    assert holder.reload() is False  # changed: loaded once it holds still for one look
    assert holder.reload() is False
    assert holder.current is first
    assert holder.problem is not None and "rules.0.when: unknown name 'nope'" in holder.problem
    _write(path, "rules: [{code: A, action: decline, when: amount > 1, message: m}]\n")
    assert holder.reload() is False
    assert holder.reload() is True
    assert holder.problem is None and holder.current.version != first.version
    assert holder.current.rules[0].action == "decline"


def test_a_file_caught_mid_write_is_never_served(tmp_path: Path) -> None:
    """The truncation that starts a write leaves an empty file (a valid file with no
    rules) for a moment: a look that sees it, followed by one that sees the written
    file, loads only the written one."""
    path = tmp_path / "rules.yaml"
    _write(path, "rules: [{code: A, action: review, when: amount > 1, message: m}]\n")
    holder = RulesHolder(path)
    first = holder.current
    _write(path, "")  # mid-write
    assert holder.reload() is False and holder.current is first
    _write(path, "rules: [{code: B, action: decline, when: amount > 1, message: m}]\n")
    assert holder.reload() is False and holder.current is first  # changed again: settling
    assert holder.reload() is True
    assert [r.code for r in holder.current.rules] == ["B"]
