"""The analysts' review page and its JSON API, over the review queue
(``service/loop/review_queue.py``).

* ``GET /review``: the page (``service/edge/static/review.html`` + ``review.js`` +
  ``review.css``, package data; no other asset, so it works offline). Open: it holds no
  data; everything it shows comes from the API below.
* ``GET /v1/review/items?offset=&limit=``: the queue, oldest decision first, each item
  with the transaction, score, reasons and its key features.
* ``GET /v1/review/item?transaction_id=``: one item in full (every feature the model
  saw), whether it is still queued, its label once one arrived, and the card's recent
  history (its session events in the online store, newest first).
* ``POST /v1/review/label`` ``{"transaction_id", "label": "fraud" | "legitimate"}``:
  the analyst's mark, stored through the feedback path (``service.edge.feedback.store_label``:
  the feedback log, source ``analyst``, arrival time the service's clock, the key's id),
  which also takes the item out of the queue. This route is the analysts' own: the one
  place a ``label`` key stores source ``analyst`` (``POST /v1/feedback`` refuses it from a
  key without ``admin``). A mark is a duplicate only of the same key's earlier mark, never
  of a label another key sent (``feedback.feedback_key``), and training ranks it above
  every other source.

Next to a transaction labelled fraud, the page offers "Add card to blocked_cards": a
``PUT /v1/lists/blocked_cards/items`` (``service.edge.lists_api``) of its card with the
page's key, reason ``confirmed fraud <transaction_id>``; the list's own scope rules apply
(a key without ``lists`` or ``admin`` is answered 403, which the page shows).

The id travels in a query parameter or the body, never in the path: an id may hold any
printable character, and ``/``, ``..`` or ``%2F`` in a path are split, normalised away
by clients, or decoded before routing.

Authentication: the API's routes need the ``label`` scope (or ``admin``, which implies
it), reads included (the app adds it where it includes :data:`router`): the queue shows
card and merchant ids, amounts and features of other callers' transactions, which a
``score`` key (a payment system) has no need to read. The page asks for a key once and
keeps it in the tab's ``sessionStorage``. Errors have the ``/v1`` shape: 404
``not_found``, 415 for a mark that is not JSON, 422 naming the field, 503
``log_unavailable`` (the queue's server does not answer) or ``log_off``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from functools import cache
from importlib import resources as package_files
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from fraud_scoring.event_log import LogUnavailable
from fraud_scoring.events import ID_PATTERN
from fraud_scoring.session import decode_member, events_key
from service.core.decision import indicators
from service.edge import auth
from service.edge.feedback import FeedbackIn, FeedbackOut, store_label
from service.edge.routes import json_model
from service.edge.schemas import ReasonOut
from service.errors import NotFound, Rejected, RejectReason, error_responses
from service.loop.review_queue import QueuedItem, ReviewQueue
from service.resources import Resources, resources

log = logging.getLogger(__name__)

router = APIRouter()  # the JSON API (the app adds the label scope)
page_router = APIRouter()  # the page and its assets (open)

KEY_FEATURES = 6  # shown per item: the reasons' features, then by model importance
HISTORY = 20  # the card's most recent session events shown with an item

TransactionId = Annotated[str, Query(min_length=1, max_length=128, pattern=ID_PATTERN)]


class KeyFeature(BaseModel):
    name: str
    value: float | None
    # 'missing' | 'stale': the value is the feature's default (the store had none, or
    # only one too old); None: a value read or computed for this transaction.
    flag: Literal["missing", "stale"] | None = None


class ReviewItem(BaseModel):
    """One queued transaction as the list shows it."""

    transaction_id: str
    decided_at: datetime  # UTC
    event_time: str  # as sent (RFC 3339 with the transaction's own offset)
    amount: float
    currency: str
    card_id: str
    merchant_id: str
    country: str
    channel: str
    mcc: str
    score: float | None
    model_version: str
    reasons: list[ReasonOut]
    key_features: list[KeyFeature]


class ReviewPage(BaseModel):
    total: int  # items in the queue
    offset: int
    items: list[ReviewItem]


class Label(BaseModel):
    """The first label that arrived for the transaction (any source)."""

    label: Literal["fraud", "legitimate"]
    source: str
    label_time: datetime  # arrival, UTC
    key_id: str | None = None  # the key that sent it (None: stored before keys were kept)


class HistoryEvent(BaseModel):
    """One of the card's transactions in its session state (the online store)."""

    transaction_id: str
    event_time: datetime  # UTC
    amount: float
    merchant_id: str
    country: str


