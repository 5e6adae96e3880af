"""A card's recent history in the online store: the write side every recorder shares,
and the event time a caller cannot move back.

The card's velocity features (counts and sums over 1 minute to 24 hours, distinct
merchants and countries, time since the last transaction, a changed country) are
declared in ``feature_repo/features.yaml`` like every other windowed aggregation and
kept in tiles (``fraud_scoring/declared.py``): reading them costs the same whatever a
card's traffic. This module keeps what is not a feature:

* the card's **history**: its events of the last 24 h, which the review page shows and
  whose newest event time bounds how far back a caller may stamp the next one
  (:func:`effective_us`);
* the **time unit**: event times are integer microseconds since the epoch (UTC)
  everywhere (:func:`to_us`, :func:`epoch_us`), so the online path (Redis scores are
  doubles, exact for integers below 2**53) and the offline path compare exactly.

**Redis layout** (see :func:`events_key`, :func:`ids_key`). Per card, two keys that share
the hash tag ``{card:<id>}`` so a card's state lives on one Redis Cluster slot:

* ``{card:<id>}:ev`` - sorted set, score = event time (µs), member =
  ``transaction_id \\x1f amount \\x1f merchant_id \\x1f country``;
* ``{card:<id>}:ids`` - hash transaction_id -> event time, which makes applying an
  event idempotent on ``transaction_id``.

Both are trimmed to 24 h plus 900 s (an event may be stamped ahead) plus the allowed
lateness behind the card's newest event, and to the card's newest :data:`HISTORY_CAP`
events, so what a card keeps does not grow with its traffic (a card hit by a card-testing
attack keeps its newest 100 events, not the day's tens of thousands). An event pushed
out by the cap loses its id with it; applied again, it is older than the card's oldest
and dropped, so the history stays what it was (between events of one microsecond, which
of them stays is the sorted set's order). Every write goes
through one Lua script, :data:`APPLY_LUA` (one call per card, idempotent on
``transaction_id``), queued with :func:`queue_apply`: the streaming updater
(``streaming/state.py``, which documents the late-event rule) and the scoring service
(read-your-writes: each scored transaction joins its card's history as part of scoring)
both use it, so a transaction written by one and then by the other is the same member at
the same score, written once. Nothing on the scoring path reads the whole history: the
scorer reads only its newest event (one ``ZREVRANGE 0 0``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import pandas as pd

from fraud_scoring.events import Transaction

US = 1_000_000
DAY_US = 86_400 * US
# The history a card keeps (plus the allowed lateness), and the TTL it is based on.
LONGEST_WINDOW_US = DAY_US
# An event may be stamped up to FRAUD_MAX_FUTURE_SKEW_S (at most 900 s) ahead of the
# clock and is recorded: the history keeps this much more, so such an event never trims
# an honest one that a 24 h window still reads.
FUTURE_ROOM_US = 900 * US
# The most events a card's history keeps (its newest): the review page shows 20, and the
# scorer reads only the newest. ~18 KB per card at the cap (scale-sheet).
HISTORY_CAP = 100

SEP = "\x1f"  # unit separator: cannot occur in validated ids or country codes


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """The part of a transaction a card's history keeps."""

    ts_us: int
    transaction_id: str
    amount: float
    merchant_id: str
    country: str


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@overload
def to_us(ts: float | datetime) -> int: ...
@overload
def to_us(ts: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.int64]: ...
def to_us(ts: float | datetime | npt.NDArray[np.floating[Any]]) -> int | npt.NDArray[np.int64]:
    """Epoch seconds (UTC) -> integer microseconds since the epoch, this module's unit.

    A float, or an array of them element-wise, is rounded to the nearest microsecond
    (ties to even). An aware datetime converts exactly: its ``timestamp()`` would go
    through a float.
    """
    if isinstance(ts, datetime):
        delta = ts - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * US + delta.microseconds
    if isinstance(ts, np.ndarray):
        return np.rint(ts * US).astype(np.int64)
    return round(ts * US)


