"""The compiled declarations (:func:`load`, :func:`parse`): the states every engine
keeps (:class:`Spec`, one per entity, value and filter, with the union of its windows),
and the math every engine shares (:func:`finish`, :func:`derived_columns`).

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
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from fraud_scoring.declared import kinds
from fraud_scoring.declared.expressions import (
    REQUEST_FIELDS,
    _check_expr,
    evaluate,
    is_expression,
    value_names,
)
from fraud_scoring.declared.kinds import Sums
from fraud_scoring.declared.language import (
    ARRIVALS,
    EXTREMES,
    FIELD_KEY_TYPES,
    FIELD_VALUE_TYPES,
    FUTURE_ROOM_US,
    KEY_COLUMNS,
    LABEL_ROOM_US,
    NEEDS_CATEGORY,
    NEEDS_VALUE,
    SOURCE_FILTERS,
    SOURCE_VALUES,
    US,
    VALUE_COLUMNS,
    WHOLE_TILE_AGGS,
    AggregationDecl,
    DeclarationError,
    DeclarationsFile,
    DerivedDecl,
    ReasonDecl,
    field_types,
    field_values,
    parse_window,
    read,
    tile_width,
    window_label,
)
from fraud_scoring.feature_specs import BatchView

# A tile's record in Redis (:mod:`.redis_tiles`): index, count, sum, sum of squares.
TILE = struct.Struct("<4d")
TILE_EXTREMES = struct.Struct("<6d")  # a state with min or max: (..., min, max)
LAYOUT = 2  # in every state's id: a new layout starts new keys (backfill them)


def tile_doubles(shape: tuple[bool, tuple[int, ...]]) -> int:
    """The doubles in a tile record of ``shape`` (:attr:`Spec.tile_shape`)."""
    return 4 + 2 * shape[0] + len(shape[1])


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
    half_life_us: int = 0  # decayed_sum's

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
    # The half-lives of its decayed sums: its tiles keep one decayed sum per half-life.
    half_lives: tuple[int, ...] = ()
    # The team's declared fields it reads (key, value, filter), with their types.
    fields: tuple[tuple[str, str], ...] = ()

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
        """The value is a key column (a merchant, a country) or a declared string,
        category or bool field: its values are kept, not summed."""
        return (
            self.value_column in KEY_COLUMNS
            or dict(self.fields).get(self.value_column or "") in FIELD_KEY_TYPES
        )

    @cached_property
    def required(self) -> tuple[str, ...]:
        """The columns an event must have to be recorded: a categorical value, and the
        declared number fields its value reads (an event without one is not counted)."""
        if self.categorical:
            return (self.value_column,)  # type: ignore[return-value]
        numbers = {n for n, t in self.fields if t in FIELD_VALUE_TYPES}
        return tuple(sorted(value_names(self.value_column) & numbers))

    @cached_property  # read per state and micro-batch: derived once
    def filter_signature(self) -> tuple[Any, ...]:
        """What decides which rows this state records: the columns it requires and its
        filter (states that share it share their rows' mask)."""
        return (self.required, tuple(sorted(self.row_filter)))

    @cached_property
    def row_filter(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """The filter as the row engines compare it: a bool field's ``true``/``false``
        also as Python's bools (the SQL engines compare it as text)."""
        bools = {n for n, t in self.fields if t == "bool"}
        out = []
        for c, allowed in self.filter.items():
            extra = tuple(v == "true" for v in allowed) if c in bools else ()
            out.append((c, (*allowed, *extra)))
        return tuple(out)

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
    def tile_shape(self) -> tuple[bool, tuple[int, ...]]:
        """What a tile's record holds after (index, count, sum, sum of squares): min and
        max or not, then a decayed sum per half-life (µs)."""
        return self.keeps_extremes, self.half_lives

    @cached_property
    def tile(self) -> struct.Struct:
        """A tile's record: :data:`TILE`, :data:`TILE_EXTREMES` (min, max), then a
        decayed sum per half-life."""
        return struct.Struct(f"<{tile_doubles(self.tile_shape)}d")

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
        if any(_empty(row.get(c)) for c in self.required):
            return False
        return all(row.get(c) in allowed for c, allowed in self.row_filter)

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
    # The team's declared fields (the file's ``fields`` section), by name and type.
    fields: tuple[tuple[str, str], ...] = ()

    @cached_property
    def number_fields(self) -> tuple[str, ...]:
        """The declared number fields: request fields a derived expression or a reason
        may read (NaN where a transaction has none)."""
        return tuple(n for n, t in self.fields if t in FIELD_VALUE_TYPES)

    @cached_property
    def field_reads(self) -> tuple[str, ...]:
        """The declared number fields the derived features and reasons read: the request
        columns :func:`derived_columns` needs beside the contract's (none: nothing to
        read per transaction)."""
        names: set[str] = set()
        for expr in [*(d.expr for d in self.derived), *(r.when for r in self.reasons)]:
            names |= {
                n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)
            }
        names |= {n for r in self.reasons for n in r.reads()}
        return tuple(n for n in self.number_fields if n in names)

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

    def defaults(self) -> Mapping[str, float]:
        """Each aggregation's value without a key (read-only; kept: every micro-batch
        asks)."""
        return self._defaults

    @cached_property
    def _defaults(self) -> Mapping[str, float]:
        return MappingProxyType({f.name: f.fallback for s in self.specs for f in s.features})


EMPTY = Declarations((), (), "nothing declared")


def _empty(v: Any) -> bool:
    return v is None or v != v or v == ""


# Merchants, countries and cards recur; typed: 1 and 1.0 are "1" and "1.0".
@functools.lru_cache(maxsize=1 << 16, typed=True)
def value_code(v: Any) -> float:
    """A categorical value as the number a state records: 48 bits of its BLAKE2b hash
    (exact in a double; two values share a code with probability ~2**-48 per pair)."""
    digest = hashlib.blake2b(str(v).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def compile_decls(
    decls: Sequence[AggregationDecl], fields: Mapping[str, str] | None = None
) -> tuple[Spec, ...]:
    """Group declarations by (entity, value, filter) into the states they share;
    ``fields``: the declared fields by name, their types (:func:`field_types`)."""
    fields = fields or {}
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
        # And one whose tiles keep decayed sums (one per half-life).
        half_lives = tuple(sorted({d.half_life_us(a) for d in ds for a in d.features} - {0}))
        if half_lives:
            canon += "+decayed" + repr(half_lives)
        # The id covers the windows: a new window starts a new state (backfill it).
        # and the storage layout: a new layout starts new keys too.
        sid = hashlib.blake2b(
            (canon + repr(sorted(windows)) + f"L{LAYOUT}").encode(), digest_size=5
        ).hexdigest()
        feats = []
        for d in ds:
            for agg in d.features:
                for label in d.windows:
                    us = parse_window(label)
                    win = Window(label, us, tile_width(us))
                    name = f"{d.prefix(agg)}_{label}"
                    feats.append(Declared(agg, name, win, d.default_of(agg), d.half_life_us(agg)))
        first = ds[0]
        reads = {*first.entity, *value_names(first.value), *first.filter}
        used = tuple((n, t) for n, t in fields.items() if n in reads)
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
                half_lives,
                used,
            )
        )
    return tuple(specs)


