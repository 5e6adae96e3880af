"""The API's bodies: the batch endpoint's request and every scoring response.

A single transaction's request body is :class:`fraud_scoring.events.Transaction`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from fraud_scoring.events import Transaction
from service.scoring import ScoreResult


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
    transaction_id: str
    decision: str
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

    @classmethod
    def of(cls, res: ScoreResult, total_ms: float) -> ScoreOut:
        """The response for one scored transaction; ``total_ms`` is the handler's own
        time, so whatever the micro-batch's stages do not explain was queueing."""
        tm = res.timing_ms
        queue_ms = max(total_ms - tm["feature_read"] - tm["inference"] - tm["decision"], 0.0)
        return cls(
            transaction_id=res.transaction_id,
            decision=res.decision,
            score=res.score,
            reasons=[ReasonOut(code=r.code, message=r.message) for r in res.reasons],
            model_version=res.model_version,
            features=FeatureStatus(missing=res.missing, stale=res.stale),
            timing=Timing(
                queue_ms=queue_ms,
                feature_read_ms=tm["feature_read"],
                inference_ms=tm["inference"],
                decision_ms=tm["decision"],
                total_ms=total_ms,
                batch_size=int(tm["batch_size"]),
            ),
            degraded=res.degraded is not None,
        )


class BatchIn(BaseModel):
    """The batch endpoint's body: the client's own batch (each one joins micro-batches)."""

    transactions: list[Transaction]


class BatchOut(BaseModel):
    results: list[ScoreOut]
