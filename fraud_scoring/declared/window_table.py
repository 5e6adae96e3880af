"""The window table of a micro-batch: every (state, window, row) read as one row of a
few arrays, and the array kernels over it (tiles summed with ``bincount``, newest events
and kept values as (rows x 32) arrays, the finish of every aggregation). What the table
holds for a set of states and per-state row counts is derived once and cached; the
serving path that fills it is :mod:`fraud_scoring.declared.columnar`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fraud_scoring.declared import kernels as K
from fraud_scoring.declared import kinds
from fraud_scoring.declared.kinds import Sums
from fraud_scoring.declared.language import NEWEST, US
from fraud_scoring.declared.plan import Spec, tile_doubles
from fraud_scoring.redis_clients import hmget_packed, hmget_parts


@dataclass(frozen=True)
class Feature:
    name: str
    spec: int
    window: int
    agg: str
    default: float | None
    fallback: float  # without a key
    key: str  # its column among its window rows' finished ones (finish)


@dataclass(frozen=True, eq=False)  # hashed by identity: one per set of states
class Compiled:
    """What the window table needs of a set of states, derived once per declarations."""

    specs: tuple[Spec, ...]
    fields: tuple[tuple[bytes, ...], ...]  # per state: its HMGET fields
    heads: tuple[str, ...]  # per state: its key names' start ("{agg:<id>:")
    # per state: its HMGET in the protocol, around the key: (head, fields), for
    # callers that send commands packed (:func:`hmget`)
    packed: tuple[tuple[bytes, bytes], ...]
    features: tuple[Feature, ...]
    by_window: dict[tuple[int, int], tuple[Feature, ...]]  # (state, window) -> its features


@functools.lru_cache(maxsize=8)
def _compile(specs: tuple[Spec, ...]) -> Compiled:
    fields, heads, feats = [], [], []
    for s, spec in enumerate(specs):
        extra = (b"n", b"d") if spec.keeps_values else (b"n",)
        fields.append((*(str(u).encode() for u in spec.widths), *extra))
        heads.append("{agg:" + spec.id + ":")
        windows = {w.us: j for j, w in enumerate(spec.windows)}
        feats += [
            Feature(
                f.name,
                s,
                windows[f.window.us],
                f.agg,
                f.default,
                f.fallback,
                f"{f.agg}/{f.half_life_us}" if f.half_life_us else f.agg,
            )
            for f in spec.features
        ]
    by_window: dict[tuple[int, int], list[Feature]] = {}
    for f in feats:
        by_window.setdefault((f.spec, f.window), []).append(f)
    packed = tuple(hmget_parts(fs) for fs in fields)
    return Compiled(
        specs,
        tuple(fields),
        tuple(heads),
        packed,
        tuple(feats),
        {k: tuple(v) for k, v in by_window.items()},
    )


def hmget(packed: tuple[bytes, bytes], key: str) -> bytes:
    """A state's HMGET of ``key`` (its hash's name) in the protocol, as hiredis packs
    it (the name UTF-8)."""
    return hmget_packed(packed, key.encode())


class _Specs(tuple[Spec, ...]):
    """A tuple of states, hashed by identity (a Spec holds a dict: not hashable)."""

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


_SPECS: dict[int, tuple[tuple[Spec, ...], _Specs]] = {}


def compiled(specs: tuple[Spec, ...]) -> Compiled:
    held = _SPECS.get(id(specs))
    if held is None or held[0] is not specs:
        if len(_SPECS) > 16:
            _SPECS.clear()
        held = _SPECS[id(specs)] = (specs, _Specs(specs))
    return _compile(held[1])


# --- the window table ---------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """Per tile record shape (:attr:`Spec.tile_shape`): the rings (state, width, row)
    and the window rows (state, window, row) of a batch whose states read ``ns`` rows
    each: static index arrays."""

    shape: tuple[bool, tuple[int, ...]]

    win_ring: np.ndarray
    win_pair: np.ndarray
    win_width: np.ndarray  # float64: tile width (µs)
    win_tiles: np.ndarray  # float64
    win_whole: np.ndarray  # float64 1.0: whole tiles (the tile holding t not read)
    win_us: np.ndarray  # float64: the window (µs)
    win_slots: np.ndarray  # float64: its ring's slots
    block: dict[tuple[int, int], int]  # (state, window) -> first window row
    keys: frozenset[str]  # its features' columns finished from its sums (not values')


@dataclass(frozen=True)
class Index:
    pair_whole: np.ndarray  # per pair: bool, the state reads whole tiles
    # From the replies' fields flattened (state, row, field: every state's HMGET of
    # each row, in order): each record size's rings (state, width, row), the newest
    # events (state, row) and the kept values of the states that keep them (state, row).
    rings: dict[tuple[bool, tuple[int, ...]], Callable[[Sequence[Any]], tuple[Any, ...]]]
    newest: Callable[[Sequence[Any]], tuple[Any, ...]]
    kept: Callable[[Sequence[Any]], tuple[Any, ...]]
    tables: tuple[Table, ...]  # one per tile record shape
    values: tuple[int, ...]  # the states that keep values
    # Their window rows (state, window, row): pair, row of the kept values, window.
    val_pair: np.ndarray
    val_kept: np.ndarray
    val_width: np.ndarray
    val_tiles: np.ndarray
    val_us: np.ndarray
    val_block: dict[tuple[int, int], int]


@functools.lru_cache(maxsize=512)
def index(comp: Compiled, ns: tuple[int, ...]) -> Index:
    starts, at = [], 0
    for n in ns:
        starts.append(at)
        at += n
    whole = np.zeros(at, dtype=bool)
    for s, spec in enumerate(comp.specs):
        whole[starts[s] : starts[s] + ns[s]] = spec.whole_tiles
    tables: list[Table] = []
    for shape in dict.fromkeys(spec.tile_shape for spec in comp.specs):
        cols: dict[str, list[np.ndarray]] = {
            k: [] for k in ("ring", "pair", "width", "tiles", "whole", "us", "slots")
        }
        block: dict[tuple[int, int], int] = {}
        rings = wins = 0
        for s, spec in enumerate(comp.specs):
            if spec.tile_shape != shape:
                continue
            n, p0 = ns[s], starts[s]
            first: dict[int, int] = {}
            for u in spec.widths:
                first[u] = rings
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
        if not block:
            continue

        def cat(xs: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype=dtype)

        tables.append(
            Table(
                shape,
                cat(cols["ring"], np.intp),
                cat(cols["pair"], np.intp),
                cat(cols["width"], np.float64),
                cat(cols["tiles"], np.float64),
                cat(cols["whole"], np.float64),
                cat(cols["us"], np.float64),
                cat(cols["slots"], np.float64),
                block,
                frozenset(
                    f.key
                    for sw in block
                    for f in comp.by_window.get(sw, ())
                    if kinds.KINDS[f.agg].reads != "category"
                ),
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
    return Index(
        whole,
        *_pickers(comp, ns),
        tuple(tables),
        values,
        np.asarray(vcols["pair"], dtype=np.intp),
        np.asarray(vcols["kept"], dtype=np.intp),
        np.asarray(vcols["width"], dtype=np.float64),
        np.asarray(vcols["tiles"], dtype=np.float64),
        np.asarray(vcols["us"], dtype=np.float64),
        vblock,
    )


def _pickers(comp: Compiled, ns: Sequence[int]) -> tuple[Any, Any, Any]:
    """Index's rings, newest and kept: where each field lies in the flattened replies."""
    base, newest, kept = 0, list[int](), list[int]()
    rings: dict[tuple[bool, tuple[int, ...]], list[int]] = {}
    for s, spec in enumerate(comp.specs):
        nf, nw = len(comp.fields[s]), len(spec.widths)
        starts = [base + i * nf for i in range(ns[s])]
        for f in range(nw):
            rings.setdefault(spec.tile_shape, []).extend(a + f for a in starts)
        newest += (a + nw for a in starts)
        if spec.keeps_values:
            kept += (a + nw + 1 for a in starts)
        base += nf * ns[s]
    return {shape: _picker(idx) for shape, idx in rings.items()}, _picker(newest), _picker(kept)


