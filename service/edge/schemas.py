"""The API's bodies: the batch endpoint's request and every scoring response.

A single transaction's request body is :class:`fraud_scoring.events.Transaction`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fraud_scoring.events import Transaction
from service.core.scoring import ScoreResult

# service.core.decision.DECISIONS as a type (a test keeps the two equal).
Decision = Literal["approve", "review", "decline"]

TXN_EXAMPLE: dict[str, Any] = {
    "transaction_id": "t-000123",
    "card_id": "c-42",
    "merchant_id": "m-7",
    "amount": 129.90,
    "currency": "EUR",
    "event_time": "2026-11-30T07:00:00+00:00",
    "country": "DE",
    "channel": "ecom",
    "mcc": "5732",
    "device_id": "d-9",
}

SCORE_EXAMPLE: dict[str, Any] = {
    "transaction_id": "t-000123",
    "decision": "review",
    "score": 0.41,
    "reasons": [
        {
            "code": "MODEL_SCORE_REVIEW",
            "message": "Model score 0.41 is at or above the review threshold 0.0054.",
        },
        {"code": "VELOCITY_1H", "message": "9 transactions on this card in the last hour."},
    ],
    "model_version": "3",
    "features": {"missing": [], "stale": ["merchant_fraud_rate_90d"]},
    "timing": {
        "queue_ms": 1.2,
        "feature_read_ms": 0.8,
        "inference_ms": 0.3,
        "decision_ms": 0.05,
        "total_ms": 2.4,
        "batch_size": 8,
    },
}


class ReasonOut(BaseModel):
    code: str
    message: str


class FeatureStatus(BaseModel):
    missing: list[str] = Field(description="features with no value; defaults were used")
    stale: list[str] = Field(
        description="features older than their TTL (or newer than the "
        "transaction); defaults were used"
    )


class Timing(BaseModel):
    queue_ms: float
    feature_read_ms: float
    inference_ms: float
    decision_ms: float
    total_ms: float
    batch_size: int = Field(description="transactions in the micro-batch this one ran in")


class ScoreOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [SCORE_EXAMPLE]})

    transaction_id: str
    decision: Decision
    score: float | None = Field(
        description="the model's probability; null for a rules-only (degraded) decision"
    )
    reasons: list[ReasonOut]
    model_version: str = Field(description='"rules-only" for a degraded decision')
    features: FeatureStatus
    timing: Timing
    degraded: bool = Field(
        default=False,
        description="true: the online store had no batch features or did not answer, and "
        "FRAUD_DEGRADED_POLICY=rules decided on request and session features by rules only",
    )

    @staticmethod
    def wire(res: ScoreResult, total_ms: float) -> dict[str, Any]:
        """The response for one scored transaction, as the plain dict that is serialised
        (this model's fields and shape; tests validate it against the model): built
        without a validation pass, serialised once by :func:`pydantic_core.to_json`.
        ``total_ms`` is the handler's own time, so whatever the micro-batch's stages do
        not explain was queueing."""
        tm = res.timing_ms
        queue_ms = max(total_ms - tm["feature_read"] - tm["inference"] - tm["decision"], 0.0)
        return {
            "transaction_id": res.transaction_id,
            "decision": res.decision,
            "score": res.score,
            "reasons": [{"code": r.code, "message": r.message} for r in res.reasons],
            "model_version": res.model_version,
            "features": {"missing": res.missing, "stale": res.stale},
            "timing": {
                "queue_ms": queue_ms,
                "feature_read_ms": tm["feature_read"],
                "inference_ms": tm["inference"],
                "decision_ms": tm["decision"],
                "total_ms": total_ms,
                "batch_size": int(tm["batch_size"]),
            },
            "degraded": res.degraded is not None,
        }

    @classmethod
    def of(cls, res: ScoreResult, total_ms: float) -> ScoreOut:
        """:meth:`wire` as a validated model."""
        return cls.model_validate(cls.wire(res, total_ms))


class BatchIn(BaseModel):
    """The batch endpoint's body: the client's own batch (each one joins micro-batches)."""

    transactions: list[Transaction]


class BatchOut(BaseModel):
    results: list[ScoreOut]
