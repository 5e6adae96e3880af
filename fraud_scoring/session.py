"""Per-card session (second- to hour-level) features, declared once.

The streaming updater (``streaming/``), the scoring service and the training-set builder
all use the declarations, the Redis layout and the one pure function in this module:

* :func:`session_features` is the feature math: plain events in, one row of floats out.
* :func:`queue_session_reads` / :func:`parse_session_results` are the serving edge: the
  scorer queues the reads for a whole batch on the same pipeline as its batch (Feast)
  reads, then hands the replies back here. A read is bounded (:data:`READ_LUA`): a
  card's newest :data:`READ_CAP` events come in full, the older ones as exact totals
  (:class:`OlderEvents`) that :func:`session_features` continues from.
* :func:`offline_session_features` is the training edge: the same function, called as
  of each row's own event time over the raw history.

**Point in time.** "As of t" means events with event time strictly before ``t`` and at
or after ``t - window``. The transaction being scored never counts in its own features:
it is excluded by time (its own event time is ``t``, not before it) *and* by
``transaction_id`` (in case the updater stored it under a slightly different time).

**Time unit.** Event times are integer microseconds since the epoch (UTC) everywhere in
this module, so the online path (Redis scores are doubles, exact for integers below
2**53) and the offline path (pandas nanoseconds // 1000) compare exactly.

**Redis layout** (see :func:`events_key`, :func:`ids_key`). Per card, two keys that share
the hash tag ``{card:<id>}`` so a card's state lives on one Redis Cluster slot:

* ``{card:<id>}:ev`` - sorted set, score = event time (µs), member =
  ``transaction_id \\x1f amount \\x1f merchant_id \\x1f country``;
* ``{card:<id>}:ids`` - hash transaction_id -> event time, which makes applying an
  event idempotent on ``transaction_id``.

Both are trimmed to the longest window plus the allowed lateness behind the card's
newest event, so state per card is bounded. Every write goes through one Lua script,
:data:`APPLY_LUA` (one call per card, idempotent on ``transaction_id``), queued with
:func:`queue_apply`: the streaming updater (``streaming/state.py``, which documents the
late-event rule) and the scoring service (read-your-writes: each scored transaction
joins its card's state as part of scoring) both use it, so a transaction written by
one and then by the other is the same member at the same score, written once.

**Spanning features** (a 30-day count = batch snapshot + stream since the snapshot):
the stream half is here (``card_*_since_snapshot``: events in
``[max(snapshot, t - 24h), t)``, given the card's batch snapshot time), the sum is
:func:`fraud_scoring.features.spanning_features`, whose declarations say how exact it is.
Every other session feature lies entirely inside the stream's retention and is exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from string import Template
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import pandas as pd

from fraud_scoring.events import Transaction
from fraud_scoring.feature_specs import Feature, Kind

US = 1_000_000
MINUTE_US, HOUR_US, DAY_US = 60 * US, 3600 * US, 86_400 * US
WINDOWS: tuple[tuple[str, int], ...] = (
    ("1m", MINUTE_US),
    ("10m", 10 * MINUTE_US),
    ("1h", HOUR_US),
    ("24h", DAY_US),
)
LONGEST_WINDOW_US = DAY_US
# A card with no earlier transaction inside the longest window gets this many seconds.
NO_PREVIOUS_S = LONGEST_WINDOW_US / US

_S: Kind = "session"
SESSION_FEATURES: tuple[Feature, ...] = (
    *(
        Feature(
            f"card_txn_count_{w}",
            _S,
            "int64",
            0,
            f"card transactions in the {w} before the event (exclusive of it)",
        )
        for w, _ in WINDOWS
    ),
    *(
        Feature(
            f"card_amount_sum_{w}",
            _S,
            "float32",
            0.0,
            f"sum of the card's amounts in the {w} before the event",
        )
        for w, _ in WINDOWS
    ),
    Feature("card_distinct_merchants_1h", _S, "int64", 0, "distinct merchants, last hour"),
    Feature("card_distinct_countries_1h", _S, "int64", 0, "distinct countries, last hour"),
    Feature(
        "card_seconds_since_prev_txn",
        _S,
        "float32",
        NO_PREVIOUS_S,
        "seconds since the card's previous transaction, capped at 86400 (also when none)",
    ),
    Feature(
        "card_country_changed",
        _S,
        "float32",
        0.0,
        "1 when the event's country differs from the card's previous transaction's "
        "(previous within 24h; 0 when none)",
    ),
    Feature(
        "card_txn_count_since_snapshot",
        _S,
        "int64",
        0,
        "card transactions since its batch snapshot (at most the last 24h; without a "
        "snapshot, the last 24h): the stream half of card_txn_count_30d_live",
        model_input=False,
    ),
    Feature(
        "card_amount_sum_since_snapshot",
        _S,
        "float32",
        0.0,
        "sum of amounts over the same span as card_txn_count_since_snapshot",
        model_input=False,
    ),
)
SESSION_NAMES: tuple[str, ...] = tuple(f.name for f in SESSION_FEATURES)
N_SESSION = len(SESSION_NAMES)
DEFAULT_ROW: tuple[float, ...] = tuple(float(f.default) for f in SESSION_FEATURES)

SEP = "\x1f"  # unit separator: cannot occur in validated ids or country codes


@dataclass(frozen=True, slots=True)
class SessionEvent:
    """The part of a transaction that session features read."""

    ts_us: int
    transaction_id: str
    amount: float
    merchant_id: str
    country: str


# --- the feature math ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OlderEvents:
    """What a bounded read (:func:`queue_session_reads`) did not return of a card's window:
    aggregates of the card's events older than every event it returned.

    ``totals`` maps a start time (µs) to the count and the amount sum of those events at
    or after it, the sum added in (time, transaction_id) order from 0.0 as
    :func:`session_features` adds (so continuing it with the returned events gives the
    same bits); ``merchants_1h``/``countries_1h`` are the distinct values among those in
    the last hour; ``bound_us`` is the time of the oldest returned event (no older event
    is later)."""

    totals: Mapping[int, tuple[int, float]]
    merchants_1h: frozenset[str]
    countries_1h: frozenset[str]
    bound_us: int

    def at(self, start_us: int) -> tuple[int, float] | None:
        """(count, sum) of the older events at or after ``start_us``; None when the read
        did not aggregate that start (then only a bound is known)."""
        if start_us > self.bound_us:
            return 0, 0.0
        return self.totals.get(start_us)


def session_features(
    events: Sequence[SessionEvent],
    as_of_us: int,
    exclude_id: str | None = None,
    country: str | None = None,
    snapshot_us: int = 0,
    older: OlderEvents | None = None,
) -> tuple[float, ...]:
    """One row of session features (in :data:`SESSION_NAMES` order) as of ``as_of_us``.

    ``events`` may be any superset of the card's events in the longest window, in any
    order; events at or after ``as_of_us``, older than the window, or with
    ``transaction_id == exclude_id`` are ignored. ``country`` is the scored
    transaction's country (None: ``card_country_changed`` is its default, 0).
    ``snapshot_us`` is the card's usable batch snapshot time (0: none) for the
    ``*_since_snapshot`` pair. Amount sums add events in (time, transaction_id) order so
    every caller gets the same bits.

    ``older`` (the serving edge's bounded read): the window's events older than all of
    ``events``, already aggregated (``events`` must then hold at least one event the
    row counts); each count and sum starts from its total. Exact, except the
    ``*_since_snapshot`` pair when ``older`` has no total for the snapshot's start: then
    it counts only the events from the next start it has (a lower bound).
    """
    lo = as_of_us - LONGEST_WINDOW_US
    evs = sorted(
        (e for e in events if lo <= e.ts_us < as_of_us and e.transaction_id != exclude_id),
        key=lambda e: (e.ts_us, e.transaction_id),
    )
    counts, sums = [], []
    for _, w in WINDOWS:
        start = as_of_us - w
        n, s = _older_total(older, start)
        for e in evs:
            if e.ts_us >= start:
                n += 1
                s += e.amount
        counts.append(float(n))
        sums.append(s)
    hour = as_of_us - HOUR_US
    recent = [e for e in evs if e.ts_us >= hour]
    merchants = {e.merchant_id for e in recent}
    countries = {e.country for e in recent}
    if older is not None:
        merchants |= older.merchants_1h
        countries |= older.countries_1h
    since_start = max(snapshot_us, lo)
    n_since, s_since = _older_total(older, since_start)
    for e in evs:
        if e.ts_us >= since_start:
            n_since += 1
            s_since += e.amount
    if evs:
        prev = evs[-1]
        gap = (as_of_us - prev.ts_us) / US
        changed = 1.0 if country is not None and prev.country != country else 0.0
    else:
        gap, changed = NO_PREVIOUS_S, 0.0
    return (
        *counts,
        *sums,
        float(len(merchants)),
        float(len(countries)),
        gap,
        changed,
        float(n_since),
        s_since,
    )


def _older_total(older: OlderEvents | None, start_us: int) -> tuple[int, float]:
    """Where a window's count and sum start: 0 without an older part; else its total at
    ``start_us``, or at the next start it aggregated (a lower bound; see OlderEvents)."""
    if older is None:
        return 0, 0.0
    total = older.at(start_us)
    if total is None:
        later = [t for t in older.totals if t >= start_us]
        total = older.totals[min(later)] if later else (0, 0.0)
    return total


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

# KEYS: events zset, ids hash. ARGV: retention_us, lateness_us, ttl_ms, then
# (transaction_id, ts_us, member) per event. Returns {added, duplicates, late, dropped}:
# an event already behind the retention horizon is dropped without touching state; one
# that falls behind it within the same call (a newer event came along) is added, then
# trimmed, and also counted as dropped.
# Scores are formatted with %d: Lua's default number format (%.14g) would round µs.
_APPLY_FN = """
local function apply(ev, ids, retention, lateness, ttl, a, lo, hi)
  local newest = redis.call('ZREVRANGE', ev, 0, 0, 'WITHSCORES')
  local maxts = nil
  if newest[2] then maxts = tonumber(newest[2]) end
  local added, dup, late, dropped = 0, 0, 0, 0
  local new_ts = {}
  for i = lo, hi, 3 do
    local id, ts = a[i], tonumber(a[i + 1])
    if maxts and ts < maxts - retention then
      late = late + 1
      dropped = dropped + 1
    elseif redis.call('HSETNX', ids, id, a[i + 1]) == 1 then
      if maxts and ts < maxts - lateness then late = late + 1 end
      redis.call('ZADD', ev, a[i + 1], a[i + 2])
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
end
"""
APPLY_LUA = (
    _APPLY_FN
    + """
local retention, lateness, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
return apply(KEYS[1], KEYS[2], retention, lateness, ttl, ARGV, 4, #ARGV)
"""
)
# Many cards in one call (one server: a Cluster needs one call per card's slot). KEYS:
# (events zset, ids hash) per card. ARGV: retention_us, lateness_us, ttl_ms, then per card
# its event count and its (transaction_id, ts_us, member) triples. Returns APPLY_LUA's
# reply per card, in order.
APPLY_MANY_LUA = (
    _APPLY_FN
    + """
local retention, lateness, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out, pos = {}, 4
for k = 1, #KEYS, 2 do
  local n = tonumber(ARGV[pos])
  out[#out + 1] = apply(KEYS[k], KEYS[k + 1], retention, lateness, ttl, ARGV, pos + 1, pos + 3 * n)
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
    ``retention = 24 h + allowed_lateness`` behind the card's newest event. ``ttl_s`` is
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
        return LONGEST_WINDOW_US + self.lateness_us

    @property
    def ttl_ms(self) -> int:
        ttl = self.ttl_s if self.ttl_s is not None else self.retention_us / US + 3600
        return round(ttl * 1000)

    def args(self, events: Sequence[SessionEvent]) -> list[str | int]:
        """ARGV of one :data:`APPLY_LUA` call for one card's events."""
        return [self.retention_us, self.lateness_us, self.ttl_ms, *_event_args(events)]


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
    args: list[str | int] = [limits.retention_us, limits.lateness_us, limits.ttl_ms]
    for card, evs in by_card.items():
        keys += (events_key(card), ids_key(card))
        args += (len(evs), *_event_args(evs))
    pipe.execute_command("EVALSHA", APPLY_MANY_SHA, len(keys), *keys, *args)
    return 1


# --- the serving edge ---------------------------------------------------------------------

# A card's read is bounded: at most READ_CAP events travel and are decoded in Python; the
# rest of its 24 h arrive as a few totals summed by the server (READ_LUA), so a card with
# thousands of events costs the event loop what one with READ_CAP costs.
READ_CAP = 128
# Per transaction: the window starts READ_LUA totals the older events from (µs), in this
# order: each window's start, then the last UTC midnight (the batch snapshots' time).
N_STARTS = len(WINDOWS) + 1

# KEYS[i]: the events zset of transaction i. ARGV[1]: the cap. Then per transaction,
# N_STARTS + 2 values: t (exclusive end, µs), the transaction_id to leave out, the starts
# (the longest window's start is the read's lower bound). Returns per transaction
# {events, older}: events = member, score, ... of its newest <= cap events in [start, t),
# newest first; older = 0 when that was all of them, else the totals of the rest:
# count, sum per start (sums as %.17g strings: exact doubles; Lua numbers would reach the
# client truncated to integers), then the distinct merchants and countries of the rest
# within the hour window. Sums add in ascending (time, member) order, which is
# session_features' (time, transaction_id) order: a member starts with the id and byte
# 31 sorts before any id character.
READ_LUA = Template("""
local cap, width = tonumber(ARGV[1]), ${width}
local out = {}
for i = 1, #KEYS do
  local a = 2 + (i - 1) * width
  local t, excl, lo = '(' .. ARGV[a], ARGV[a + 1], ARGV[a + 1 + ${longest}]
  local newest = redis.call('ZREVRANGEBYSCORE', KEYS[i], t, lo, 'WITHSCORES', 'LIMIT', 0, cap + 1)
  if #newest <= 2 * cap then
    out[i] = {newest, 0}
  else
    newest[2 * cap + 2] = nil
    newest[2 * cap + 1] = nil
    local rest = redis.call('ZREVRANGEBYSCORE', KEYS[i], t, lo, 'WITHSCORES', 'LIMIT', cap, -1)
    local starts, n, s = {}, {}, {}
    for k = 1, ${nstarts} do
      starts[k] = tonumber(ARGV[a + 1 + k])
      n[k] = 0
      s[k] = 0.0
    end
    local hour = starts[${hour}]
    local seen_m, seen_c, merchants, countries = {}, {}, {}, {}
    for j = #rest - 1, 1, -2 do
      local m, ts = rest[j], tonumber(rest[j + 1])
      local c1 = string.find(m, '\\31', 1, true)
      if string.sub(m, 1, c1 - 1) ~= excl then
        local c2 = string.find(m, '\\31', c1 + 1, true)
        local amount = tonumber(string.sub(m, c1 + 1, c2 - 1))
        for k = 1, ${nstarts} do
          if ts >= starts[k] then
            n[k] = n[k] + 1
            s[k] = s[k] + amount
          end
        end
        if ts >= hour then
          local c3 = string.find(m, '\\31', c2 + 1, true)
          local merchant, country = string.sub(m, c2 + 1, c3 - 1), string.sub(m, c3 + 1)
          if not seen_m[merchant] then
            seen_m[merchant] = true
            merchants[#merchants + 1] = merchant
          end
          if not seen_c[country] then
            seen_c[country] = true
            countries[#countries + 1] = country
          end
        end
      end
    end
    local older = {}
    for k = 1, ${nstarts} do
      older[#older + 1] = n[k]
      older[#older + 1] = string.format('%.17g', s[k])
    end
    older[#older + 1] = merchants
    older[#older + 1] = countries
    out[i] = {newest, older}
  end
end
return out
""").substitute(
    width=N_STARTS + 2,
    nstarts=N_STARTS,
    longest=[w for _, w in WINDOWS].index(LONGEST_WINDOW_US) + 1,
    hour=[w for _, w in WINDOWS].index(HOUR_US) + 1,
)
READ_SHA = hashlib.sha1(READ_LUA.encode()).hexdigest()
# What a server must have loaded (SCRIPT LOAD) for the updater's and the scorer's calls.
SCRIPTS = (APPLY_LUA, APPLY_MANY_LUA, READ_LUA)


def _starts(t_us: int) -> list[int]:
    return [*(t_us - w for _, w in WINDOWS), t_us - t_us % DAY_US]


def queue_session_reads(
    pipe: Any,
    card_ids: Sequence[str],
    as_of_ts: Sequence[float],
    txn_ids: Sequence[str | None] | None = None,
    *,
    per_card: bool = False,
    cap: int = READ_CAP,
) -> int:
    """Queue the session reads for ``len(card_ids)`` transactions on a redis-py pipeline
    (sync or asyncio; commands are only queued here); return how many commands were
    queued (hand that many replies to :func:`parse_session_results`).

    One ``EVALSHA`` of :data:`READ_LUA` for the whole batch, or one per transaction with
    ``per_card`` (a Redis Cluster, where one call's keys must share a slot; a card's
    keys carry its hash tag). Each transaction reads its card's events in
    ``[t - 24h, t)`` (``as_of_ts``: epoch seconds, UTC): the newest ``cap`` in full, the
    rest as totals. ``txn_ids`` are left out of those totals (None: nothing left out; the
    full events are filtered by :func:`parse_session_results`). The same card may appear
    several times; each occurrence gets its own read. Needs :data:`READ_LUA` loaded
    (``SCRIPT LOAD``); otherwise the replies are ``NoScriptError``.
    """
    if cap < 2:
        raise ValueError("cap must be >= 2 (the newest event left out may be the scored one)")
    n = len(card_ids)
    ids = txn_ids if txn_ids is not None else [None] * n
    groups = [[i] for i in range(n)] if per_card else [list(range(n))] if n else []
    for group in groups:
        keys: list[str] = []
        args: list[str | int] = [cap]
        for i in group:
            t = to_us(as_of_ts[i])
            keys.append(events_key(card_ids[i]))
            args += (t, ids[i] or "", *_starts(t))
        pipe.execute_command("EVALSHA", READ_SHA, len(keys), *keys, *args)
    return len(groups)


@dataclass
class ReadStats:
    """What the bounded reads of a batch did: ``capped`` reads returned older events as
    totals (still exact), ``inexact`` of them left a ``*_since_snapshot`` pair a lower
    bound (a snapshot time that is not the last UTC midnight; see :class:`OlderEvents`)."""

    capped: int = 0
    inexact: int = 0


def parse_session_results(
    replies: Sequence[Any],
    card_ids: Sequence[str],
    as_of_ts: Sequence[float],
    txn_ids: Sequence[str | None],
    countries: Sequence[str | None] | None = None,
    snapshot_ts: Sequence[float] | None = None,
    stats: ReadStats | None = None,
) -> dict[str, np.ndarray]:
    """Session feature columns (float64, one per name in :data:`SESSION_NAMES`).

    ``replies`` are the replies of the commands :func:`queue_session_reads` queued, in
    order (slice them out of the pipeline's result list); a ``NoScriptError`` among them
    is raised. ``txn_ids`` are the scored transactions' ids (excluded from their own
    features); ``countries`` their countries (needed for ``card_country_changed``;
    None leaves that feature at its default 0); ``snapshot_ts`` the cards' usable batch
    snapshot times in epoch seconds (0 or None: none). A card without state gets the
    defaults, which are the true values for "no recent transactions", not a stand-in.
    ``stats``, when given, is told how many reads were capped.
    """
    n = len(card_ids)
    per_txn: list[Any] = []
    for r in replies:
        if isinstance(r, Exception):
            raise r
        per_txn.extend(r)
    if len(per_txn) != n:
        raise ValueError(f"expected replies for {n} transactions, got {len(per_txn)}")
    out = np.empty((n, N_SESSION), dtype=np.float64)
    for i, (flat, rest) in enumerate(per_txn):
        events = [decode_member(flat[j], float(flat[j + 1])) for j in range(0, len(flat), 2)]
        t = to_us(as_of_ts[i])
        snapshot_us = to_us(snapshot_ts[i]) if snapshot_ts is not None else 0
        older = None
        if rest:
            starts = _starts(t)
            older = OlderEvents(
                {
                    start: (int(rest[2 * k]), float(rest[2 * k + 1]))
                    for k, start in enumerate(starts)
                },
                frozenset(m.decode() for m in rest[-2]),
                frozenset(c.decode() for c in rest[-1]),
                events[-1].ts_us,  # newest first: the last is the oldest returned
            )
            if stats is not None:
                stats.capped += 1
                if older.at(max(snapshot_us, starts[-2])) is None:
                    stats.inexact += 1
        out[i] = session_features(
            events,
            t,
            txn_ids[i],
            countries[i] if countries is not None else None,
            snapshot_us,
            older,
        )
    return {name: out[:, j] for j, name in enumerate(SESSION_NAMES)}


# --- the training edge --------------------------------------------------------------------


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


def offline_session_features(
    df: pd.DataFrame, history: pd.DataFrame | None = None
) -> dict[str, np.ndarray]:
    """Session features for every row of ``df`` as of its own event time (float64 columns,
    in ``df``'s row order).

    ``df`` needs transaction_id, card_id, merchant_id, amount, country and
    event_timestamp or event_time (tz-aware datetimes, or epoch seconds). The events
    counted come from ``history`` (same columns; default ``df`` itself), deduplicated
    on transaction_id exactly as the updater does; pass the full raw history when
    ``df`` is a sample. Each row excludes its own transaction_id, like the scorer. The
    ``*_since_snapshot`` pair reads ``df["card_snapshot_time"]`` (epoch seconds, as the
    point-in-time join left it: NaN or 0 for no usable snapshot) when present.
    """
    hist = df if history is None else history
    h_ts = epoch_us(hist)
    h = (
        pd.DataFrame(
            {
                "card": hist["card_id"].to_numpy(object),
                "ts": h_ts,
                "tid": hist["transaction_id"].to_numpy(object),
                "amount": hist["amount"].to_numpy(np.float64),
                "merchant": hist["merchant_id"].to_numpy(object),
                "country": hist["country"].to_numpy(object),
            }
        )
        .drop_duplicates("tid", keep="first")
        .sort_values(["card", "ts", "tid"], kind="stable")
    )
    cards = h["card"].to_numpy(object)
    h_ts_sorted = h["ts"].to_numpy(np.int64)
    events = [
        SessionEvent(int(t), tid, float(a), m, c)
        for t, tid, a, m, c in zip(
            h_ts_sorted, h["tid"], h["amount"], h["merchant"], h["country"], strict=True
        )
    ]
    # Per card: the slice [start, end) of the sorted history.
    uniq, first = np.unique(cards.astype(str), return_index=True)
    bounds = dict(
        zip(
            uniq.tolist(),
            zip(first.tolist(), [*first[1:].tolist(), len(cards)], strict=True),
            strict=True,
        )
    )

    q_ts = epoch_us(df)
    q_card = df["card_id"].to_numpy(object)
    q_tid = df["transaction_id"].to_numpy(object)
    q_ctry = df["country"].to_numpy(object)
    q_snap = (
        to_us(pd.to_numeric(df["card_snapshot_time"]).fillna(0).to_numpy(np.float64)).tolist()
        if "card_snapshot_time" in df.columns
        else [0] * len(df)
    )
    out = np.empty((len(df), N_SESSION), dtype=np.float64)
    for i in range(len(df)):
        b = bounds.get(str(q_card[i]))
        if b is None:
            out[i] = session_features((), int(q_ts[i]), q_tid[i], q_ctry[i], q_snap[i])
            continue
        s, e = b
        t = int(q_ts[i])
        lo = s + int(np.searchsorted(h_ts_sorted[s:e], t - LONGEST_WINDOW_US, "left"))
        hi = s + int(np.searchsorted(h_ts_sorted[s:e], t, "left"))
        out[i] = session_features(events[lo:hi], t, q_tid[i], q_ctry[i], q_snap[i])
    return {name: out[:, j] for j, name in enumerate(SESSION_NAMES)}