# --- time the caller cannot move back ------------------------------------------------------


def effective_us(
    cards: Sequence[str],
    ts_us: Sequence[int],
    newest: Mapping[str, int] | None = None,
    within_us: int = 1200 * US,
) -> list[int]:
    """Each transaction's **effective time**, in arrival order: its event time, unless
    that is earlier than its card's newest recorded event (``newest``: the store's, then
    the earlier ones here) by at most ``within_us`` (what the service's event-time bound
    lets a caller move, twice), in which case 1 µs after it; older is a late event, left
    at its time. A caller that stamps each
    attempt earlier than the last cannot hide a burst from the velocity windows: every
    window (session and declared) reads and records the transaction at this time. Equal
    times are left as they are; for transactions that arrive in event-time order (the
    raw history's order) this changes nothing."""
    top = dict(newest or {})
    out = []
    for card, ts in zip(cards, ts_us, strict=True):
        held = top.get(card)
        if held is not None and held - within_us <= ts < held:
            ts = held + 1
        top[card] = ts if held is None else max(held, ts)
        out.append(ts)
    return out


def effective_times(
    txns: Sequence[Transaction],
    recorded: Sequence[bool],
    newest: Mapping[str, int],
    within_us: int,
) -> list[Transaction]:
    """``txns`` with each recorded one's event time moved to its effective time
    (:func:`effective_us`, in batch order after the store's ``newest`` per card); the
    others (what-if reads that record nothing) keep theirs."""
    rec = [t for t, r in zip(txns, recorded, strict=True) if r]
    eff = iter(
        effective_us(
            [t.card_id for t in rec], [to_us(t.event_time) for t in rec], newest, within_us
        )
    )
    out = []
    for t, r in zip(txns, recorded, strict=True):
        if r and (us := next(eff)) != to_us(t.event_time):
            moved = (_EPOCH + timedelta(microseconds=us)).astimezone(t.event_time.tzinfo)
            t = t.model_copy(update={"event_time": moved})
        out.append(t)
    return out


# --- Redis layout -------------------------------------------------------------------------


def card_tag(card_id: str) -> str:
    return "{card:" + card_id + "}"


def events_key(card_id: str) -> str:
    return card_tag(card_id) + ":ev"


def ids_key(card_id: str) -> str:
    return card_tag(card_id) + ":ids"


def encode_member(e: SessionEvent) -> str:
    """The sorted-set member of one event (its score is ``e.ts_us``)."""
    return SEP.join((e.transaction_id, repr(float(e.amount)), e.merchant_id, e.country))


def decode_member(member: bytes | str, score: float) -> SessionEvent:
    s = member.decode() if isinstance(member, bytes) else member
    tid, amount, merchant, country = s.split(SEP)
    return SessionEvent(int(score), tid, float(amount), merchant, country)


# --- the write side (updater and scorer alike) ---------------------------------------------

