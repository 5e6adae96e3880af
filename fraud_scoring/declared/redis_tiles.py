"""The Redis layout of the declared states and the scripts that record events into it
(:func:`queue_apply`, :func:`queue_record`, or a whole batch in every state at once:
:func:`queue_states`); a key's windows are read by :func:`queue_read` (parsed by
:func:`fraud_scoring.declared.microbatch.parse_reads`).

**Cost per key is bounded.** A key's state is a ring of tiles per width (count, sum,
sum of squares; with min or max also the tile's smallest and largest value), its
:data:`NEWEST` newest events (for the exact end and ``seconds_since_last``) and the ids
of the last ``horizon`` (for idempotency); a read touches ``W / u + 1`` tiles per window
whatever the key's traffic (a min or max whose tile holding ``t`` also holds later
events: a few more, bounded by the widths, :func:`_extremes_before`). A state with a
categorical value (``distinct_count``, ``changed``) also keeps, per value, the newest
time it was seen among the events older than its :data:`NEWEST` newest, for at most
:data:`DISTINCT_CAP` values.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from fraud_scoring.declared.expressions import evaluate, value_names
from fraud_scoring.declared.language import DISTINCT_CAP, NEWEST, US
from fraud_scoring.declared.plan import Spec, _empty, value_code
from fraud_scoring.redis_clients import is_cluster_pipeline

# Per (spec, key), two keys sharing the hash tag {agg:<spec id>:<key>}:
#   <p>:t   hash: field "<u>" per tile width u, that width's tiles as packed records of
#           four little-endian doubles (tile index, count, sum, sum of squares; a state
#           with min or max: six, the tile's smallest and largest value after them), one per
#           tile holding events; it keeps the tiles of the last ``slots`` indexes (older
#           ones are dropped once the field holds more than ``slots``: no read reaches
#           them). Field "n": the NEWEST newest events, packed (ts µs, value) doubles in
#           time order. Fields "f" and "b": the oldest event time recorded live and
#           the newest recorded by a backfill (a backfill records only between them).
#   <p>:ids zset transaction_id -> ts, the last ``horizon`` of the key (idempotency):
#           only on a Redis Cluster and in a label state. Elsewhere a transaction state
#           keeps no ids per key (its bytes do not grow with the key's traffic): one
#           hash per transaction, fraud:seen:{<transaction_id>} (MARKER_PREFIX), has a
#           field per state that recorded it, written by the same script call; it
#           expires Limits.mark_ttl_ms (the horizon and an hour) after its last write.
# Both expire ``ttl`` after the key's last write. A read is one HMGET of the hash
# (:func:`queue_read`; no script), summed in the client, vectorized over a micro-batch
# (:func:`parse_reads`).
# (The tile records: :data:`fraud_scoring.declared.plan.TILE` and ``TILE_EXTREMES``.)
NEWEST_REC = struct.Struct("<2d")


# The recording scripts are files beside this module (package data): record.lua holds
# config() and record(), which apply.lua (APPLY_LUA) and apply_states.lua
# (APPLY_STATES_LUA) call; each script is record.lua's text and its own, as sent.
def _lua(name: str) -> str:
    """A recording script's source (``fraud_scoring/declared/<name>``, package data)."""
    return resources.files("fraud_scoring.declared").joinpath(name).read_text(encoding="utf-8")


# KEYS: t, ids of one or more keys of one spec (mark_ttl_ms 0); or (mark_ttl_ms > 0)
# t of each key, then each event's marker (in order). ARGV: the settings packed in one
# argument as little-endian doubles (:func:`pack_settings`): horizon_us, newest, ttl_ms,
# backfill (1/0), dcap, dback_us, extremes (1/0: tiles of six doubles, with min and
# max), nwidths, (u, slots)*, nhalf, half_life_us* (a decayed sum per tile each, after
# the rest), mark_ttl_ms; then each width's u as text (its field); the state's id, the
# number of markers, then per key: nev, (id, ts, value)*. dcap > 0 (a state that keeps
# values): the events pushed out of the newest list update field "d" (per value code its
# newest time among them; values older than the key's newest by more than dback_us are
# dropped, then all but the dcap newest). Returns per key a list, per event 1 (added),
# 0 (duplicate, or a backfill's event the key holds already) or -1 (older than the
# key's newest by more than the horizon: dropped, as nothing live reads that far back).
# A key's events in one call are summed per tile first, and its hash read and written
# once; a key whose events are all duplicates is not read.
_RECORD_FN = "\n" + _lua("record.lua")
APPLY_LUA = _RECORD_FN + "\n" + _lua("apply.lua")

