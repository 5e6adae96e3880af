"""One id, one transaction (the idempotency-key contract payment APIs keep).

Before a micro-batch records its transactions, each recorded ``transaction_id`` is
claimed in Redis (``SET fraud:txn:{<id>} <content> NX GET EX ttl``, in the batch's
round trip with its reads; its writes follow once the claims' replies are in): the first
claim wins. A later request with the same id and the
same content is a **retry**: it is answered with the original answer (kept in the same
key once the first answer is out) and changes no state; with other content it is
**refused** (409 ``id_reused``, naming the fields that differ) and changes nothing. The
key lives ``FRAUD_IDEMPOTENCY_TTL_S`` (about 0.5 KB per transaction in that span).
Requests that record nothing (``X-Fraud-Record: false``) claim nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fraud_scoring.events import Transaction
from fraud_scoring.redis_clients import STORE_ERRORS
from fraud_scoring.session import events_key, to_us
from service.core.store_health import FeatureStoreUnavailable, write_refused

SEP = "\x1e"  # between the content and the answer in one value


class IdReused(Exception):
    """A ``transaction_id`` already used for another transaction (answered 409)."""

    def __init__(self, transaction_id: str, fields: Sequence[str]) -> None:
        self.transaction_id, self.fields = transaction_id, list(fields)
        super().__init__(
            f"transaction_id {transaction_id!r} was already used for another transaction "
            f"(different {', '.join(self.fields)})"
        )


_UNANSWERED: tuple[type[Exception], ...] = (*STORE_ERRORS, TimeoutError)


def key(transaction_id: str) -> str:
    return "fraud:txn:{" + transaction_id + "}"


def content(t: Transaction) -> dict[str, Any]:
    """What makes a transaction the same one (the event time as µs, so an equal instant
    written with another offset is the same), a team's declared fields included (a PII
    one as its hash)."""
    c = {
        "card_id": t.card_id,
        "merchant_id": t.merchant_id,
        "amount": t.amount,
        "currency": t.currency,
        "event_time": to_us(t.event_time),
        "country": t.country,
        "channel": t.channel,
        "mcc": t.mcc,
        "device_id": t.device_id,
    }
    if type(t) is not Transaction:  # the declared fields' model (fraud_scoring.fields)
        c.update(t.model_dump(mode="json", exclude=_CONTRACT_FIELDS))
    return c


_CONTRACT_FIELDS = set(Transaction.model_fields)


def encode(c: dict[str, Any]) -> str:
    return json.dumps(c, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Claim:
    """A claim's outcome: ``new`` (this request owns the id), else a retry (``answer``:
    the original answer as stored, None while it is not stored yet) or ``reused``
    (the fields that differ)."""

    new: bool
    answer: dict[str, Any] | None = None
    reused: IdReused | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """A recorded transaction's claim and its encoded content (for :func:`queue_answers`)."""

    claim: Claim
    content: str


@dataclass(frozen=True)
class Claiming:
    """The claims a micro-batch's round trip carries (:func:`queue_claims`)."""

    asked: list[Transaction]  # the transactions claimed, in batch order
    cards: list[str]  # their cards, whose newest recorded time is read first
    contents: list[str]  # each claim's content (:func:`outcome`)
    claims: bool  # whether ids are claimed at all (FRAUD_IDEMPOTENCY_TTL_S > 0)


def queue_claims(
    pipe: Any, txns: Sequence[Transaction], recorded: Sequence[bool], ttl_s: int, *, bounded: bool
) -> Claiming | None:
    """Queue the claims of the ids of the transactions a micro-batch records (``ttl_s``
    <= 0: none) and, with a live event-time bound (``bounded``), the reads of the newest
    recorded event time of their cards (:func:`fraud_scoring.session.effective_times`,
    which moves backdated attempts); None: nothing to claim or read."""
    if not any(recorded) or (ttl_s <= 0 and not bounded):
        return None
    asked = [t for t, r in zip(txns, recorded, strict=True) if r]
    cards = list(dict.fromkeys(t.card_id for t in asked)) if bounded else []
    for card in cards:
        pipe.execute_command("ZREVRANGE", events_key(card), 0, 0, "WITHSCORES")
    contents = []
    if ttl_s > 0:
        for t in asked:
            c = encode(content(t))
            pipe.execute_command("SET", key(t.transaction_id), c, "NX", "GET", "EX", ttl_s)
            contents.append(c)
    return Claiming(asked, cards, contents, ttl_s > 0)