# KEYS: events zset, ids hash. ARGV: retention_us, lateness_us, ttl_ms, cap, then
# (transaction_id, ts_us, member) per event. Returns {added, duplicates, late, dropped}:
# an event already behind the retention horizon, or older than the oldest of a card that
# holds ``cap`` events, is dropped without touching state; one that falls behind it, or
# out of the newest ``cap``, within the same call (newer events came along) is added,
# then trimmed, and also counted as dropped. A call that adds nothing changes nothing (no
# trim, no expiry refresh: a card expires ``ttl`` after the call that last added to it).
# Scores are formatted with %d: Lua's default number format (%.14g) would round µs.
_APPLY_FN = """
local function apply(ev, ids, retention, lateness, ttl, cap, a, lo, hi)
  local newest = redis.call('ZREVRANGE', ev, 0, 0, 'WITHSCORES')
  local maxts = nil
  if newest[2] then maxts = tonumber(newest[2]) end
  local added, dup, late, dropped = 0, 0, 0, 0
  local new_ts, new_ids = {}, {}
  -- A card at its cap: an event older than its oldest would go again at once (its id
  -- went with it when it was pushed out): dropped without touching state.
  local floor = nil
  if redis.call('ZCARD', ev) >= cap then
    floor = tonumber(redis.call('ZRANGE', ev, 0, 0, 'WITHSCORES')[2])
  end
  for i = lo, hi, 3 do
    local id, ts = a[i], tonumber(a[i + 1])
    if maxts and ts < maxts - retention then
      late = late + 1
      dropped = dropped + 1
    elseif floor and ts < floor then
      dropped = dropped + 1
    elseif redis.call('HSETNX', ids, id, a[i + 1]) == 1 then
      if maxts and ts < maxts - lateness then late = late + 1 end
      redis.call('ZADD', ev, a[i + 1], a[i + 2])
      added = added + 1
      new_ts[#new_ts + 1] = ts
      new_ids[id] = true
      if (not maxts) or ts > maxts then maxts = ts end
    else
      dup = dup + 1
    end
  end
  -- A call that added nothing (a second recorder's duplicates, late or dropped events)
  -- leaves the card as the call that added its newest left it: already trimmed, its
  -- expiry set then.
  if maxts and added > 0 then
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
    local over = redis.call('ZCARD', ev) - cap
    if over > 0 then  -- the oldest go, with their ids
      for _, m in ipairs(redis.call('ZRANGE', ev, 0, over - 1)) do
        local id = string.sub(m, 1, string.find(m, '\\31', 1, true) - 1)
        redis.call('HDEL', ids, id)
        if new_ids[id] then dropped = dropped + 1 end
      end
      redis.call('ZREMRANGEBYRANK', ev, 0, over - 1)
    end
    redis.call('PEXPIRE', ev, ttl)
    redis.call('PEXPIRE', ids, ttl)
  end
  return {added, dup, late, dropped}
end
"""
APPLY_LUA = (
    _APPLY_FN
    + """
local retention, lateness, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
return apply(KEYS[1], KEYS[2], retention, lateness, ttl, tonumber(ARGV[4]), ARGV, 5, #ARGV)
"""
)
# Many cards in one call (one server: a Cluster needs one call per card's slot). KEYS:
# (events zset, ids hash) per card. ARGV: retention_us, lateness_us, ttl_ms, cap, then per card
# its event count and its (transaction_id, ts_us, member) triples. Returns APPLY_LUA's
# reply per card, in order.
APPLY_MANY_LUA = (
    _APPLY_FN
    + """
local retention, lateness, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
local out, pos = {}, 5
for k = 1, #KEYS, 2 do
  local n = tonumber(ARGV[pos])
  out[#out + 1] = apply(KEYS[k], KEYS[k + 1], retention, lateness, ttl, cap, ARGV, pos + 1,
    pos + 3 * n)
  pos = pos + 1 + 3 * n
end
return out
"""
)
assert SEP == "\x1f"  # the script splits members on byte 31
APPLY_SHA = hashlib.sha1(APPLY_LUA.encode()).hexdigest()
APPLY_MANY_SHA = hashlib.sha1(APPLY_MANY_LUA.encode()).hexdigest()


@dataclass(frozen=True)
class SessionLimits:
    """How far behind its card's newest event an event may arrive, and how long an idle
    card lives: the arguments every :data:`APPLY_LUA` call carries.

    ``allowed_lateness_s`` is ``FRAUD_ALLOWED_LATENESS_S``; state is kept for
    ``retention = 24 h + 900 s + allowed_lateness`` behind the card's newest event. ``ttl_s`` is
    the wall-clock expiry of an idle card (default: retention plus an hour). The
    updater and the scorer must use the same limits, or one would trim what the other
    keeps.
    """

    allowed_lateness_s: float
    ttl_s: float | None = None

    @property
    def lateness_us(self) -> int:
        return round(self.allowed_lateness_s * US)

    @property
    def retention_us(self) -> int:
        return LONGEST_WINDOW_US + FUTURE_ROOM_US + self.lateness_us

    @property
    def ttl_ms(self) -> int:
        ttl = self.ttl_s if self.ttl_s is not None else self.retention_us / US + 3600
        return round(ttl * 1000)

    def args(self, events: Sequence[SessionEvent]) -> list[str | int]:
        """ARGV of one :data:`APPLY_LUA` call for one card's events."""
        return [self.retention_us, self.lateness_us, self.ttl_ms, HISTORY_CAP, *_event_args(events)]


