"""The write side of session state: apply validated transactions to Redis.

One Lua script per card and batch makes each card's update atomic, so a crash leaves a
card either fully updated for the batch or untouched, and replaying the batch after a
restart changes nothing (idempotent on ``transaction_id``, see the ``:ids`` hash in
``fraud_scoring.session``).

**Late events.** Every event applies at its own event time. An event whose time is more
than ``allowed_lateness`` behind the newest event already stored for its card is
*late*: it is still applied and counted (``late``). State is trimmed to
``RETENTION = 24 h + allowed_lateness`` behind the card's newest event, so an event
older than that is dropped on arrival and counted (``dropped``); it could only change
features as of times more than ``allowed_lateness`` in the card's past, which nothing
scores any more. Idle cards also expire by wall clock (``ttl_s``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from fraud_scoring.events import Transaction
from fraud_scoring.session import (
    LONGEST_WINDOW_US,
    SEP,
    US,
    SessionEvent,
    encode_member,
    events_key,
    ids_key,
    to_us,
)

# KEYS: events zset, ids hash. ARGV: retention_us, lateness_us, ttl_ms, then
# (transaction_id, ts_us, member) per event. Returns {added, duplicates, late, dropped}:
# an event already behind the retention horizon is dropped without touching state; one
# that falls behind it within the same call (a newer event came along) is added, then
# trimmed, and also counted as dropped.
# Scores are formatted with %d: Lua's default number format (%.14g) would round µs.
APPLY_LUA = """
local ev, ids = KEYS[1], KEYS[2]
local retention, lateness, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local newest = redis.call('ZREVRANGE', ev, 0, 0, 'WITHSCORES')
local maxts = nil
if newest[2] then maxts = tonumber(newest[2]) end
local added, dup, late, dropped = 0, 0, 0, 0
local new_ts = {}
for i = 4, #ARGV, 3 do
  local id, ts = ARGV[i], tonumber(ARGV[i + 1])
  if maxts and ts < maxts - retention then
    late = late + 1
    dropped = dropped + 1
  elseif redis.call('HSETNX', ids, id, ARGV[i + 1]) == 1 then
    if maxts and ts < maxts - lateness then late = late + 1 end
    redis.call('ZADD', ev, ARGV[i + 1], ARGV[i + 2])
    added = added + 1
    new_ts[#new_ts + 1] = ts
    if (not maxts) or ts > maxts then maxts = ts end
  else
    dup = dup + 1
  end
end
if maxts then
  local horizon = maxts - retention
  local old = redis.call('ZRANGEBYSCORE', ev, '-inf', '(' .. string.format('%d', horizon))
  if #old > 0 then
    for _, m in ipairs(old) do
      local cut = string.find(m, '\\31', 1, true)
      redis.call('HDEL', ids, string.sub(m, 1, cut - 1))
    end
    redis.call('ZREMRANGEBYSCORE', ev, '-inf', '(' .. string.format('%d', horizon))
    for _, ts in ipairs(new_ts) do
      if ts < horizon then dropped = dropped + 1 end
    end
  end
  redis.call('PEXPIRE', ev, ttl)
  redis.call('PEXPIRE', ids, ttl)
end
return {added, dup, late, dropped}
"""
assert SEP == "\x1f"  # the script splits members on byte 31


@dataclass
class ApplyResult:
    added: int = 0
    duplicates: int = 0
    late: int = 0
    dropped: int = 0

    def __iadd__(self, other: ApplyResult) -> ApplyResult:
        self.added += other.added
        self.duplicates += other.duplicates
        self.late += other.late
        self.dropped += other.dropped
        return self


def to_session_event(txn: Transaction) -> SessionEvent:
    return SessionEvent(
        to_us(txn.event_time), txn.transaction_id, txn.amount, txn.merchant_id, txn.country
    )


CardEvent = tuple[str, SessionEvent]  # (card_id, event)


def card_event(txn: Transaction) -> CardEvent:
    return txn.card_id, to_session_event(txn)


class SessionWriter:
    """Applies batches of events to Redis: one pipelined round trip per batch."""

    def __init__(
        self, client: redis.Redis, allowed_lateness_s: float, ttl_s: float | None = None
    ) -> None:
        self.client = client
        self.lateness_us = round(allowed_lateness_s * US)
        self.retention_us = LONGEST_WINDOW_US + self.lateness_us
        # Wall-clock expiry of an idle card: its retention plus an hour of slack.
        ttl = ttl_s if ttl_s is not None else self.retention_us / US + 3600
        self.ttl_ms = round(ttl * 1000)
        self.script = client.register_script(APPLY_LUA)

    def _args(self, events: Sequence[SessionEvent]) -> list[str | int]:
        args: list[str | int] = [self.retention_us, self.lateness_us, self.ttl_ms]
        for e in events:
            args += (e.transaction_id, e.ts_us, encode_member(e))
        return args

    def apply(self, events: Sequence[CardEvent]) -> ApplyResult:
        """Apply (card_id, event) pairs (any order, duplicates allowed) in one round trip.

        Raises ``redis.RedisError`` when Redis fails; then some cards may already be
        updated, and applying the same batch again is safe.
        """
        by_card: dict[str, list[SessionEvent]] = defaultdict(list)
        for card, e in events:
            by_card[card].append(e)
        if not by_card:
            return ApplyResult()
        pipe = self.client.pipeline(transaction=False)
        for card, evs in by_card.items():
            self.script(keys=[events_key(card), ids_key(card)], args=self._args(evs), client=pipe)
        total = ApplyResult()
        for added, dup, late, dropped in pipe.execute():
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total

    def apply_unpipelined(self, events: Sequence[CardEvent]) -> ApplyResult:
        """Baseline for the benchmark: one script call (one round trip) per event."""
        total = ApplyResult()
        for card, e in events:
            added, dup, late, dropped = self.script(
                keys=[events_key(card), ids_key(card)], args=self._args([e])
            )
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total
