"""What a feature declaration is: the types every declaration module shares.

:mod:`fraud_scoring.features` declares the hand-written (request) features and turns the
declared ones (``feature_repo/features.yaml``: daily snapshots, aggregations, derived)
into these types too, so every consumer reads one shape of declaration.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

Kind = Literal["batch", "request", "aggregation", "derived"]
# A Feast entity's name (its join key without "_id": card, merchant, device, ...).
Entity = str


@dataclass(frozen=True)
class Feature:
    """One feature, declared once. ``default`` is what a missing or stale value becomes
    (the response lists such features)."""

    name: str
    kind: Kind
    dtype: Literal["float32", "int64", "string"]
    default: float | str
    description: str
    entity: Entity | None = None  # batch features only
    model_input: bool = True  # string features feed request features, not the model


@dataclass(frozen=True)
class SnapshotAgg:
    """How a snapshot feature is computed (``fraud_scoring/snapshots.py`` documents each
    aggregation): over the view's transactions with ``event_time`` in the ``window_us``
    before the snapshot time (0: all history), passing ``filter``."""

    name: str
    agg: str
    value: str | None
    window_us: int
    window_label: str
    filter: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class BatchView:
    """A Feast feature view: one parquet table per entity, one snapshot row per day, for
    each key with a transaction in the view's window (``window_us``)."""

    name: str
    entity: Entity
    join_key: str
    ttl: timedelta
    window_us: int = 0
    features: tuple[Feature, ...] = ()
    aggs: tuple[SnapshotAgg, ...] = ()
    description: str = ""
