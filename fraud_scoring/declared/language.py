"""The declarations language: what a declaration may name (the key, value and filter
columns, the sources, the aggregations), its windows and their tile widths, and the
checked schema of ``feature_repo/features.yaml`` (:class:`AggregationDecl`,
:class:`DerivedDecl`, :class:`ReasonDecl`; :func:`read` reads the YAML). The states the
declarations compile to, and the semantics every engine shares: :mod:`.plan`.
"""

from __future__ import annotations

import ast
import math
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fraud_scoring.declared.expressions import _FUNCS, _check_expr, _parsed, value_names
from fraud_scoring.declared.kinds import DECAY_TILES, KINDS, kinds_where
from fraud_scoring.declared.kinds import DISTINCT_CAP as DISTINCT_CAP

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
# A team's declared fields (the ``fields`` section, ``fraud_scoring/fields.py``) are read
# by type: a string, category or bool field as a key, a filter or a categorical value,
# a number field as a value (or a name in a value's expression).
FIELD_KEY_TYPES = ("string", "category", "bool")
FIELD_VALUE_TYPES = ("number",)
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
# An arrival counts from the day after it arrived (plus FRAUD_BATCH_AVAILABLE_AFTER_S):
# its state keeps tiles this far ahead of the present beyond its delay.
LABEL_ROOM_US = 2 * 86_400 * US
# The aggregation kinds (one entry each in :data:`.kinds.KINDS`) and what they need.
if TYPE_CHECKING:
    Agg = str
else:
    Agg = Literal[tuple(KINDS)]
# A state whose events are not recorded as they happen (a delay, or labels, which the
# daily batch records) reads whole tiles, so only these aggregations.
WHOLE_TILE_AGGS = kinds_where(lambda k: k.whole_tiles)
NEEDS_VALUE = kinds_where(lambda k: k.reads == "number")
# Aggregations that keep, per tile, the smallest and largest value too.
EXTREMES = kinds_where(lambda k: k.extremes)
# Aggregations of a categorical value (a key column): a state keeps the values it saw.
NEEDS_CATEGORY = kinds_where(lambda k: k.reads == "category")
# Integer features (int64 columns): a declared default must be a whole number.
WHOLE_NUMBER_AGGS = kinds_where(lambda k: k.whole_number)
# Aggregations over the exact window (t - W up to t): empty when no event lies in it;
# the others are empty when the tile-snapped window holds no event.
EXACT_WINDOW_AGGS = kinds_where(lambda k: k.exact_window)


class DeclarationError(ValueError):
    """The declarations file is unreadable or breaks the language; the message names
    the file and the field."""


def field_types(raw: object) -> dict[str, str]:
    """The declared fields of a declarations document ``raw`` by name, their types (the
    ``fields`` section as written; ``fraud_scoring/fields.py`` checks it whole): what a
    declaration may read besides the contract's columns."""
    section = raw.get("fields") if isinstance(raw, dict) else None
    out: dict[str, str] = {}
    for f in section if isinstance(section, list) else ():
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out[f["name"]] = str(f.get("type"))
    return out


def field_values(raw: object) -> dict[str, tuple[str, ...]]:
    """The declared category fields of ``raw`` by name, their values (a filter on one
    names some of them)."""
    section = raw.get("fields") if isinstance(raw, dict) else None
    out: dict[str, tuple[str, ...]] = {}
    for f in section if isinstance(section, list) else ():
        if isinstance(f, dict) and f.get("type") == "category" and isinstance(f.get("name"), str):
            out[f["name"]] = tuple(map(str, f.get("values") or ()))
    return out


def _fields(info: ValidationInfo | None) -> Mapping[str, str]:
    """The declared fields a validation was given (:func:`field_types`; none: {})."""
    ctx = info.context if info is not None else None
    return ctx.get("fields", {}) if isinstance(ctx, dict) else {}


def _field_use(name: str, types: Mapping[str, str], allowed: Sequence[str], what: str) -> bool:
    """Whether ``name`` is a declared field usable as ``what`` (its type among
    ``allowed``); a declared field of another type is refused naming it."""
    if name not in types:
        return False
    if types[name] not in allowed:
        raise ValueError(
            f"{name!r} is a {types[name]} field: {what} is a {' or '.join(allowed)} field"
        )
    return True


