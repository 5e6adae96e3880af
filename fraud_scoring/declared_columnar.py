"""A micro-batch's declared features as columns: the serving read of every declared
state for every transaction of the batch in a fixed number of array operations.

:func:`queue_batch` queues, per state and transaction with a key, one ``HMGET`` of the
key's tiles and newest events (the layout of ``fraud_scoring.declared``), then the
recording of the recorded transactions (the same script calls as the row-by-row path).
:func:`parse_batch` turns the replies into the declared columns:

* every state's tile rings of one record size are joined into one array, and every
  (state, window, transaction) is one row of a window table: its tiles are summed with
  ``bincount`` (count, sum, squares; min and max with ``reduceat``), its newest events
  give the time since the last one and the exact end (events at or after ``t`` in the
  tile holding ``t`` are taken out again), a categorical state's distinct values and
  ``changed`` flag come from its newest events and kept values, all as (rows x 32)
  arrays. No per-row Python objects: the cost is O(states) array operations plus a
  linear pass over the bytes read.
* rows that need an exactness correction go through the row-by-row definition
  (:func:`fraud_scoring.declared.online_row`) alone: attempts of one key recorded in the
  same micro-batch (a burst: they see each other in event-time order), and a min or max
  whose tile holding ``t`` also holds later events (a replay). Their cost is
  proportional to those rows.

The result equals :func:`fraud_scoring.declared.parse_batch` (the reference) row for row
(tests/test_declared_columnar.py); which reads were inexact is counted the same way.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fraud_scoring import declared as D

US = D.US
NEWEST = D.NEWEST
_GROUPS = (D.TILE, D.TILE_EXTREMES)  # tile records of 4 or 6 doubles


@dataclass(frozen=True)
class _Feature:
    name: str
    spec: int
    window: int
    agg: str
    default: float | None
    fallback: float  # without a key


@dataclass(frozen=True, eq=False)  # hashed by identity: one per set of states
class _Compiled:
    """What the window table needs of a set of states, derived once per declarations."""

    specs: tuple[D.Spec, ...]
    fields: tuple[tuple[bytes, ...], ...]  # per state: its HMGET fields
    heads: tuple[str, ...]  # per state: its key names' start ("{agg:<id>:")
    features: tuple[_Feature, ...]
    by_window: dict[tuple[int, int], tuple[_Feature, ...]]  # (state, window) -> its features


@functools.lru_cache(maxsize=8)
def _compile(specs: tuple[D.Spec, ...]) -> _Compiled:
    fields, heads, feats = [], [], []
    for s, spec in enumerate(specs):
        extra = (b"n", b"d") if spec.keeps_values else (b"n",)
        fields.append((*(str(u).encode() for u in spec.widths), *extra))
        heads.append("{agg:" + spec.id + ":")
        windows = {w.us: j for j, w in enumerate(spec.windows)}
        feats += [
            _Feature(f.name, s, windows[f.window.us], f.agg, f.default, f.fallback)
            for f in spec.features
        ]
    by_window: dict[tuple[int, int], list[_Feature]] = {}
    for f in feats:
        by_window.setdefault((f.spec, f.window), []).append(f)
    return _Compiled(
        specs,
        tuple(fields),
        tuple(heads),
        tuple(feats),
        {k: tuple(v) for k, v in by_window.items()},
    )


class _Specs(tuple[D.Spec, ...]):
    """A tuple of states, hashed by identity (a Spec holds a dict: not hashable)."""

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


_SPECS: dict[int, tuple[tuple[D.Spec, ...], _Specs]] = {}


def _compiled(specs: tuple[D.Spec, ...]) -> _Compiled:
    held = _SPECS.get(id(specs))
    if held is None or held[0] is not specs:
        if len(_SPECS) > 16:
            _SPECS.clear()
        held = _SPECS[id(specs)] = (specs, _Specs(specs))
    return _compile(held[1])


@dataclass
class Plan:
    """What :func:`queue_batch` queued: per state the rows it read (those with a key) and
    their keys, and the recording (as :class:`fraud_scoring.declared.BatchPlan`)."""

    compiled: _Compiled
    rows: list[np.ndarray]  # per state: the rows read (indexes into the batch)
    keys: list[list[str]]  # per state: their keys
    cols: D.BatchColumns  # the whole batch
    writes: list[tuple[list[tuple[D.Spec, list[str]]], bool, D.BatchColumns]]
    recorded: list[bool]


def queue_batch(
    pipe: Any,
    decl: D.Declarations,
    cols: D.BatchColumns,
    record: Sequence[bool],
    horizon_s: float,
    *,
    writes_after: Callable[[], None] | None = None,
    per_key: bool = False,
) -> Plan:
    """Queue a micro-batch's reads (one HMGET per state and row with a key), then (after
    ``writes_after``, which may queue other writes) the recording of the rows whose
    ``record`` is true, as :func:`fraud_scoring.declared.queue_batch` does."""
    comp = _compiled(decl.specs)
    keyed: dict[tuple[str, ...], tuple[np.ndarray, list[str]]] = {}
    plan = Plan(comp, [], [], cols, [], list(record))
    for spec, fields, head in zip(comp.specs, comp.fields, comp.heads, strict=True):
        got = keyed.get(spec.entity)
        if got is None:
            all_keys = cols.keys(spec.entity)
            idx = [i for i, k in enumerate(all_keys) if k is not None]
            present: list[str] = [k for k in all_keys if k is not None]
            got = keyed[spec.entity] = (np.asarray(idx, dtype=np.intp), present)
        rows, keys = got
        for key in keys:
            pipe.execute_command("HMGET", head + key + "}:t", *fields)
        plan.rows.append(rows)
        plan.keys.append(keys)
    if writes_after is not None:
        writes_after()
    kept = [i for i, r in enumerate(record) if r]
    rec = cols
    if len(kept) < len(record):
        rec = D.BatchColumns([cols.rows[i] for i in kept], [cols.ts_us[i] for i in kept])
    if not per_key:
        states = D.queue_states(pipe, decl.specs, rec, horizon_s)
        if states:
            plan.writes.append((states, True, rec))
        return plan
    for spec in decl.specs:
        keys = D.queue_record(pipe, spec, rec, D.Limits.for_spec(spec, horizon_s), per_key=True)
        plan.writes += [([(spec, [k])], False, rec) for k in keys]
    return plan


# --- the window table ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Table:
    """Per record size: the rings (state, width, row) and the window rows (state,
    window, row) of a batch whose states read ``ns`` rows each: static index arrays."""

    ring_pair: np.ndarray  # per ring: its (state, row) pair
    ring_at: list[tuple[int, int, int, int]]  # per (state, field): pair start, n, field, ring start
    win_ring: np.ndarray
    win_pair: np.ndarray
    win_width: np.ndarray  # float64: tile width (µs)
    win_tiles: np.ndarray  # float64
    win_whole: np.ndarray  # float64 1.0: whole tiles (the tile holding t not read)
    win_us: np.ndarray  # float64: the window (µs)
    win_slots: np.ndarray  # float64: its ring's slots
    block: dict[tuple[int, int], int]  # (state, window) -> first window row


@dataclass(frozen=True)
class _Index:
    pair_start: tuple[int, ...]  # per state: its first pair
    pair_whole: np.ndarray  # per pair: bool, the state reads whole tiles
    tables: tuple[_Table | None, _Table | None]
    values: tuple[int, ...]  # the states that keep values
    # Their window rows (state, window, row): pair, row of the kept values, window.
    val_pair: np.ndarray
    val_kept: np.ndarray
    val_width: np.ndarray
    val_tiles: np.ndarray
    val_us: np.ndarray
    val_block: dict[tuple[int, int], int]


@functools.lru_cache(maxsize=512)
def _index(comp: _Compiled, ns: tuple[int, ...]) -> _Index:
    starts, at = [], 0
    for n in ns:
        starts.append(at)
        at += n
    whole = np.zeros(at, dtype=bool)
    for s, spec in enumerate(comp.specs):
        whole[starts[s] : starts[s] + ns[s]] = spec.whole_tiles
    tables: list[_Table | None] = []
    for g in (0, 1):
        ring_pair: list[np.ndarray] = []
        ring_at: list[tuple[int, int, int, int]] = []
        cols: dict[str, list[np.ndarray]] = {
            k: [] for k in ("ring", "pair", "width", "tiles", "whole", "us", "slots")
        }
        block: dict[tuple[int, int], int] = {}
        rings = wins = 0
        for s, spec in enumerate(comp.specs):
            if int(spec.keeps_extremes) != g:
                continue
            n, p0 = ns[s], starts[s]
            first: dict[int, int] = {}
            for j, (u, _) in enumerate(spec.widths.items()):
                first[u] = rings
                ring_at.append((p0, n, j, rings))
                ring_pair.append(np.arange(p0, p0 + n))
                rings += n
            for k, w in enumerate(spec.windows):
                block[(s, k)] = wins
                wins += n
                cols["ring"].append(np.arange(first[w.width_us], first[w.width_us] + n))
                cols["pair"].append(np.arange(p0, p0 + n))
                for name, v in (
                    ("width", w.width_us),
                    ("tiles", w.tiles),
                    ("whole", float(spec.whole_tiles)),
                    ("us", w.us),
                    ("slots", spec.widths[w.width_us]),
                ):
                    cols[name].append(np.full(n, v, dtype=np.float64))
        if not ring_at:
            tables.append(None)
            continue

        def cat(xs: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype=dtype)

        tables.append(
            _Table(
                cat(ring_pair, np.intp),
                ring_at,
                cat(cols["ring"], np.intp),
                cat(cols["pair"], np.intp),
                cat(cols["width"], np.float64),
                cat(cols["tiles"], np.float64),
                cat(cols["whole"], np.float64),
                cat(cols["us"], np.float64),
                cat(cols["slots"], np.float64),
                block,
            )
        )
    values = tuple(s for s, spec in enumerate(comp.specs) if spec.keeps_values)
    vcols: dict[str, list[Any]] = {k: [] for k in ("pair", "kept", "width", "tiles", "us")}
    vblock: dict[tuple[int, int], int] = {}
    rows = kept_at = 0
    for s in values:
        n, p0 = ns[s], starts[s]
        for j, w in enumerate(comp.specs[s].windows):
            vblock[(s, j)] = rows
            rows += n
            vcols["pair"] += range(p0, p0 + n)
            vcols["kept"] += range(kept_at, kept_at + n)
            vcols["width"] += [w.width_us] * n
            vcols["tiles"] += [w.tiles] * n
            vcols["us"] += [w.us] * n
        kept_at += n
    return _Index(
        tuple(starts),
        whole,
        (tables[0], tables[1]),
        values,
        np.asarray(vcols["pair"], dtype=np.intp),
        np.asarray(vcols["kept"], dtype=np.intp),
        np.asarray(vcols["width"], dtype=np.float64),
        np.asarray(vcols["tiles"], dtype=np.float64),
        np.asarray(vcols["us"], dtype=np.float64),
        vblock,
    )


def _packed(blobs: list[bytes], doubles: int) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``doubles`` float64 each from ``blobs`` (one per ring, possibly
    empty): all records as one (records, doubles) array and each blob's record count."""
    lens = np.fromiter(map(len, blobs), dtype=np.intp, count=len(blobs))
    flat = np.frombuffer(b"".join(blobs), dtype="<f8").reshape(-1, doubles)
    return flat, lens // (8 * doubles)


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts), dtype=np.intp)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _expand(counts: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments ``starts[i] .. starts[i] + counts[i]`` of a record array: each
    record's segment and its position in the record array."""
    total = int(counts.sum())
    seg = np.repeat(np.arange(len(counts)), counts)
    pos = np.repeat(starts - _starts(counts), counts) + np.arange(total)
    return seg, pos


def _newest(blobs: list[bytes], pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """The newest events of each pair as (pairs, NEWEST) arrays of times (µs; -inf:
    none) and values, left-aligned in time order."""
    flat, counts = _packed(blobs, 2)
    counts = np.minimum(counts, NEWEST)
    ts = np.full((pairs, NEWEST), -np.inf)
    vs = np.zeros((pairs, NEWEST))
    if len(flat):
        lens = np.fromiter(map(len, blobs), dtype=np.intp, count=len(blobs)) // 16
        seg, pos = _expand(counts, _starts(lens))
        dest = seg * NEWEST + (pos - np.repeat(_starts(lens), counts))
        ts.ravel()[dest] = flat[pos, 0]
        vs.ravel()[dest] = flat[pos, 1]
    return ts, vs


def _kept(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The values pushed out of each pair's newest events (field "d": code, newest
    time) as (pairs, most held) arrays of codes and times (-inf: none)."""
    flat, counts = _packed(blobs, 2)
    width = max(int(counts.max(initial=0)), 1)
    codes = np.full((len(blobs), width), np.nan)
    ts = np.full((len(blobs), width), -np.inf)
    if len(flat):
        seg, pos = _expand(counts, _starts(counts))
        dest = seg * width + (pos - np.repeat(_starts(counts), counts))
        codes.ravel()[dest] = flat[pos, 0]
        ts.ravel()[dest] = flat[pos, 1]
    return codes, ts


@dataclass
class _Windows:
    """One record size's window rows, summed."""

    c: np.ndarray
    s: np.ndarray
    q: np.ndarray
    covered: np.ndarray
    lo: np.ndarray  # min (inf: none)
    hi: np.ndarray  # max (-inf: none)


def _sum_windows(tab: _Table, blobs: list[bytes], doubles: int, t: np.ndarray) -> _Windows:
    flat, counts = _packed(blobs, doubles)
    rstart = _starts(counts)
    m = len(tab.win_ring)
    cnt = counts[tab.win_ring]
    seg, pos = _expand(cnt, rstart[tab.win_ring])
    last = np.floor_divide(t[tab.win_pair], tab.win_width)  # the tile holding t
    first = last - tab.win_tiles
    end = last - tab.win_whole
    idx = flat[pos, 0]
    inside = (idx >= first[seg]) & (idx <= end[seg])
    c = np.bincount(seg, weights=flat[pos, 1] * inside, minlength=m)
    s = np.bincount(seg, weights=flat[pos, 2] * inside, minlength=m)
    q = np.bincount(seg, weights=flat[pos, 3] * inside, minlength=m)
    # The ring keeps the indexes above its top's minus its slots: one this read needs
    # may have been dropped once the top reached that far past it.
    top = np.full(len(counts), -np.inf)
    some = counts > 0
    if some.any():
        top[some] = np.maximum.reduceat(
            np.where(flat[:, 1] != 0, flat[:, 0], -np.inf), rstart[some]
        )
    covered = top[tab.win_ring] - tab.win_slots < first
    lo = np.full(m, np.inf)
    hi = np.full(m, -np.inf)
    if doubles == 6 and len(pos):
        some = cnt > 0
        at = _starts(cnt)[some]
        lo[some] = np.minimum.reduceat(np.where(inside, flat[pos, 4], np.inf), at)
        hi[some] = np.maximum.reduceat(np.where(inside, flat[pos, 5], -np.inf), at)
    return _Windows(c, s, q, covered, lo, hi)


def parse_batch(
    plan: Plan, reads: Sequence[Any], writes: Sequence[Any], ts_us: Sequence[int]
) -> tuple[dict[str, np.ndarray], int]:
    """The declared columns of the micro-batch (float64, one per declared feature) from
    its replies (``reads`` and ``writes`` in :func:`queue_batch`'s order; a failed write
    counts as not recorded), and how many reads were inexact. Equal to
    :func:`fraud_scoring.declared.parse_batch` row for row."""
    with np.errstate(invalid="ignore"):  # floor_divide of -inf (no event) is NaN
        return _parse(plan, reads, writes, ts_us)


def _parse(
    plan: Plan, reads: Sequence[Any], writes: Sequence[Any], ts_us: Sequence[int]
) -> tuple[dict[str, np.ndarray], int]:
    comp = plan.compiled
    n = len(ts_us)
    ns = tuple(len(r) for r in plan.rows)
    ix = _index(comp, ns)
    t_all = np.asarray(ts_us, dtype=np.int64)
    pair_row = np.concatenate(plan.rows) if plan.rows else np.zeros(0, np.intp)
    t = t_all[pair_row].astype(np.float64)
    pairs = len(pair_row)
    # The replies, per state: its rings (per width), its newest events, its kept values.
    ring_blobs: tuple[list[bytes], list[bytes]] = ([], [])
    newest: list[bytes] = []
    kept: dict[int, list[bytes]] = {}
    pos = 0
    for s, spec in enumerate(comp.specs):
        chunk = reads[pos : pos + ns[s]]
        pos += ns[s]
        nw = len(spec.widths)
        out = ring_blobs[int(spec.keeps_extremes)]
        for j in range(nw):
            out += [r[j] or b"" for r in chunk]
        newest += [r[nw] or b"" for r in chunk]
        if spec.keeps_values:
            kept[s] = [r[nw + 1] or b"" for r in chunk]
    ts_s, vs_s = _newest(newest, pairs)  # stored
    # Whole tiles end before the tile holding t: what lies ahead is never read.
    ahead = (ts_s >= t[:, None]) & ~ix.pair_whole[:, None]
    n_ahead = ahead.sum(axis=1)
    exact = n_ahead < NEWEST
    # The events this micro-batch recorded in the key before t (a burst): with the
    # stored ones for the newest event and the values, added to the windows below.
    mates = _mates(plan, writes, ix, t)
    ts_n, vs_n = ts_s, vs_s
    if mates is not None:
        m_ts, m_vs = _by_pair(mates[0], mates[1], mates[2], pairs)
        ts_n, vs_n = np.concatenate([ts_s, m_ts], axis=1), np.concatenate([vs_s, m_vs], axis=1)
    before = ts_n < t[:, None]
    last_ts = np.where(before, ts_n, -np.inf).max(axis=1, initial=-np.inf)
    tied = before & (ts_n == last_ts[:, None])
    last_v = np.where(tied, vs_n, -np.inf).max(axis=1, initial=-np.inf)
    last_v = np.where(last_ts > -np.inf, last_v, 0.0)
    since = np.where(last_ts > -np.inf, (t - last_ts) / US, np.inf)
    cols: dict[str, np.ndarray] = {}
    fix: set[tuple[int, int]] = set()  # (state, pair): by the row-by-row definition
    counts: dict[tuple[int, int], np.ndarray] = {}  # (state, window): a values state's counts
    for g, tab in enumerate(ix.tables):
        if tab is None:
            continue
        win = _sum_windows(tab, ring_blobs[g], 6 if g else 4, t)
        wp = tab.win_pair
        exact &= np.bincount(wp, weights=(~win.covered).astype(np.float64), minlength=pairs) == 0
        c, s_, q = win.c, win.s, win.q
        if n_ahead.any():  # a replay: later events in t's tile are not before t
            hit = ahead[wp] & (
                np.floor_divide(ts_s[wp], tab.win_width[:, None])
                == np.floor_divide(t[wp], tab.win_width)[:, None]
            )
            v = vs_s[wp]
            c = c - hit.sum(axis=1)
            s_ = s_ - (v * hit).sum(axis=1)
            q = q - (v * v * hit).sum(axis=1)
            if g:  # a min or max cannot be taken out: those rows row by row
                held = np.bincount(wp, weights=hit.any(axis=1).astype(np.float64), minlength=pairs)
                for pp in np.flatnonzero(held).tolist():
                    fix.add((_state_of(ix.pair_start, pp), pp))
        if mates is not None:
            c, s_, q = _add_mates(tab, mates, t, win, c, s_, q)
        if not exact.all():  # a replay: some later events were counted; never below nothing
            loose = ~exact[wp]
            c = np.where(loose, np.maximum(c, 0.0), c)
            s_ = np.where(loose, np.maximum(s_, 0.0), s_)
            q = np.where(loose, np.maximum(q, 0.0), q)
        agg = _finish(c, s_, q, since[wp], last_v[wp], win.lo, win.hi, tab.win_us)
        sw = since[wp]
        for (s, j), at in tab.block.items():
            for f in comp.by_window.get((s, j), ()):
                if f.agg in agg:
                    cols[f.name] = _column(agg, f, at, plan.rows[s], n, c, sw, tab.win_us)
            if s in ix.values:
                counts[(s, j)] = c[at : at + ns[s]]
    if ix.values:
        _values(comp, ix, plan, kept, (ts_n, vs_n, t, since), counts, cols)
    for st, p in sorted(fix):
        exact[p] = _by_row(plan, writes, reads, ts_us, st, p, ix, cols)
    return cols, int(pairs - exact.sum())


def _finish(
    c: np.ndarray,
    s: np.ndarray,
    q: np.ndarray,
    since: np.ndarray,
    last: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    us: np.ndarray,
) -> dict[str, np.ndarray]:
    """:func:`fraud_scoring.declared._finish_one` over window rows (the same IEEE
    operations)."""
    some = c > 0
    safe = np.where(some, c, 1.0)
    mean = np.where(some, s / safe, 0.0)
    var = np.where(some, np.maximum(q / safe - mean * mean, 0.0), 0.0)
    w = us / US
    return {
        "count": c,
        "sum": s,
        "mean": mean,
        "std": np.sqrt(var),
        "seconds_since_last": np.minimum(since, w),
        "last": np.where(since <= w, last, 0.0),
        "min": np.where(lo != np.inf, lo, 0.0),
        "max": np.where(hi != -np.inf, hi, 0.0),
    }


def _column(
    agg: Mapping[str, np.ndarray],
    f: _Feature,
    at: int,
    rows: np.ndarray,
    n: int,
    c: np.ndarray,
    since: np.ndarray,
    us: np.ndarray,
) -> np.ndarray:
    """One feature's column over the batch: its window rows, a declared default where
    the window holds nothing, the fallback for rows without a key."""
    k = len(rows)
    v = agg[f.agg][at : at + k]
    if f.default is not None:
        none = (
            since[at : at + k] > us[at : at + k] / US
            if f.agg in D.EXACT_WINDOW_AGGS
            else c[at : at + k] <= 0
        )
        v = np.where(none, f.default, v)
    if k == n:
        return v
    out = np.full(n, f.fallback)
    out[rows] = v
    return out


def _values(
    comp: _Compiled,
    ix: _Index,
    plan: Plan,
    kept: Mapping[int, list[bytes]],
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    counts: Mapping[tuple[int, int], np.ndarray],
    cols: dict[str, np.ndarray],
) -> None:
    """distinct_count and changed of the states that keep values, over their window
    rows at once: from the key's newest events before t (``pairs``: the newest events'
    times and values, each pair's t and time since its last event) and the values
    pushed out of them (``kept``)."""
    ts_n, vs_n, t, since_p = pairs
    n = len(plan.cols.ts_us)
    codes_k, ts_k = _kept([b for s in ix.values for b in kept[s]])
    own = np.concatenate([_own(comp.specs[s], plan.cols, plan.rows[s]) for s in ix.values])
    vp, vk = ix.val_pair, ix.val_kept
    tn, vn, tv = ts_n[vp], vs_n[vp], t[vp][:, None]
    tk, ck, mine = ts_k[vk], codes_k[vk], own[vk][:, None]
    width = ix.val_width[:, None]
    first = np.floor_divide(tv, width) - ix.val_tiles[:, None]
    before, before_k = tn < tv, tk < tv
    sel_n = before & (np.floor_divide(tn, width) >= first)
    sel_k = before_k & (np.floor_divide(tk, width) >= first)
    both = np.concatenate([np.where(sel_n, vn, np.nan), np.where(sel_k, ck, np.nan)], axis=1)
    both.sort(axis=1)
    new = ~np.isnan(both)
    new[:, 1:] &= both[:, 1:] != both[:, :-1]
    start = tv - ix.val_us[:, None]
    latest = np.maximum(
        np.where(before & (tn >= start), tn, -np.inf).max(axis=1, initial=-np.inf),
        np.where(before_k & (tk >= start), tk, -np.inf).max(axis=1, initial=-np.inf),
    )[:, None]
    same = ((tn == latest) & (vn == mine)).any(axis=1) | ((tk == latest) & (ck == mine)).any(axis=1)
    values = {
        "distinct_count": np.minimum(new.sum(axis=1), D.DISTINCT_CAP).astype(np.float64),
        "changed": np.where((latest[:, 0] > -np.inf) & ~np.isnan(mine[:, 0]) & ~same, 1.0, 0.0),
    }
    since = since_p[vp]
    for (s, j), at in ix.val_block.items():
        k = len(plan.rows[s])
        w = comp.specs[s].windows[j]
        for f in comp.by_window.get((s, j), ()):
            if f.agg not in values:
                continue
            v = values[f.agg][at : at + k]
            if f.default is not None:  # a declared default where the window is empty
                exact_window = f.agg in D.EXACT_WINDOW_AGGS
                none = since[at : at + k] > w.us / US if exact_window else counts[(s, j)] <= 0
                v = np.where(none, f.default, v)
            if k == n:
                cols[f.name] = v
            else:
                cols[f.name] = np.full(n, f.fallback)
                cols[f.name][plan.rows[s]] = v


def _own(spec: D.Spec, cols: D.BatchColumns, rows: np.ndarray) -> np.ndarray:
    """Each read row's own value code (NaN: none, or not a categorical state)."""
    if not spec.categorical:
        return np.full(len(rows), np.nan)
    values = cols.values(spec)
    raw = cols.column(spec.value_column)  # type: ignore[arg-type]
    return np.array(
        [np.nan if _empty(raw[i]) else values[i] for i in rows.tolist()], dtype=np.float64
    )


def _empty(v: Any) -> bool:
    return v is None or v != v or v == ""


def _state_of(starts: Sequence[int], p: int) -> int:
    s = 0
    while s + 1 < len(starts) and starts[s + 1] <= p:
        s += 1
    return s


def _results(plan: Plan, writes: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per state (by id), which of its recorded events were new to the store (in the
    order of :meth:`BatchColumns.groups`: keys, then rows); a failed write: none."""
    out: dict[str, np.ndarray] = {}
    per_key: dict[str, dict[str, list[int]]] = {}
    for (states, one_call, _), reply in zip(plan.writes, writes, strict=True):
        if isinstance(reply, Exception):
            continue
        if one_call:
            for (spec, _keys), part in zip(states, reply, strict=True):
                raw = part if isinstance(part, bytes) else str(part).encode()
                out[spec.id] = np.frombuffer(raw, dtype=np.uint8) == ord("1")
        else:
            ((spec, (key,)),) = states  # a Redis Cluster: one APPLY call per key
            per_key.setdefault(spec.id, {})[key] = [int(x) for x in reply[0]]
    if per_key:
        rec = plan.writes[0][2]
        for spec in plan.compiled.specs:
            got = per_key.get(spec.id)
            if got is not None:
                groups = rec.groups(spec)
                flat = [a for k, g in groups.items() for a in got.get(k, [0] * len(g))]
                out[spec.id] = np.asarray(flat, dtype=np.int64) == 1
    return out


def _mates(
    plan: Plan, writes: Sequence[Any], ix: _Index, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The events this micro-batch recorded, new to the store, in each read's key before
    its time and not its own transaction: (pair, time, value) arrays; None: there are
    none (no key read by a row is recorded by another row: the common case)."""
    if not plan.writes:
        return None
    rec = plan.writes[0][2]  # every write call records the same rows
    results: dict[str, np.ndarray] | None = None
    tid: tuple[np.ndarray, np.ndarray] | None = None
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s, spec in enumerate(plan.compiled.specs):
        if spec.source != "transactions":
            continue
        groups = rec.groups(spec)
        sizes = list(map(len, groups.values()))
        if not groups or (rec is plan.cols and len(groups) == sum(sizes)):
            continue  # every recorded row its own key, read by itself only
        if results is None:
            results = _results(plan, writes)
            code = {x: j for j, x in enumerate(plan.cols.ids)}
            tid = (
                np.fromiter(map(code.__getitem__, plan.cols.ids), np.intp, len(plan.cols.ids)),
                np.fromiter(map(code.__getitem__, rec.ids), np.intp, len(rec.ids)),
            )
        fresh = results.get(spec.id)
        if fresh is None or not fresh.any():
            continue
        assert tid is not None
        rows = np.fromiter(itertools.chain.from_iterable(groups.values()), np.intp, sum(sizes))
        key = np.repeat(np.arange(len(groups)), sizes)[fresh]
        rows = rows[fresh]
        ev_tid = tid[1][rows]
        ev_ts = np.asarray(rec.ts_us, dtype=np.float64)[rows] + spec.delay_us
        ev_v = np.asarray(rec.values(spec), dtype=np.float64)[rows]
        kid = dict(zip(groups, range(len(groups)), strict=True))
        pk = np.fromiter((kid.get(k, -1) for k in plan.keys[s]), np.intp, len(plan.keys[s]))
        lo = np.searchsorted(key, pk, "left")
        hi = np.where(pk >= 0, np.searchsorted(key, pk, "right"), lo)
        seg, at = _expand(hi - lo, lo)
        pair = ix.pair_start[s] + seg
        ok = (ev_tid[at] != tid[0][plan.rows[s][seg]]) & (ev_ts[at] < t[pair])
        parts.append((pair[ok], ev_ts[at][ok], ev_v[at][ok]))
    if not parts or not sum(len(p[0]) for p in parts):
        return None
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )


def _by_pair(
    pair: np.ndarray, ts: np.ndarray, vs: np.ndarray, pairs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Events (pair, time, value) as (pairs, most per pair) arrays (-inf: none)."""
    order = np.argsort(pair, kind="stable")
    pair, ts, vs = pair[order], ts[order], vs[order]
    counts = np.bincount(pair, minlength=pairs)
    width = int(counts.max())
    out_ts = np.full((pairs, width), -np.inf)
    out_vs = np.zeros((pairs, width))
    dest = pair * width + (np.arange(len(pair)) - np.repeat(_starts(counts), counts))
    out_ts.ravel()[dest] = ts
    out_vs.ravel()[dest] = vs
    return out_ts, out_vs


def _add_mates(
    tab: _Table,
    mates: tuple[np.ndarray, np.ndarray, np.ndarray],
    t: np.ndarray,
    win: _Windows,
    c: np.ndarray,
    s: np.ndarray,
    q: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window sums (and min, max in ``win``) with the micro-batch's own earlier
    events of each key added where a window holds them."""
    pair, ts, vs = mates
    order = np.argsort(tab.win_pair, kind="stable")  # each pair's window rows
    counts = np.bincount(tab.win_pair, minlength=len(t))
    mate, at = _expand(counts[pair], _starts(counts)[pair])
    wr = order[at]
    width = tab.win_width[wr]
    tile = np.floor_divide(ts[mate], width)
    here = np.floor_divide(t[tab.win_pair[wr]], width)
    inc = (tile >= here - tab.win_tiles[wr]) & ~((tab.win_whole[wr] == 1.0) & (tile >= here))
    wr, v = wr[inc], vs[mate][inc]
    m = len(c)
    c = c + np.bincount(wr, minlength=m)
    s = s + np.bincount(wr, weights=v, minlength=m)
    q = q + np.bincount(wr, weights=v * v, minlength=m)
    np.minimum.at(win.lo, wr, v)
    np.maximum.at(win.hi, wr, v)
    return c, s, q


def _fresh(plan: Plan, writes: Sequence[Any], spec: D.Spec, key: str) -> list[D.Event]:
    """The events of ``key`` this micro-batch recorded in ``spec`` that were new to the
    store (as :func:`fraud_scoring.declared.parse_batch` finds them)."""
    for (recorded, one_call, batch), reply in zip(plan.writes, writes, strict=True):
        if isinstance(reply, Exception):
            continue
        for (sp, keys), part in zip(recorded, reply if one_call else [reply], strict=True):
            if sp is not spec or key not in keys:
                continue
            if one_call:  # one character per event of the state's keys, in order
                groups, at = batch.groups(sp), 0
                for k in keys:
                    if k == key:
                        break
                    at += len(groups[k])
                results = [{ord("1"): 1}.get(x, 0) for x in part[at : at + len(groups[key])]]
            else:
                results = dict(zip(keys, part, strict=True))[key]
            evs = batch.events(sp, key)
            return [e for e, a in zip(evs, results, strict=True) if int(a) == 1]
    return []


def _by_row(
    plan: Plan,
    writes: Sequence[Any],
    reads: Sequence[Any],
    ts_us: Sequence[int],
    s: int,
    p: int,
    ix: _Index,
    cols: dict[str, np.ndarray],
) -> bool:
    """One (state, row) by the row-by-row definition, written into ``cols``; returns
    whether it is exact."""
    spec = plan.compiled.specs[s]
    local = p - ix.pair_start[s]
    i = int(plan.rows[s][local])
    key = plan.keys[s][local]
    t = ts_us[i]
    state = D.parse_reads(spec, [reads[p]], [t])[0]
    row = plan.cols.rows[i]
    tid = str(row["transaction_id"])
    mates = [e for e in _fresh(plan, writes, spec, key) if e.transaction_id != tid]
    feats, exact = D.online_row(spec, state, t, mates, spec.own_code(row))
    for name, v in feats.items():
        cols[name][i] = v
    return exact
