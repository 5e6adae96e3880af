"""Daily snapshot features declared as data: the ``snapshots`` section of
``feature_repo/features.yaml``.

A snapshot view is one Feast feature view over one entity (a key column: ``card_id``,
``merchant_id``, ``device_id``, ...). For each day ``D`` the daily batch computes one row
per key that has a transaction in the view's ``window`` before ``D+1 00:00 UTC`` (the
snapshot time), from transactions strictly before that instant and labels that had
*arrived* before it; the row is materialized into the online store through Feast and
joined point-in-time by training. One SQL statement per view is generated from these
declarations (``batch_jobs/daily_features.py``) and run as written by DuckDB and Spark.

Aggregations (``window``: the feature's own, at most the view's; default the view's):

=======================  =========================================================  ======
``count``                transactions in the window                                 int64
``sum`` ``mean``         of ``value`` (a number column) over the window's           float
``std`` ``min`` ``max``  transactions; ``std`` is the population deviation
``distinct_count``       distinct values of ``value`` (a key column)                int64
``most_frequent``        the most frequent value of ``value`` (ties: the smallest)  string
``fraud_count``          transactions with a fraud label that arrived before the    int64
                         snapshot time
``fraud_rate``           ``fraud_count`` / ``count``                                float
``days_since_first_seen``  days from the key's first transaction (all history)      float
``snapshot_time``        the snapshot time, epoch seconds (never a model input)     int64
=======================  =========================================================  ======

A key without a transaction in a feature's window gets 0 for ``count``, ``sum``,
``distinct_count`` and ``fraud_count`` and no value (its default, listed as missing)
for the others. Transactions without a key (an empty ``device_id``, say) are in no
view. A ``filter`` (column -> allowed values) restricts a feature's
transactions like an aggregation's. A team's declared fields (the ``fields`` section)
are values and filters as in an aggregation: a number field for ``sum`` ... ``max`` (a
transaction without one is not in them), a string, category or bool field for
``distinct_count``, ``most_frequent`` and a filter; a view's entity is a contract key.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from fraud_scoring.declared import (
    KEY_COLUMNS,
    US,
    VALUE_COLUMNS,
    DeclarationError,
    _Strict,
    known_filter,
    parse_window,
)
from fraud_scoring.declared.language import (
    FIELD_KEY_TYPES,
    FIELD_VALUE_TYPES,
    field_types,
    field_values,
)
from fraud_scoring.feature_specs import BatchView, Feature, SnapshotAgg

SnapshotAggName = Literal[
    "count",
    "sum",
    "mean",
    "std",
    "min",
    "max",
    "distinct_count",
    "most_frequent",
    "fraud_count",
    "fraud_rate",
    "days_since_first_seen",
    "snapshot_time",
]
NUMBER_AGGS = {"sum", "mean", "std", "min", "max"}
CATEGORY_AGGS = {"distinct_count", "most_frequent"}
NO_WINDOW = {"days_since_first_seen", "snapshot_time"}
INT_AGGS = {"count", "distinct_count", "fraud_count", "snapshot_time"}
# Aggregations that are 0, not missing, for a key without transactions in the window.
ZERO_WHEN_EMPTY = {"count", "sum", "distinct_count", "fraud_count"}


class SnapshotFeatureDecl(_Strict):
    """One snapshot feature."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    agg: SnapshotAggName
    value: str | None = Field(default=None, description="the column the aggregation reads")
    window: str | None = Field(default=None, description="at most the view's; default it")
    filter: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    default: float | str | None = None
    description: str = ""

    @field_validator("filter", mode="before")
    @classmethod
    def _values(cls, v: Any) -> Any:
        # A bool field's values as text: true, false (what the SQL compares).
        def text(x: Any) -> Any:
            return str(x).lower() if isinstance(x, bool) else x

        if isinstance(v, dict):
            return {
                k: tuple(map(text, x)) if isinstance(x, list | tuple) else (text(x),)
                for k, x in v.items()
            }
        return v

    @field_validator("filter")
    @classmethod
    def _known_filter(
        cls, v: dict[str, tuple[str, ...]], info: ValidationInfo
    ) -> dict[str, tuple[str, ...]]:
        ctx = info.context if isinstance(info.context, dict) else {}
        return known_filter(v, ctx.get("fields", {}), ctx.get("values", {}))

    @field_validator("window")
    @classmethod
    def _window(cls, v: str | None) -> str | None:
        if v is not None:
            parse_window(v)
        return v