class ReviewDetail(ReviewItem):
    queued: bool  # False once a label arrived (the item is kept for the log's retention)
    label: Label | None
    device_id: str | None
    # The team's declared fields (docs/data-contract.md, "Your own fields"), in their
    # declared order; a PII field as its hash's prefix ("pii:1f3a9c0e…"), never more.
    fields: dict[str, str | float | bool | None] = {}
    features: dict[str, float | None]  # every feature, in the model's order
    missing: list[str]
    stale: list[str]
    card_history: list[HistoryEvent] | None  # None: the online store did not answer


class LabelIn(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    transaction_id: str = Field(min_length=1, max_length=128, pattern=ID_PATTERN)
    label: Literal["fraud", "legitimate"]


def _queue(res: Resources) -> ReviewQueue:
    """The review queue; :class:`~service.errors.Rejected` (503 ``log_off``) when the
    event log is off."""
    if res.review is None:
        raise Rejected(
            RejectReason.LOG_OFF,
            "the review queue needs the event log (FRAUD_DECISION_LOG=off)",
            retry_after_s=60,
        )
    return res.review


def _unavailable(exc: LogUnavailable) -> Rejected:
    log.warning("review queue: %s", exc)  # names the server: to the log, not the caller
    return Rejected(RejectReason.LOG_UNAVAILABLE, "the review queue cannot be read now")


async def _item(res: Resources, transaction_id: str) -> QueuedItem:
    """The queued (or labelled, not yet expired) item; raises 503 when the queue is off
    or unreadable, :class:`~service.errors.NotFound` when there is no such item."""
    queue = _queue(res)
    try:
        found = await queue.get(transaction_id)
    except LogUnavailable as exc:
        raise _unavailable(exc) from None
    if found is None:
        raise NotFound(
            f"no review item for {transaction_id!r} (never decided 'review', or expired)",
            "transaction_id",
        )
    return found


def key_features(entry: dict[str, Any], importance: dict[str, float]) -> list[KeyFeature]:
    """The features an analyst looks at first: those the reasons are about, then the
    model's most important ones, :data:`KEY_FEATURES` in all (more if the reasons name
    more)."""
    feats: dict[str, float | None] = entry["features"]
    # The feature each reason code is about (the amount rule's is the amount).
    about = {i.code: i.feature for i in indicators()} | {"RULE_AMOUNT_OVER_LIMIT": "amount"}
    names = [about[r["code"]] for r in entry["reasons"] if about.get(r["code"]) in feats]
    for name in sorted(feats, key=lambda n: -importance.get(n, 0.0)):
        if len(names) >= KEY_FEATURES:
            break
        if name not in names:
            names.append(name)
    flags: dict[str, Literal["missing", "stale"]] = {n: "stale" for n in entry["stale"]}
    flags |= {n: "missing" for n in entry["missing"]}
    return [KeyFeature(name=n, value=feats[n], flag=flags.get(n)) for n in dict.fromkeys(names)]


def _summary(entry: dict[str, Any], importance: dict[str, float]) -> dict[str, Any]:
    t = entry["transaction"]
    return {
        "transaction_id": entry["transaction_id"],
        "decided_at": datetime.fromtimestamp(entry["decided_at"] / 1e6, UTC),
        **{k: t[k] for k in ("event_time", "amount", "currency", "card_id", "merchant_id")},
        **{k: t[k] for k in ("country", "channel", "mcc")},
        "score": entry["score"],
        "model_version": entry["model_version"],
        "reasons": entry["reasons"],
        "key_features": key_features(entry, importance),
    }


PII_SHOWN = 12  # characters of a PII field's stored hash the page shows: "pii:" and 8 hex


def shown_fields(res: Resources, t: dict[str, Any]) -> dict[str, str | float | bool | None]:
    """The transaction's declared fields as logged; a PII field's hash cut to its
    prefix (enough to tell two values apart on the page, too little to look one up)."""
    out: dict[str, str | float | bool | None] = {}
    for f in res.door.fields:
        v = t.get(f.name)
        out[f.name] = f"{v[:PII_SHOWN]}…" if f.pii and isinstance(v, str) else v
    return out


def _importance(res: Resources) -> dict[str, float]:
    current = res.models.current
    return dict(current.meta.feature_importance) if current else {}


async def card_history(res: Resources, card_id: str) -> list[HistoryEvent] | None:
    """The card's :data:`HISTORY` most recent session events (newest first), read from
    the online store; None when it does not answer (the item is shown without)."""
    if res.health is not None and res.health.is_open:
        return None  # the breaker is open: do not wait for a timeout
    try:
        key = events_key(card_id)
        rows = await res.redis.zrange(key, 0, HISTORY - 1, desc=True, withscores=True)
    except (redis.RedisError, OSError) as exc:
        log.warning("review: card history not read: %s", type(exc).__name__)
        return None
    out = []
    for member, score in rows:
        e = decode_member(member, score)
        out.append(
            HistoryEvent(
                transaction_id=e.transaction_id,
                event_time=datetime.fromtimestamp(e.ts_us / 1e6, UTC),
                amount=e.amount,
                merchant_id=e.merchant_id,
                country=e.country,
            )
        )
    return out


@router.get(
    "/v1/review/items",
    response_model=ReviewPage,
    responses=error_responses(401, 403, 422, 503),
)
async def list_items(
    request: Request,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> ReviewPage:
    """The review queue, oldest decision first: ``limit`` items from ``offset``."""
    res = resources(request)
    queue = _queue(res)
    try:
        total, entries = await queue.page(offset, limit)
    except LogUnavailable as exc:
        raise _unavailable(exc) from None
    importance = _importance(res)
    items = [ReviewItem.model_validate(_summary(e, importance)) for e in entries]
    return ReviewPage(total=total, offset=offset, items=items)


@router.get(
    "/v1/review/item",
    response_model=ReviewDetail,
    responses=error_responses(401, 403, 404, 422, 503),
)
async def get_item(request: Request, transaction_id: TransactionId) -> ReviewDetail:
    """One item in full, its label once one arrived, and the card's recent history."""
    res = resources(request)
    found = await _item(res, transaction_id)
    entry, label = found.item, found.label
    t = entry["transaction"]
    return ReviewDetail.model_validate(
        {
            **_summary(entry, _importance(res)),
            "queued": found.queued,
            "label": None
            if label is None
            else {
                "label": "fraud" if label["is_fraud"] else "legitimate",
                "source": label["source"],
                "label_time": datetime.fromtimestamp(label["label_time"] / 1e6, UTC),
                "key_id": label.get("key_id"),
            },
            "device_id": t.get("device_id"),
            "fields": shown_fields(res, t),
            "features": entry["features"],
            "missing": entry["missing"],
            "stale": entry["stale"],
            "card_history": await card_history(res, t["card_id"]),
        }
    )


@router.post(
    "/v1/review/label",
    response_model=FeedbackOut,
    responses=error_responses(401, 403, 404, 408, 413, 415, 422, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": LabelIn.model_json_schema()}},
        }
    },
)
async def label_item(request: Request) -> FeedbackOut:
    """The analyst's mark: stored as ``POST /v1/feedback`` stores a label (source
    ``analyst``, ``time`` now, or the event time if that is later), and the item leaves
    the queue. 404 for an id that is not a review item; ``duplicate`` as in feedback
    (this key's first mark stands; another key's label, of any source, never makes it
    one)."""
    body = await json_model(request, LabelIn)
    res = resources(request)
    found = await _item(res, body.transaction_id)
    # An event time may lie a little ahead of the clock (FRAUD_MAX_EVENT_SKEW_S).
    event_time = datetime.fromisoformat(found.item["transaction"]["event_time"])
    label = FeedbackIn(
        transaction_id=body.transaction_id,
        label=body.label,
        source="analyst",
        time=max(datetime.now(UTC), event_time),
    )
    who = auth.principal(request).key_id
    out = await store_label(res, label, who)
    log.info("review: %s marked %s by key %s", body.transaction_id, body.label, who)
    return out


# --- the page -------------------------------------------------------------------------

_ASSETS = {
    "review.html": "text/html; charset=utf-8",
    "review.js": "text/javascript; charset=utf-8",
    "review.css": "text/css; charset=utf-8",
}
# Only the page's own files: no inline script or style, nothing from another origin.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@cache
def _asset(name: str) -> bytes:
    return (package_files.files("service.edge") / "static" / name).read_bytes()


def _serve(name: str) -> Response:
    return Response(
        _asset(name),
        media_type=_ASSETS[name],
        headers={
            "Content-Security-Policy": _CSP,
            "X-Content-Type-Options": "nosniff",
            "Cache-Control": "no-cache",
        },
    )


@page_router.get("/review", include_in_schema=False)
async def review_page() -> Response:
    return _serve("review.html")


@page_router.get("/review/review.js", include_in_schema=False)
async def review_js() -> Response:
    return _serve("review.js")


@page_router.get("/review/review.css", include_in_schema=False)
async def review_css() -> Response:
    return _serve("review.css")
