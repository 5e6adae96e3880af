"""The ceiling for ``bench.bench_http``: a scoring endpoint written the way FastAPI users
write one, doing no work of its own.

``POST /v1/score`` takes the project's pydantic ``Transaction`` as its body parameter and
declares a ``response_model``, so FastAPI reads the body, parses and validates it, calls
the handler, then validates and serialises the answer through the model: everything a
typical FastAPI + uvicorn endpoint costs before its first line of business logic. The
answer is fixed, built from the request (its ``transaction_id`` echoed).

``ScoreOut`` here has the fields of the service's own answer
(``service.edge.schemas.ScoreOut``) without importing it: that module pulls in the scorer
(Feast, ONNX Runtime, redis-py), which this endpoint would then carry in its process for
nothing. ``bench_http`` checks at start that the two models still have the same shape.

    FRAUD_PORT=8001 python -m bench.typical_app
"""

from __future__ import annotations

import os
from typing import Literal

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, Field

from fraud_scoring.events import Transaction


class ReasonOut(BaseModel):
    code: str
    message: str


class FeatureStatus(BaseModel):
    missing: list[str]
    stale: list[str]
    inexact: list[str] = Field(default_factory=list)


class Timing(BaseModel):
    queue_ms: float
    feature_read_ms: float
    inference_ms: float
    decision_ms: float
    total_ms: float
    batch_size: int


class ScoreOut(BaseModel):
    transaction_id: str
    decision: Literal["approve", "review", "decline"]
    score: float | None
    reasons: list[ReasonOut]
    model_version: str
    decided_by: Literal["rule", "list", "model"] = "model"
    rules_version: str | None = None
    shadow_rules: list[ReasonOut] = Field(default_factory=list)
    features: FeatureStatus
    timing: Timing
    degraded: bool = False


app = FastAPI()


@app.post("/v1/score", response_model=ScoreOut)
async def score(txn: Transaction) -> ScoreOut:
    return ScoreOut(
        transaction_id=txn.transaction_id,
        decision="approve",
        score=0.0,
        reasons=[],
        model_version="typical",
        decided_by="model",
        rules_version="typical",
        shadow_rules=[],
        features=FeatureStatus(missing=[], stale=[], inexact=[]),
        timing=Timing(
            queue_ms=0.0,
            feature_read_ms=0.0,
            inference_ms=0.0,
            decision_ms=0.0,
            total_ms=0.0,
            batch_size=1,
        ),
    )


@app.get("/readyz")
async def readyz() -> dict[str, str]:
    return {"status": "ready"}


if __name__ == "__main__":
    uvicorn.run(
        app,
        host=os.environ.get("FRAUD_HOST", "127.0.0.1"),
        port=int(os.environ.get("FRAUD_PORT", "8001")),
        log_level="warning",
        access_log=False,
    )
