"""``POST /v1/feedback``: a label for a scored transaction (a chargeback, an analyst's
verdict, a customer's report), so training and the served-traffic figures learn from it.

The label is appended to the event log's feedback stream/topic (FRAUD_FEEDBACK_STREAM),
idempotent on (``transaction_id``, ``source``), and for ``analyst`` on the sending key too
(:func:`feedback_key`): a retry, or a second label from the same source (the same key's
for an analyst), is one entry and the first one stands. An analyst's mark is therefore
never a duplicate of another key's label. The daily batch job (``fraud-scoring decisions
compact``) writes the labels into ``raw/labels/date=<arrival day>`` beside the
chargebacks, in their format, and their sources into ``raw/label_sources``, so training
picks them up and takes one per transaction by source (``batch_jobs.labels``: analyst,
then chargeback, then any other; the newest first within a source). Through the log
rather than straight into the files so that any number of service replicas can take
feedback without sharing a volume or a lock.

**Arrival time.** ``label_time`` is when the service received the label, not the
``time`` the caller reports (kept as ``reported_time``): a label counts only from its
arrival, so a back-dated label cannot leak into features or training sets of the past.

**Who may label.** The ``label`` scope (or ``admin``, which implies it): analysts and
chargeback feeds, not a payment system's ``score`` key. Each stored label carries the
caller's key id (``key_id``). **Who may say ``analyst``.** An analyst's verdict outranks
every other source in training, so ``source: analyst`` is checked against the key
(:func:`check_source`): the review page's mark (``POST /v1/review/label``, the analysts'
own route, which always stores ``analyst``), or this route with a key holding
:data:`ANALYST_SCOPE` (``admin``). A ``label`` key (a chargeback feed) sending it gets 403
naming ``source``, and nothing is stored.

**Matched or not.** A label is *matched* when the service still holds the decision of
its ``transaction_id`` (:func:`scored_transaction`): its review-queue item (every
``review`` decision, kept for the decision log's retention), else the id's claim
(``service/core/idempotency.py``: every answered recorded decision, kept
``FRAUD_IDEMPOTENCY_TTL_S``). Both are already written by scoring, hold the event time,
and cost one read here. An *unmatched* label (never scored, or scored too long ago) is
stored all the same, with ``matched: false`` in the log and in the answer, and counted
(``fraud_feedback_labels_total{source,matched}``); only a matched label takes an item
out of the analysts' review queue (``service/loop/review_queue.py``), and that close is
kept with the key id. The review page's marks come through :func:`store_label`.

**Label time.** ``time`` must lie in [the transaction's event time, now +
:data:`LABEL_SKEW_S`] (unmatched: not more than :data:`UNMATCHED_MAX_AGE_S` ago), else
422 naming ``time``; the event time itself is always accepted (the service scores event
times up to ``FRAUD_MAX_EVENT_SKEW_S`` ahead, and the review page labels such an item at
its event time).

The body must be JSON (``Content-Type: application/json``, else 415; bytes that are not
UTF-8 JSON: the one 422 ``invalid_json``), so a cross-site form cannot post a label.

Authentication: the router has no dependency of its own; the app adds the API's
authentication when it includes it (``app.include_router(router, dependencies=[...])``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import redis
from fastapi import APIRouter, Request
from prometheus_client import Counter
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from fraud_scoring import declared as D
from fraud_scoring.event_log import LogRecord, LogUnavailable
from fraud_scoring.events import ID_PATTERN
from fraud_scoring.session import to_us
from service.core import idempotency, live_labels
from service.edge import auth
from service.edge.routes import json_model
from service.edge.schemas import wire_ids
from service.errors import Forbidden, Invalid, Rejected, RejectReason, error_responses
from service.resources import Resources, resources

log = logging.getLogger(__name__)

router = APIRouter()

Source = Literal["chargeback", "analyst", "customer"]
LABEL_SKEW_S = 300.0  # a label's time may run this far ahead of the server clock
# An unmatched label's time may be this old at most (no card scheme takes disputes older).
UNMATCHED_MAX_AGE_S = 2 * 365 * 86_400.0
# The scope a key needs to send ``source: analyst`` here (the review page's mark needs only
# ``label``: it is the analysts' own route). ``admin``: the keys that ran the review queue
# before ``label`` existed, and never a chargeback feed's.
ANALYST_SCOPE = auth.Scope.ADMIN


class FeedbackIn(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    transaction_id: str = Field(min_length=1, max_length=128, pattern=ID_PATTERN)
    label: Literal["fraud", "legitimate"]
    source: Source
    # A date-time, not a number (lax mode would read a number as epoch seconds: 0 is 1970).
    time: AwareDatetime = Field(
        description="When the source established the label (RFC 3339 with an offset): at or "
        "after the transaction's event time, at most 300 s past the server clock.",
    )

    @field_validator("time", mode="before")
    @classmethod
    def _no_number(cls, v: object) -> object:
        if isinstance(v, int | float):  # bool too
            raise ValueError("must be an RFC 3339 date-time string with an offset")
        return v


class FeedbackOut(BaseModel):
    transaction_id: str
    source: Source
    # True: this (transaction_id, source) was already stored (for an analyst: by this key);
    # nothing changed.
    duplicate: bool
    # False: the service holds no decision for the id (never scored, or too long ago):
    # stored all the same, but it closes no review item.
    matched: bool
    # True: recorded in the declared label states as it arrived (the matched transaction's
    # first label): it counts from now, online and in training; False: from the daily
    # batch after its arrival day.
    live: bool = False
    label_time: float  # arrival, epoch seconds (UTC); for a duplicate, this call's arrival


def feedback_key(transaction_id: str, source: str, key_id: str) -> str:
    """The idempotence key of a label (``\\x1f`` cannot occur in an id): one label per
    (``transaction_id``, ``source``), and an analyst's per sending key too, so that no
    other key's label (one stored as ``analyst`` before sources were checked, or a mark
    through the page by another key) can make an analyst's mark a duplicate.
    ``batch_jobs.decisions.feedback_labels`` keeps one per the same key."""
    if source == "analyst":
        return f"{transaction_id}\x1f{source}\x1f{key_id}"
    return f"{transaction_id}\x1f{source}"


@functools.cache
def _labels() -> Counter:
    counter = Counter(
        "fraud_feedback_labels",
        "Labels stored through POST /v1/feedback and the review page, by source and by "
        "whether the service held the decision of their transaction_id (matched)",
        ["source", "matched"],
    )
    # Every source and match at 0 from the start (a series born at its first count looks
    # flat to rate()): create_app calls zero_counters().
    for source in get_args(Source):
        for matched in ("true", "false"):
            counter.labels(source=source, matched=matched)
    return counter


def zero_counters() -> None:
    """Export ``fraud_feedback_labels_total`` at 0 for every source and match (once)."""
    _labels()


@router.post(
    "/v1/feedback",
    response_model=FeedbackOut,
    responses=error_responses(401, 403, 408, 413, 415, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": wire_ids(FeedbackIn.model_json_schema())}},
        }
    },
)
async def feedback(request: Request) -> FeedbackOut:
    """Store one label. 200 with ``duplicate`` telling a retry from a new label and
    ``matched`` whether the service holds the transaction's decision; 403 naming
    ``source`` for ``analyst`` from a key without ``admin`` (:func:`check_source`); 415
    for a body that is not JSON; 422 naming the field for a bad body or ``time``; 503
    (Retry-After) when the log cannot take it, or is off (FRAUD_DECISION_LOG=off)."""
    body = await json_model(request, FeedbackIn)
    who = auth.principal(request)
    check_source(body, who)
    return await store_label(resources(request), body, who.key_id)


def check_source(body: FeedbackIn, who: auth.Principal) -> None:
    """``source: analyst`` only from a key holding :data:`ANALYST_SCOPE`, else
    :class:`~service.errors.Forbidden` (403) naming ``source``: an analyst's label
    outranks a chargeback in training, so a chargeback feed's key cannot claim one."""
    if body.source == "analyst" and ANALYST_SCOPE not in who.scopes:
        raise Forbidden(
            f"key {who.key_id!r} lacks scope {ANALYST_SCOPE.value!r} needed for source "
            "'analyst' (analysts mark through the review page, POST /v1/review/label)",
            "source",
        )


