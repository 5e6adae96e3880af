"""The review queue: transactions decided ``review``, waiting for an analyst's label.

Written by the decision log's background writer (``DecisionLog(after_write=...)``), after
each batch is in the log: one Lua call for the batch's ``review`` decisions, never on
the scoring path. An item leaves the queue when a label for its ``transaction_id``
arrives through the feedback path (``POST /v1/feedback`` or the review page, which uses
it), from any source, when the label is *matched* (the service holds the decision:
``service.edge.feedback``): a label for an id never scored neither removes an item nor,
kept, hides the decision that comes under that id later.

**Redis layout** (the decision log's Redis server: ``FRAUD_DECISION_LOG_URL``, else
``REDIS_URL``'s; with the log on Kafka, ``REDIS_URL``'s), all under the hash tag of the
log's stream name, so one Cluster slot holds the queue and its items::

    {decisions}:review              sorted set: transaction_id, score = decision time (µs)
    {decisions}:review:item:<id>    the item (JSON), kept for the log's retention
    {decisions}:review:done:<id>    the first label that closed it (JSON, with the key id),
                                    as long

**Idempotent and bounded.** An item is added only if its item key is new and no label
arrived for it, so a retried ``transaction_id`` (also one retried after it was labelled)
is queued once. Items expire with the decision log's retention
(``FRAUD_DECISION_LOG_RETENTION_S``); each add also trims queue members older than it,
and a listing drops members whose item expired.

Errors: every call raises :class:`~fraud_scoring.event_log.LogUnavailable` when the
server does not answer (the writer retries; the API answers 503).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fraud_scoring.event_log import LogRecord, LogUnavailable
from fraud_scoring.redis_clients import STORE_ERRORS, async_client
from service.core.scoring import ScoreResult

# KEYS[1]: the queue. ARGV: item TTL (ms), oldest decision time kept (µs, "" for all),
# then (transaction_id, decision time µs, item JSON) triples. Returns how many were new.
_ADD_LUA = """
if ARGV[2] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
end
local n = 0
for i = 3, #ARGV, 3 do
  local id = ARGV[i]
  if redis.call('EXISTS', KEYS[1] .. ':done:' .. id) == 0
    and redis.call('SET', KEYS[1] .. ':item:' .. id, ARGV[i + 2], 'NX', 'PX', ARGV[1]) then
    redis.call('ZADD', KEYS[1], ARGV[i + 1], id)
    n = n + 1
  end
end
return n
"""

# KEYS[1]: the queue. ARGV: transaction_id, label JSON, TTL (ms). Returns 1 if the id
# was queued. The first label stands (as in the feedback log).
_RESOLVE_LUA = """
redis.call('SET', KEYS[1] .. ':done:' .. ARGV[1], ARGV[2], 'NX', 'PX', ARGV[3])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

FOREVER_MS = 10 * 365 * 86_400_000  # retention 0 ("forever"): ten years, as the log


@dataclass(frozen=True)
class QueuedItem:
    """One item as stored (``item``: the decision log's entry, with reason messages) and,
    once labelled, the label that closed it (``label``: ``is_fraud``, ``source``,
    ``label_time`` in epoch µs, ``key_id``: the caller's key)."""

    item: dict[str, Any]
    queued: bool
    label: dict[str, Any] | None


class ReviewQueue:
    """The queue on the Redis server at ``url``, keyed under ``{<stream>}:review``.
    ``timeout_s`` bounds every call; items live ``retention_s`` (0: ten years)."""

    def __init__(self, url: str, stream: str, retention_s: float, timeout_s: float) -> None:
        self.key = f"{{{stream}}}:review"
        self.retention_us = int(retention_s * 1e6)
        self.ttl_ms = int(retention_s * 1000) or FOREVER_MS
        # A Redis Cluster URL gets the cluster client (every key shares the stream's slot).
        self.client: Any = async_client(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._add = self.client.register_script(_ADD_LUA)
        self._resolve = self.client.register_script(_RESOLVE_LUA)

    def item_key(self, transaction_id: str) -> str:
        return f"{self.key}:item:{transaction_id}"

    def done_key(self, transaction_id: str) -> str:
        return f"{self.key}:done:{transaction_id}"

    async def add(self, logged: Sequence[tuple[ScoreResult, LogRecord]]) -> int:
        """Queue the ``review`` decisions among ``logged`` (a batch the decision log just
        wrote: each result with its log record); returns how many were new. The item is
        the log's entry with each reason's message beside its code."""
        args: list[Any] = []
        for result, record in logged:
            if result.decision != "review":
                continue
            entry = json.loads(record.payload)
            entry["reasons"] = [{"code": r.code, "message": r.message} for r in result.reasons]
            args += [
                result.transaction_id,
                entry["decided_at"],
                json.dumps(entry, separators=(",", ":")),
            ]
        if not args:
            return 0
        oldest = time.time_ns() // 1000 - self.retention_us if self.retention_us else ""
        return int(await self._call(self._add(keys=[self.key], args=[self.ttl_ms, oldest, *args])))

    async def resolve(self, transaction_id: str, label: dict[str, Any]) -> bool:
        """A label arrived for ``transaction_id``: take it out of the queue and keep the
        label (the first one stands; a decision logged after it is not queued). True if
        it was queued. Only for a transaction the service scored (a *matched* label,
        ``service.edge.feedback``): for any other id the kept label would hide its
        decision when it comes."""
        payload = json.dumps(label, separators=(",", ":"))
        done = self._resolve(keys=[self.key], args=[transaction_id, payload, self.ttl_ms])
        return bool(await self._call(done))

    async def page(self, offset: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """The queue's size and up to ``limit`` items from ``offset``, oldest decision
        first. Members whose item expired are dropped from the queue on the way."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(self.key)
        pipe.zrange(self.key, offset, offset + limit - 1)
        total, ids = await self._call(pipe.execute())
        if not ids:
            return int(total), []
        raw = await self._call(self.client.mget([self.item_key(i.decode()) for i in ids]))
        gone = [i for i, r in zip(ids, raw, strict=True) if r is None]
        if gone:
            await self._call(self.client.zrem(self.key, *gone))
        return int(total) - len(gone), [json.loads(r) for r in raw if r is not None]

    async def get(self, transaction_id: str) -> QueuedItem | None:
        """The item (None if never queued or expired), whether it is still queued, and
        its label once one arrived."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.item_key(transaction_id))
        pipe.zscore(self.key, transaction_id)
        pipe.get(self.done_key(transaction_id))
        item, score, label = await self._call(pipe.execute())
        if item is None:
            return None
        return QueuedItem(json.loads(item), score is not None, json.loads(label) if label else None)

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (*STORE_ERRORS, OSError) as exc:  # type: ignore[misc]  # OSError: timeouts too
            raise LogUnavailable(f"review queue {self.key!r}: {exc}") from exc

    async def close(self) -> None:
        await self.client.aclose()
