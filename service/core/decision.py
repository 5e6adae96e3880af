"""Decision policy: model thresholds, then hard rules, with reasons that explain it.

Thresholds come from the model metadata (chosen on the holdout by the training job) and
can be overridden in settings. Hard rules apply after the model and can only make a
decision stricter. Reason codes are indicators over the features the model saw, ordered
by the model's feature importance when the metadata has it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

DECISIONS = ("approve", "review", "decline")


@dataclass(frozen=True)
class Reason:
    code: str
    message: str


@dataclass(frozen=True)
class Indicator:
    code: str
    feature: str
    fires: Callable[[Mapping[str, float]], bool]
    message: Callable[[Mapping[str, float]], str]


INDICATORS: tuple[Indicator, ...] = (
    Indicator(
        "AMOUNT_FAR_ABOVE_CARD_HISTORY",
        "amount_to_card_mean_30d",
        lambda f: f["amount_to_card_mean_30d"] >= 5,
        lambda f: f"Amount is {f['amount_to_card_mean_30d']:.1f}x the card's 30-day average.",
    ),
    Indicator(
        "FOREIGN_COUNTRY",
        "is_foreign_country",
        lambda f: f["is_foreign_country"] >= 1,
        lambda f: "Transaction country differs from the card's usual country.",
    ),
    Indicator(
        "RISKY_MERCHANT",
        "merchant_fraud_rate_90d",
        lambda f: f["merchant_fraud_rate_90d"] >= 0.02,
        lambda f: f"Merchant's 90-day fraud rate is {f['merchant_fraud_rate_90d']:.1%}.",
    ),
    Indicator(
        "NEW_CARD",
        "card_days_since_first_seen",
        lambda f: 0 < f["card_days_since_first_seen"] < 3,
        lambda f: f"Card first seen {f['card_days_since_first_seen']:.1f} days ago.",
    ),
    Indicator(
        "VELOCITY_10M",
        "card_txn_count_10m",
        lambda f: f.get("card_txn_count_10m", 0) >= 3,
        lambda f: (
            f"{f.get('card_txn_count_10m', 0):.0f} transactions on this card in "
            "the last 10 minutes."
        ),
    ),
    Indicator(
        "VELOCITY_1H",
        "card_txn_count_1h",
        lambda f: f.get("card_txn_count_1h", 0) >= 8,
        lambda f: (
            f"{f.get('card_txn_count_1h', 0):.0f} transactions on this card in the last hour."
        ),
    ),
)


# The features Policy.decide reads (the amount rule and the indicators): the scorer hands
# it these alone, not every column.
FEATURES_READ: frozenset[str] = frozenset({"amount", *(i.feature for i in INDICATORS)})


@dataclass(frozen=True)
class Policy:
    review_threshold: float
    decline_threshold: float
    review_amount_limit: float
    importance: Mapping[str, float]

    def decide(
        self, score: float, features: Mapping[str, float], card_known: bool
    ) -> tuple[str, list[Reason]]:
        """Decision and reasons for one transaction (``features`` as the model saw them)."""
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
        fired = [i for i in INDICATORS if i.feature in features and i.fires(features)]
        fired.sort(key=lambda i: -self.importance.get(i.feature, 0.0))
        reasons.extend(Reason(i.code, i.message(features)) for i in fired)
        return decision, reasons


# Rules-only decisions (degraded mode) use only what does not come from the batch job:
# the request and the card's session counts.
_SESSION_INDICATORS = tuple(i for i in INDICATORS if i.code.startswith("VELOCITY_"))
# The features the rules-only decision reads (the card's velocity), when they were read.
RULE_FEATURES = tuple(i.feature for i in _SESSION_INDICATORS)


def rules_only(
    amount: float, session: Mapping[str, float], review_amount_limit: float
) -> tuple[str, list[Reason]]:
    """The degraded-mode decision without a model score: 'review' when the amount is over
    the limit or a velocity indicator fires on the session counts, else 'approve'; never
    'decline' (no model has judged it). ``session`` may be empty (store unreachable)."""
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
    for i in _SESSION_INDICATORS:
        if i.feature in session and i.fires(session):
            decision = "review"
            reasons.append(Reason(i.code, i.message(session)))
    return decision, reasons