async def scored_transaction(res: Resources, transaction_id: str) -> dict[str, Any] | None:
    """The transaction of the decision the service holds for ``transaction_id`` (its key
    columns, ``amount``, ``transaction_id`` and ``event_us``: what a label state records),
    None when it holds none: its review-queue item, else its claim (kept
    ``FRAUD_IDEMPOTENCY_TTL_S``; a claim that cannot be read, with the feature store
    down, counts as none). Raises LogUnavailable when the queue does not answer."""
    if res.review is not None:
        found = await res.review.get(transaction_id)
        if found is not None:
            txn = found.item["transaction"]
            return _columns(transaction_id, txn, to_us(datetime.fromisoformat(txn["event_time"])))
    if not res.settings.idempotency_ttl_s or (res.health is not None and res.health.is_open):
        return None
    try:
        held = await res.redis.get(idempotency.key(transaction_id))
    except (redis.RedisError, OSError) as exc:
        log.warning("feedback: claim of %r not read: %s", transaction_id, type(exc).__name__)
        return None
    if held is None:
        return None
    text = held.decode() if isinstance(held, bytes) else str(held)
    content, _, answer = text.partition(idempotency.SEP)
    if not answer:  # claimed, not answered (refused, or still in flight)
        return None
    txn = json.loads(content)
    return _columns(transaction_id, txn, int(txn["event_time"]))


