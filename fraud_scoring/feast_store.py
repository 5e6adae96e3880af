"""The Feast seam: opening the store with the project's settings, and Feast's Redis layout.

``feature_repo/feature_store.yaml`` (or the file ``FRAUD_FEATURE_STORE_YAML`` names)
says how the store is built: project, provider, store types, key serialization. Where
the data lives comes from the caller, in code: the registry file goes under the data dir
and the online store is the Redis that ``REDIS_URL`` names, the same one the scoring
service reads directly. Nothing is passed through the environment.

The service reads batch features straight from Feast's Redis layout (key and field
encoding below) so one pipelined round trip carries a whole micro-batch. That layout is
Feast's internal one, so ``pyproject.toml`` pins Feast's minor version and
``tests/test_feast_layout.py`` fails when a Feast release changes it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import yaml
from feast import FeatureStore, RepoConfig
from feast.infra.online_stores.helpers import _mmh3, _redis_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey
from feast.protos.feast.types.Value_pb2 import Value
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError

from fraud_scoring.redis_server import feast_connection_string, feast_redis_type

REPO_DIR = Path(__file__).resolve().parent.parent / "feature_repo"
_REGISTRY = Path("feast") / "registry.db"  # under the data dir


def repo_config(data_dir: Path, redis_url: str, yaml_path: Path | None = None) -> RepoConfig:
    """Feast's configuration: ``yaml_path`` (default: the shipped feature_store.yaml) with
    the registry file placed at ``data_dir/feast/registry.db`` and the online store's
    connection (and ``redis_type``: ``redis_cluster`` for a cluster URL) taken from
    ``redis_url``.

    ``${...}`` placeholders in the yaml are not expanded here (they are for the ``feast``
    CLI); the two values they stand for are set from the arguments. Raises
    ``FileNotFoundError`` when the yaml is missing and ``ValueError`` when it is not a
    mapping, its online store is not Redis, or Feast rejects it.
    """
    yaml_file = yaml_path or REPO_DIR / "feature_store.yaml"
    if not yaml_file.exists():
        raise FileNotFoundError(f"feature_store.yaml not found at {yaml_file}")
    raw: Any = yaml.safe_load(yaml_file.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{yaml_file}: expected a mapping of Feast settings")
    online = raw.get("online_store")
    # The service reads Feast's Redis layout itself, so no other online store will do.
    if not isinstance(online, dict) or online.get("type") != "redis":
        raise ValueError(f"{yaml_file}: online_store must be a mapping with type: redis")
    registry_path = str(data_dir.resolve() / _REGISTRY)
    registry = raw.get("registry")
    if isinstance(registry, dict):
        if registry.get("registry_type", "file") != "file":
            raise ValueError(f"{yaml_file}: registry.registry_type must be file")
        registry = {**registry, "path": registry_path}
    else:
        registry = registry_path
    raw = {
        **raw,
        "registry": registry,
        "online_store": {
            **online,
            "connection_string": feast_connection_string(redis_url),
            "redis_type": feast_redis_type(redis_url),
        },
    }
    try:
        config = RepoConfig(**raw)
    except ValidationError as exc:
        raise ValueError(f"{yaml_file}: {exc}") from None
    config.repo_path = REPO_DIR
    return config


def open_store(data_dir: Path, redis_url: str, yaml_path: Path | None = None) -> FeatureStore:
    """A FeatureStore over ``data_dir`` and ``redis_url`` (see :func:`repo_config`).

    Creates ``data_dir/feast`` for the registry file if needed.
    """
    config = repo_config(data_dir, redis_url, yaml_path)
    (data_dir.resolve() / _REGISTRY).parent.mkdir(parents=True, exist_ok=True)
    return FeatureStore(repo_path=str(REPO_DIR), config=config)


def online_key(project: str, join_key: str, entity_id: str, key_version: int = 3) -> bytes:
    """The Redis key under which Feast's Redis online store keeps one entity's features
    (all views of that entity share the hash; ``_ts:<view>`` holds each view's time).
    Entity key serialization v3: Feast's own bytes for the empty id, then ``<u32
    length><value>`` in place of its value (as :func:`online_key_column`): ~0.6 us a key,
    where Feast's protobuf costs ~4 us, twice a transaction (two views)."""
    if key_version != 3:
        return feast_online_key(project, join_key, entity_id, key_version)
    head, tail = _key_parts(project, join_key)
    value = entity_id.encode()
    return b"%b%b%b%b" % (head, len(value).to_bytes(4, "little"), value, tail)


def feast_online_key(project: str, join_key: str, entity_id: str, key_version: int = 3) -> bytes:
    """:func:`online_key` by Feast's own serializer (one protobuf per key)."""
    ek = EntityKey(join_keys=[join_key], entity_values=[Value(string_val=entity_id)])
    return _redis_key(project, ek, key_version)


@functools.cache
def _key_parts(project: str, join_key: str) -> tuple[bytes, bytes]:
    """What comes before an entity value's length in a v3 key, and after its value."""
    tail = project.encode()
    probe = feast_online_key(project, join_key, "", 3)
    return probe[: len(probe) - len(tail) - 4], tail


def online_keys(
    project: str, join_key: str, entity_ids: list[str], key_version: int = 3
) -> list[bytes]:
    """:func:`online_key` of many entities of one join key (see :func:`online_key_column`)."""
    if key_version != 3:
        return [online_key(project, join_key, e, key_version) for e in entity_ids]
    column = online_key_column(project, join_key, pa.array(entity_ids, pa.string()))
    keys: list[bytes] = column.to_pylist()
    return keys


def online_key_column(
    project: str, join_key: str, entity_ids: pa.Array, key_version: int = 3
) -> pa.BinaryArray:
    """:func:`online_key` of each entity id in ``entity_ids`` (strings, no nulls), built
    column-wise: the bytes before the entity value are the same for every entity, so
    Feast serializes one key and the others reuse its prefix (entity key serialization
    v3: ``<u32 length><value>`` follows the prefix, then the project). Other versions:
    one Feast call per entity."""
    if key_version != 3:
        ids = entity_ids.to_pylist()
        return pa.array([online_key(project, join_key, e, key_version) for e in ids], pa.binary())
    prefix = _key_parts(project, join_key)[0]
    utf8 = entity_ids.cast(pa.binary())
    lengths = pc.binary_length(utf8).to_numpy(zero_copy_only=False).astype("<u4")
    length_bytes = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(4), len(lengths), [None, pa.py_buffer(lengths.tobytes())]
    ).cast(pa.binary())
    return pc.binary_join_element_wise(
        pa.scalar(prefix), length_bytes, utf8, pa.scalar(project.encode()), pa.scalar(b"")
    )


def batch_marker_key(project: str, view: str) -> str:
    """The key the batch job sets after it materializes ``view`` (value: the ISO time of
    that run). The service checks it periodically: a Redis that restarted without
    persistence lacks it, so "no batch features at all" is told apart from a card with
    no history."""
    return f"fraud_scoring:materialized:{project}:{view}"


def online_field(view: str, feature: str) -> bytes:
    """The hash field of one feature of ``view`` in Feast's Redis layout (the 4-byte
    little-endian murmur3 of ``"<view>:<feature>"``)."""
    return bytes(_mmh3(f"{view}:{feature}"))


def stored_time(raw: bytes) -> float:
    """Epoch seconds of a view's ``_ts:<view>`` field as Feast's Redis store writes it."""
    ts = Timestamp()
    ts.ParseFromString(raw)
    return ts.seconds + ts.nanos / 1e9
