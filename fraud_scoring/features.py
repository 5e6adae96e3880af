"""Every feature the model can use, declared once.

Three kinds of feature:

* **batch** (snapshot) features, declared in the ``snapshots`` section of
  ``feature_repo/features.yaml`` (:mod:`fraud_scoring.snapshots`): computed by the daily
  job from one SQL statement per view generated from the declarations
  (``batch_jobs/daily_features.py``), written to parquet, served through Feast (a view
  and an entity per declared view: ``feature_repo/definitions.py``) and joined
  point-in-time by the training job.
* **request** features, written here: computed from the transaction itself and the
  batch values by :func:`request_features`, a pure function over columns that the
  scoring service and the training-set builder both call.
* **declared** aggregations and derived features (the same file): windowed
  aggregations on any entity, kept in tiles by the streaming updater and the scorer
  (``fraud_scoring/declared.py``), and derived expressions over all the others.

:func:`build_features` assembles every column the model can read from (batch snapshot
columns, declared aggregations, the transactions themselves): the scoring service and
the training-set builder both call it and differ only in how they fetch its inputs.

``default`` is what a missing or stale value becomes; the response lists such features.
The declaration types are in ``fraud_scoring/feature_specs.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from fraud_scoring import declared, session, snapshots
from fraud_scoring.declared.file_errors import field_lines, load_every_error
from fraud_scoring.feature_specs import BatchView, Feature, Kind

_R: Kind = "request"
# A card with a narrow 30-day spread gives huge z-scores for an ordinary amount: clipped.
ZSCORE_CLIP = 50.0
REQUEST_FEATURES: tuple[Feature, ...] = (
    Feature("amount", _R, "float32", 0.0, "transaction amount (as sent, no FX conversion)"),
    Feature("amount_log", _R, "float32", 0.0, "log1p(amount)"),
    Feature("amount_to_card_mean_30d", _R, "float32", 1.0, "amount / card 30d mean amount"),
    Feature(
        "amount_zscore_30d",
        _R,
        "float32",
        0.0,
        "(amount - mean) / std over the card's 30-day snapshot, clipped to [-50, 50] "
        "(0 without a spread)",
    ),
    Feature(
        "hour_of_day_local",
        _R,
        "float32",
        0.0,
        "hour (0-23) of the event in its own UTC offset: the RFC 3339 offset it was sent "
        "with (raw history: utc_offset_min); an epoch event time counts as UTC",
    ),
    Feature("is_foreign_country", _R, "float32", 0.0, "country differs from card top country"),
    Feature("channel_ecom", _R, "float32", 0.0, "1 when channel is ecom"),
    Feature("channel_atm", _R, "float32", 0.0, "1 when channel is atm"),
    Feature("has_device_id", _R, "float32", 0.0, "1 when a device id was sent"),
)


Columns = Mapping[str, npt.ArrayLike]


def view_features(view: BatchView) -> tuple[Feature, ...]:
    return view.features


def views() -> tuple[BatchView, ...]:
    """The daily snapshot views (the ``snapshots`` section of the declarations)."""
    return declarations().views


def batch_features() -> tuple[Feature, ...]:
    """Every snapshot feature, view by view."""
    return tuple(f for v in views() for f in v.features)


def hand_written_features() -> dict[str, Feature]:
    """The features written in this module (request), by name."""
    return {f.name: f for f in REQUEST_FEATURES}


def hand_written_names() -> list[str]:
    return list(hand_written_features())


# What :func:`request_features` reads from the snapshots: the declarations must hold them.
REQUEST_READS = ("card_amount_mean_30d", "card_amount_std_30d", "card_top_country_30d")


def load_declarations(path: Path) -> declared.Declarations:
    """Every declaration in ``path``: the snapshot views, the aggregations and the
    derived features. Names must be unique across them and the hand-written ones, and
    the snapshots must hold what the request features read. One
    :class:`declared.DeclarationError` lists every problem of the file, with its line."""
    raw = declared.read(path)
    lines = field_lines(path.read_text())
    return load_every_error(
        raw,
        str(path),
        lines,
        lambda doc, known: _declarations(doc, str(path), known),
        hand_written_names(),
    )


def _declarations(raw: object, source: str, known: Sequence[str]) -> declared.Declarations:
    """The declarations of the document ``raw``; ``known``: names declared elsewhere
    (raises :class:`declared.DeclarationError` at the first problem)."""
    views = snapshots.parse(raw, source)
    taken = [*hand_written_names(), *known]
    for f in (f for v in views for f in v.features):
        if f.name in taken:
            raise declared.DeclarationError(f"{source}: feature {f.name!r} is declared twice")
        taken.append(f.name)
    decl = dataclasses.replace(declared.parse(raw, source, taken), views=views)
    strings = {f.name for v in views for f in v.features if f.dtype == "string"}
    strings |= {f.name for f in REQUEST_FEATURES if f.dtype == "string"}
    numbers = {*taken, *decl.names(), *declared.REQUEST_FIELDS, *decl.number_fields} - strings
    declared.check_reasons(decl.reasons, numbers, source)
    missing = [n for n in REQUEST_READS if n not in taken]
    if missing:
        raise declared.DeclarationError(
            f"{source}: snapshots: the request features read {', '.join(missing)}; declare "
            "them (docs/features.md)"
        )
    return decl


@cache
def declarations() -> declared.Declarations:
    """The declarations (``feature_repo/features.yaml``, or the file
    ``FRAUD_FEATURES_FILE`` names), loaded once per process."""
    return load_declarations(declarations_path())


def declarations_path() -> Path:
    """The declarations file this process reads: ``FRAUD_FEATURES_FILE``, or the shipped
    ``feature_repo/features.yaml``."""
    path = os.environ.get("FRAUD_FEATURES_FILE")
    return Path(path) if path else declared.DEFAULT_PATH


# How the Feast registry names the shipped file (its path differs between installations).
SHIPPED_DECLARATIONS = "shipped"


def declarations_source() -> str:
    """Which declarations this process reads, as the Feast registry records it (the
    feature service's tag, ``feature_repo/definitions.py``): the file's absolute path,
    or :data:`SHIPPED_DECLARATIONS` for ``feature_repo/features.yaml``."""
    path = declarations_path().resolve()
    return SHIPPED_DECLARATIONS if path == declared.DEFAULT_PATH.resolve() else str(path)


def declared_features() -> dict[str, Feature]:
    """The declared features as :class:`Feature` declarations (counts are int64)."""
    decl = declarations()
    out = {}
    defaults = decl.defaults()
    for spec in decl.specs:
        for f in spec.features:
            what = spec.description or f"{f.agg} per {'+'.join(spec.entity)}"
            out[f.name] = Feature(
                f.name,
                "aggregation",
                "int64" if f.agg in declared.WHOLE_NUMBER_AGGS else "float32",
                defaults[f.name],
                f"{what}, {f.agg} over {f.window.label} (tiles of "
                f"{f.window.width_us // declared.US} s)",
            )
    for d in decl.derived:
        out[d.name] = Feature(d.name, "derived", "float32", 0.0, d.description or d.expr)
    return out


def all_features() -> dict[str, Feature]:
    """Every feature by name: snapshot, request, then the declared aggregations and
    derived ones."""
    snap = {f.name: f for f in batch_features()}
    return {**snap, **hand_written_features(), **declared_features()}


def producible_features() -> set[str]:
    """Every feature the service produces as a number: what a model may ask for. String
    features (e.g. the top country) feed request features, never a model."""
    return {n for n, f in all_features().items() if f.dtype != "string"}


def default_model_features() -> list[str]:
    """The ordered model inputs the training job uses by default."""
    return [f.name for f in all_features().values() if f.model_input]


def request_features(
    amount: npt.ArrayLike,
    event_ts: npt.ArrayLike,
    utc_offset_s: npt.ArrayLike,
    country: npt.ArrayLike,
    channel: npt.ArrayLike,
    has_device: npt.ArrayLike,
    batch: Columns,
) -> dict[str, np.ndarray]:
    """Request-time features for n transactions, as float32 columns.

    ``event_ts`` is epoch seconds (UTC), ``utc_offset_s`` the event's local UTC offset in
    seconds (0 when unknown). ``batch`` holds the batch feature columns after
    defaults were applied (missing card: count 0, mean 0, top country ""), so a card
    with no history gets ratio 1, z-score 0 and is never "foreign".
    """
    amt = np.asarray(amount, dtype=np.float64)
    mean = np.asarray(batch["card_amount_mean_30d"], dtype=np.float64)
    std = np.asarray(batch["card_amount_std_30d"], dtype=np.float64)
    top = np.asarray(batch["card_top_country_30d"], dtype=object)
    ctry = np.asarray(country, dtype=object)
    chan = np.asarray(channel, dtype=object)
    local = np.asarray(event_ts, dtype=np.float64) + np.asarray(utc_offset_s, dtype=np.float64)
    ratio = np.where(mean > 0, amt / np.where(mean > 0, mean, 1.0), 1.0)
    z = np.where(std > 0, (amt - mean) / np.where(std > 0, std, 1.0), 0.0)
    out = {
        "amount": amt,
        "amount_log": np.log1p(amt),
        "amount_to_card_mean_30d": ratio,
        # clipped as declared above (np.clip by its definition: two ufuncs, not its checks)
        "amount_zscore_30d": np.minimum(np.maximum(z, -ZSCORE_CLIP), ZSCORE_CLIP),
        "hour_of_day_local": np.floor((local % 86400) / 3600),
        "is_foreign_country": ((top != "") & (top != ctry)).astype(np.float64),
        "channel_ecom": (chan == "ecom").astype(np.float64),
        "channel_atm": (chan == "atm").astype(np.float64),
        "has_device_id": np.asarray(has_device, dtype=np.float64),
    }
    return {k: v.astype(np.float32) for k, v in out.items()}


def apply_defaults(
    batch: Mapping[str, npt.ArrayLike], present: npt.ArrayLike | None = None
) -> dict[str, np.ndarray]:
    """Batch columns with missing values (None/NaN) replaced by each feature's default.

    Only the batch features present in ``batch`` are returned. ``present`` (bool per
    row), when given, also replaces whole rows that are missing or stale. Returns float64
    columns for numbers and object columns for strings.
    """
    out: dict[str, np.ndarray] = {}
    for f in batch_features():
        if f.name not in batch:
            continue
        given = batch[f.name]
        if present is None and isinstance(given, list):
            # The online reader's few rows: a comprehension costs less than pandas' isna
            # on an object array (same values).
            vals = [f.default if v is None or v != v else v for v in given]
            out[f.name] = np.array(vals, dtype=object if f.dtype == "string" else np.float64)
            continue
        col = np.asarray(given, dtype=object)
        missing = np.asarray(pd.isna(col), dtype=bool)
        if present is not None:
            missing |= ~np.asarray(present, dtype=bool)
        col = np.where(missing, f.default, col)
        out[f.name] = col if f.dtype == "string" else col.astype(np.float64)
    return out


@dataclass(frozen=True)
class RequestColumns:
    """The transactions themselves, n rows, as the assembly reads them.

    ``event_us`` is the event time in integer microseconds since the epoch (UTC), the
    session module's unit (:func:`fraud_scoring.session.to_us`); ``utc_offset_s`` the
    offset the time was sent with, in seconds (0 when unknown); ``has_device`` whether a
    device id was sent.
    """

    amount: npt.ArrayLike
    event_us: npt.ArrayLike
    utc_offset_s: npt.ArrayLike
    country: npt.ArrayLike
    channel: npt.ArrayLike
    has_device: npt.ArrayLike
    # The declared number fields the derived features and reasons read
    # (``Declarations.field_reads``), NaN (or None) where a transaction has none.
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def build_features(
    batch: Columns,
    request: RequestColumns,
    aggregations: Columns | None = None,
) -> dict[str, np.ndarray]:
    """Every feature column for n transactions: the one assembly of the model's input.

    ``batch`` holds the batch columns after :func:`apply_defaults` (a missing or stale
    snapshot already replaced by defaults, ``card_snapshot_time`` 0), ``aggregations``
    the declared aggregations' columns as of each event time (any not given: its
    default). Returns those plus the request and derived columns (float32 or float64;
    strings stay object); :func:`assemble` picks the model's columns in its order.
    """
    event_s = np.asarray(request.event_us, dtype=np.int64) / session.US
    req = request_features(
        request.amount,
        event_s,
        request.utc_offset_s,
        request.country,
        request.channel,
        request.has_device,
        batch,
    )
    cols = {**{k: np.asarray(v) for k, v in batch.items()}, **req}
    # The request fields expressions read besides the amount (declared.REQUEST_FIELDS).
    cols["event_time_s"] = event_s
    cols["utc_offset_s"] = np.asarray(request.utc_offset_s, dtype=np.float64)
    for k, v in request.fields.items():  # declared number fields (None: NaN)
        cols[k] = np.asarray(v, dtype=np.float64)
    decl = declarations()
    n = len(event_s)
    given = aggregations or {}
    for k, default in decl.defaults().items():  # what was not read is its default
        cols[k] = np.asarray(given[k], dtype=np.float64) if k in given else np.full(n, default)
    cols.update(declared.derived_columns(decl, cols, n))
    return cols


def assemble(names: list[str], columns: Mapping[str, npt.ArrayLike]) -> np.ndarray:
    """The model's input matrix (n, len(names)) as float32, in the model's own order."""
    # One conversion of all columns at once (a quarter of column_stack's time at few rows).
    return np.ascontiguousarray(np.array([columns[n] for n in names], dtype=np.float32).T)
