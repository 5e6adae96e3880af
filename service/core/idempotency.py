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
from fraud_scoring.session import to_us

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
    written with another offset is the same)."""
    return {
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


def queue_claims(pipe: Any, txns: Sequence[Transaction], ttl_s: int) -> list[str]:
    """Queue one claim per transaction; returns the encoded contents (for
    :func:`outcome` and :func:`queue_answers`)."""
    out = []
    for t in txns:
        c = encode(content(t))
        pipe.execute_command("SET", key(t.transaction_id), c, "NX", "GET", "EX", ttl_s)
        out.append(c)
    return out


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
