"""Windowed aggregations and derived features declared as data (``feature_repo/features.yaml``).

A declaration names an entity (one or more transaction columns), an optional filter, a
value column, windows and the aggregations wanted; each (aggregation, window) becomes a
feature ``<prefix>_<window>``. This module is the language (parsed and checked:
:func:`load`), the tile math every engine shares (:func:`tile_of`, :func:`finish`), the
Redis layout (record events: the script :data:`APPLY_LUA`, or :data:`APPLY_STATES_LUA`
for a whole batch in every state at once, :func:`queue_states`; read a key's windows:
:func:`queue_read` and :func:`parse_reads`), and the derived-feature evaluator
(:func:`evaluate`).
The batch side compiles the same declarations to DuckDB (``batch_jobs/declared_sql.py``).

**Semantics (every engine, exactly).** A window ``W`` has a tile width ``u`` (the
largest of 1 s, 5 s, 1 min, 5 min, 1 h, 6 h, 1 day that divides ``W`` at least 10
times: 1m → 5 s, 10m → 1 min, 1h → 5 min, 1d → 1 h, 7d → 6 h, 30d → 1 day). Its
value for a transaction at ``t`` covers the key's events with
``ts // u >= t // u - W / u`` and ``ts < t``: the start is snapped down to a tile edge
(the window reaches back between ``W`` and ``W + u``), the end is exact. A transaction
never counts in its own features, and each ``transaction_id`` counts once.
``seconds_since_last`` is exact: seconds since the key's newest event before ``t``,
capped at ``W`` (also when none). ``changed`` (a categorical value, e.g. ``country``) is
1 when the key's latest event before ``t`` and at most ``W`` before it exists and none
of the events at that latest time has the transaction's own value, else 0.
``distinct_count`` (a categorical value) counts the distinct values of the window's
events (the same snapped start), saturating at :data:`DISTINCT_CAP`. ``min`` and ``max``
are the smallest and largest value of the window's events (0: none).

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

import ast
import functools
import hashlib
import itertools
import json
import math
import operator
import re
import string
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fraud_scoring.feature_specs import BatchView

US = 1_000_000
# Tile widths, finest first (µs); a window takes the widest that divides it >= 10 times.
TILE_WIDTHS_US = (US, 5 * US, 60 * US, 300 * US, 3600 * US, 6 * 3600 * US, 86_400 * US)
MIN_TILES = 10
MIN_WINDOW_US, MAX_WINDOW_US = 60 * US, 180 * 86_400 * US
# A key keeps its NEWEST newest events: a read is exact when fewer than NEWEST of the
# key's stored events lie at or after the transaction's time (always, when scoring live).
NEWEST = 32
# An event stamped this far ahead of a key's other events never overwrites a tile that a
# window still reads (the service's event-time bound, FRAUD_MAX_EVENT_SKEW_S, is 600 s).
FUTURE_ROOM_US = 900 * US
# A key accepts an event up to this long (plus FRAUD_ALLOWED_LATENESS_S) behind its
# newest, and keeps the ids of that span for idempotency.
HORIZON_S = 3600.0
UNITS = {"s": US, "m": 60 * US, "h": 3600 * US, "d": 86_400 * US}

# The transaction columns a declaration may read (entity, filter, value).
KEY_COLUMNS = ("card_id", "merchant_id", "device_id", "country", "channel", "mcc")
VALUE_COLUMNS = ("amount",)
# What a declaration counts: the transactions as they happen, or events that arrive
# later and that the daily batch records ("arrivals"), each counted from when the online
# store has it: labels (chargebacks, analysts' marks) and the service's own decisions
# (the decision log, compacted daily). An arrival carries its transaction's columns.
Source = Literal["transactions", "labels", "decisions"]
ARRIVALS = ("labels", "decisions")
# Each arrival source's own number columns (a value may read them) and, for decisions,
# the column a filter may read besides the key columns.
SOURCE_VALUES = {"labels": ("is_fraud",), "decisions": ("score",)}
SOURCE_FILTERS = {"decisions": ("decision",)}
LABEL_VALUE_COLUMNS = SOURCE_VALUES["labels"]
ARRIVAL_VALUE_COLUMNS = tuple(c for cols in SOURCE_VALUES.values() for c in cols)
ARRIVAL_FILTER_COLUMNS = tuple(c for cols in SOURCE_FILTERS.values() for c in cols)
# A state whose events are not recorded as they happen (a delay, or labels, which the
# daily batch records) reads whole tiles, so only these aggregations.
WHOLE_TILE_AGGS = {"count", "sum", "mean", "std", "min", "max"}
# An arrival counts from the day after it arrived (plus FRAUD_BATCH_AVAILABLE_AFTER_S):
# its state keeps tiles this far ahead of the present beyond its delay.
LABEL_ROOM_US = 2 * 86_400 * US
Agg = Literal[
    "count",
    "sum",
    "mean",
    "std",
    "min",
    "max",
    "seconds_since_last",
    "last",
    "distinct_count",
    "changed",
]
NEEDS_VALUE = {"sum", "mean", "std", "min", "max", "last"}
# Aggregations that keep, per tile, the smallest and largest value too.
EXTREMES = {"min", "max"}
# Aggregations of a categorical value (a key column): a state keeps the values it saw.
NEEDS_CATEGORY = {"distinct_count", "changed"}
# Integer features (int64 columns): a declared default must be a whole number.
WHOLE_NUMBER_AGGS = {"count", "distinct_count"}
# Aggregations over the exact window (t - W up to t): empty when no event lies in it;
# the others are empty when the tile-snapped window holds no event.
EXACT_WINDOW_AGGS = {"seconds_since_last", "last", "changed"}
# distinct_count saturates here (a state keeps at most this many values per key).
DISTINCT_CAP = 100


class DeclarationError(ValueError):
    """The declarations file is unreadable or breaks the language; the message names
    the file and the field."""


def known_filter(v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """A declaration's ``filter``, refused when it names a column that is not a key
    column (or a decision's own: ``source: decisions`` is checked by :func:`parse`)."""
    known = (*KEY_COLUMNS, *ARRIVAL_FILTER_COLUMNS)
    for c in v:
        if c not in known:
            raise ValueError(f"unknown column {c!r}; one of {', '.join(known)}")
    return v


def parse_window(text: str) -> int:
    """``"10m"`` → microseconds. Units s, m, h, d; 1 minute to 180 days."""
    unit = UNITS.get(text[-1:]) if text else None
    if unit is None or not text[:-1].isdigit():
        raise ValueError(f"window {text!r}: expected a number and a unit (s, m, h, d)")
    us = int(text[:-1]) * unit
    if not MIN_WINDOW_US <= us <= MAX_WINDOW_US:
        raise ValueError(f"window {text!r}: must be from 1m to 180d")
    return us


def tile_width(window_us: int) -> int:
    """The tile width of a window (see the module docstring)."""
    return max(u for u in TILE_WIDTHS_US if window_us % u == 0 and window_us // u >= MIN_TILES)


def tile_of(ts_us: int, width_us: int) -> int:
    return ts_us // width_us


# --- the language -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AggregationDecl(_Strict):
    """One entity's windowed aggregations (see docs/features.md)."""

    source: Source = Field(default="transactions", description="what the events are")
    entity: tuple[str, ...] = Field(description="transaction columns that form the key")
    value: str | None = Field(
        default=None,
        description="the column the aggregations read, or an expression over the number "
        "columns (e.g. log1p(amount), where(amount > 500, 1, 0))",
    )
    default: float | dict[Agg, float] | None = Field(
        default=None,
        description="a feature's value when its window holds no event of the key (one "
        "number for every aggregation, or one per aggregation); else 0, and the window "
        "for seconds_since_last",
    )
    delay: str | None = Field(
        default=None, description="an event counts this long after its event time (1m-180d)"
    )
    filter: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="column -> allowed values; events outside skip"
    )
    windows: tuple[str, ...]
    features: dict[Agg, str] = Field(description="aggregation -> feature name prefix")
    description: str = ""

    @field_validator("entity", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("filter", mode="before")
    @classmethod
    def _values(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {k: (x,) if isinstance(x, str) else x for k, x in v.items()}
        return v

    @field_validator("entity")
    @classmethod
    def _known_key(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("needs at least one column")
        for c in v:
            if c not in KEY_COLUMNS:
                raise ValueError(f"unknown column {c!r}; one of {', '.join(KEY_COLUMNS)}")
        return v

    @field_validator("filter")
    @classmethod
    def _known_filter(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        return known_filter(v)

    @field_validator("value")
    @classmethod
    def _known_value(cls, v: str | None) -> str | None:
        known = (*VALUE_COLUMNS, *ARRIVAL_VALUE_COLUMNS, *KEY_COLUMNS)
        if v is None or v in known:
            return v
        if v.isidentifier():
            raise ValueError(
                f"unknown column {v!r}; one of {', '.join(known)}, or an expression over "
                f"{', '.join((*VALUE_COLUMNS, *ARRIVAL_VALUE_COLUMNS))}"
            )
        _check_expr(v, {*VALUE_COLUMNS, *ARRIVAL_VALUE_COLUMNS})
        return v

    @model_validator(mode="after")
    def _defaults(self) -> AggregationDecl:
        if self.default is None:
            return self
        given = (
            self.default
            if isinstance(self.default, dict)
            else dict.fromkeys(self.features, self.default)
        )
        for agg, x in given.items():
            if agg not in self.features:
                raise ValueError(f"default: {agg!r} is not one of this declaration's features")
            if not math.isfinite(x):
                raise ValueError(f"default: {agg}: must be a finite number")
            if agg in WHOLE_NUMBER_AGGS and x != int(x):
                raise ValueError(f"default: {agg}: must be a whole number (a count)")
        return self

    def default_of(self, agg: str) -> float | None:
        """The declared default of ``agg``'s features (None: the built-in one)."""
        if isinstance(self.default, dict):
            return self.default.get(agg)  # type: ignore[call-overload]
        return self.default

    @field_validator("delay")
    @classmethod
    def _delay(cls, v: str | None) -> str | None:
        if v is not None:
            parse_window(v)
        return v

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("needs at least one window")
        for w in v:
            parse_window(w)
        return v


class DerivedDecl(_Strict):
    """A feature computed from other features and request fields by an expression."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    expr: str
    description: str = ""


class ReasonDecl(_Strict):
    """A reason code a decision gives when ``when`` (an expression over features and
    request fields) is not 0; ``message`` names features in braces, with an optional
    format: ``"{card_txn_count_1h:.0f} transactions in the last hour"``."""

    code: str = Field(pattern=r"^[A-Z][A-Z0-9_]*$", max_length=64)
    when: str
    message: str = Field(min_length=1, max_length=300)
    description: str = ""

    def reads(self) -> tuple[str, ...]:
        """The names ``when`` and ``message`` read, in order (the first: the feature the
        reason is about, shown first on the review page and ordered by its importance)."""
        names = [n.id for n in ast.walk(_parsed(self.when)) if isinstance(n, ast.Name)]
        names += [f for _, f, _, _ in string.Formatter().parse(self.message) if f]
        return tuple(dict.fromkeys(n for n in names if n not in _FUNCS))


# Reason codes the service gives itself (the model's thresholds, the amount rule, a card
# without history, rules-only decisions): a declared reason may not take them.
BUILT_IN_REASONS = (
    "MODEL_SCORE_DECLINE",
    "MODEL_SCORE_REVIEW",
    "RULE_AMOUNT_OVER_LIMIT",
    "NO_CARD_HISTORY",
    "DEGRADED_RULES_ONLY",
)


def check_reasons(reasons: Sequence[ReasonDecl], known: set[str], source: str) -> None:
    """Refuse a reason whose code is taken, whose ``when`` is not an expression over
    ``known`` (number features and request fields) or whose message names anything else
    or has a bad format; :class:`DeclarationError` names the field."""
    codes: set[str] = set()
    for i, r in enumerate(reasons):
        where = f"{source}: reasons.{i}"
        if r.code in BUILT_IN_REASONS or r.code in codes:
            raise DeclarationError(f"{where}.code: {r.code!r} is taken")
        codes.add(r.code)
        try:
            _check_expr(r.when, known)
        except ValueError as exc:
            raise DeclarationError(f"{where}.when: {exc}") from None
        try:
            for _, name, spec, conv in string.Formatter().parse(r.message):
                if name is None:
                    continue
                if name not in known:
                    raise ValueError(f"{{{name}}}: not a number feature or request field")
                if conv is not None:
                    raise ValueError(f"{{{name}!{conv}}}: no conversions")
                if re.search(r"\d{3}", spec or ""):
                    raise ValueError(f"{{{name}:{spec}}}: width and precision under 100")
                format(0.0, spec or "")
        except ValueError as exc:
            raise DeclarationError(f"{where}.message: {exc}") from None


def reason_message(reason: ReasonDecl, row: Mapping[str, float]) -> str:
    """``reason``'s message with ``row``'s values (checked by :func:`check_reasons`)."""
    return reason.message.format_map(row)


class DeclarationsFile(_Strict):
    aggregations: tuple[AggregationDecl, ...] = ()
    derived: tuple[DerivedDecl, ...] = ()
    reasons: tuple[ReasonDecl, ...] = ()
    snapshots: Any = ()  # the daily snapshot views: fraud_scoring/snapshots.py checks them


@dataclass(frozen=True)
class Window:
    label: str
    us: int
    width_us: int

    @property
    def tiles(self) -> int:
        return self.us // self.width_us


@dataclass(frozen=True)
class Declared:
    """One declared feature: its aggregation, name and window."""

    agg: str
    name: str
    window: Window
    default: float | None = None  # declared; None: the built-in one (:meth:`fallback`)

    @property
    def fallback(self) -> float:
        """The value when the window holds no event of the key (or there is no key)."""
        if self.default is not None:
            return self.default
        return self.window.us / US if self.agg == "seconds_since_last" else 0.0


@dataclass(frozen=True)
class Spec:
    """The state one entity keeps: every declaration with the same entity, value and
    filter shares it (one read per key), with the union of their windows."""

    entity: tuple[str, ...]
    value_column: str | None
    filter: dict[str, tuple[str, ...]]
    id: str
    windows: tuple[Window, ...]
    features: tuple[Declared, ...]
    description: str = ""
    source: str = "transactions"
    delay_us: int = 0

    @property
    def whole_tiles(self) -> bool:
        """Events are not recorded as they happen (a delay puts them ahead of the
        present; labels and decisions are recorded by the daily batch): a window reads
        whole tiles, its end snapped down to the tile edge at or before ``t`` too."""
        return self.delay_us > 0 or self.arrivals

    @property
    def arrivals(self) -> bool:
        """The daily batch records this state's events (labels, decisions)."""
        return self.source in ARRIVALS

    @property
    def ahead_us(self) -> int:
        """How far ahead of the present this state's event times may lie."""
        return self.delay_us + (LABEL_ROOM_US if self.arrivals else 0)

    @cached_property  # read on every queued call: derived once
    def widths(self) -> dict[int, int]:
        """Tile width → ring size (slots): the most tiles a window of that width reads,
        plus room for events stamped up to :data:`FUTURE_ROOM_US` (and the state's
        :attr:`ahead_us`) ahead of the key's present (a slot is only stored once an event
        lands in it)."""
        out: dict[int, int] = {}
        for w in self.windows:
            room = -(-(FUTURE_ROOM_US + self.ahead_us) // w.width_us)
            out[w.width_us] = max(out.get(w.width_us, 0), w.tiles + 2 + room)
        return out

    @property
    def longest_us(self) -> int:
        return max(w.us for w in self.windows)

    @cached_property  # read per event: derived once
    def categorical(self) -> bool:
        """The value is a key column (a merchant, a country): its values are kept, not
        summed."""
        return self.value_column in KEY_COLUMNS

    @cached_property
    def keeps_values(self) -> bool:
        """The state keeps the values it saw (for distinct_count and changed)."""
        return any(f.agg in NEEDS_CATEGORY for f in self.features)

    @cached_property
    def defaulted(self) -> tuple[Declared, ...]:
        """The features with a declared default."""
        return tuple(f for f in self.features if f.default is not None)

    @cached_property
    def keeps_extremes(self) -> bool:
        """The state's tiles keep their smallest and largest value too (min, max)."""
        return any(f.agg in EXTREMES for f in self.features)

    @cached_property
    def tile(self) -> struct.Struct:
        """A tile's record: :data:`TILE`, or :data:`TILE_EXTREMES` (min, max)."""
        return TILE_EXTREMES if self.keeps_extremes else TILE

    def distinct_back_us(self, horizon_us: int) -> int:
        """How far behind the key's newest event a kept value can still count."""
        return self.longest_us + max(w.width_us for w in self.windows) + horizon_us

    def reach_us(self, horizon_us: int) -> int:
        """How far behind a key's newest event an event can still change what the key
        keeps: a tile its rings hold (``slots`` tiles of each width), a value kept for
        ``distinct_count`` or an id (``horizon_us``). A backfill sends nothing older."""
        rings = max(slots * u for u, slots in self.widths.items())
        return max(rings, self.distinct_back_us(horizon_us)) + horizon_us

    def feature_names(self) -> list[str]:
        return [f.name for f in self.features]

    @cached_property
    def value_expr(self) -> bool:
        """The value is an expression over number columns (:func:`evaluate`)."""
        return is_expression(self.value_column)

    @cached_property
    def value_sql(self) -> str | None:
        """The value's column in the batch engines' event table: the column itself, or
        for an expression the column ``frames`` computes (named by its text's hash)."""
        if not self.value_expr:
            return self.value_column
        assert self.value_column is not None
        return "v_" + hashlib.blake2b(self.value_column.encode(), digest_size=6).hexdigest()

    def key_value(self, row: Mapping[str, Any]) -> str | None:
        """The entity value of a transaction (None: a key column is empty, e.g. no
        device id; the features are then their defaults)."""
        parts = []
        for c in self.entity:
            v = row.get(c)
            if v is None or v != v or v == "":
                return None
            parts.append(str(v))
        return "\x1f".join(parts)

    def passes(self, row: Mapping[str, Any]) -> bool:
        """Inside the filter, and (a categorical value) with a value: an event without
        one is not recorded in this state."""
        if self.categorical and _empty(row.get(self.value_column)):  # type: ignore[arg-type]
            return False
        return not self.filter or all(row.get(c) in allowed for c, allowed in self.filter.items())

    def value(self, row: Mapping[str, Any]) -> float:
        """The number recorded for an event: its value column, or (categorical) the
        code of its value (:func:`value_code`), or 1.0 without a value column."""
        if self.categorical:
            return value_code(row[self.value_column])  # type: ignore[index]
        if self.value_expr:
            assert self.value_column is not None
            cols = {c: [float(row[c])] for c in value_names(self.value_column)}
            return float(evaluate(self.value_column, cols)[0])
        return float(row[self.value_column]) if self.value_column else 1.0

    def own_code(self, row: Mapping[str, Any]) -> float | None:
        """A transaction's own value code (a categorical state; None: none, or no
        value)."""
        if not self.categorical or _empty(row.get(self.value_column)):  # type: ignore[arg-type]
            return None
        return self.value(row)

    def backfilled_key(self) -> str:
        """Set once the raw history is recorded into this state (``features backfill``,
        or the daily batch for a state without it); the service refuses to serve a
        state without it (an empty or not yet backfilled state would serve zeros)."""
        return "fraud:declared:" + self.id + ":backfilled"

    def prefix(self, key: str) -> str:
        # One hash tag per (spec, key): a key's three Redis keys share a Cluster slot.
        return "{agg:" + self.id + ":" + key + "}"


@dataclass(frozen=True)
class Declarations:
    specs: tuple[Spec, ...]
    derived: tuple[DerivedDecl, ...]
    source: str
    # The daily snapshot views (fraud_scoring/snapshots.py), when loaded with them.
    views: tuple[BatchView, ...] = ()
    reasons: tuple[ReasonDecl, ...] = ()

    def aggregate_names(self) -> list[str]:
        return [n for s in self.specs for n in s.feature_names()]

    def names(self) -> list[str]:
        """Every declared feature: snapshot, aggregation, derived."""
        snap = [f.name for v in self.views for f in v.features]
        return [*snap, *self.aggregate_names(), *(d.name for d in self.derived)]

    def needed(self, names: set[str]) -> set[str]:
        """``names`` and every feature their derived ones read, transitively."""
        exprs = {d.name: d.expr for d in self.derived}
        out, todo = set(), list(names)
        while todo:
            n = todo.pop()
            if n in out:
                continue
            out.add(n)
            if n in exprs:
                tree = ast.parse(exprs[n], mode="eval")
                todo += [x.id for x in ast.walk(tree) if isinstance(x, ast.Name)]
        return out

    def defaults(self) -> dict[str, float]:
        return {f.name: f.fallback for s in self.specs for f in s.features}


EMPTY = Declarations((), (), "nothing declared")


def _empty(v: Any) -> bool:
    return v is None or v != v or v == ""


@functools.lru_cache(maxsize=1 << 16)  # merchants, countries and cards recur
def value_code(v: Any) -> float:
    """A categorical value as the number a state records: 48 bits of its BLAKE2b hash
    (exact in a double; two values share a code with probability ~2**-48 per pair)."""
    digest = hashlib.blake2b(str(v).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def compile_decls(decls: Sequence[AggregationDecl]) -> tuple[Spec, ...]:
    """Group declarations by (entity, value, filter) into the states they share."""
    groups: dict[str, list[AggregationDecl]] = {}
    for d in decls:
        shape: dict[str, Any] = {
            "e": d.entity,
            "v": d.value,
            "f": {k: sorted(v) for k, v in d.filter.items()},
        }
        if d.source != "transactions" or d.delay:  # the ids of older states do not change
            shape |= {"s": d.source, "d": parse_window(d.delay) if d.delay else 0}
        canon = json.dumps(shape, sort_keys=True)
        groups.setdefault(canon, []).append(d)
    specs = []
    for canon0, ds in groups.items():
        windows = {parse_window(w) for d in ds for w in d.windows}
        # A state that keeps values is a different state (its id changes with it).
        keeps = any(a in NEEDS_CATEGORY for d in ds for a in d.features)
        canon = canon0 + ("+values" if keeps else "")
        # So is one whose tiles keep min and max (its records are longer).
        if any(a in EXTREMES for d in ds for a in d.features):
            canon += "+extremes"
        # The id covers the windows: a new window starts a new state (backfill it).
        # and the storage layout: a new layout starts new keys too.
        sid = hashlib.blake2b(
            (canon + repr(sorted(windows)) + f"L{LAYOUT}").encode(), digest_size=5
        ).hexdigest()
        feats = []
        for d in ds:
            for agg, prefix in d.features.items():
                for label in d.windows:
                    us = parse_window(label)
                    win = Window(label, us, tile_width(us))
                    feats.append(Declared(agg, f"{prefix}_{label}", win, d.default_of(agg)))
        first = ds[0]
        specs.append(
            Spec(
                first.entity,
                first.value,
                dict(first.filter),
                sid,
                tuple(Window(window_label(us), us, tile_width(us)) for us in sorted(windows)),
                tuple(feats),
                "; ".join(d.description for d in ds if d.description),
                first.source,
                parse_window(first.delay) if first.delay else 0,
            )
        )
    return tuple(specs)


def window_label(us: int) -> str:
    """Microseconds as the shortest window text: 2_592_000_000_000 -> ``"30d"``."""
    for unit, size in sorted(UNITS.items(), key=lambda kv: -kv[1]):
        if us % size == 0:
            return f"{us // size}{unit}"
    raise AssertionError(us)


def parse(raw: object, source: str, taken: Sequence[str] = ()) -> Declarations:
    """Check and compile declarations (the YAML document ``raw``); ``taken`` are the
    feature names already declared elsewhere. Raises :class:`DeclarationError`."""
    try:
        doc = DeclarationsFile.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise DeclarationError(f"{source}: {loc}: {first['msg']}") from None
    for i, d in enumerate(doc.aggregations):
        numbers = (*VALUE_COLUMNS, *SOURCE_VALUES.get(d.source, ()))
        reads = value_names(d.value)
        for other, cols in SOURCE_VALUES.items():
            if reads & set(cols) and d.source != other:
                raise DeclarationError(
                    f"{source}: aggregations.{i}.value: {d.value!r} reads a column of "
                    f"{other} ({', '.join(cols)}): declare source: {other}"
                )
        for other, cols in SOURCE_FILTERS.items():
            if set(d.filter) & set(cols) and d.source != other:
                raise DeclarationError(
                    f"{source}: aggregations.{i}.filter: {', '.join(cols)} is a column of "
                    f"{other}: declare source: {other}"
                )
        if NEEDS_VALUE & set(d.features) and not (reads and reads <= set(numbers)):
            raise DeclarationError(
                f"{source}: aggregations.{i}.value: sum/mean/std/min/max/last need a number "
                f"column ({', '.join(numbers)}) or an expression over them"
            )
        whole = d.delay is not None or d.source in ARRIVALS
        if whole and set(d.features) - WHOLE_TILE_AGGS:
            raise DeclarationError(
                f"{source}: aggregations.{i}.features: with a delay or source "
                f"{'/'.join(ARRIVALS)} only "
                f"{', '.join(sorted(WHOLE_TILE_AGGS))} (whole tiles)"
            )
        if NEEDS_CATEGORY & set(d.features) and d.value not in KEY_COLUMNS:
            raise DeclarationError(
                f"{source}: aggregations.{i}.value: distinct_count/changed need a "
                f"categorical column ({', '.join(KEY_COLUMNS)})"
            )
    decl = Declarations(compile_decls(doc.aggregations), doc.derived, source, reasons=doc.reasons)
    seen = set(taken)
    for n in decl.names():
        if n in seen:
            raise DeclarationError(f"{source}: feature {n!r} is declared twice")
        seen.add(n)
    known = set(taken) | set(decl.aggregate_names()) | set(REQUEST_FIELDS)
    for i, dd in enumerate(decl.derived):
        try:
            _check_expr(dd.expr, known)
        except ValueError as exc:
            raise DeclarationError(f"{source}: derived.{i}.expr: {exc}") from None
        known.add(dd.name)
    return decl


def is_expression(value: str | None) -> bool:
    """A declaration's value is an expression, not a column name."""
    return value is not None and not value.isidentifier()


@functools.lru_cache(maxsize=1024)  # read per event (a label's value): parsed once
def value_names(value: str | None) -> frozenset[str]:
    """The columns a declaration's value reads (none without a value)."""
    if value is None:
        return frozenset()
    if not is_expression(value):
        return frozenset({value})
    tree = _parsed(value)
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS)


@functools.lru_cache(maxsize=1024)  # derived features are evaluated per micro-batch
def _parsed(expr: str) -> ast.Expression:
    return ast.parse(expr, mode="eval")


def read(path: Path) -> object:
    """The YAML document in ``path`` (raises :class:`DeclarationError`)."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise DeclarationError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise DeclarationError(f"{path}: not YAML: {exc}") from None


def load(path: Path, taken: Sequence[str] = ()) -> Declarations:
    """The aggregations and derived features in ``path`` (YAML), checked and compiled
    (:func:`fraud_scoring.features.load_declarations` adds the snapshot views)."""
    return parse(read(path), str(path), taken)


DEFAULT_PATH = Path(__file__).resolve().parent.parent / "feature_repo" / "features.yaml"


# --- the math every engine shares ---------------------------------------------------------


def finish(
    spec: Spec,
    window: Window,
    count: npt.ArrayLike,
    total: npt.ArrayLike,
    squares: npt.ArrayLike,
    since_last_s: npt.ArrayLike,
    distinct: npt.ArrayLike | None = None,
    changed: npt.ArrayLike | None = None,
    last: npt.ArrayLike | None = None,
    minimum: npt.ArrayLike | None = None,
    maximum: npt.ArrayLike | None = None,
) -> dict[str, np.ndarray]:
    """The declared features over ``window`` from its sums, and (a state that keeps
    values) its distinct values and changed flags, the newest event's value (``last``;
    NaN: none) and the window's smallest and largest values (NaN: no event) (float64
    columns)."""
    c = np.asarray(count, dtype=np.float64)
    s = np.asarray(total, dtype=np.float64)
    q = np.asarray(squares, dtype=np.float64)
    safe = np.where(c > 0, c, 1.0)
    mean = np.where(c > 0, s / safe, 0.0)
    var = np.where(c > 0, np.maximum(q / safe - mean * mean, 0.0), 0.0)
    values = {
        "count": c,
        "sum": s,
        "mean": mean,
        "std": np.sqrt(var),
        "seconds_since_last": np.minimum(
            np.asarray(since_last_s, dtype=np.float64), window.us / US
        ),
    }
    if distinct is not None:
        values["distinct_count"] = np.minimum(np.asarray(distinct, np.float64), DISTINCT_CAP)
    if changed is not None:
        values["changed"] = np.asarray(changed, dtype=np.float64)
    if last is not None:
        within = np.asarray(since_last_s, dtype=np.float64) <= window.us / US
        lv = np.asarray(last, dtype=np.float64)
        values["last"] = np.where(within & ~np.isnan(lv), np.nan_to_num(lv), 0.0)
    for agg, x in (("min", minimum), ("max", maximum)):
        if x is not None:
            xv = np.asarray(x, dtype=np.float64)
            values[agg] = np.where(np.isnan(xv), 0.0, xv)
    out = {}
    for f in spec.features:
        if f.window.us == window.us and f.agg in values:
            out[f.name] = values[f.agg]
            if f.default is not None:  # a declared default where the window holds nothing
                none = (
                    np.asarray(since_last_s, dtype=np.float64) > window.us / US
                    if f.agg in EXACT_WINDOW_AGGS
                    else c == 0
                )
                out[f.name] = np.where(none, f.default, values[f.agg])
    return out


# --- derived features ---------------------------------------------------------------------

# Request fields an expression may read besides features.
REQUEST_FIELDS = ("amount",)
_FUNCS: dict[str, Callable[..., Any]] = {
    "log1p": np.log1p,
    "abs": np.abs,
    "sqrt": lambda x: np.sqrt(np.maximum(x, 0.0)),
    "clip": np.clip,
    "minimum": np.minimum,
    "maximum": np.maximum,
    "where": np.where,
}
_BINOPS = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply}
_CMPS = {
    ast.Gt: np.greater,
    ast.GtE: np.greater_equal,
    ast.Lt: np.less,
    ast.LtE: np.less_equal,
    ast.Eq: np.equal,
    ast.NotEq: np.not_equal,
}


def _check_expr(expr: str, known: set[str]) -> None:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in known and node.id not in _FUNCS:
            raise ValueError(f"unknown name {node.id!r}")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in _FUNCS
        ):
            raise ValueError(f"only these functions: {', '.join(_FUNCS)}")
        ok = (
            ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.Compare, ast.Call,
            ast.Name, ast.Load, ast.Constant, ast.Div, *_BINOPS, *_CMPS,
        )  # fmt: skip
        if not isinstance(node, ok):
            raise ValueError(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ValueError("constants must be numbers")


def evaluate(expr: str, columns: Mapping[str, npt.ArrayLike]) -> np.ndarray:
    """An expression over float64 columns. ``a / b`` is 0 where ``b`` is 0 (write the
    default you want with ``where``); clipping is written in the expression."""
    return np.asarray(_compiled(expr)(columns), dtype=np.float64)


def _div(a: Any, b: Any) -> Any:
    b = np.asarray(b, dtype=np.float64)
    return np.where(b != 0, np.asarray(a) / np.where(b != 0, b, 1.0), 0.0)


def _chain(*parts: Any) -> Any:
    """A comparison (chained: ``0 < x < 3``) as 1.0 / 0.0."""
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return np.asarray(out).astype(np.float64)


# The names a compiled expression calls: numpy's operations, and each function by name.
_NAMESPACE: dict[str, Any] = {
    "__builtins__": {},
    "_col": lambda c, k: np.asarray(c[k], dtype=np.float64),
    "_div": _div,
    "_neg": operator.neg,
    "_chain": _chain,
    **{f"_op_{op.__name__}": fn for op, fn in _BINOPS.items()},
    **{f"_op_{op.__name__}": fn for op, fn in _CMPS.items()},
    **{f"_fn_{name}": fn for name, fn in _FUNCS.items()},
}


class _Compile(ast.NodeTransformer):
    """A checked expression (:func:`_check_expr`) as calls into :data:`_NAMESPACE`: the
    tree is walked once, not per evaluation."""

    @staticmethod
    def _call(name: str, *args: ast.expr) -> ast.Call:
        return ast.Call(ast.Name(name, ast.Load()), list(args), [])

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self._call("_col", ast.Name("c", ast.Load()), ast.Constant(node.id))

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Constant(float(node.value))  # type: ignore[arg-type]  # numbers only

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return self._call("_neg", self.visit(node.operand))

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        a, b = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Div):
            return self._call("_div", a, b)
        return self._call(f"_op_{type(node.op).__name__}", a, b)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        sides = [node.left, *node.comparators]
        parts = [
            self._call(f"_op_{type(op).__name__}", self.visit(x), self.visit(y))
            for op, x, y in zip(node.ops, sides, sides[1:], strict=False)
        ]
        return self._call("_chain", *parts)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        assert isinstance(node.func, ast.Name)
        return self._call(f"_fn_{node.func.id}", *(self.visit(a) for a in node.args))


@functools.lru_cache(maxsize=1024)  # derived features and reasons: per micro-batch
def _compiled(expr: str) -> Callable[[Mapping[str, npt.ArrayLike]], Any]:
    _check_expr(expr, _AnyName())
    body = _Compile().visit(ast.parse(expr, mode="eval").body)
    tree = ast.fix_missing_locations(ast.Expression(ast.Lambda(_lambda_args("c"), body)))
    fn: Callable[[Mapping[str, npt.ArrayLike]], Any] = eval(  # checked above
        compile(tree, f"<expression {expr!r}>", "eval"), _NAMESPACE
    )
    return fn


def _lambda_args(name: str) -> ast.arguments:
    return ast.arguments(
        posonlyargs=[], args=[ast.arg(name)], kwonlyargs=[], kw_defaults=[], defaults=[]
    )


class _AnyName(set[str]):
    """Every name is known: :func:`_check_expr` then checks the shape alone (the names
    were checked when the declarations were loaded)."""

    def __contains__(self, _name: object) -> bool:
        return True


def derived_columns(
    decl: Declarations, columns: Mapping[str, npt.ArrayLike], n: int
) -> dict[str, np.ndarray]:
    """Every derived feature, in declaration order (a later one may read an earlier)."""
    cols = dict(columns)
    out = {}
    for d in decl.derived:
        v = np.broadcast_to(evaluate(d.expr, cols), (n,)).astype(np.float64)
        out[d.name] = cols[d.name] = v
    return out


# --- the Redis layout and the recording script --------------------------------------------
#
# Per (spec, key), two keys sharing the hash tag {agg:<spec id>:<key>}:
#   <p>:t   hash: field "<u>" per tile width u, that width's tiles as packed records of
#           four little-endian doubles (tile index, count, sum, sum of squares; a state
#           with min or max: six, the tile's smallest and largest value after them), one per
#           tile holding events; it keeps the tiles of the last ``slots`` indexes (older
#           ones are dropped once the field holds more than ``slots``: no read reaches
#           them). Field "n": the NEWEST newest events, packed (ts µs, value) doubles in
#           time order. Fields "f" and "b": the oldest event time recorded live and
#           the newest recorded by a backfill (a backfill records only between them).
#   <p>:ids zset transaction_id -> ts, the last ``horizon`` of the key (idempotency)
# Both expire ``ttl`` after the key's last write. A read is one HMGET of the hash
# (:func:`queue_read`; no script), summed in the client, vectorized over a micro-batch
# (:func:`parse_reads`).
TILE = struct.Struct("<4d")
TILE_EXTREMES = struct.Struct("<6d")  # a state with min or max: (..., min, max)
NEWEST_REC = struct.Struct("<2d")
LAYOUT = 2  # in every state's id: a new layout starts new keys (backfill them)

# KEYS: t, ids of one or more keys of one spec. ARGV: horizon_us, newest, ttl_ms,
# backfill (1/0), dcap, dback_us, extremes (1/0: tiles of six doubles, with min and
# max), nwidths, (u, slots)*, then per key: nev,
# (id, ts, value)*. dcap > 0 (a state that keeps values): the events pushed out of the
# newest list update field "d" (per value code its newest time among them; values older
# than the key's newest by more than dback_us are dropped, then all but the dcap
# newest). Returns
# per key a list, per event 1 (added), 0 (duplicate, or a backfill's event the key
# holds already) or -1 (older than the key's newest by more than the horizon: dropped,
# as nothing live reads that far back). A key's events in one call are summed per tile
# first, and its hash read and written once.
_RECORD_FN = (
    """
-- A state's settings from ARGV[pos]: horizon_us, newest, ttl_ms, backfill (1/0), dcap,
-- dback_us, extremes (1/0), nwidths, (u, slots)*. Returns them (record's c) and the
-- position after.
local function config(pos)
  local nw = tonumber(ARGV[pos + 7])
  local widths, fields = {}, {}
  for w = 1, nw do
    local u = ARGV[pos + 6 + 2*w]
    widths[w] = {u, tonumber(u), tonumber(ARGV[pos + 7 + 2*w])}
    fields[w] = u
  end
  fields[nw + 1], fields[nw + 2], fields[nw + 3], fields[nw + 4] = 'n', 'f', 'b', 'd'
  -- a tile's record: 4 doubles, or 6 with its min and max
  local rs = ARGV[pos + 6] == '1' and 48 or 32
  return {tonumber(ARGV[pos]), tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2]),
    ARGV[pos + 3] == '1', tonumber(ARGV[pos + 4]), tonumber(ARGV[pos + 5]), nw, widths,
    fields, rs}, pos + 8 + 2 * nw
end
"""
    + """
-- Record one key's events: ``nev`` of them, ``ev(e)`` -> id, ts (µs), value (numbers).
local function record(kt, kid, c, nev, ev)
  local horizon, keep, ttl, backfill, dcap, dback, nw, widths, fields, rs = unpack(c)
  local held = redis.call('HMGET', kt, unpack(fields))
  local recent = held[nw + 1] or ''
  -- f: the oldest event recorded live; b: the newest recorded by a backfill
  local first = held[nw + 2] and tonumber(held[nw + 2])
  local back = held[nw + 3] and tonumber(held[nw + 3])
  local back0 = back  -- as before this call: events of one time all count (labels share one)
  local newest = nil
  if #recent > 0 then newest = struct.unpack('<d', recent, #recent - 15) end
  local out, tiles, added = {}, {}, false
  for w = 1, nw do tiles[w] = {} end
  for e = 1, nev do
    local id, ts, x = ev(e)
    if backfill and ((back0 and ts <= back0) or (first and ts >= first)) then
      out[e] = 0  -- recorded by an earlier backfill, or live (the stream has it)
    elseif redis.call('ZSCORE', kid, id) then
      out[e] = 0
    elseif newest and ts < newest - horizon then
      out[e] = -1
    else
      redis.call('ZADD', kid, ts, id)
      for w = 1, nw do
        local u = widths[w][2]
        local idx = (ts - math.fmod(ts, u)) / u
        local t = tiles[w][idx]
        if t == nil then t = {idx, 0, 0, 0, x, x}; tiles[w][idx] = t end
        t[2], t[3], t[4] = t[2] + 1, t[3] + x, t[4] + x * x
        if x < t[5] then t[5] = x end
        if x > t[6] then t[6] = x end
      end
      local at = #recent + 1  -- keep `recent` in time order: insert after any <= ts
      while at > 1 and struct.unpack('<d', recent, at - 16) > ts do at = at - 16 end
      recent = recent:sub(1, at - 1) .. struct.pack('<dd', ts, x) .. recent:sub(at)
      if not newest or ts > newest then newest = ts end
      if backfill then
        if not back or ts > back then back = ts end
      elseif not first or ts < first then
        first = ts
      end
      out[e] = 1
      added = true
    end
  end
  if added then
    local set = {}
    for w = 1, nw do
      local ring = held[w] or ''
      local grew = false
      for idx, t in pairs(tiles[w]) do
        local needle, at = struct.pack('<d', idx), 0
        repeat  -- the record of this tile, if held (a match must start a record)
          at = string.find(ring, needle, at + 1, true)
        until at == nil or at % rs == 1
        local rec
        if at and rs == 48 then
          local _, hc, hs, hq, lo, hi = struct.unpack('<dddddd', ring, at)
          rec = struct.pack('<dddddd', idx, t[2] + hc, t[3] + hs, t[4] + hq,
            math.min(t[5], lo), math.max(t[6], hi))
        elseif at then
          local _, hc, hs, hq = struct.unpack('<dddd', ring, at)
          rec = struct.pack('<dddd', idx, t[2] + hc, t[3] + hs, t[4] + hq)
        elseif rs == 48 then
          rec = struct.pack('<dddddd', idx, t[2], t[3], t[4], t[5], t[6])
        else
          rec = struct.pack('<dddd', idx, t[2], t[3], t[4])
        end
        if at then
          ring = ring:sub(1, at - 1) .. rec .. ring:sub(at + rs)
        else
          ring = ring .. rec
          grew = true
        end
      end
      local slots = widths[w][3]
      if grew and #ring > rs * slots then  -- keep the tiles of the last `slots` indexes
        local top, recs = -1, {}
        for at = 1, #ring, rs do
          local idx = struct.unpack('<d', ring, at)
          recs[#recs + 1] = {idx, at}
          if idx > top then top = idx end
        end
        local kept = {}
        for _, r in ipairs(recs) do
          if r[1] > top - slots then kept[#kept + 1] = ring:sub(r[2], r[2] + rs - 1) end
        end
        ring = table.concat(kept)
      end
      set[#set + 1] = widths[w][1]
      set[#set + 1] = ring
    end
    if #recent > 16 * keep then
      local cut = #recent - 16 * keep
      if dcap > 0 then  -- the values pushed out: their newest time per value
        local seen, d = {}, held[nw + 4] or ''
        for at = 1, #d, 16 do
          local c, ts = struct.unpack('<dd', d, at)
          seen[c] = ts
        end
        for at = 1, cut, 16 do
          local ts, c = struct.unpack('<dd', recent, at)
          if not seen[c] or seen[c] < ts then seen[c] = ts end
        end
        local recs = {}
        for c, ts in pairs(seen) do
          if ts >= newest - dback then recs[#recs + 1] = {ts, c} end
        end
        -- newest first, then by code: the same bytes however the values arrived
        table.sort(recs, function(x, y) return x[1] > y[1] or (x[1] == y[1] and x[2] < y[2]) end)
        for i = #recs, dcap + 1, -1 do recs[i] = nil end
        local out_d = {}
        for i, r in ipairs(recs) do out_d[i] = struct.pack('<dd', r[2], r[1]) end
        set[#set + 1] = 'd'
        set[#set + 1] = table.concat(out_d)
      end
      recent = recent:sub(cut + 1)
    end
    set[#set + 1] = 'n'
    set[#set + 1] = recent
    if first then set[#set + 1] = 'f'; set[#set + 1] = string.format('%d', first) end
    if back then set[#set + 1] = 'b'; set[#set + 1] = string.format('%d', back) end
    redis.call('HSET', kt, unpack(set))
    redis.call('ZREMRANGEBYSCORE', kid, '-inf', '(' .. string.format('%d', newest - horizon))
    redis.call('PEXPIRE', kt, ttl)
    redis.call('PEXPIRE', kid, ttl)
  end
  return out
end
"""
)
APPLY_LUA = (
    _RECORD_FN
    + """
local c, pos = config(1)
local result = {}
for g = 1, #KEYS / 2 do
  local nev, at = tonumber(ARGV[pos]), pos
  result[g] = record(KEYS[2*g - 1], KEYS[2*g], c, nev, function(e)
    return ARGV[at + 3*e - 2], tonumber(ARGV[at + 3*e - 1]), tonumber(ARGV[at + 3*e])
  end)
  pos = pos + 1 + 3 * nev
end
return result
"""
)
# KEYS: t, ids of each key of each state, in order. ARGV (lists as one text, each item
# followed by its separator): [1] n (rows), [2] the rows' transaction ids (each + "\x1f"),
# [3] their times in µs (each + ","), [4] ncols, then per value column the rows' values
# (each + ",", empty where a row has none), then nstates and per state: its settings
# (APPLY_LUA's, up to the keys), delay_us, its value column (1..ncols; 0: each event
# counts 1.0), then its keys' rows (1-based; per key "i,j,...;", in key order). Each
# key's events are recorded exactly as APPLY_LUA records them (id, ts + delay, value).
# Returns per state a string, one character per event of its keys in order: "1"
# (added), "0" (duplicate, or held by a backfill already) or "-" (dropped).
APPLY_STATES_LUA = (
    _RECORD_FN
    + """
local n = tonumber(ARGV[1])
local ids, times = {}, {}
for x in string.gmatch(ARGV[2], '([^\\031]*)\\031') do ids[#ids + 1] = x end
for x in string.gmatch(ARGV[3], '([^,]*),') do times[#times + 1] = tonumber(x) end
assert(#ids == n and #times == n, 'ids and times must hold n rows')
local ncol = tonumber(ARGV[4])
local cols = {}
for k = 1, ncol do
  local col = {}
  for x in string.gmatch(ARGV[4 + k], '([^,]*),') do col[#col + 1] = tonumber(x) or false end
  assert(#col == n, 'a value column must hold n rows')
  cols[k] = col
end
local pos, kpos = 6 + ncol, 1
local code = {[1] = '1', [0] = '0', [-1] = '-'}
local result = {}
for s = 1, tonumber(ARGV[5 + ncol]) do
  local c
  c, pos = config(pos)
  local delay, vals = tonumber(ARGV[pos]), cols[tonumber(ARGV[pos + 1])]
  local codes = {}
  for key in string.gmatch(ARGV[pos + 2], '([^;]*);') do
    local rows = {}
    for i in string.gmatch(key, '%d+') do rows[#rows + 1] = tonumber(i) end
    local out = record(KEYS[kpos], KEYS[kpos + 1], c, #rows, function(e)
      local i = rows[e]
      return ids[i], times[i] + delay, vals and vals[i] or 1.0
    end)
    for e = 1, #out do codes[#codes + 1] = code[out[e]] end
    kpos = kpos + 2
  end
  pos = pos + 3
  result[s] = table.concat(codes)
end
return result
"""
)
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

    @classmethod
    def for_spec(cls, spec: Spec, horizon_s: float) -> Limits:
        # A label state's events arrive out of time order by up to its ahead_us.
        back = int(horizon_s * US) + (spec.ahead_us if spec.arrivals else 0)
        return cls(back, ((spec.longest_us + spec.ahead_us + back) // US + 3600) * 1000)


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
        cat = spec.value_column if spec.categorical else None
        return (cat, tuple(sorted(spec.filter.items())))

    def mask(self, spec: Spec) -> list[bool] | None:
        """Which rows pass ``spec``'s filter and (a categorical value) have a value;
        None: all of them."""
        sig = self._filter_sig(spec)
        if sig in self._masks:
            return self._masks[sig]
        cat, _ = sig
        ok = [True] * len(self.rows)
        if cat is not None:
            ok = [not (v is None or v != v or v == "") for v in self.column(cat)]
        for c, allowed in spec.filter.items():
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
            cols = {
                c: [self._number(c, i, v) for i, v in enumerate(self.column(c))]
                for c in value_names(vc)
            }
            out = evaluate(vc, cols).tolist()
        else:
            out = [self._number(vc, i, v) for i, v in enumerate(self.column(vc))]
        self._values[vc] = out
        return out

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


@functools.lru_cache(maxsize=1 << 16)  # merchants, countries and cards recur
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


def _apply_head(spec: Spec, limits: Limits) -> list[Any]:
    """The ARGV of an :data:`APPLY_LUA` call before its keys' events."""
    head: list[Any] = [limits.horizon_us, NEWEST, limits.ttl_ms, int(limits.backfill)]
    dcap = DISTINCT_CAP if spec.keeps_values else 0
    head += [dcap, spec.distinct_back_us(limits.horizon_us), int(spec.keeps_extremes)]
    head.append(len(spec.widths))
    for u, slots in spec.widths.items():
        head += (u, slots)
    return head


def _queue_call(pipe: Any, spec: Spec, keys: Sequence[str], args: list[Any]) -> None:
    """One APPLY call for ``keys`` (``args``: its whole ARGV)."""
    names = [n for k in keys for p in (spec.prefix(k),) for n in (p + ":t", p + ":ids")]
    pipe.execute_command("EVALSHA", APPLY_SHA, len(names), *names, *args)


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

    head = _apply_head(spec, limits)
    for keys in [[k] for k in by_key] if per_key else [list(by_key)] if by_key else []:
        args = list(head)
        for key in keys:
            args.append(len(by_key[key]))
            for e in by_key[key]:
                args += (e.transaction_id, e.ts_us, repr(float(e.value)))
        _queue_call(pipe, spec, keys, args)
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
    head = _apply_head(spec, limits)
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
            _queue_call(pipe, spec, [key], [*head, *part])
    else:
        _queue_call(pipe, spec, keys, [*head, *flat(per)])
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
        args += _apply_head(spec, Limits.for_spec(spec, horizon_s))
        places = [
            at[idx[0]] if len(idx) == 1 else ",".join(map(at.__getitem__, idx))
            for idx in groups.values()
        ]
        args += (spec.delay_us, columns[spec.value_column], ";".join(places) + ";")
        names += [n for k in groups for p in (spec.prefix(k),) for n in (p + ":t", p + ":ids")]
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
        here = t_us // w.width_us
        for ts, v in ahead:  # included with the tile that holds t: not before t
            if ts // w.width_us == here:
                c, s, q = c - 1, s - v, q - v * v
        lo = here - w.tiles
        for ts, v in mates:
            if ts // w.width_us >= lo and not (spec.whole_tiles and ts // w.width_us >= here):
                c, s, q = c + 1, s + v, q + v * v
                mn, mx = min(mn, v), max(mx, v)
        if not exact:  # a replay: some later events were counted; never below nothing
            c, s, q = max(c, 0.0), max(s, 0.0), max(q, 0.0)
        out.update(_finish_one(spec, w, c, s, q, since, last, mn, mx))
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
    values["distinct_count"] = float(min(len(codes), DISTINCT_CAP))
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
) -> dict[str, float]:
    """:func:`finish` for one row on Python floats (the same IEEE operations, without
    numpy's per-call cost on the scorer's path); ``mn``, ``mx``: the window's smallest
    and largest value (inf, -inf: no event)."""
    mean = s / c if c > 0 else 0.0
    var = max(q / c - mean * mean, 0.0) if c > 0 else 0.0
    values = {
        "count": c,
        "sum": s,
        "mean": mean,
        "std": math.sqrt(var),
        "seconds_since_last": min(since, w.us / US),
        "last": last if since <= w.us / US else 0.0,
        "min": mn if mn != math.inf else 0.0,
        "max": mx if mx != -math.inf else 0.0,
    }
    return {f.name: values[f.agg] for f in spec.features if f.window.us == w.us and f.agg in values}


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
    if not per_key:
        states = queue_states(pipe, decl.specs, cols, horizon_s)
        if states:
            plan.writes.append((states, True, cols))
        return plan
    for spec in decl.specs:
        keys = queue_record(pipe, spec, cols, Limits.for_spec(spec, horizon_s), per_key=True)
        plan.writes += [([(spec, [k])], False, cols) for k in keys]
    return plan


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
    """The fields of a validated transaction (``fraud_scoring.events.Transaction``) a
    declaration reads."""
    return dict(zip(ROW_FIELDS, _row_of(txn), strict=True))


ROW_FIELDS = ("transaction_id", *KEY_COLUMNS, *VALUE_COLUMNS)
_row_of = operator.attrgetter(*ROW_FIELDS)  # one C call per transaction (the updater's)