def _picker(idx: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items at ``idx`` of a sequence, as a tuple, in one C call."""
    if len(idx) == 1:
        (i,) = idx
        return lambda seq: (seq[i],)
    if not idx:
        return lambda seq: ()
    return operator.itemgetter(*idx)


def records(blobs: Sequence[bytes | None], doubles: int) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``doubles`` float64 each from ``blobs`` (one per ring, possibly
    empty; None, an absent field, is empty): all records as one (records, doubles) array
    and each blob's record count."""
    # length_hint(None) is 0 and filter(None, ...) drops it: no Python per blob
    lens = np.fromiter(map(operator.length_hint, blobs), dtype=np.intp, count=len(blobs))
    flat = np.frombuffer(b"".join(filter(None, blobs)), dtype="<f8").reshape(-1, doubles)
    return flat, lens // (8 * doubles)


def offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts), dtype=np.intp)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def expand(counts: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments ``starts[i] .. starts[i] + counts[i]`` of a record array: each
    record's segment and its position in the record array."""
    total = int(counts.sum())
    seg = np.repeat(np.arange(len(counts)), counts)
    pos = np.repeat(starts - offsets(counts), counts) + np.arange(total)
    return seg, pos


def newest_events(
    blobs: Sequence[bytes | None], t: np.ndarray, whole: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The newest events of each pair as (pairs, NEWEST) arrays of times (µs; -inf:
    none) and values, left-aligned in time order (a blob holds at most NEWEST), which
    of them lie at or after the pair's t ``t`` in a state that reads the tile holding t
    (``whole`` False), and how many do per pair."""
    flat, counts = records(blobs, 2)
    return K.newest_events(flat, counts, NEWEST, t, whole)  # type: ignore[no-any-return]


def kept_values(blobs: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """The values pushed out of each pair's newest events (field "d": code, newest
    time) as (pairs, most held) arrays of codes and times (-inf: none)."""
    flat, counts = records(blobs, 2)
    return K.kept_values(flat, counts)  # type: ignore[no-any-return]


@dataclass
class Windows:
    """One record size's window rows, summed."""

    c: np.ndarray
    s: np.ndarray
    q: np.ndarray
    lo: np.ndarray  # min (inf: none)
    hi: np.ndarray  # max (-inf: none)
    decayed: dict[int, np.ndarray]  # per half-life (µs): the sum decayed to t
    uncovered: np.ndarray  # per pair: its window rows the rings no longer cover


def sum_windows(tab: Table, blobs: Sequence[bytes | None], t: np.ndarray) -> Windows:
    """The window rows of ``tab`` summed over their rings (``blobs``, one per ring) as
    of each pair's t (``t``): :func:`fraud_scoring.declared.kernels.sum_windows`."""
    flat, counts = records(blobs, tile_doubles(tab.shape))
    halves = np.asarray(tab.shape[1], dtype=np.float64)
    c, s, q, lo, hi, dec, uncovered = K.sum_windows(
        flat,
        counts,
        tab.win_ring,
        tab.win_pair,
        tab.win_width,
        tab.win_tiles,
        tab.win_whole,
        tab.win_slots,
        t,
        tab.shape[0],
        4 + 2 * tab.shape[0],
        halves,
    )
    decayed = dict(zip(tab.shape[1], dec, strict=True))
    return Windows(c, s, q, lo, hi, decayed, uncovered)


def finish(
    keys: Iterable[str],
    c: np.ndarray,
    s: np.ndarray,
    q: np.ndarray,
    since: np.ndarray,
    last: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    us: np.ndarray,
    decayed: Mapping[int, np.ndarray],
) -> dict[str, np.ndarray]:
    """Each of ``keys`` (:attr:`Feature.key`: a kind, or ``decayed_sum/<half-life>``)
    over the window rows' sums, by its kind's finish (:mod:`.kinds`; the row path runs
    the same on one row)."""
    sums = Sums(c, s, q, since, us / US, last, lo, hi)
    out = {}
    for key in keys:
        agg, _, half = key.partition("/")
        at = dataclasses.replace(sums, decayed=decayed[int(half)]) if half else sums
        out[key] = kinds.finish(agg, at)
    return out


def by_pair(
    pair: np.ndarray, ts: np.ndarray, vs: np.ndarray, pairs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Events (pair, time, value) as (pairs, most per pair) arrays (-inf: none)."""
    order = np.argsort(pair, kind="stable")
    pair, ts, vs = pair[order], ts[order], vs[order]
    counts = np.bincount(pair, minlength=pairs)
    width = int(counts.max())
    out_ts = np.full((pairs, width), -np.inf)
    out_vs = np.zeros((pairs, width))
    dest = pair * width + (np.arange(len(pair)) - np.repeat(offsets(counts), counts))
    out_ts.ravel()[dest] = ts
    out_vs.ravel()[dest] = vs
    return out_ts, out_vs


def add_mates(
    tab: Table,
    mates: tuple[np.ndarray, np.ndarray, np.ndarray],
    t: np.ndarray,
    win: Windows,
    c: np.ndarray,
    s: np.ndarray,
    q: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window sums (and min, max and the decayed sums in ``win``) with the
    micro-batch's own earlier events of each key added where a window holds them."""
    pair, ts, vs = mates
    order = np.argsort(tab.win_pair, kind="stable")  # each pair's window rows
    counts = np.bincount(tab.win_pair, minlength=len(t))
    mate, at = expand(counts[pair], offsets(counts)[pair])
    wr = order[at]
    width = tab.win_width[wr]
    at_ts = ts[mate]
    here = np.floor_divide(t[tab.win_pair[wr]], width) * width  # t's tile starts here
    first = here - tab.win_tiles[wr] * width
    inc = (at_ts >= first) & ~((tab.win_whole[wr] == 1.0) & (at_ts >= here))
    wr, v = wr[inc], vs[mate][inc]
    m = len(c)
    c = c + np.bincount(wr, minlength=m)
    s = s + np.bincount(wr, weights=v, minlength=m)
    q = q + np.bincount(wr, weights=v * v, minlength=m)
    np.minimum.at(win.lo, wr, v)
    np.maximum.at(win.hi, wr, v)
    for h, d in win.decayed.items():
        weight = np.exp2((at_ts[inc] - t[tab.win_pair[wr]]) / h)
        win.decayed[h] = d + np.bincount(wr, weights=v * weight, minlength=m)
    return c, s, q
