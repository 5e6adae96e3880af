"""Feast objects: entities, the batch feature views and the model's feature service.

The views, their entities and schemas come from the declared snapshot views
(``feature_repo/features.yaml``, read through ``fraud_scoring.features``): a new
declared view is a new Feast entity and view here. This file only says where the daily
job writes each view. The project builds them with
:func:`build` and the data dir from its settings (``fraud_scoring.feast_store``). The
module-level objects exist for the ``feast`` CLI (``feast -c feature_repo apply``), which
collects them from this module; they read ``FRAUD_DATA_DIR`` (default ``data``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast import Entity, FeatureService, FeatureStore, FeatureView, Field, FileSource, ValueType
from feast.types import Float32, Int64, String

from fraud_scoring.features import BatchView, declarations_source, view_features, views

_TYPES = {"float32": Float32, "int64": Int64, "string": String}
# The feature service's tag naming the declarations file the views come from.
DECLARATIONS_TAG = "fraud_scoring.declarations"
SERVICE_NAME = "fraud_model"
_ENTITY_TEXT = {"card": "A payment card (PAN token).", "merchant": "A merchant account."}


@dataclass(frozen=True)
class Definitions:
    """Everything ``FeatureStore.apply`` registers for this project."""

    entities: tuple[Entity, ...]
    views: tuple[FeatureView, ...]
    service: FeatureService

    def objects(self) -> list[Any]:
        """All of them, as one list for ``FeatureStore.apply`` (one registry commit)."""
        # Any: apply's element type is a union Feast does not export.
        return [*self.entities, *self.views, self.service]


def _view(v: BatchView, entity: Entity, features_dir: Path) -> FeatureView:
    return FeatureView(
        name=v.name,
        entities=[entity],
        ttl=v.ttl,
        schema=[
            Field(name=f.name, dtype=_TYPES[f.dtype], description=f.description)
            for f in view_features(v)
        ],
        source=FileSource(
            name=f"{v.name}_daily",
            path=str(features_dir / v.name),
            timestamp_field="event_timestamp",
        ),
        online=True,
        description=v.description
        or f"Daily snapshot per {v.entity}, as of the end of each day (UTC).",
    )


def build(data_dir: Path) -> Definitions:
    """The Feast objects over the feature tables under ``data_dir / "features"``.

    ``data_dir`` is resolved to an absolute path: the registry stores each source's
    path, and the training join reads the tables from there whatever the working
    directory.
    """
    features_dir = data_dir.resolve() / "features"
    declared = views()
    entities = {
        v.entity: Entity(
            name=v.entity,
            join_keys=[v.join_key],
            value_type=ValueType.STRING,
            description=_ENTITY_TEXT.get(v.entity, f"The transactions' {v.join_key}."),
        )
        for v in declared
    }
    feature_views = tuple(_view(v, entities[v.entity], features_dir) for v in declared)
    service = FeatureService(
        name=SERVICE_NAME,
        features=list(feature_views),
        description="Batch features read by the scoring service and the training job.",
        # Which declarations file made these views: `fraud-scoring feast` reads the same.
        tags={DECLARATIONS_TAG: declarations_source()},
    )
    return Definitions(tuple(entities.values()), feature_views, service)


# For the feast CLI only (see the module docstring), which collects the objects among
# this module's attributes: one per declared entity and view, by its name (card,
# card_30d, ...). The project calls build().
_cli = build(Path(os.environ.get("FRAUD_DATA_DIR", "data")))
globals().update({e.name: e for e in _cli.entities} | {v.name: v for v in _cli.views})
fraud_model_features = _cli.service


def apply_definitions(store: FeatureStore, data_dir: Path) -> None:
    """Register the entities, views and feature service in ``store``'s registry
    (idempotent); the views' sources are the feature tables under ``data_dir``."""
    store.apply(build(data_dir).objects())
