"""The rules' compiled masks (fraud_scoring/rules.py, ``_Program``: the rules of a set
evaluated together, each shared sub-expression once) give what each rule's expression
gives alone in the declared features' language; Verdicts' per-set plan; a message naming
a feature the rules do not otherwise read. No world, no server."""

from __future__ import annotations

from typing import Any

import numpy as np

from fraud_scoring import rules as R
from fraud_scoring.declared.expressions import evaluate
from service.core.decision import Verdicts, rules_only_rules
from service.core.rules import known_features

KNOWN = set(known_features())

RULES = b"""
lists:
  blocked_cards: {key: card_id}
  trusted_merchants: {key: merchant_id}
  unread: {key: device_id}
rules:
  - {code: A, action: allow, when: "merchant_id in trusted_merchants and score < 0.5", message: m}
  - {code: B, action: decline, when: "card_id in blocked_cards or amount > 900", message: m}
  - {code: C, action: review, when: "amount > 900 and country != 'US'", message: m, mode: shadow}
  - {code: D, action: review, when: "(amount > 5) + (card_is_new > 0) >= 2", message: m}
  - {code: E, action: review, when: "not (amount > 100 or not (country == 'US'))", message: m}
  - {code: F, action: decline, when: "-amount < -50 and 0 < card_txn_count_1h <= 3", message: m}
  - {code: G, action: review, when: "maximum(amount, card_amount_sum_1h) / card_txn_count_1h > 200",
     message: m}
  - {code: H, action: review, when: "review_amount_limit > 3", message: m}
  - {code: I, action: review, when: "(amount > 100) == 0 and (amount > 10) != 0", message: m}
  - {code: J, action: review, message: m,
     when: "where(card_is_new, amount, 0) > 50 or log1p(amount) * 2 > 9"}
  - {code: K, action: review, when: "mcc not in ('7995', '4829') and device_id != ''", message: m}
  - {code: L, action: review, message: m,
     when: "clip(amount_zscore_30d, -1, 1) >= 1 and sqrt(amount) > 3 or abs(amount_zscore_30d) > 2"}
  - {code: M, action: decline, when: "device_id in unread", message: m}
  - {code: N, action: review, when: "amount > 900 and card_is_new == 1", message: m}
  - {code: O, action: review, message: m,
     when: "starts_with(mcc, '79', '48') and not ends_with(merchant_id, '2')"}
"""


def _reference(rs: R.RuleSet, numbers: dict, strings: dict, members: dict, n: int) -> np.ndarray:
    """Each rule alone, as the masks were computed before the program: its string tests
    by np.isin, its expression by the declared features' evaluate."""
    cols = dict(numbers)
    for t in rs.tests:
        if t.match == "prefix":
            cols[t.name] = np.array(
                [any(v.startswith(x) for x in t.values) for v in strings[t.field]]
            )
        elif t.match == "suffix":
            cols[t.name] = np.array(
                [any(v.endswith(x) for x in t.values) for v in strings[t.field]]
            )
        elif t.list_name is None:
            cols[t.name] = np.isin(strings[t.field], t.values)
        else:
            got = members.get(R.member_column(t.list_name, t.field))
            cols[t.name] = np.zeros(n, dtype=bool) if got is None else got
    out = np.zeros((len(rs.rules), n), dtype=bool)
    for i, r in enumerate(rs.rules):
        v = evaluate(r.expr, cols)
        out[i] = (v != 0) & ~np.isnan(v)
    return out