def _event_args(events: Sequence[SessionEvent]) -> list[str | int]:
    """The (transaction_id, ts_us, member) triples the apply scripts take per event."""
    args: list[str | int] = []
    for e in events:
        args += (e.transaction_id, e.ts_us, encode_member(e))
    return args


def to_session_event(txn: Transaction) -> SessionEvent:
    """The session event of a validated transaction; its time converts exactly (no float),
    so the updater and the scorer store a transaction at the same microsecond."""
    return SessionEvent(
        to_us(txn.event_time), txn.transaction_id, txn.amount, txn.merchant_id, txn.country
    )


def queue_apply(
    pipe: Any, by_card: Mapping[str, Sequence[SessionEvent]], limits: SessionLimits
) -> int:
    """Queue one ``EVALSHA`` of :data:`APPLY_LUA` per card on a pipeline (sync or asyncio);
    return how many were queued (their replies are ``[added, duplicates, late, dropped]``).

    ``EVALSHA`` needs the script loaded (``SCRIPT LOAD`` :data:`APPLY_LUA`): a reply that
    is a ``NoScriptError`` means the server lost it (restart, flush); load it and queue
    again (applying twice is harmless).

    On a Redis Cluster pipeline the call goes to the node of the card's slot (both keys
    carry the card's hash tag). It is queued with ``execute_command``: redis-py's cluster
    pipelines refuse the ``evalsha`` method outright, whatever the keys, though they
    route the command itself by its keys.
    """
    for card, evs in by_card.items():
        args = limits.args(evs)
        pipe.execute_command("EVALSHA", APPLY_SHA, 2, events_key(card), ids_key(card), *args)
    return len(by_card)


def queue_apply_many(
    pipe: Any,
    by_card: Mapping[str, Sequence[SessionEvent]],
    limits: SessionLimits,
    *,
    per_card: bool = False,
) -> int:
    """:func:`queue_apply` for a scored micro-batch: all its cards in one ``EVALSHA`` of
    :data:`APPLY_MANY_LUA` (one reply: the per-card replies, in order), or with
    ``per_card`` (a Redis Cluster, where one call's keys must share a slot) one
    :data:`APPLY_LUA` call per card. Returns how many commands were queued."""
    if per_card:
        return queue_apply(pipe, by_card, limits)
    if not by_card:
        return 0
    keys: list[str] = []
    args: list[str | int] = [limits.retention_us, limits.lateness_us, limits.ttl_ms, HISTORY_CAP]
    for card, evs in by_card.items():
        keys += (events_key(card), ids_key(card))
        args += (len(evs), *_event_args(evs))
    pipe.execute_command("EVALSHA", APPLY_MANY_SHA, len(keys), *keys, *args)
    return 1


SCRIPTS = (APPLY_LUA, APPLY_MANY_LUA)


def epoch_us(df: pd.DataFrame) -> np.ndarray:
    """Each row's event time (``event_timestamp``, else ``event_time``: tz-aware datetimes
    of any resolution, or epoch seconds) as int64 µs since the epoch, this module's unit."""
    col = "event_timestamp" if "event_timestamp" in df.columns else "event_time"
    s = df[col]
    if pd.api.types.is_numeric_dtype(s):  # epoch seconds
        return to_us(s.to_numpy(np.float64))
    ts = pd.to_datetime(s, utc=True)
    return np.asarray(
        ts.dt.tz_convert("UTC").astype("datetime64[ns, UTC]").astype("int64").to_numpy() // 1000,
        dtype=np.int64,
    )
