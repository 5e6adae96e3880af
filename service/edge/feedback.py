"""``POST /v1/feedback``: a label for a scored transaction (a chargeback, an analyst's
verdict, a customer's report), so training and the served-traffic figures learn from it.

The label is appended to the event log's feedback stream/topic (FRAUD_FEEDBACK_STREAM),
idempotent on (``transaction_id``, ``source``): a retry, or a second label from the same
source, is one entry and the first one stands. The daily batch job (``fraud-scoring
decisions compact``) writes the labels into ``raw/labels/date=<arrival day>`` beside the
chargebacks, in their format, so training picks them up. Through the log rather than
straight into the files so that any number of service replicas can take feedback
without sharing a volume or a lock.

**Arrival time.** ``label_time`` is when the service received the label, not the
``time`` the caller reports (kept as ``reported_time``): a label counts only from its
arrival, so a back-dated label cannot leak into features or training sets of the past.

A label also takes its transaction out of the analysts' review queue
(``service/loop/review_queue.py``); the review page's marks come through :func:`store_label`.

Authentication: the router has no dependency of its own; the app adds the API's
authentication when it includes it (``app.include_router(router, dependencies=[...])``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from fraud_scoring.event_log import LogRecord, LogUnavailable
from fraud_scoring.events import ID_PATTERN
from service.errors import ErrorCode, error_body, error_responses
from service.resources import Resources, resources

log = logging.getLogger(__name__)

router = APIRouter()

Source = Literal["chargeback", "analyst", "customer"]


class FeedbackIn(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    transaction_id: str = Field(min_length=1, max_length=128, pattern=ID_PATTERN)
    label: Literal["fraud", "legitimate"]
    source: Source
    time: AwareDatetime = Field(description="When the source established the label.")


class FeedbackOut(BaseModel):
    transaction_id: str
    source: Source
    duplicate: bool  # True: this (transaction_id, source) was already stored; nothing changed
    label_time: float  # arrival, epoch seconds (UTC); for a duplicate, this call's arrival


def feedback_key(transaction_id: str, source: str) -> str:
    """The idempotence key of a label (``\\x1f`` cannot occur in an id)."""
    return f"{transaction_id}\x1f{source}"


@router.post(
    "/v1/feedback",
    response_model=FeedbackOut,
    responses=error_responses(401, 403, 408, 413, 422, 503),
)
async def feedback(request: Request, body: FeedbackIn) -> FeedbackOut | JSONResponse:
    """Store one label. 200 with ``duplicate`` telling a retry from a new label; 422
    naming the field for a bad body; 503 (Retry-After) when the log cannot take it, or
    is off (FRAUD_DECISION_LOG=off)."""
    return await store_label(resources(request), body)


async def store_label(res: Resources, body: FeedbackIn) -> FeedbackOut | JSONResponse:
    """The feedback path, for this route and the review page's marks: append the label
    to the feedback log, then take the transaction out of the review queue (a queue that
    does not answer is logged, not failed: the label is stored). The answer as the route
    gives it: :class:`FeedbackOut`, or the 503 as a JSONResponse."""
    if res.feedback is None:
        return JSONResponse(
            error_body(
                ErrorCode.LOG_OFF,
                "feedback needs the event log, which is off (FRAUD_DECISION_LOG=off)",
            ),
            status_code=503,
            headers={"Retry-After": "60"},
        )
    arrived_us = time.time_ns() // 1000
    record = {
        "transaction_id": body.transaction_id,
        "is_fraud": body.label == "fraud",
        "source": body.source,
        "reported_time": int(body.time.timestamp() * 1e6),
        "label_time": arrived_us,
    }
    payload = json.dumps(record, separators=(",", ":")).encode()
    try:
        new = await res.feedback.send(
            [LogRecord(feedback_key(body.transaction_id, body.source), payload)]
        )
    except LogUnavailable as exc:
        log.warning("feedback not stored: %s", exc)
        return JSONResponse(
            # The cause names the log's host: it goes to the log, not to the caller.
            error_body(ErrorCode.LOG_UNAVAILABLE, "the label could not be stored now"),
            status_code=503,
            headers={"Retry-After": "1"},
        )
    if res.review is not None:
        label = {"is_fraud": record["is_fraud"], "source": body.source, "label_time": arrived_us}
        try:
            await res.review.resolve(body.transaction_id, label)
        except LogUnavailable as exc:
            log.warning(
                "label stored, but %s stays in the review queue: %s", body.transaction_id, exc
            )
    # Kafka cannot tell a duplicate at write time (the compaction drops it): "new" there.
    return FeedbackOut(
        transaction_id=body.transaction_id,
        source=body.source,
        duplicate=new == 0,
        label_time=arrived_us / 1e6,
    )