def _batch(rng: np.random.Generator, n: int) -> tuple[dict, dict, dict]:
    numbers: dict[str, Any] = {
        "amount": rng.lognormal(5, 1.5, n),
        "card_is_new": (rng.random(n) < 0.3).astype(np.float32),
        "card_txn_count_1h": rng.poisson(2, n).astype(np.float32),
        "card_amount_sum_1h": rng.lognormal(5, 1, n).astype(np.float32),
        "amount_zscore_30d": rng.normal(0, 1.5, n),
        "score": rng.random(n).astype(np.float32),
        "review_amount_limit": 5000.0,
    }
    for k in ("amount_zscore_30d", "card_amount_sum_1h", "card_txn_count_1h"):
        numbers[k][rng.random(n) < 0.2] = np.nan  # NaN never holds
    strings = {
        "country": np.array(rng.choice(["US", "FR", "BR"], n), dtype=object),
        "mcc": np.array(rng.choice(["7995", "4829", "5411"], n), dtype=object),
        "device_id": np.array(rng.choice(["", "d1", "d2"], n), dtype=object),
        "card_id": np.array(rng.choice(["c1", "c2"], n), dtype=object),
        "merchant_id": np.array(rng.choice(["m1", "m2"], n), dtype=object),
    }
    members = {
        R.member_column("blocked_cards", "card_id"): rng.random(n) < 0.2,
        R.member_column("trusted_merchants", "merchant_id"): (rng.random(n) < 0.2).astype(int),
    }  # "unread" is not read: no row
    return numbers, strings, members


def test_the_compiled_masks_equal_each_rule_evaluated_alone() -> None:
    rs = R.parse(RULES, "r.yaml", KNOWN)
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):
        for n in (1, 2, 7, 64, 300):
            numbers, strings, members = _batch(rng, n)
            want = _reference(rs, numbers, strings, members, n)
            got = rs.masks(numbers, strings, members, n)
            assert got.shape == want.shape and got.dtype == bool
            assert (got == want).all(), np.argwhere(got != want)[:5]
            assert 0 < want.sum() < want.size
            # a subset (rules-only mode) is compiled apart and keeps the set's order
            sub = [r for r in rs.rules if not r.reads_list and not r.reads_score]
            idx = [rs.rules.index(r) for r in sub]
            assert (rs.masks(numbers, strings, members, n, sub) == want[idx]).all()
            assert (rs.masks(numbers, strings, members, n) == want).all()  # again, cached


def test_an_empty_set_and_an_empty_batch() -> None:
    none = R.parse(b"rules: []\n", "r.yaml", KNOWN)
    assert none.masks({}, {}, {}, 5).shape == (0, 5)
    rs = R.parse(RULES, "r.yaml", KNOWN)
    numbers, strings, members = _batch(np.random.default_rng(0), 0)
    assert rs.masks(numbers, strings, members, 0).shape == (len(rs.rules), 0)


def test_verdicts_per_row_match_the_rules_in_file_order() -> None:
    rs = R.parse(RULES, "r.yaml", KNOWN)
    numbers, strings, members = _batch(np.random.default_rng(5), 40)
    with np.errstate(all="ignore"):
        m = rs.masks(numbers, strings, members, 40)
    scores = np.asarray(numbers["score"], dtype=np.float64)
    for rules, masks in ((rs.rules, m), (tuple(rules_only_rules(rs, set(numbers))), None)):
        if masks is None:
            masks = m[[rs.rules.index(r) for r in rules]]
        v = Verdicts(rules, masks, 40, scores, 0.6, 0.95)
        for i in range(40):
            got = v.row(i, {})
            matched = [rules[j] for j in np.flatnonzero(masks[:, i])]
            active = [r.code for r in matched if r.active]
            assert sorted(got.fired) == sorted(active)
            assert [s.code for s in got.shadow] == [r.reason_code for r in matched if not r.active]
            if got.decided_by != "model":
                assert got.fired[0] == rules[int(v.decider[i])].code


def test_a_feature_only_a_message_names_is_read_and_a_lacking_value_reads_nan() -> None:
    rs = R.parse(
        b"lists: {blocked_cards: {key: card_id}}\n"
        b"rules: [{code: B, action: decline, when: card_id in blocked_cards,"
        b" message: 'blocked; {merchant_amount_mean_7d:.0f} on {country}'}]\n",
        "r.yaml",
        KNOWN,
    )
    assert rs.features == {"merchant_amount_mean_7d"}  # the scorer reads it for the message
    rule = rs.rules[0]
    assert rule.message({"merchant_amount_mean_7d": 12.0, "country": "FR"}) == "blocked; 12 on FR"
    assert rule.message({}) == "blocked; nan on "
