"""Scoring one micro-batch of transactions, top to bottom:

read features (one pipelined round trip) → request features → feature vector in the
model's order → ONNX Runtime (off the event loop) → decision policy → results.

The dynamic batcher calls :meth:`Scorer.score_batch` with whatever micro-batch it formed;
the naive path (batching off) calls it with one transaction per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from fraud_scoring import features as F
from fraud_scoring.events import Transaction
from fraud_scoring.settings import Settings
from service.decision import Policy, Reason
from service.errors import Rejected, RejectReason
from service.model import LoadedModel, ModelHolder
from service.online_features import OnlineFeatureReader


class FeatureStoreUnavailable(Rejected):
    """The online store (Redis) did not answer the batch's read: no decision is made on
    made-up features; the API answers 503 so the caller applies its own fallback."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectReason.FEATURE_STORE, detail)


@dataclass
class ScoreResult:
    transaction_id: str
    decision: str
    score: float
    reasons: list[Reason]
    model_version: str
    missing: list[str]
    stale: list[str]
    timing_ms: dict[str, float] = field(default_factory=dict)
    # Wall-clock (ns) bounds of each stage, for per-request trace spans.
    spans_ns: dict[str, tuple[int, int]] = field(default_factory=dict)


def policy_for(model: LoadedModel, settings: Settings) -> Policy:
    th = model.meta.thresholds_for(model.variant)
    return Policy(
        review_threshold=settings.review_threshold
        if settings.review_threshold is not None
        else th.review,
        decline_threshold=settings.decline_threshold
        if settings.decline_threshold is not None
        else th.decline,
        review_amount_limit=settings.review_amount_limit,
        importance=model.meta.feature_importance,
    )


class Scorer:
    def __init__(
        self,
        redis: Any,
        reader: OnlineFeatureReader,
        models: ModelHolder,
        settings: Settings,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.redis = redis
        self.reader = reader
        self.models = models
        self.settings = settings
        self.pool = pool

    async def read_features(
        self, txns: Sequence[Transaction]
    ) -> tuple[dict[str, np.ndarray], list[list[str]], list[list[str]]]:
        """All feature columns (batch, session, request, spanning) for ``txns``, one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        self.reader.queue(pipe, txns)
        try:
            replies = await pipe.execute()
        except RedisError as exc:
            raise FeatureStoreUnavailable(f"feature store (Redis) unavailable: {exc}") from exc
        rows = self.reader.parse(replies, txns)
        req = F.request_features(
            [t.amount for t in txns],
            [t.event_ts for t in txns],
            [t.utc_offset_s for t in txns],
            [t.country for t in txns],
            [t.channel for t in txns],
            [t.device_id is not None for t in txns],
            rows.columns,
        )
        span = F.spanning_features(rows.columns)
        return {**rows.columns, **req, **span}, rows.missing, rows.stale

    async def score_batch(self, txns: Sequence[Transaction]) -> list[ScoreResult]:
        """Decisions for one micro-batch, in input order. Raises FeatureStoreUnavailable
        when Redis does not answer and Rejected(no_model) when no model is loaded."""
        wall0, t0 = time.time_ns(), time.perf_counter()
        cols, missing, stale = await self.read_features(txns)
        wall1, t1 = time.time_ns(), time.perf_counter()
        model = self.models.require()  # one model for the whole batch, even during a swap
        x = F.assemble(model.meta.feature_names, cols)
        if len(txns) <= self.settings.inline_inference_max_batch and not model.on_gpu:
            scores = model.predict(x)  # cheaper than the thread handoff (settings)
        else:
            scores = await asyncio.get_running_loop().run_in_executor(self.pool, model.predict, x)
        wall2, t2 = time.time_ns(), time.perf_counter()
        policy = policy_for(model, self.settings)
        names = list(cols)
        out = []
        for i, t in enumerate(txns):
            row = {n: cols[n][i] for n in names if cols[n].dtype != object}
            decision, reasons = policy.decide(
                float(scores[i]),
                row,
                card_known="card_txn_count_30d" not in missing[i]
                and "card_txn_count_30d" not in stale[i],
            )
            out.append(
                ScoreResult(
                    transaction_id=t.transaction_id,
                    decision=decision,
                    score=float(scores[i]),
                    reasons=reasons,
                    model_version=model.version,
                    missing=missing[i],
                    stale=stale[i],
                )
            )
        wall3, t3 = time.time_ns(), time.perf_counter()
        for r in out:
            r.timing_ms = {
                "feature_read": (t1 - t0) * 1e3,
                "inference": (t2 - t1) * 1e3,
                "decision": (t3 - t2) * 1e3,
                "batch_size": float(len(txns)),
            }
            r.spans_ns = {
                "feature_read": (wall0, wall1),
                "inference": (wall1, wall2),
                "decision": (wall2, wall3),
            }
        return out
