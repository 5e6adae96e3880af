"""The aggregation kinds, one entry each (:data:`KINDS`): what a kind reads, what its
state's tiles must keep for it, when its window counts as empty, and its finish, the one
definition every engine runs (online over a micro-batch's columns or one row, offline
over DuckDB's or Spark's window sums: :func:`finish`).

Every engine first reduces a window to the same sums (:class:`Sums`: count, sum, sum of
squares, the smallest and largest value, the time since the newest event and its value,
the distinct values, whether the value changed, the decayed sum at a half-life); a
kind's finish turns them into its feature. Adding a kind whose finish needs only these
sums is one entry here (and its tests); one that needs another per-tile sum also needs
that sum in the tile layout (``record.lua``,
:func:`fraud_scoring.declared.window_table.sum_windows`, the window SQL):
docs/features.md, "Adding an aggregation kind".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

# distinct_count saturates here (a state keeps at most this many values per key).
DISTINCT_CAP = 100


@dataclass(frozen=True)
class Sums:
    """One window's sums, as numpy arrays (one element per window row) or numpy
    scalars (one row); ``lo``/``hi``: no event is any non-finite value (online: inf and
    -inf; offline: NaN); ``last``: NaN or anything with ``since`` beyond the window when
    there is none; ``window_s``: the window in seconds."""

    c: Any
    s: Any
    q: Any
    since: Any
    window_s: Any
    last: Any = 0.0
    lo: Any = np.inf
    hi: Any = -np.inf
    distinct: Any = 0.0
    changed: Any = 0.0
    decayed: Any = 0.0  # the window's decayed sum at the feature's half-life


def _mean(x: Sums) -> Any:
    some = x.c > 0
    return np.where(some, x.s / np.where(some, x.c, 1.0), 0.0)


def _std(x: Sums) -> Any:
    some = x.c > 0
    safe = np.where(some, x.c, 1.0)
    mean = np.where(some, x.s / safe, 0.0)
    return np.sqrt(np.where(some, np.maximum(x.q / safe - mean * mean, 0.0), 0.0))


def _extreme(v: Any) -> Any:
    return np.where(np.isfinite(v), v, 0.0)


@dataclass(frozen=True)
class Kind:
    """One aggregation kind.

    ``reads``: no value (each event counts 1), a number column or expression, or a
    categorical value (a key column: its values are kept per key, not summed).
    ``whole_number``: an int64 feature (a declared default must be whole).
    ``exact_window``: empty when no event lies in ``t - W`` up to ``t`` (else: when the
    tile-snapped window holds none). ``whole_tiles``: allowed on a state that reads
    whole tiles (a delay, labels, decisions). ``extremes``: the state's tiles keep their
    smallest and largest value. ``finish``: the feature from a window's :class:`Sums`."""

    name: str
    reads: Literal["any", "number", "category"]
    finish: Callable[[Sums], Any]
    whole_number: bool = False
    exact_window: bool = False
    whole_tiles: bool = True
    extremes: bool = False
    # Parameters its YAML entry takes ({name: prefix, half_life: 1h}); a kind with any
    # is declared with them. half_life: the state's tiles keep a decayed sum per
    # half-life (:data:`DECAY_TILES`).
    params: tuple[str, ...] = ()


# A tile keeps its decayed sum relative to its own end: an event early in a tile weighs
# 2^-(width / half-life) there, so a half-life must be at least a 64th of each window's
# tile width (else that weight would underflow a double).
DECAY_TILES = 64


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("count", "any", lambda x: x.c, whole_number=True),
        Kind("sum", "number", lambda x: x.s),
        Kind("mean", "number", _mean),
        Kind("std", "number", _std),
        Kind("min", "number", lambda x: _extreme(x.lo), extremes=True),
        Kind("max", "number", lambda x: _extreme(x.hi), extremes=True),
        Kind(
            "seconds_since_last",
            "any",
            lambda x: np.minimum(x.since, x.window_s),
            exact_window=True,
            whole_tiles=False,
        ),
        Kind(
            "last",
            "number",
            lambda x: np.where((x.since <= x.window_s) & ~np.isnan(x.last), x.last, 0.0),
            exact_window=True,
            whole_tiles=False,
        ),
        Kind(
            "distinct_count",
            "category",
            lambda x: np.minimum(x.distinct, DISTINCT_CAP),
            whole_number=True,
            whole_tiles=False,
        ),
        Kind("changed", "category", lambda x: x.changed, exact_window=True, whole_tiles=False),
        # sum of value * 2^-((t - ts) / half-life) over the window (the value: 1 without
        # one: a decayed count), the exponentially decayed velocity beside hard windows
        Kind("decayed_sum", "any", lambda x: x.decayed, params=("half_life",)),
    )
}


def kinds_where(test: Callable[[Kind], bool]) -> set[str]:
    return {k.name for k in KINDS.values() if test(k)}


def finish(agg: str, sums: Sums) -> Any:
    """The feature of kind ``agg`` from a window's sums (float64)."""
    return KINDS[agg].finish(sums)


def empty(agg: str, sums: Sums) -> Any:
    """Where the window holds nothing for kind ``agg`` (a declared default applies)."""
    if KINDS[agg].exact_window:
        return sums.since > sums.window_s
    return sums.c <= 0