def claimed(
    claiming: Claiming, replies: Sequence[Any], recorded: Sequence[bool]
) -> tuple[list[Claimed | None] | None, dict[str, int], list[Any]]:
    """From the replies to :func:`queue_claims`'s commands: per transaction its claim
    (None: not recorded, or the store refused the claim; the list None: no claims were
    made), the cards' newest recorded times (µs), and the store's refusals (a full
    store still decides: those transactions are not recorded). Raises
    :class:`FeatureStoreUnavailable` when a read or claim failed otherwise."""
    cards = claiming.cards
    newest: dict[str, int] = {}
    for card, top in zip(cards, replies, strict=False):
        if isinstance(top, Exception):
            raise FeatureStoreUnavailable("feature store unavailable: a read failed")
        if top:
            newest[card] = int(float(top[1]))
    if not claiming.claims:
        return None, newest, []
    got = iter(zip(claiming.asked, claiming.contents, replies[len(cards) :], strict=True))
    out: list[Claimed | None] = []
    refused: list[Any] = []
    for r in recorded:
        if not r:
            out.append(None)
            continue
        t, c, reply = next(got)
        if write_refused(reply):
            refused.append(reply)
            out.append(None)
            continue
        if isinstance(reply, Exception):
            raise FeatureStoreUnavailable("feature store unavailable: a claim failed")
        out.append(Claimed(outcome(t, c, reply), c))
    return out, newest, refused


def outcome(txn: Transaction, mine: str, reply: Any) -> Claim:
    if reply is None:
        return Claim(new=True)
    held = reply.decode() if isinstance(reply, bytes) else str(reply)
    theirs, _, answer = held.partition(SEP)
    if theirs == mine:
        return Claim(new=False, answer=json.loads(answer) if answer else None)
    try:
        before = json.loads(theirs)
    except json.JSONDecodeError:
        before = {}
    now = json.loads(mine)
    fields = sorted(k for k in now if before.get(k) != now[k]) or ["content"]
    return Claim(new=False, reused=IdReused(txn.transaction_id, fields))


async def reused_in(redis: Any, txns: Sequence[Transaction], timeout_s: float) -> IdReused | None:
    """The first of ``txns`` whose id is already claimed for another transaction (or
    used twice in ``txns`` with other content), read in one round trip before a batch
    call scores anything: a call with one reused id is refused whole (409) and records
    nothing. None when every id is new or a retry, or when the store does not answer
    (the claims then decide per transaction, as for single calls). A claim made between
    this read and the batch's own claims is still refused per transaction."""
    contents = [encode(content(t)) for t in txns]
    seen: dict[str, str] = {}
    for t, c in zip(txns, contents, strict=True):
        if seen.setdefault(t.transaction_id, c) != c:
            return outcome(t, c, seen[t.transaction_id].encode()).reused
    pipe = redis.pipeline(transaction=False)
    for t in txns:
        pipe.get(key(t.transaction_id))
    try:
        async with asyncio.timeout(timeout_s):
            held = await pipe.execute(raise_on_error=False)
    except _UNANSWERED:
        return None
    for t, c, reply in zip(txns, contents, held, strict=True):
        if reply is None or isinstance(reply, Exception):
            continue
        if (reused := outcome(t, c, reply).reused) is not None:
            return reused
    return None


def queue_answers(
    pipe: Any, ids: Sequence[str], contents: Sequence[str], answers: Sequence[dict[str, Any]]
) -> None:
    """Keep each new claim's answer beside its content (same key, same expiry)."""
    for i, c, a in zip(ids, contents, answers, strict=True):
        pipe.execute_command("SET", key(i), c + SEP + json.dumps(a), "XX", "KEEPTTL")