def known_filter(
    v: dict[str, tuple[str, ...]],
    fields: Mapping[str, str] | None = None,
    values: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, tuple[str, ...]]:
    """A declaration's ``filter``, refused when it names a column that is not a key
    column, a declared string/category/bool field (``fields``: name -> type) or a
    decision's own (``source: decisions`` is checked by :func:`parse`), or a value a
    category field (``values``: its values) or a bool field (true, false) cannot hold."""
    known = (*KEY_COLUMNS, *ARRIVAL_FILTER_COLUMNS)
    for c, allowed in v.items():
        if c not in known and not _field_use(c, fields or {}, FIELD_KEY_TYPES, "a filter"):
            extra = f", or a declared {'/'.join(FIELD_KEY_TYPES)} field" if fields else ""
            raise ValueError(f"unknown column {c!r}; one of {', '.join(known)}{extra}")
        kind = (fields or {}).get(c)
        can = ("true", "false") if kind == "bool" else (values or {}).get(c, ())
        if kind in ("bool", "category") and (bad := [x for x in allowed if x not in can]):
            raise ValueError(f"{c}: {bad[0]!r} is not one of its values ({', '.join(can)})")
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
    """The tile width of a window (see :mod:`fraud_scoring.declared.plan`)."""
    return max(u for u in TILE_WIDTHS_US if window_us % u == 0 and window_us // u >= MIN_TILES)


def tile_of(ts_us: int, width_us: int) -> int:
    return ts_us // width_us


def window_label(us: int) -> str:
    """Microseconds as the shortest window text: 2_592_000_000_000 -> ``"30d"``."""
    for unit, size in sorted(UNITS.items(), key=lambda kv: -kv[1]):
        if us % size == 0:
            return f"{us // size}{unit}"
    raise AssertionError(us)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KindParams(_Strict):
    """A feature of a kind that takes parameters (:attr:`.kinds.Kind.params`):
    ``{decayed_sum: {name: card_amount_decayed, half_life: 1h}}``."""

    name: str = Field(description="the feature name prefix")
    half_life: str | None = Field(
        default=None,
        description="decayed_sum: the time in which an event's weight halves (1m-180d)",
    )

    @field_validator("half_life")
    @classmethod
    def _half_life(cls, v: str | None) -> str | None:
        if v is not None:
            parse_window(v)
        return v


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
    features: dict[Agg, KindParams] = Field(
        description="aggregation -> feature name prefix, or for a kind with parameters "
        "{name: prefix, <parameter>: value} (decayed_sum: half_life)"
    )
    description: str = ""

    @field_validator("entity", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("filter", mode="before")
    @classmethod
    def _values(cls, v: Any) -> Any:
        # A bool field's values as text: true, false (what every engine compares).
        if isinstance(v, dict):
            return {
                k: tuple(str(y).lower() if isinstance(y, bool) else y for y in x)
                if isinstance(x, list | tuple)
                else (str(x).lower() if isinstance(x, bool) else x,)
                for k, x in v.items()
            }
        return v

    @field_validator("entity")
    @classmethod
    def _known_key(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if not v:
            raise ValueError("needs at least one column")
        fields = _fields(info)
        for c in v:
            if c not in KEY_COLUMNS and not _field_use(c, fields, FIELD_KEY_TYPES, "a key"):
                extra = f", or a declared {'/'.join(FIELD_KEY_TYPES)} field" if fields else ""
                raise ValueError(f"unknown column {c!r}; one of {', '.join(KEY_COLUMNS)}{extra}")
        return v

    @field_validator("filter")
    @classmethod
    def _known_filter(
        cls, v: dict[str, tuple[str, ...]], info: ValidationInfo
    ) -> dict[str, tuple[str, ...]]:
        ctx = info.context if isinstance(info.context, dict) else {}
        return known_filter(v, _fields(info), ctx.get("values", {}))

    @field_validator("value")
    @classmethod
    def _known_value(cls, v: str | None, info: ValidationInfo) -> str | None:
        fields = _fields(info)
        numbers = (*VALUE_COLUMNS, *ARRIVAL_VALUE_COLUMNS)
        known = (*numbers, *KEY_COLUMNS)
        if v is None or v in known:
            return v
        if v in fields:
            _field_use(v, fields, (*FIELD_VALUE_TYPES, *FIELD_KEY_TYPES), "a value")
            return v
        declared = [n for n, t in fields.items() if t in FIELD_VALUE_TYPES]
        if v.isidentifier():
            more = ", a declared field" if fields else ""
            raise ValueError(
                f"unknown column {v!r}; one of {', '.join(known)}{more}, or an expression "
                f"over {', '.join((*numbers, *declared))}"
            )
        _check_expr(v, {*numbers, *fields})
        for name in sorted(value_names(v) & set(fields)):
            _field_use(name, fields, FIELD_VALUE_TYPES, "a name in a value's expression")
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

    @field_validator("features", mode="before")
    @classmethod
    def _prefixes(cls, v: Any) -> Any:
        """A plain prefix is the parameters {name: prefix}."""
        if isinstance(v, dict):
            return {k: {"name": x} if isinstance(x, str) else x for k, x in v.items()}
        return v

    def prefix(self, agg: str) -> str:
        """The feature name prefix of ``agg``'s features."""
        return self.features[agg].name

    def half_life_us(self, agg: str) -> int:
        """``agg``'s half-life in µs (0: none)."""
        v = self.features[agg].half_life
        return parse_window(v) if v else 0

    @model_validator(mode="after")
    def _params(self) -> AggregationDecl:
        for agg, v in self.features.items():
            wanted = KINDS[agg].params
            given = {k for k in ("half_life",) if getattr(v, k, None) is not None}
            if missing := [p for p in wanted if p not in given]:
                raise ValueError(
                    f"features: {agg}: needs {', '.join(missing)} "
                    f"({{{agg}: {{name: <prefix>, {missing[0]}: 1h}}}})"
                )
            if extra := sorted(given - set(wanted)):
                raise ValueError(f"features: {agg}: takes no {', '.join(extra)}")
            if half := self.half_life_us(agg):
                for w in self.windows:
                    width = tile_width(parse_window(w))
                    if width > DECAY_TILES * half:
                        raise ValueError(
                            f"features: {agg}: half_life {v.half_life} is too short for "
                            f"window {w} (tiles of {width // US} s): at least "
                            f"{-(-width // DECAY_TILES) // US} s"
                        )
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
    "STALE_CARD_HISTORY",
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
    fields: Any = ()  # a team's own transaction fields: fraud_scoring/fields.py checks them


def read(path: Path) -> object:
    """The YAML document in ``path`` (raises :class:`DeclarationError`)."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise DeclarationError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise DeclarationError(f"{path}: not YAML: {exc}") from None
