"""The window table's loops, compiled (numba): each is one pass over a micro-batch's
records where the array form takes 20-40 numpy calls, so a micro-batch of one is not
paid in per-call overhead. The arrays in and out are those of
:mod:`fraud_scoring.declared.window_table`, which documents what they hold; each
kernel's docstring gives the array expression it computes.

Compiled on first use and cached beside this file (``__pycache__``) where that is
writable; elsewhere (a read-only install) in each process, once (about a second).
``NUMBA_CACHE_DIR`` moves the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np


def _jit(fn: Callable[..., Any]) -> Any:
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable cache location: compiled in each process
        return numba.njit(nogil=True)(fn)


@_jit
def sum_windows(
    flat: np.ndarray,
    counts: np.ndarray,
    win_ring: np.ndarray,
    win_pair: np.ndarray,
    win_width: np.ndarray,
    win_tiles: np.ndarray,
    win_whole: np.ndarray,
    win_slots: np.ndarray,
    t: np.ndarray,
    minmax: bool,
    dcol: int,
    halves: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Per window row: the count, sum and sum of squares of its ring's tiles inside the
    window (``first <= index <= end``), the min and max (``minmax``) and each
    half-life's sum decayed from each tile's end to t (``halves``, record columns from
    ``dcol``); the rings' records one ring after the other (``counts`` each). Returns c,
    s, q, lo, hi, decayed (half-lives x window rows) and per pair (``t``'s) how many of
    its window rows its ring no longer covers."""
    m = win_ring.shape[0]
    rstart = np.zeros(counts.shape[0], np.intp)
    for i in range(1, counts.shape[0]):
        rstart[i] = rstart[i - 1] + counts[i - 1]
    c, s, q = np.zeros(m), np.zeros(m), np.zeros(m)
    uncovered = np.zeros(t.shape[0], np.intp)
    lo, hi = np.full(m, np.inf), np.full(m, -np.inf)
    decayed = np.zeros((halves.shape[0], m))
    for r in range(m):
        ring, width, tp = win_ring[r], win_width[r], t[win_pair[r]]
        last = tp // width  # the tile holding t
        first = last - win_tiles[r]
        end = last - win_whole[r]
        top = -np.inf
        for i in range(rstart[ring], rstart[ring] + counts[ring]):
            at = flat[i, 0]
            if flat[i, 1] != 0 and at > top:
                top = at
            if at < first or at > end:
                continue
            c[r] += flat[i, 1]
            s[r] += flat[i, 2]
            q[r] += flat[i, 3]
            if minmax:
                lo[r] = min(lo[r], flat[i, 4])
                hi[r] = max(hi[r], flat[i, 5])
            for j in range(halves.shape[0]):
                gap = (at + 1) * width - tp
                decayed[j, r] += flat[i, dcol + j] * np.exp2(gap / halves[j])
        # The ring keeps the indexes above its top's minus its slots.
        if top - win_slots[r] >= first:
            uncovered[win_pair[r]] += 1
    return c, s, q, lo, hi, decayed, uncovered


