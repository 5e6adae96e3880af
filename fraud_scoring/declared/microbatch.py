"""A micro-batch's declared features, as the scorer and the updater queue them: the reads
of its keys (:func:`queue_batch`), their replies parsed into each key's state
(:func:`parse_reads`, :class:`KeyState`) and each transaction's features from its key's
state and its batch mates (:func:`online_row`, :func:`parse_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fraud_scoring.declared.kinds import KINDS, Sums
from fraud_scoring.declared.language import (
    EXACT_WINDOW_AGGS,
    KEY_COLUMNS,
    NEWEST,
    US,
    VALUE_COLUMNS,
)
from fraud_scoring.declared.plan import Declarations, Spec, Window
from fraud_scoring.declared.redis_tiles import (
    NEWEST_REC,
    BatchColumns,
    Event,
    Limits,
    _state_results,
    queue_read,
    queue_record,
    queue_states,
)
from fraud_scoring.events import Transaction


@dataclass
class KeyState:
    """A key's read, parsed: its stored events at or after ``t`` (ts, value; at most
    :data:`NEWEST`), its newest stored event before ``t`` (None: none kept), and per
    window the sums over its tiles, the tile holding ``t`` included. A state that keeps
    values also has its newest events before ``t`` (``before``: ts, value code) and the
    values pushed out of them (``kept``: code -> newest time). A state with min or max
    has per window the smallest and largest value of its events before ``t``
    (``extremes``; inf, -inf: none). ``covered`` is False when the key's ring may have
    dropped a tile a window reads (the key's newest event lies further past ``t`` than
    the ring keeps: a replay far behind its present), or when a window's min or max
    needs events before ``t`` in a tile that also holds later ones and the key no longer
    keeps them (:func:`_extremes_before`)."""

    ahead: list[tuple[int, float]]
    last_before: int | None
    sums: list[tuple[float, float, float]]
    before: list[tuple[int, float]] = field(default_factory=list)
    kept: dict[float, int] = field(default_factory=dict)
    covered: bool = True
    # The largest value among the stored events at ``last_before`` (None: none kept).
    last_value: float | None = None
    extremes: list[tuple[float, float]] = field(default_factory=list)
    # A state with decayed sums: per window, per half-life (µs) the decayed sum of its
    # tiles as of ``t``, the tile holding ``t`` included.
    decayed: list[dict[int, float]] = field(default_factory=list)


def _recent(
    blob: bytes | None, t_us: int
) -> tuple[list[tuple[int, float]], int | None, float | None]:
    """From a key's newest events (packed, in time order): those at or after ``t_us``,
    the time of the newest before it and the largest value at that time."""
    if not blob:
        return [], None, None
    at = len(blob) - NEWEST_REC.size
    ts, best = NEWEST_REC.unpack_from(blob, at)
    if ts < t_us:  # scoring live: nothing stored lies ahead; ties sit at the end
        while at > 0:
            at -= NEWEST_REC.size
            a, b = NEWEST_REC.unpack_from(blob, at)
            if a != ts:
                break
            best = max(best, b)
        return [], int(ts), best
    recs = [(int(a), b) for a, b in NEWEST_REC.iter_unpack(blob)]
    before = [(a, b) for a, b in recs if a < t_us]
    if not before:
        return [r for r in recs if r[0] >= t_us], None, None
    last = before[-1][0]
    return [r for r in recs if r[0] >= t_us], last, max(b for a, b in before if a == last)


def parse_reads(spec: Spec, replies: Sequence[Any], t_us: Sequence[int]) -> list[KeyState]:
    """The states of the keys :func:`queue_read` read for ``spec`` (``replies``: their
    replies in order; ``t_us``: each read's time). The tiles are summed for the whole
    batch at once."""
    n = len(t_us)
    assert len(replies) == n, (len(replies), n)
    t = np.asarray(t_us, dtype=np.int64)
    sums: list[np.ndarray] = []  # per window: (n, 3) count, sum, squares
    lows: list[np.ndarray] = []  # per window (min or max declared): (n,) min, max
    highs: list[np.ndarray] = []
    decs: list[dict[int, np.ndarray]] = []  # per window: half-life -> (n,) decayed sum
    dcol = 4 + 2 * spec.keeps_extremes  # the first decayed sum in a tile's record
    rings: dict[int, np.ndarray] = {}
    covered = np.ones(n, dtype=bool)
    rec = spec.tile.size
    for pos, (u, slots) in enumerate(spec.widths.items()):
        held = [r[pos] or b"" for r in replies]
        size = max([slots * rec, *map(len, held)])
        raw = b"".join(h.ljust(size, b"\0") for h in held)
        rings[u] = np.frombuffer(raw, dtype="<f8").reshape(n, size // rec, rec // 8)
    for w in spec.windows:
        ring = rings[w.width_us]
        last = (t // w.width_us).astype(np.float64)[:, None]
        idx = ring[:, :, 0]
        # whole tiles: the tile holding t is not read
        inside = (idx >= last - w.tiles) & ((idx < last) if spec.whole_tiles else (idx <= last))
        sums.append((ring[:, :, 1:4] * inside[:, :, None]).sum(axis=1))
        if spec.keeps_extremes:
            lows.append(np.where(inside, ring[:, :, 4], np.inf).min(axis=1))
            highs.append(np.where(inside, ring[:, :, 5], -np.inf).max(axis=1))
        if spec.half_lives:  # each tile's sum, decayed from its end to t
            gap = np.where(inside, (idx + 1) * w.width_us - t[:, None], -np.inf)
            decs.append(
                {
                    h: (ring[:, :, dcol + j] * np.exp2(gap / h)).sum(axis=1)
                    for j, h in enumerate(spec.half_lives)
                }
            )
        # The ring keeps the indexes above its top's minus its slots: one this read
        # needs may have been dropped once the top reached that far past it.
        top = np.where(ring[:, :, 1] != 0, idx, -np.inf).max(axis=1)
        covered &= top - spec.widths[w.width_us] < last[:, 0] - w.tiles
    out = []
    at = len(spec.widths)
    for i, r in enumerate(replies):
        ahead, last_ts, last_value = _recent(r[at], t_us[i])
        sums_i = [tuple(x[i].tolist()) for x in sums]
        state = KeyState(
            ahead,
            last_ts,
            sums_i,  # type: ignore[arg-type]
            covered=bool(covered[i]),
            last_value=last_value,
            decayed=[{h: float(x[i]) for h, x in d.items()} for d in decs],
        )
        if spec.keeps_extremes:
            state.extremes = [
                (float(lo[i]), float(hi[i])) for lo, hi in zip(lows, highs, strict=True)
            ]
            if ahead and not spec.whole_tiles:  # later events in t's tiles: not counted
                _exclude_ahead(spec, state, {u: x[i] for u, x in rings.items()}, r[at], t_us[i])
        if spec.keeps_values:
            blob = r[at] or b""
            state.before = [(int(a), b) for a, b in NEWEST_REC.iter_unpack(blob) if a < t_us[i]]
            state.kept = {c: int(ts) for c, ts in NEWEST_REC.iter_unpack(r[at + 1] or b"")}
        out.append(state)
    return out


def _exclude_ahead(
    spec: Spec, state: KeyState, rings: Mapping[int, np.ndarray], blob: bytes | None, t_us: int
) -> None:
    """Recompute the min and max of each window whose tile holding ``t_us`` also holds
    stored events at or after it (``state.ahead``): its earlier tiles, then that tile's
    part before ``t_us`` (:func:`_extremes_before`); ``state.covered`` turns False when
    that part is not exact. ``rings``: the key's tiles per width (records as rows)."""
    recent = [(int(a), b) for a, b in NEWEST_REC.iter_unpack(blob or b"")]
    for w_i, w in enumerate(spec.windows):
        here = t_us // w.width_us
        if not any(ts // w.width_us == here for ts, _ in state.ahead):
            continue
        lo, hi = _tile_extremes(rings[w.width_us], here - w.tiles, here - 1)
        plo, phi, ok = _extremes_before(spec, rings, recent, state.ahead, t_us, w.width_us)
        state.extremes[w_i] = (min(lo, plo), max(hi, phi))
        state.covered &= ok


def _tile_extremes(ring: np.ndarray, first: int, last: int) -> tuple[float, float]:
    """The smallest and largest value in one key's tiles ``first..last`` of one width
    (inf, -inf: none holds events)."""
    idx = ring[:, 0]
    sel = (idx >= first) & (idx <= last) & (ring[:, 1] != 0)
    if not sel.any():
        return math.inf, -math.inf
    return float(ring[sel, 4].min()), float(ring[sel, 5].max())


def _extremes_before(
    spec: Spec,
    rings: Mapping[int, np.ndarray],
    recent: Sequence[tuple[int, float]],
    ahead: Sequence[tuple[int, float]],
    t_us: int,
    u: int,
) -> tuple[float, float, bool]:
    """The smallest and largest value of a key's events from the edge of the tile of
    width ``u`` holding ``t_us`` up to, not including, ``t_us``, and whether that is
    exact. A tile without stored events at or after ``t_us`` (``ahead``) is read whole;
    else from the key's newest events (``recent``) when they reach back to the tile's
    edge; else the tile is split into the state's next finer tiles (read whole, while
    that ring still holds them) and that width's tile holding ``t_us``, and so on. A min
    cannot be subtracted: when none of these holds, the tile is read whole (later events
    included) and the answer is not exact."""
    start = t_us // u * u
    whole = _tile_extremes(rings[u], t_us // u, t_us // u)
    if not any(ts < start + u for ts, _ in ahead):  # nothing at or after t in this tile
        return (*whole, True)
    if len(recent) < NEWEST or recent[0][0] < start:  # every event since the edge kept
        xs = [v for ts, v in recent if start <= ts < t_us]
        return min(xs, default=math.inf), max(xs, default=-math.inf), True
    finer = [v for v in spec.widths if v < u]
    if not finer:
        return (*whole, False)
    v = max(finer)
    ring, first = rings[v], start // v
    held = ring[ring[:, 1] != 0, 0]
    if len(held) and first <= held.max() - spec.widths[v]:  # the ring dropped some
        return (*whole, False)
    lo, hi = _tile_extremes(ring, first, t_us // v - 1)
    plo, phi, ok = _extremes_before(spec, rings, recent, ahead, t_us, v)
    return min(lo, plo), max(hi, phi), ok


def online_row(
    spec: Spec,
    state: KeyState | None,
    t_us: int,
    batch_mates: Sequence[Event] = (),
    own: float | None = None,
) -> tuple[dict[str, float], bool]:
    """One transaction's features of ``spec`` as of ``t_us`` from its key's read
    (:func:`parse_reads`; None: no key, defaults), plus the events of the same
    micro-batch recorded with it that were new to the store (the read ran before they
    were written); ``own`` is the transaction's own value code (a categorical state:
    ``changed``; None: it has none). Returns the
    features and whether they are exact (False only in a replay far behind the key's
    present: :data:`NEWEST` or more stored events lie at or after ``t_us``, or the ring
    no longer holds a tile a window reads)."""
    # Whole tiles end before the tile holding t: what lies ahead is never read.
    ahead = state.ahead if state and not spec.whole_tiles else []
    # Fewer than NEWEST kept events at or after t: every event after t is kept; and
    # the ring still holds every tile the windows read.
    exact = len(ahead) < NEWEST and (state is None or state.covered)
    mates = [(e.ts_us, e.value) for e in batch_mates if e.ts_us < t_us]
    before = [ts for ts, _ in mates]
    if state is not None and state.last_before is not None:
        before.append(state.last_before)
    since = (t_us - max(before)) / US if before else math.inf
    last = 0.0  # the newest event's value before t (ties: the largest)
    if before:
        newest = max(before)
        tied = [v for ts, v in mates if ts == newest]
        if state is not None and state.last_before == newest and state.last_value is not None:
            tied.append(state.last_value)
        last = max(tied)
    out: dict[str, float] = {}
    for w_i, w in enumerate(spec.windows):
        c, s, q = state.sums[w_i] if state else (0.0, 0.0, 0.0)
        mn, mx = state.extremes[w_i] if state and state.extremes else (math.inf, -math.inf)
        dec = (
            dict(state.decayed[w_i])
            if state and state.decayed
            else dict.fromkeys(spec.half_lives, 0.0)
        )
        here = t_us // w.width_us
        for ts, v in ahead:  # included with the tile that holds t: not before t
            if ts // w.width_us == here:
                c, s, q = c - 1, s - v, q - v * v
                for h in dec:
                    dec[h] -= v * float(np.exp2((ts - t_us) / h))
        lo = here - w.tiles
        for ts, v in mates:
            if ts // w.width_us >= lo and not (spec.whole_tiles and ts // w.width_us >= here):
                c, s, q = c + 1, s + v, q + v * v
                mn, mx = min(mn, v), max(mx, v)
                for h in dec:
                    dec[h] += v * float(np.exp2((ts - t_us) / h))
        if not exact:  # a replay: some later events were counted; never below nothing
            c, s, q = max(c, 0.0), max(s, 0.0), max(q, 0.0)
            dec = {h: max(x, 0.0) for h, x in dec.items()}
        out.update(_finish_one(spec, w, c, s, q, since, last, mn, mx, dec))
        if spec.keeps_values:
            out.update(_values_one(spec, w, state, mates, t_us, own))
        for f in spec.defaulted:  # a declared default where the window holds nothing
            if f.window.us == w.us and (
                since > w.us / US if f.agg in EXACT_WINDOW_AGGS else c <= 0
            ):
                out[f.name] = f.default  # type: ignore[assignment]
    return out, exact


def _values_one(
    spec: Spec,
    w: Window,
    state: KeyState | None,
    mates: Sequence[tuple[int, float]],
    t_us: int,
    own: float | None,
) -> dict[str, float]:
    """distinct_count and changed over ``w``: from the key's newest events before
    ``t``, the values pushed out of them (all older: exact whenever the read is) and the
    micro-batch's own earlier events."""
    events = [*(state.before if state else ()), *mates]
    kept = list(state.kept.items()) if state else []
    values: dict[str, float] = {}
    lo = t_us // w.width_us - w.tiles
    codes = {c for ts, c in events if ts // w.width_us >= lo}
    codes |= {c for c, ts in kept if ts < t_us and ts // w.width_us >= lo}
    held = Sums(0.0, 0.0, 0.0, 0.0, 0.0, distinct=np.float64(len(codes)))
    values["distinct_count"] = float(KINDS["distinct_count"].finish(held))
    start = t_us - w.us
    times = [ts for ts, _ in events if ts >= start]
    times += [ts for _, ts in kept if start <= ts < t_us]
    if not times or own is None:
        values["changed"] = 0.0
    else:
        latest = max(times)
        same = any(ts == latest and c == own for ts, c in events) or any(
            ts == latest and c == own for c, ts in kept
        )
        values["changed"] = 0.0 if same else 1.0
    return {f.name: values[f.agg] for f in spec.features if f.window.us == w.us and f.agg in values}


def _finish_one(
    spec: Spec,
    w: Window,
    c: float,
    s: float,
    q: float,
    since: float,
    last: float = 0.0,
    mn: float = math.inf,
    mx: float = -math.inf,
    decayed: Mapping[int, float] | None = None,
) -> dict[str, float]:
    """:func:`finish` for one row: each feature by its kind's finish (:mod:`.kinds`, on
    numpy scalars: the same IEEE operations as over columns); ``mn``, ``mx``: the
    window's smallest and largest value (inf, -inf: no event)."""
    f64 = np.float64
    sums = Sums(f64(c), f64(s), f64(q), f64(since), f64(w.us / US), f64(last), f64(mn), f64(mx))
    out = {}
    for f in spec.features:
        if f.window.us == w.us and KINDS[f.agg].reads != "category":
            at = sums
            if f.half_life_us:
                at = dataclasses.replace(sums, decayed=f64((decayed or {})[f.half_life_us]))
            out[f.name] = float(KINDS[f.agg].finish(at))
    return out


# --- a micro-batch (the scorer's edge) ----------------------------------------------------


@dataclass
class BatchPlan:
    """What one micro-batch queued: per declaration and row the key it read (None: no
    key), and the events it records, by declaration and key."""

    reads: list[tuple[Spec, int, str | None]]
    # Per write call: the states it records with their keys in reply order, whether it
    # is one APPLY_STATES call (else one APPLY call of one state), and the batch's
    # columns (the recorded rows'; their events: BatchColumns.events).
    writes: list[tuple[list[tuple[Spec, list[str]]], bool, BatchColumns]]


def queue_batch(
    pipe: Any,
    decl: Declarations,
    rows: Sequence[Mapping[str, Any]],
    ts_us: Sequence[int],
    record: Sequence[bool],
    horizon_s: float,
    *,
    writes_after: Callable[[], None] | None = None,
    per_key: bool = False,
    read: bool = True,
) -> BatchPlan:
    """Queue a micro-batch's reads, then (after ``writes_after``, which may queue other
    writes) the recording of the rows whose ``record`` is true: one call for every state
    (:func:`queue_states`), or with ``per_key`` (a Redis Cluster) one per key. ``read``
    False: record only, as the updater does. The reads come first, the recording last."""
    plan = BatchPlan([], [])
    for spec in decl.specs if read else ():
        for i, row in enumerate(rows):
            key = spec.key_value(row)
            if key is not None:
                queue_read(pipe, spec, key, ts_us[i])
            plan.reads.append((spec, i, key))
    if writes_after is not None:
        writes_after()
    kept = [i for i, r in enumerate(record) if r]
    if len(kept) < len(rows):
        cols = BatchColumns([rows[i] for i in kept], [ts_us[i] for i in kept])
    else:
        cols = BatchColumns(rows, ts_us)
    plan.writes = queue_recording(pipe, decl.specs, cols, horizon_s, per_key=per_key)
    return plan


Writes = list[tuple[list[tuple[Spec, list[str]]], bool, BatchColumns]]


def queue_recording(
    pipe: Any, specs: Sequence[Spec], cols: BatchColumns, horizon_s: float, *, per_key: bool
) -> Writes:
    """Queue the recording of ``cols``' rows in ``specs``: one :data:`APPLY_STATES_LUA`
    call, or with ``per_key`` (a Redis Cluster) one APPLY call per key. Returns per write
    call the states it records with their keys in reply order, whether it is one
    APPLY_STATES call, and ``cols`` (:attr:`BatchPlan.writes`)."""
    if not per_key:
        states = queue_states(pipe, specs, cols, horizon_s)
        return [(states, True, cols)] if states else []
    writes: Writes = []
    for spec in specs:
        keys = queue_record(pipe, spec, cols, Limits.for_spec(spec, horizon_s), per_key=True)
        writes += [([(spec, [k])], False, cols) for k in keys]
    return writes


def parse_batch(
    plan: BatchPlan,
    reads: Sequence[Any],
    writes: Sequence[Any],
    rows: Sequence[Mapping[str, Any]],
    ts_us: Sequence[int],
) -> tuple[dict[str, list[float]], int]:
    """The declared columns of the micro-batch from its replies (``reads`` and
    ``writes`` in :func:`queue_batch`'s order; a failed write counts as not recorded).
    Attempts of one key in the same micro-batch see each other in event-time order.
    Returns the columns and how many reads were inexact."""
    fresh: dict[tuple[str, str], list[Event]] = {}
    for (recorded, one_call, batch), reply in zip(plan.writes, writes, strict=True):
        if isinstance(reply, Exception):
            continue
        for (spec, keys), part in zip(recorded, reply if one_call else [reply], strict=True):
            results = (
                _state_results(spec, keys, batch, part)
                if one_call
                else dict(zip(keys, part, strict=True))
            )
            for key, per_event in results.items():
                evs = batch.events(spec, key)
                fresh[(spec.id, key)] = [
                    e for e, a in zip(evs, per_event, strict=True) if int(a) == 1
                ]
    cols: dict[str, list[float]] = {}
    inexact = 0
    pos = 0
    for _, group in itertools.groupby(plan.reads, key=lambda r: r[0].id):
        rows_of = list(group)
        spec = rows_of[0][0]
        keyed = [i for _, i, key in rows_of if key is not None]
        n = len(keyed)
        states = iter(parse_reads(spec, reads[pos : pos + n], [ts_us[i] for i in keyed]))
        pos += n
        for _, i, read_key in rows_of:
            state = next(states) if read_key is not None else None
            tid = str(rows[i]["transaction_id"])
            mates = (
                [e for e in fresh.get((spec.id, read_key), []) if e.transaction_id != tid]
                if read_key is not None
                else []
            )
            feats, exact = online_row(spec, state, ts_us[i], mates, spec.own_code(rows[i]))
            inexact += not exact
            for k, v in feats.items():
                cols.setdefault(k, []).append(v)
    return cols, inexact


def transaction_row(txn: Any) -> dict[str, Any]:
    """The fields of a validated transaction (``fraud_scoring.events.Transaction``, or a
    door's model with a team's declared fields: ``fraud_scoring.fields.Door``) a
    declaration reads: :data:`ROW_FIELDS` and the declared fields (PII ones hashed)."""
    names, get = _reader(type(txn))  # type: ignore[arg-type]  # a class is hashable
    return dict(zip(names, get(txn), strict=True))


def transaction_rows(txns: Sequence[Any]) -> list[dict[str, Any]]:
    """:func:`transaction_row` of each of ``txns``, which one door validated (one model):
    the fields to read are found once per micro-batch."""
    if not txns:
        return []
    names, get = _reader(type(txns[0]))  # type: ignore[arg-type]  # a class is hashable
    return [dict(zip(names, get(t), strict=True)) for t in txns]


ROW_FIELDS = ("transaction_id", *KEY_COLUMNS, *VALUE_COLUMNS)


@functools.cache
def _reader(model: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The names a row of ``model`` holds and one C call that reads them: the contract's
    :data:`ROW_FIELDS`, then the model's own fields beyond the contract's (declared)."""
    fields = getattr(model, "model_fields", {})
    names = (*ROW_FIELDS, *(n for n in fields if n not in Transaction.model_fields))
    return names, operator.attrgetter(*names)
