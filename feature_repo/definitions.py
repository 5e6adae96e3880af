"""Feast objects: entities, the batch feature views and the model's feature service.

The schemas come from ``fraud_scoring.features`` (the one declaration of each feature);
this file only says where the daily job writes each view. Source paths are resolved
from ``FRAUD_DATA_DIR`` when the definitions are applied.
"""

from __future__ import annotations

import os
from pathlib import Path

from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Int64, String

from fraud_scoring.features import VIEWS, BatchView, view_features

_TYPES = {"float32": Float32, "int64": Int64, "string": String}


def features_dir() -> Path:
    return Path(os.environ.get("FRAUD_DATA_DIR", "data")).resolve() / "features"


card = Entity(
    name="card",
    join_keys=["card_id"],
    value_type=ValueType.STRING,
    description="A payment card (PAN token).",
)
merchant = Entity(
    name="merchant",
    join_keys=["merchant_id"],
    value_type=ValueType.STRING,
    description="A merchant account.",
)
_ENTITIES = {"card": card, "merchant": merchant}


def _view(v: BatchView) -> FeatureView:
    return FeatureView(
        name=v.name,
        entities=[_ENTITIES[v.entity]],
        ttl=v.ttl,
        schema=[
            Field(name=f.name, dtype=_TYPES[f.dtype], description=f.description)
            for f in view_features(v)
        ],
        source=FileSource(
            name=f"{v.name}_daily",
            path=str(features_dir() / v.name),
            timestamp_field="event_timestamp",
        ),
        online=True,
        description=f"Daily snapshot per {v.entity}, as of the end of each day (UTC).",
    )


card_30d, merchant_90d = (_view(v) for v in VIEWS)

fraud_model_features = FeatureService(
    name="fraud_model",
    features=[card_30d, merchant_90d],
    description="Batch features read by the scoring service and the training job.",
)
