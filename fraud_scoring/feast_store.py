"""Opening the Feast store with the project's settings."""

from __future__ import annotations

import os
from pathlib import Path

from feast import FeatureStore
from feast.infra.online_stores.helpers import _redis_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey
from feast.protos.feast.types.Value_pb2 import Value
from google.protobuf.timestamp_pb2 import Timestamp

from fraud_scoring.redis_server import feast_connection_string

REPO_DIR = Path(__file__).resolve().parent.parent / "feature_repo"


def open_store(data_dir: Path, redis_url: str, yaml_path: Path | None = None) -> FeatureStore:
    """A FeatureStore over ``data_dir`` and ``redis_url``.

    feature_store.yaml reads ``FRAUD_DATA_DIR`` and ``FRAUD_FEAST_REDIS`` from the
    environment, so they are set here (absolute path; Feast's connection-string form).
    """
    data_dir = data_dir.resolve()
    (data_dir / "feast").mkdir(parents=True, exist_ok=True)
    os.environ["FRAUD_DATA_DIR"] = str(data_dir)
    os.environ["FRAUD_FEAST_REDIS"] = feast_connection_string(redis_url)
    yaml_file = yaml_path or REPO_DIR / "feature_store.yaml"
    if not yaml_file.exists():
        raise FileNotFoundError(f"feature_store.yaml not found at {yaml_file}")
    return FeatureStore(repo_path=str(REPO_DIR), fs_yaml_file=yaml_file)


def apply_definitions(store: FeatureStore) -> None:
    """Register the entities, views and feature service (idempotent)."""
    import importlib

    import feature_repo.definitions as d

    d = importlib.reload(d)  # source paths follow the current FRAUD_DATA_DIR
    store.apply([d.card, d.merchant, d.card_30d, d.merchant_90d, d.fraud_model_features])


def online_key(project: str, join_key: str, entity_id: str, key_version: int = 3) -> bytes:
    """The Redis key under which Feast's Redis online store keeps one entity's features
    (all views of that entity share the hash; ``_ts:<view>`` holds each view's time)."""
    ek = EntityKey(join_keys=[join_key], entity_values=[Value(string_val=entity_id)])
    return _redis_key(project, ek, key_version)


def stored_time(raw: bytes) -> float:
    """Epoch seconds of a view's ``_ts:<view>`` field as Feast's Redis store writes it."""
    ts = Timestamp()
    ts.ParseFromString(raw)
    return ts.seconds + ts.nanos / 1e9