class SnapshotDecl(_Strict):
    """One snapshot view: an entity's daily features."""

    view: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="the Feast feature view")
    entity: str = Field(description="the key column (one of the transaction key columns)")
    window: str = Field(description="a key has a row when it transacted in this window")
    ttl: str = Field(default="2d", description="a snapshot older than this is stale")
    features: tuple[SnapshotFeatureDecl, ...]
    description: str = ""

    @field_validator("entity")
    @classmethod
    def _key(cls, v: str) -> str:
        if v not in KEY_COLUMNS:
            raise ValueError(f"unknown column {v!r}; one of {', '.join(KEY_COLUMNS)}")
        return v

    @field_validator("window", "ttl")
    @classmethod
    def _window(cls, v: str) -> str:
        parse_window(v)
        return v


class SnapshotsFile(_Strict):
    snapshots: tuple[SnapshotDecl, ...] = ()


def entity_name(join_key: str) -> str:
    """The Feast entity of a key column: ``card_id`` -> ``card``."""
    return join_key.removesuffix("_id")


def _feature(view: SnapshotDecl, f: SnapshotFeatureDecl, window_label: str) -> Feature:
    string = f.agg == "most_frequent"
    dtype = "string" if string else "int64" if f.agg in INT_AGGS else "float32"
    zero = 0 if dtype == "int64" else 0.0
    default = f.default if f.default is not None else ("" if string else zero)
    what = f"{f.agg.replace('_', ' ')}" + (f" of {f.value}" if f.value else "")
    span = "" if f.agg in NO_WINDOW else f", {window_label}"
    return Feature(
        f.name,
        "batch",
        dtype,  # type: ignore[arg-type]
        default,
        f.description or f"{what}{span} (daily snapshot per {entity_name(view.entity)})",
        entity_name(view.entity),
        model_input=not string and f.agg != "snapshot_time",
    )


def parse(raw: object, source: str) -> tuple[BatchView, ...]:
    """Check and compile the ``snapshots`` section of the declarations document ``raw``.
    Raises :class:`DeclarationError` naming the field."""
    section = raw.get("snapshots", ()) if isinstance(raw, dict) else ()
    fields = field_types(raw)
    numbers = (*VALUE_COLUMNS, *(n for n, t in fields.items() if t in FIELD_VALUE_TYPES))
    categories = (*KEY_COLUMNS, *(n for n, t in fields.items() if t in FIELD_KEY_TYPES))
    try:
        doc = SnapshotsFile.model_validate(
            {"snapshots": section or ()},
            context={"fields": fields, "values": field_values(raw)},
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise DeclarationError(f"{source}: {loc}: {first['msg']}") from None
    views, names, keys = [], set(), set()
    for i, v in enumerate(doc.snapshots):
        where = f"{source}: snapshots.{i}"
        if v.view in names:
            raise DeclarationError(f"{where}.view: {v.view!r} is declared twice")
        if v.entity in keys:
            raise DeclarationError(f"{where}.entity: {v.entity!r} has a view already")
        names.add(v.view)
        keys.add(v.entity)
        view_us = parse_window(v.window)
        feats, aggs = [], []
        for j, f in enumerate(v.features):
            at = f"{where}.features.{j}"
            if f.agg in NUMBER_AGGS and f.value not in numbers:
                raise DeclarationError(
                    f"{at}.value: {f.agg} needs a number column ({', '.join(numbers)})"
                )
            if f.agg in CATEGORY_AGGS and f.value not in categories:
                raise DeclarationError(
                    f"{at}.value: {f.agg} needs a key column or a declared "
                    f"{'/'.join(FIELD_KEY_TYPES)} field ({', '.join(categories)})"
                )
            if f.agg == "most_frequent" and fields.get(f.value or "") == "bool":
                raise DeclarationError(f"{at}.value: most_frequent reads a text, not a bool")
            if f.agg not in NUMBER_AGGS | CATEGORY_AGGS and f.value is not None:
                raise DeclarationError(f"{at}.value: {f.agg} reads no value")
            if f.agg in NO_WINDOW and (f.window is not None or f.filter):
                raise DeclarationError(f"{at}: {f.agg} takes no window and no filter")
            us = parse_window(f.window) if f.window else view_us
            if us > view_us:
                raise DeclarationError(
                    f"{at}.window: {f.window} is longer than the view's window {v.window}"
                )
            label = f.window or v.window
            if f.agg in NO_WINDOW:
                us, label = 0, "all"
            feats.append(_feature(v, f, label))
            aggs.append(
                SnapshotAgg(f.name, f.agg, f.value, us, label, tuple(sorted(f.filter.items())))
            )
        views.append(
            BatchView(
                v.view,
                entity_name(v.entity),
                v.entity,
                timedelta(microseconds=parse_window(v.ttl)),
                view_us,
                tuple(feats),
                tuple(aggs),
                v.description,
            )
        )
    return tuple(views)


def window_days(view: BatchView) -> int:
    """Whole days of raw history the view's window can touch (its partitions)."""
    return -(-view.window_us // (86_400 * US))