# KEYS: t of each key of each state, in order, then the marker of each distinct
# transaction id in order of its first row. ARGV (lists as one text, each item
# followed by its separator): [1] n (rows), [2] the rows' transaction ids (each + "\x1f"),
# [3] their times in µs (each + ","), [4] ncols, then per value column the rows' values
# (each + ",", empty where a row has none), then nstates and per state: its settings
# (APPLY_LUA's: the packed numbers, then the widths' fields), delay_us, its value
# column (1..ncols; 0: each event counts 1.0), its keys' rows (1-based; per key
# "i,j,...;", in key order), its id. Each key's events are recorded exactly as
# APPLY_LUA records them (id, ts + delay, value). Returns per state a string, one
# character per event of its keys in order: "1" (added), "0" (duplicate, or held by a
# backfill already) or "-" (dropped).
APPLY_STATES_LUA = _RECORD_FN + "\n" + _lua("apply_states.lua")
APPLY_SHA = hashlib.sha1(APPLY_LUA.encode()).hexdigest()
APPLY_STATES_SHA = hashlib.sha1(APPLY_STATES_LUA.encode()).hexdigest()
SCRIPTS = (APPLY_LUA, APPLY_STATES_LUA)


@dataclass(frozen=True)
class Limits:
    """How far back a key accepts an event (µs behind its newest) and how long an idle
    key lives (ms)."""

    horizon_us: int
    ttl_ms: int
    # A backfill's call: it records only events older than the key's oldest live one
    # and newer than the newest an earlier backfill recorded (each transaction once).
    backfill: bool = False
    # How long a transaction's marker lives after its last write (ms): a duplicate that
    # comes later than this (at a key whose newest event is still within the horizon of
    # it: an idle key) is counted again. for_spec: the horizon and an hour.
    mark_ttl_ms: int = 0
    # False: no markers at all (a backfill's events further back than the live horizon:
    # its watermarks f and b keep a rerun from counting them twice, and a marker per
    # historical transaction would cost ~100 bytes each for nothing).
    marks: bool = True

    @classmethod
    def for_spec(cls, spec: Spec, horizon_s: float) -> Limits:
        # A label state's events arrive out of time order by up to its ahead_us.
        back = int(horizon_s * US) + (spec.ahead_us if spec.arrivals else 0)
        ttl = ((spec.longest_us + spec.ahead_us + back) // US + 3600) * 1000
        return cls(back, ttl, mark_ttl_ms=int(horizon_s * 1000) + 3_600_000)

    def mark_ttl(self, spec: Spec, per_key: bool) -> int:
        """The markers' lifetime a call for ``spec`` sends: 0 (the key's id set) on a
        Redis Cluster (one call's keys share a slot; a transaction's marker is elsewhere)
        and for a label state (labels arrive days late: their ids are kept per key); -1:
        none (``marks`` false)."""
        if per_key or spec.arrivals:
            return 0
        if not self.marks:
            return -1
        return self.mark_ttl_ms or int(self.horizon_us // 1000) + 3_600_000


@dataclass(frozen=True, slots=True)
class Event:
    """One transaction as a declared aggregation records it."""

    transaction_id: str
    ts_us: int
    value: float


class BatchColumns:
    """A batch of transactions (``rows`` at ``ts_us``) as the states record them: each
    state's keys, filter and values computed column-wise, once per batch, and shared by
    every state that reads the same ones (the default declarations have ~10 states over
    4 entities). Semantics are :meth:`Spec.key_value`, :meth:`Spec.passes` and
    :meth:`Spec.value`, row by row."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], ts_us: Sequence[int]) -> None:
        if len(rows) != len(ts_us):
            raise ValueError(f"{len(rows)} rows but {len(ts_us)} times")
        self.rows, self.ts_us = rows, ts_us
        self._cols: dict[str, list[Any]] = {}
        self._keys: dict[tuple[str, ...], list[str | None]] = {}
        self._masks: dict[Any, list[bool] | None] = {}
        self._groups: dict[Any, dict[str, list[int]]] = {}
        self._values: dict[str | None, list[float]] = {}
        self._args: dict[tuple[int, str | None], list[tuple[str, int, str]]] = {}
        self._args_one: dict[tuple[int, str | None], list[tuple[int, str, int, str]]] = {}
        self._texts: dict[str | None, list[str]] = {}

    def at_times(self, ts_us: Sequence[int]) -> BatchColumns:
        """The same rows at ``ts_us`` (e.g. recorded at their effective times): this
        batch when the times are its own, else one sharing what does not depend on the
        times (keys, filters, groups, values), computed once per micro-batch."""
        if list(ts_us) == list(self.ts_us):
            return self
        other = BatchColumns(self.rows, ts_us)
        other._cols, other._keys, other._masks = self._cols, self._keys, self._masks
        other._groups, other._values, other._texts = self._groups, self._values, self._texts
        return other

    @cached_property
    def ids(self) -> list[str]:
        return [str(r["transaction_id"]) for r in self.rows]

    def column(self, c: str) -> list[Any]:
        col = self._cols.get(c)
        if col is None:
            col = self._cols[c] = [r.get(c) for r in self.rows]
        return col

    def keys(self, entity: tuple[str, ...]) -> list[str | None]:
        """Each row's key value (None: a key column is empty)."""
        out = self._keys.get(entity)
        if out is not None:
            return out
        parts = [
            [None if v is None or v != v or v == "" else str(v) for v in self.column(c)]
            for c in entity
        ]
        if len(parts) == 1:
            out = parts[0]
        else:
            joined = zip(*parts, strict=True)
            out = [None if None in p else "\x1f".join(p) for p in joined]  # type: ignore[arg-type]
        self._keys[entity] = out
        return out

    @staticmethod
    def _filter_sig(spec: Spec) -> tuple[Any, ...]:
        return spec.filter_signature

    def mask(self, spec: Spec) -> list[bool] | None:
        """Which rows pass ``spec``'s filter and have the columns it requires
        (:attr:`Spec.required`: a categorical value, a declared number field its value
        reads); None: all of them."""
        sig = self._filter_sig(spec)
        if sig in self._masks:
            return self._masks[sig]
        ok: list[bool] | None = None
        for c in spec.required:
            has = [not (v is None or v != v or v == "") for v in self.column(c)]
            ok = has if ok is None else [a and b for a, b in zip(ok, has, strict=True)]
        if ok is None:
            ok = [True] * len(self.rows)
        for c, allowed in spec.row_filter:
            ok = [a and v in allowed for a, v in zip(ok, self.column(c), strict=True)]
        out = None if all(ok) else ok
        self._masks[sig] = out
        return out

    def groups(self, spec: Spec) -> dict[str, list[int]]:
        """The rows ``spec`` records, by key value (keys in order of first appearance,
        rows in batch order)."""
        mask = self.mask(spec)
        sig = (spec.entity, None if mask is None else self._filter_sig(spec))
        out = self._groups.get(sig)
        if out is not None:
            return out
        out = {}
        keys = self.keys(spec.entity)
        if mask is not None:
            keys = [k if m else None for k, m in zip(keys, mask, strict=True)]
        for i, k in enumerate(keys):
            if k is not None:
                g = out.get(k)
                if g is None:
                    out[k] = [i]
                else:
                    g.append(i)
        self._groups[sig] = out
        return out

    def values(self, spec: Spec) -> list[float]:
        """Each row's :meth:`Spec.value` (0.0 for a row without a categorical value,
        which no state records)."""
        vc = spec.value_column
        out = self._values.get(vc)
        if out is not None:
            return out
        if vc is None:
            out = [1.0] * len(self.rows)
        elif spec.categorical:
            out = [0.0 if _empty(v) else value_code(v) for v in self.column(vc)]
        elif spec.value_expr:  # evaluated column-wise, as every engine does
            cols = {c: self._numbers(c, spec.required) for c in value_names(vc)}
            out = evaluate(vc, cols).tolist()
        else:
            out = self._numbers(vc, spec.required)
        self._values[vc] = out
        return out

    def _numbers(self, column: str, optional: Sequence[str]) -> list[float]:
        """A number column; a declared field's absent value (``optional``) is NaN (such a
        row is not recorded: :meth:`mask`), a contract column's is refused."""
        if column in optional:
            return [math.nan if v is None else float(v) for v in self.column(column)]
        return [self._number(column, i, v) for i, v in enumerate(self.column(column))]

    def _number(self, column: str, i: int, v: Any) -> float:
        if v is None:
            raise ValueError(f"{column}: missing in transaction {self.ids[i]!r}")
        return float(v)

    def args(self, spec: Spec) -> list[tuple[str, int, str]]:
        """Each row's (transaction_id, ts, value) as :data:`APPLY_LUA` takes them: ts
        plus the state's delay, the value as the shortest text that reads back as the
        same double (``repr``)."""
        sig = (spec.delay_us, spec.value_column)
        out = self._args.get(sig)
        if out is not None:
            return out
        d = spec.delay_us
        ts = self.ts_us if d == 0 else [t + d for t in self.ts_us]
        out = self._args[sig] = list(zip(self.ids, ts, self.texts(spec), strict=True))
        return out

    def texts(self, spec: Spec) -> list[str]:
        """Each row's value as the shortest text that reads back as the same double
        (``repr``; "" for a row without a categorical value, which no state records)."""
        vc = spec.value_column
        out = self._texts.get(vc)
        if out is not None:
            return out
        if vc is None:
            out = ["1.0"] * len(self.rows)
        elif spec.categorical:  # a few distinct values per batch: their texts cached
            out = ["" if _empty(v) else _code_text(v) for v in self.column(vc)]
        else:
            out = [repr(v) for v in self.values(spec)]
        self._texts[vc] = out
        return out

    @cached_property
    def positions(self) -> list[str]:
        """Each row's 1-based position as text (how :data:`APPLY_STATES_LUA` names it)."""
        return [str(i) for i in range(1, len(self.rows) + 1)]

    def args_one(self, spec: Spec) -> list[tuple[int, str, int, str]]:
        """:meth:`args` with an event count of 1 ahead (a key with one event)."""
        sig = (spec.delay_us, spec.value_column)
        out = self._args_one.get(sig)
        if out is None:
            out = self._args_one[sig] = [(1, *a) for a in self.args(spec)]
        return out

    def events(self, spec: Spec, key: str) -> list[Event]:
        """The events ``spec`` records at ``key``, in batch order."""
        values = self.values(spec)
        return [
            Event(self.ids[i], self.ts_us[i] + spec.delay_us, values[i])
            for i in self.groups(spec).get(key, ())
        ]


@functools.lru_cache(maxsize=1 << 16, typed=True)  # merchants, countries, cards recur
def _code_text(v: Any) -> str:
    return repr(value_code(v))


def events_for(
    spec: Spec, rows: Sequence[Mapping[str, Any]], ts_us: Sequence[int]
) -> dict[str, list[Event]]:
    """The events transactions ``rows`` at ``ts_us`` add to ``spec``'s keys (rows
    outside its filter, or without a key, add none; a state of labels or decisions takes
    none: see :func:`label_events_for`), by key value, each at ``ts`` plus the state's delay."""
    if spec.source != "transactions":
        return {}
    cols = BatchColumns(rows, ts_us)
    return {key: cols.events(spec, key) for key in cols.groups(spec)}


def label_available_us(label_us: int, after_s: float) -> int:
    """When the online store has a label that arrived at ``label_us``: the daily batch
    records a day's labels after that day (UTC), ``after_s`` past midnight
    (``FRAUD_BATCH_AVAILABLE_AFTER_S``)."""
    day = 86_400 * US
    return (label_us // day + 1) * day + int(after_s * US)


def label_events_for(spec: Spec, rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Event]]:
    """The events arrivals ``rows`` add to a state of labels or decisions, by key value.
    A row is a label or a decision (its ``source``; none: a label) with its
    transaction's columns, ``event_us`` (the transaction's event time) and
    ``available_us`` (:func:`label_available_us` of its arrival); it counts from the
    later of ``available_us`` and ``event_us`` plus the delay."""
    out: dict[str, list[Event]] = {}
    if not spec.arrivals:
        return out
    for row in rows:
        if row.get("source", "labels") != spec.source:
            continue
        key = spec.key_value(row)
        if key is not None and spec.passes(row):
            ts = max(int(row["available_us"]), int(row["event_us"]) + spec.delay_us)
            out.setdefault(key, []).append(Event(str(row["transaction_id"]), ts, spec.value(row)))
    return out


def marker(transaction_id: str) -> str:
    """The key of a transaction's marker: which transaction states recorded it."""
    return MARKER_PREFIX + transaction_id + "}"


MARKER_PREFIX = "fraud:seen:{"


def _apply_head(spec: Spec, limits: Limits, mark_ttl_ms: int) -> list[Any]:
    """A state's settings in an APPLY or APPLY_STATES call: the numbers (up to
    mark_ttl_ms) packed as little-endian doubles in one argument (record.lua's config()
    reads them with one ``struct.unpack``), then each width's field name."""
    nums: list[float] = [limits.horizon_us, NEWEST, limits.ttl_ms, int(limits.backfill)]
    dcap = DISTINCT_CAP if spec.keeps_values else 0
    nums += [dcap, spec.distinct_back_us(limits.horizon_us), int(spec.keeps_extremes)]
    nums.append(len(spec.widths))
    for u, slots in spec.widths.items():
        nums += (u, slots)
    nums += (len(spec.half_lives), *spec.half_lives, mark_ttl_ms)
    return [pack_settings(nums), *map(str, spec.widths)]


def pack_settings(numbers: Sequence[float]) -> bytes:
    """record.lua's settings as config() reads them (every one exact in a double)."""
    return struct.pack(f"<{len(numbers)}d", *numbers)


_HEADS: dict[tuple[str, float], tuple[tuple[Any, ...], str]] = {}


def _state_head(spec: Spec, horizon_s: float) -> tuple[tuple[Any, ...], str]:
    """A state's part of an :data:`APPLY_STATES_LUA` call that does not depend on the
    batch (its settings, then its delay) and the start of its key names: the same for
    every micro-batch, derived once (a state's id names its whole shape)."""
    got = _HEADS.get((spec.id, horizon_s))
    if got is None:
        limits = Limits.for_spec(spec, horizon_s)
        head = (*_apply_head(spec, limits, limits.mark_ttl(spec, False)), spec.delay_us)
        got = _HEADS[(spec.id, horizon_s)] = (head, spec.prefix("")[:-1])
    return got


def _queue_call(
    pipe: Any,
    spec: Spec,
    keys: Sequence[str],
    head: list[Any],
    events: Sequence[Any],
    ids: Sequence[str] | None,
    marks: int,
) -> None:
    """One APPLY call for ``keys`` (``head``: :func:`_apply_head`; ``events``: the keys'
    part of ARGV; ``ids``: each event's transaction id in order, whose markers it
    reads and writes, or None: the keys' id sets; ``marks``: the head's mark_ttl_ms)."""
    if marks == 0:  # the keys' id sets
        names = [n for k in keys for p in (spec.prefix(k),) for n in (p + ":t", p + ":ids")]
    else:  # markers (ids), or none (-1)
        names = [spec.prefix(k) + ":t" for k in keys] + [marker(i) for i in ids or ()]
    n_marks = len(ids or ())
    pipe.execute_command("EVALSHA", APPLY_SHA, len(names), *names, *head, spec.id, n_marks, *events)


def queue_apply(
    pipe: Any,
    spec: Spec,
    by_key: Mapping[str, Sequence[Event]],
    limits: Limits,
    *,
    per_key: bool = False,
) -> list[str]:
    """Queue the recording of ``by_key``'s events: one APPLY call for all keys, or with
    ``per_key`` (a Redis Cluster, where one call's keys must share a slot) one per key.
    Returns the keys in reply order (each call's reply: a list per key, of per event
    results)."""

    marks = limits.mark_ttl(spec, per_key or is_cluster_pipeline(pipe))
    head = _apply_head(spec, limits, marks)
    for keys in [[k] for k in by_key] if per_key else [list(by_key)] if by_key else []:
        args: list[Any] = []
        for key in keys:
            args.append(len(by_key[key]))
            for e in by_key[key]:
                args += (e.transaction_id, e.ts_us, repr(float(e.value)))
        ids = [e.transaction_id for k in keys for e in by_key[k]] if marks > 0 else None
        _queue_call(pipe, spec, keys, head, args, ids, marks)
    return list(by_key)


def queue_record(
    pipe: Any, spec: Spec, cols: BatchColumns, limits: Limits, *, per_key: bool = False
) -> list[str]:
    """:func:`queue_apply` of :func:`events_for` (the same calls), from a batch's
    columns: no per-event objects, and the keys, filters and values shared with the
    batch's other states. Returns the keys in reply order."""
    if spec.source != "transactions":
        return []
    groups = cols.groups(spec)
    if not groups:
        return []
    rows = cols.args(spec)
    marks = limits.mark_ttl(spec, per_key or is_cluster_pipeline(pipe))
    head = _apply_head(spec, limits, marks)
    flat = itertools.chain.from_iterable
    # Per key: its event count, then its events' (id, ts, value); most keys of a batch
    # hold one event (a tuple ready-made), a hot key many.
    one = cols.args_one(spec)
    per = [
        one[idx[0]] if len(idx) == 1 else (len(idx), *flat(map(rows.__getitem__, idx)))
        for idx in groups.values()
    ]
    keys = list(groups)
    if per_key:
        for key, part in zip(keys, per, strict=True):
            _queue_call(pipe, spec, [key], head, part, None, marks)
    else:
        ids = [cols.ids[i] for i in flat(groups.values())] if marks > 0 else None
        _queue_call(pipe, spec, keys, head, list(flat(per)), ids, marks)
    return keys


def queue_states(
    pipe: Any, specs: Sequence[Spec], cols: BatchColumns, horizon_s: float
) -> list[tuple[Spec, list[str]]]:
    """Queue the recording of a batch (``cols``) in all of ``specs`` (transaction
    states; a label state takes none) in one :data:`APPLY_STATES_LUA` call: each row's id
    and time sent once, each value column once, and per state and key only the rows'
    positions. One server only (a Redis Cluster records per key: :func:`queue_record`).
    Returns the states that record events with their keys, in reply order (the reply:
    per state a string, one character per event, :func:`_state_results`); nothing
    queued when none does."""
    states = [(s, cols.groups(s)) for s in specs if s.source == "transactions"]
    states = [(s, g) for s, g in states if g]
    if not states:
        return []
    columns: dict[str | None, int] = {None: 0}  # value column -> its place (1-based)
    values: list[str] = []
    for spec, _ in states:
        if spec.value_column not in columns:
            columns[spec.value_column] = len(columns)
            values.append(",".join(cols.texts(spec)) + ",")
    ids = "\x1f".join(cols.ids) + "\x1f"
    if ids.count("\x1f") != len(cols.ids):
        raise ValueError("transaction_id: must not hold the character \\x1f")
    times = ",".join(map(str, cols.ts_us)) + ","
    args: list[Any] = [len(cols.ids), ids, times, len(values), *values, len(states)]
    names: list[str] = []
    at = cols.positions
    for spec, groups in states:
        head, start = _state_head(spec, horizon_s)
        places = [
            at[idx[0]] if len(idx) == 1 else ",".join(map(at.__getitem__, idx))
            for idx in groups.values()
        ]
        args += head
        args += (columns[spec.value_column], ";".join(places) + ";", spec.id)
        names += [start + k + "}:t" for k in groups]  # the keys' hashes (Spec.prefix)
    names += map(marker, dict.fromkeys(cols.ids))  # each distinct transaction's marker
    pipe.execute_command("EVALSHA", APPLY_STATES_SHA, len(names), *names, *args)
    return [(spec, list(groups)) for spec, groups in states]


def _state_results(
    spec: Spec, keys: Sequence[str], cols: BatchColumns, codes: bytes
) -> dict[str, list[int]]:
    """One state's part of an :data:`APPLY_STATES_LUA` reply, as :data:`APPLY_LUA`'s:
    per key, per event 1, 0 or -1."""
    groups, out, at = cols.groups(spec), {}, 0
    for key in keys:
        n = len(groups[key])
        out[key] = [_CODES[c] for c in codes[at : at + n]]
        at += n
    if at != len(codes):
        raise ValueError(f"state {spec.id}: {len(codes)} results for {at} events")
    return out


_CODES = {ord("1"): 1, ord("0"): 0, ord("-"): -1}


def queue_read(pipe: Any, spec: Spec, key: str, t_us: int) -> None:
    """Queue the read of ``key`` (one HMGET: its tiles per width and its newest events;
    parsed, as of each read's time, by :func:`parse_reads`; a state that keeps values
    also reads them)."""
    extra = ("n", "d") if spec.keeps_values else ("n",)
    pipe.execute_command("HMGET", spec.prefix(key) + ":t", *spec.widths, *extra)