def parse(raw: object, source: str, taken: Sequence[str] = ()) -> Declarations:
    """Check and compile declarations (the YAML document ``raw``); ``taken`` are the
    feature names already declared elsewhere. Raises :class:`DeclarationError`."""
    fields = field_types(raw)
    try:
        doc = DeclarationsFile.model_validate(
            raw if raw is not None else {},
            context={"fields": fields, "values": field_values(raw)},
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise DeclarationError(f"{source}: {loc}: {first['msg']}") from None
    field_numbers = tuple(n for n, t in fields.items() if t in FIELD_VALUE_TYPES)
    field_cats = tuple(n for n, t in fields.items() if t in FIELD_KEY_TYPES)
    categories = (*KEY_COLUMNS, *field_cats)
    for i, d in enumerate(doc.aggregations):
        numbers = (*VALUE_COLUMNS, *SOURCE_VALUES.get(d.source, ()), *field_numbers)
        reads = value_names(d.value)
        own = sorted(({*d.entity, *d.filter} | reads) & set(fields))
        if own and d.source != "transactions":
            raise DeclarationError(
                f"{source}: aggregations.{i}: {', '.join(own)}: a declared field is read "
                f"by a state of transactions only (source: {d.source} carries the contract's "
                "columns)"
            )
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
        if "decayed_sum" in d.features and d.value in categories:
            raise DeclarationError(
                f"{source}: aggregations.{i}.value: decayed_sum needs a number column "
                f"({', '.join(numbers)}), an expression over them, or none (each event 1)"
            )
        if NEEDS_CATEGORY & set(d.features) and d.value not in categories:
            raise DeclarationError(
                f"{source}: aggregations.{i}.value: distinct_count/changed need a "
                f"categorical column ({', '.join(categories)})"
            )
    decl = Declarations(
        compile_decls(doc.aggregations, fields),
        doc.derived,
        source,
        reasons=doc.reasons,
        fields=tuple(fields.items()),
    )
    seen = set(taken)
    for n in decl.names():
        if n in seen:
            raise DeclarationError(f"{source}: feature {n!r} is declared twice")
        seen.add(n)
    known = set(taken) | set(decl.aggregate_names()) | set(REQUEST_FIELDS)
    known |= set(decl.number_fields)
    for i, dd in enumerate(decl.derived):
        try:
            _check_expr(dd.expr, known)
        except ValueError as exc:
            raise DeclarationError(f"{source}: derived.{i}.expr: {exc}") from None
        known.add(dd.name)
    return decl


def load(path: Path, taken: Sequence[str] = ()) -> Declarations:
    """The aggregations and derived features in ``path`` (YAML), checked and compiled
    (:func:`fraud_scoring.features.load_declarations` adds the snapshot views)."""
    return parse(read(path), str(path), taken)


DEFAULT_PATH = Path(__file__).resolve().parent.parent.parent / "feature_repo" / "features.yaml"


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
    decayed: Mapping[int, npt.ArrayLike] | None = None,
) -> dict[str, np.ndarray]:
    """The declared features over ``window`` from its sums, and (a state that keeps
    values) its distinct values and changed flags, the newest event's value (``last``;
    NaN: none), the window's smallest and largest values (NaN: no event) and its decayed
    sums by half-life (µs) (float64 columns), each by its kind's finish (:mod:`.kinds`)."""

    def col(x: npt.ArrayLike | None, none: float) -> np.ndarray:
        return np.asarray(none if x is None else x, dtype=np.float64)

    c = col(count, 0.0)
    sums = Sums(
        c,
        col(total, 0.0),
        col(squares, 0.0),
        col(since_last_s, np.inf),
        window.us / US,
        col(last, np.nan),
        col(minimum, np.nan),
        col(maximum, np.nan),
        col(distinct, 0.0),
        col(changed, 0.0),
    )
    out = {}
    for f in spec.features:
        if f.window.us == window.us:
            at = sums
            if f.half_life_us:
                at = dataclasses.replace(sums, decayed=col((decayed or {})[f.half_life_us], 0.0))
            v = np.broadcast_to(kinds.finish(f.agg, at), c.shape).astype(np.float64)
            if f.default is not None:  # a declared default where the window holds nothing
                v = np.where(kinds.empty(f.agg, sums), f.default, v)
            out[f.name] = v
    return out


def derived_columns(
    decl: Declarations, columns: Mapping[str, npt.ArrayLike], n: int
) -> dict[str, np.ndarray]:
    """Every derived feature, in declaration order (a later one may read an earlier)."""
    cols = dict(columns)
    out = {}
    for d in decl.derived:
        v = evaluate(d.expr, cols)
        if v.shape != (n,):  # a constant, or a constant's part
            v = np.broadcast_to(v, (n,))
        out[d.name] = cols[d.name] = v.astype(np.float64)  # its own (never another's)
    return out
