"""Reason codes declared as data (``reasons`` in feature_repo/features.yaml): what the
language refuses, naming the field; a reason over a newly declared feature fires and
reads its values into its message; which reasons apply in rules-only mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from fraud_scoring import declared as D
from fraud_scoring import features as F
from service.core.decision import Indicator, Policy, declared_reasons

CARD_TESTING = {
    "code": "CARD_TESTING_AT_MERCHANT",
    "when": "merchant_distinct_cards_10m >= 20",
    "message": "{merchant_distinct_cards_10m:.0f} cards at this merchant in 10 minutes.",
}


def _load(tmp_path: Path, *reasons: dict[str, str]) -> D.Declarations:
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["reasons"] = [*doc["reasons"], *reasons]
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return F.load_declarations(path)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"code": "NO_CARD_HISTORY"}, "reasons.6.code", "is taken"),
        ({"code": "VELOCITY_1H"}, "reasons.6.code", "is taken"),
        ({"code": "card_testing"}, "reasons.6.code", "should match pattern"),
        ({"when": "merchant_cards >= 20"}, "reasons.6.when", "unknown name 'merchant_cards'"),
        ({"when": "card_top_country_30d == 1"}, "reasons.6.when", "card_top_country_30d"),
        ({"when": "open('x')"}, "reasons.6.when", "only these functions"),
        ({"message": "{merchant_cards} cards"}, "reasons.6.message", "{merchant_cards}"),
        ({"message": "{amount:.1q}"}, "reasons.6.message", "format code"),
        ({"message": "{amount!r}"}, "reasons.6.message", "no conversions"),
        ({"message": "{amount:>1000000000}"}, "reasons.6.message", "under 100"),
        ({"message": "{amount.real}"}, "reasons.6.message", "not a number feature"),
        ({"message": "{0}"}, "reasons.6.message", "not a number feature"),
        ({"message": ""}, "reasons.6.message", "at least 1 character"),
    ],
)
def test_a_reason_the_language_cannot_check_is_refused_naming_the_field(
    tmp_path: Path, change: dict[str, str], field: str, words: str
) -> None:
    with pytest.raises(D.DeclarationError) as err:
        _load(tmp_path, {**CARD_TESTING, **change})
    assert field in str(err.value) and words in str(err.value), err.value


def test_a_declared_reason_fires_with_its_values_and_ranks_by_importance(
    tmp_path: Path,
) -> None:
    decl = _load(tmp_path, CARD_TESTING)
    card_testing, velocity = (
        next(r for r in decl.reasons if r.code == c)
        for c in ("CARD_TESTING_AT_MERCHANT", "VELOCITY_10M")
    )
    assert card_testing.reads() == ("merchant_distinct_cards_10m",)
    ind = Indicator(card_testing, rules=True, reads=card_testing.reads())
    cols = {"merchant_distinct_cards_10m": np.array([3.0, 20.0, np.nan, 41.0])}
    assert ind.fires(cols, 4).tolist() == [False, True, False, True]
    assert not ind.fires({"amount": np.ones(4)}, 4).any()  # not read: never fires
    row = {"merchant_distinct_cards_10m": 41.0, "card_txn_count_10m": 4.0, "amount": 9.0}
    assert ind.reason(row).message == "41 cards at this merchant in 10 minutes."

    fired = [Indicator(velocity, rules=True, reads=velocity.reads()), ind]
    policy = Policy(0.5, 0.9, 1000.0, importance={"merchant_distinct_cards_10m": 0.3})
    reasons = declared_reasons(fired, row, policy)
    assert [r.code for r in reasons] == ["CARD_TESTING_AT_MERCHANT", "VELOCITY_10M"]
    assert reasons[1].message == "4 transactions on this card in the last 10 minutes."


def test_reasons_over_streaming_features_alone_apply_in_rules_only_mode() -> None:
    from service.core.decision import indicators

    rules = {i.code: i.rules for i in indicators()}
    assert rules == {
        "AMOUNT_FAR_ABOVE_CARD_HISTORY": False,  # the card's snapshot
        "FOREIGN_COUNTRY": False,
        "RISKY_MERCHANT": False,
        "NEW_CARD": False,
        "VELOCITY_10M": True,
        "VELOCITY_1H": True,
    }


@pytest.mark.parametrize(
    "expr",
    [
        "-a + b * 2 - c / d",
        "a / 0",
        "0 < a < 3",
        "a >= b != c",
        "where(a > 0.5, log1p(abs(a)), sqrt(b - 1))",
        "clip(a / b, 0, 10)",
        "minimum(a, b) - maximum(c, 3)",
        "3",
        "-3 / 2",
        "1 < 2",
    ],
)
def test_the_compiled_expression_equals_the_reference_row_by_row(expr: str) -> None:
    """Derived features and reasons are evaluated by one compiled evaluator; the tests'
    reference evaluates each row on Python floats."""
    from tests.declared_reference import derived_reference

    rng = np.random.default_rng(3)
    cols = {k: rng.normal(size=40) * 3 for k in "abcd"}
    cols["b"][:10] = 0.0
    got = np.broadcast_to(D.evaluate(expr, cols), (40,))
    for i in range(40):
        want = derived_reference(expr, {k: float(v[i]) for k, v in cols.items()})
        assert got[i] == pytest.approx(want, nan_ok=True), (expr, i)


def test_a_reason_over_a_new_state_is_read_but_does_not_hold_serving_up(
    tmp_path: Path,
) -> None:
    """The scorer reads the states the reasons need besides the models'; only the
    models' must be backfilled before it serves."""
    from service.core.round_trip import declared_reads

    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["aggregations"].append(
        {"entity": "device_id", "value": "merchant_id", "windows": ["1h"],
         "features": {"distinct_count": "device_distinct_merchants"}}
    )  # fmt: skip
    doc["reasons"].append(
        {"code": "DEVICE_HOPPING", "when": "device_distinct_merchants_1h >= 4", "message": "x"}
    )
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(doc))
    decl = F.load_declarations(path)
    reasons = {f for r in decl.reasons for f in r.reads()}
    specs, required = declared_reads(decl, {"card_txn_count_1h"}, reasons)
    read = {f for s in specs for f in s.feature_names()}
    held = {f for s in required for f in s.feature_names()}
    assert {"device_distinct_merchants_1h", "card_txn_count_10m", "card_txn_count_1h"} <= read
    assert "card_txn_count_1h" in held and "device_distinct_merchants_1h" not in held


@pytest.mark.parametrize("n", [1, 7, 64])
def test_the_reasons_compiled_together_fire_where_each_would_alone(n: int) -> None:
    """``fired`` (the shipped reasons' conditions compiled together, as rules are) says
    for every row what each reason's own ``fires`` says, NaN and zero-division rows and a
    reason whose feature is not in the columns (it never fires) included."""
    from service.core.decision import fired, indicators

    rng = np.random.default_rng(n)
    names = {f for i in indicators() for f in i.reads}
    cols = {k: rng.choice([np.nan, 0.0, 0.5, 1.0, 3.0, 9.0, 1e3], n) for k in names}
    for dropped in (None, sorted(names)[0]):
        given = {k: v for k, v in cols.items() if k != dropped}
        want = [[i.code for i in indicators() if i.fires(given, n)[k]] for k in range(n)]
        assert [[i.code for i in row] for row in fired(given, n)] == want
        rules_only = [
            [i.code for i in indicators() if i.rules and i.fires(given, n)[k]] for k in range(n)
        ]
        assert [[i.code for i in row] for row in fired(given, n, rules=True)] == rules_only
