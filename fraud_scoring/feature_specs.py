"""What a feature declaration is: the types every declaration module shares.

:mod:`fraud_scoring.features` declares the hand-written features (batch, request, the
feature views) and turns the declared ones (``feature_repo/features.yaml``) into these
types too, so every consumer reads one shape of declaration.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

Kind = Literal["batch", "request", "aggregation", "derived"]
Entity = Literal["card", "merchant"]


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
class BatchView:
    """A Feast feature view: one parquet table per entity, one snapshot row per day."""

    name: str
    entity: Entity
    join_key: str
    ttl: timedelta


# A daily snapshot is valid until the next one is due plus a day of slack: a value older
# than this TTL is stale (replaced by its default and flagged), never silently used.
CARD_VIEW = BatchView("card_30d", "card", "card_id", ttl=timedelta(days=2))
MERCHANT_VIEW = BatchView("merchant_90d", "merchant", "merchant_id", ttl=timedelta(days=2))
VIEWS = (CARD_VIEW, MERCHANT_VIEW)