def _columns(transaction_id: str, txn: Mapping[str, Any], event_us: int) -> dict[str, Any]:
    return {
        **{c: txn.get(c) for c in D.KEY_COLUMNS},
        "amount": txn.get("amount"),
        "transaction_id": transaction_id,
        "event_us": event_us,
    }


def check_time(body: FeedbackIn, event_ts: float | None, now: float) -> None:
    """``body.time`` in [the event time, max(now + LABEL_SKEW_S, the event time)]
    (unmatched: within UNMATCHED_MAX_AGE_S of now), else the one 422 naming ``time``."""
    t = body.time.timestamp()
    why = None
    if t > max(now + LABEL_SKEW_S, event_ts if event_ts is not None else -math.inf):
        why = f"is after the server clock (more than {LABEL_SKEW_S:g} s ahead)"
    elif event_ts is not None and t < event_ts:
        at = datetime.fromtimestamp(event_ts, UTC).isoformat()
        why = f"is before the transaction's event_time ({at})"
    elif event_ts is None and t < now - UNMATCHED_MAX_AGE_S:
        why = f"is more than {UNMATCHED_MAX_AGE_S / 86_400:g} days ago"
    if why is not None:
        raise Invalid(why, "time")


def _unavailable(exc: LogUnavailable) -> Rejected:
    log.warning("feedback not stored: %s", exc)
    # The cause names the log's host: it goes to the log, not to the caller.
    return Rejected(RejectReason.LOG_UNAVAILABLE, "the label could not be stored now")


async def store_label(res: Resources, body: FeedbackIn, key_id: str) -> FeedbackOut:
    """The feedback path, for this route and the review page's marks: match the label to
    the decision the service holds (:func:`scored_transaction`), check its time, record it
    in the label states when it is the matched transaction's first
    (:mod:`service.core.live_labels`), append it to the feedback log with ``key_id`` and
    ``live``, then, when matched, take the transaction out of
    the review queue (a queue that does not answer then is logged, not failed: the label
    is stored). Raises :class:`~service.errors.Rejected` (503 ``log_off``,
    ``log_unavailable``) when the log cannot take it, :class:`~service.errors.Invalid`
    (422) for a bad ``time``."""
    if res.feedback is None:
        raise Rejected(
            RejectReason.LOG_OFF,
            "feedback needs the event log, which is off (FRAUD_DECISION_LOG=off)",
            retry_after_s=60,
        )
    try:
        txn = await scored_transaction(res, body.transaction_id)
    except LogUnavailable as exc:
        raise _unavailable(exc) from None
    matched = txn is not None
    check_time(body, txn["event_us"] / 1e6 if txn is not None else None, time.time())
    arrived_us = time.time_ns() // 1000
    live = False
    if txn is not None and res.settings.labels_live:
        s = res.settings
        live = await live_labels.record_label(
            res.redis,
            txn,
            body.label == "fraud",
            arrived_us,
            feedback_key(body.transaction_id, body.source, key_id),
            horizon_s=s.allowed_lateness_s + D.HORIZON_S,
            ttl_s=max(s.idempotency_ttl_s, s.decision_log_retention_s) + 86_400,
            timeout_s=s.redis_timeout_s,
        )
    record = {
        "transaction_id": body.transaction_id,
        "is_fraud": body.label == "fraud",
        "source": body.source,
        "reported_time": int(body.time.timestamp() * 1e6),
        "label_time": arrived_us,
        "matched": matched,
        "live": live,
        "key_id": key_id,
    }
    payload = json.dumps(record, separators=(",", ":")).encode()
    try:
        new = await res.feedback.send(
            [LogRecord(feedback_key(body.transaction_id, body.source, key_id), payload)]
        )
    except LogUnavailable as exc:
        raise _unavailable(exc) from None
    if new:
        _labels().labels(source=body.source, matched=str(matched).lower()).inc()
    if matched and res.review is not None:
        label = {
            "is_fraud": record["is_fraud"],
            "source": body.source,
            "label_time": arrived_us,
            "key_id": key_id,
        }
        try:
            if await res.review.resolve(body.transaction_id, label):
                log.info(
                    "review: %s closed by a %s label (%s) from key %s",
                    body.transaction_id,
                    body.source,
                    body.label,
                    key_id,
                )
        except LogUnavailable as exc:
            log.warning(
                "label stored, but %s stays in the review queue: %s", body.transaction_id, exc
            )
    # Kafka cannot tell a duplicate at write time (the compaction drops it): "new" there.
    return FeedbackOut(
        transaction_id=body.transaction_id,
        source=body.source,
        duplicate=new == 0,
        matched=matched,
        live=live,
        label_time=arrived_us / 1e6,
    )