@_jit
def newest_events(
    flat: np.ndarray, counts: np.ndarray, newest: int, t: np.ndarray, whole: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each pair's first ``newest`` stored events (``flat``: (time, value) records, each
    pair's ``counts`` of them one after the other) as (pairs, newest) arrays of times
    (-inf: none) and values (0), which lie at or after the pair's t where its state
    reads the tile holding t (``~whole``), and how many do per pair."""
    pairs = counts.shape[0]
    ts = np.full((pairs, newest), -np.inf)
    vs = np.zeros((pairs, newest))
    ahead = np.zeros((pairs, newest), np.bool_)
    n_ahead = np.zeros(pairs, np.intp)
    at = 0
    for p in range(pairs):
        for k in range(min(counts[p], newest)):
            ts[p, k] = flat[at + k, 0]
            vs[p, k] = flat[at + k, 1]
            if ts[p, k] >= t[p] and not whole[p]:
                ahead[p, k] = True
                n_ahead[p] += 1
        at += counts[p]
    return ts, vs, ahead, n_ahead


@_jit
def last_events(
    ts: np.ndarray, vs: np.ndarray, t: np.ndarray, us: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pair: the time of its newest event before t (-inf: none), that event's value
    (the largest of those at that time; 0: none) and the seconds since it (inf)."""
    pairs = ts.shape[0]
    last_ts = np.full(pairs, -np.inf)
    last_v = np.zeros(pairs)
    since = np.full(pairs, np.inf)
    for p in range(pairs):
        lt = -np.inf
        for k in range(ts.shape[1]):
            if lt < ts[p, k] < t[p]:
                lt = ts[p, k]
        if lt == -np.inf:
            continue
        lv = -np.inf
        for k in range(ts.shape[1]):
            if ts[p, k] == lt and vs[p, k] > lv:
                lv = vs[p, k]
        last_ts[p], last_v[p], since[p] = lt, lv, (t[p] - lt) / us
    return last_ts, last_v, since


@_jit
def kept_values(flat: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (code, time) records of each pair (``counts`` of them, one pair after the
    other) as (pairs, most held) arrays of codes (NaN: none) and times (-inf)."""
    pairs = counts.shape[0]
    width = max(counts.max() if pairs else 0, 1)
    codes = np.full((pairs, width), np.nan)
    ts = np.full((pairs, width), -np.inf)
    at = 0
    for p in range(pairs):
        for k in range(counts[p]):
            codes[p, k] = flat[at + k, 0]
            ts[p, k] = flat[at + k, 1]
        at += counts[p]
    return codes, ts


@_jit
def _add_distinct(seen: np.ndarray, held: int, v: float) -> int:
    """Insert ``v`` into ``seen[:held]`` (the distinct values so far, in order) unless it
    is there; returns how many are held. No allocation: a row holds a few dozen."""
    at = held
    while at > 0 and seen[at - 1] > v:
        at -= 1
    if at > 0 and seen[at - 1] == v:
        return held
    for j in range(held, at, -1):
        seen[j] = seen[j - 1]
    seen[at] = v
    return held + 1


@_jit
def _scan(
    ts: np.ndarray,
    vs: np.ndarray,
    row: int,
    tv: float,
    start_tile: float,
    start: float,
    seen: np.ndarray,
    held: int,
    latest: float,
) -> tuple[int, float]:
    """Row ``row`` of ``ts``/``vs`` before ``tv``: its values from ``start_tile`` on added
    to the distinct ones in ``seen[:held]``, and the newest time from ``start`` on."""
    for k in range(ts.shape[1]):
        x = ts[row, k]
        if x < tv:
            if x >= start_tile and not math.isnan(vs[row, k]):
                held = _add_distinct(seen, held, vs[row, k])
            if x >= start and x > latest:
                latest = x
    return held, latest


@_jit
def _holds(ts: np.ndarray, vs: np.ndarray, row: int, at: float, v: float) -> bool:
    """Whether row ``row`` holds value ``v`` at time ``at``."""
    for k in range(ts.shape[1]):  # noqa: SIM110 (numba compiles loops, not generators)
        if ts[row, k] == at and vs[row, k] == v:
            return True
    return False


@_jit
def values(
    tn: np.ndarray,
    vn: np.ndarray,
    tk: np.ndarray,
    ck: np.ndarray,
    own: np.ndarray,
    vp: np.ndarray,
    vk: np.ndarray,
    val_width: np.ndarray,
    val_tiles: np.ndarray,
    val_us: np.ndarray,
    t: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per value window row (pair ``vp``, kept row ``vk``): the distinct values among
    the pair's newest events (``tn``, ``vn``) and kept values (``tk``, ``ck``) before t
    from the window's first tile on, and whether the row's own value (``own``, NaN:
    none) differs from the value of the newest event inside the window (1.0; 0.0 where
    it is the same, there is none or the row has none)."""
    rows = vp.shape[0]
    distinct, changed = np.zeros(rows), np.zeros(rows)
    seen = np.empty(tn.shape[1] + tk.shape[1])
    for r in range(rows):
        p, kr, tv, width = vp[r], vk[r], t[vp[r]], val_width[r]
        start_tile = (tv // width - val_tiles[r]) * width
        start = tv - val_us[r]
        held, latest = _scan(tn, vn, p, tv, start_tile, start, seen, 0, -np.inf)
        held, latest = _scan(tk, ck, kr, tv, start_tile, start, seen, held, latest)
        distinct[r] = held
        mine = own[kr]
        if latest == -np.inf or math.isnan(mine):
            continue
        same = _holds(tn, vn, p, latest, mine) or _holds(tk, ck, kr, latest, mine)
        changed[r] = 0.0 if same else 1.0
    return distinct, changed
