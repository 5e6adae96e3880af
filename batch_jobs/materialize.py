"""Materialization straight into Feast's Redis layout: what ``FeatureStore.materialize``
writes for the daily snapshots, at tens of thousands of rows a second.

Feast's own path (offline store read, per-row Python conversion, its Redis writer) runs
at a few thousand rows a second here; a 10-million-card night would take hours. This
writer reads the day partitions the daily job wrote and produces the same Redis state:
per view, the newest snapshot of each entity in the days given, written as Feast's Redis
online store writes it (one hash per entity key, a murmur3 field per feature holding the
serialized ``Value`` proto, ``_ts:<view>`` holding the snapshot time as a protobuf
``Timestamp``, the key's expiry when ``key_ttl_seconds`` is set), and skipped, as Feast
skips it, when the stored ``_ts`` is not older. It records the materialized interval in
the registry as ``materialize`` does. The layout helpers are
``fraud_scoring.feast_store.online_key`` / ``online_field``, pinned by
tests/test_feast_layout.py; that Feast's ``get_online_features`` reads back what this
writer wrote is tested too (tests/test_materialize.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from feast import FeatureStore
from feast.infra.online_stores.redis import RedisOnlineStoreConfig
from feast.protos.feast.types.Value_pb2 import Value
from google.protobuf.timestamp_pb2 import Timestamp

from fraud_scoring.feast_store import online_field, online_keys
from fraud_scoring.features import VIEWS, BatchView, view_features
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.storage import DataError, read_partition

log = logging.getLogger(__name__)

CHUNK = 5_000  # rows per pipelined round trip (two: read _ts, then write)

# How Feast's Redis store encodes each declared dtype (feast.type_map for these types).
_ENCODERS: dict[str, Callable[[Any], bytes]] = {
    "float32": lambda v: Value(float_val=v).SerializeToString(),
    "int64": lambda v: Value(int64_val=v).SerializeToString(),
    "string": lambda v: Value(string_val=v).SerializeToString(),
}
_NULL = Value().SerializeToString()  # Feast writes a missing value as an empty Value
_FLOAT_TAG = Value(float_val=1.0).SerializeToString()[:1]  # field 6, fixed 32 bits


def encode_column(dtype: str, column: pa.ChunkedArray) -> list[bytes]:
    """Each value of ``column`` as Feast stores it: a serialized ``Value`` proto. A
    float32 column without nulls is encoded all at once (tag byte + 4 little-endian
    bytes, exactly what protobuf writes); everything else one proto per value."""
    if dtype == "float32" and column.null_count == 0:
        packed = np.empty(len(column), dtype=[("tag", "u1"), ("value", "<f4")])
        packed["tag"] = _FLOAT_TAG[0]
        packed["value"] = column.to_numpy()
        raw = packed.tobytes()
        return [raw[i : i + 5] for i in range(0, len(raw), 5)]
    enc = _ENCODERS[dtype]
    return [_NULL if v is None else enc(v) for v in column.to_pylist()]


def newest_per_entity(features_dir: Path, view: BatchView, days: Iterable[date]) -> pa.Table:
    """The newest snapshot row of each entity of ``view`` over the partitions of
    ``days`` (what Feast's materialize keeps of an interval). Raises DataError naming a
    missing or unreadable partition."""
    tables = [read_partition(features_dir, view.name, d) for d in sorted(set(days))]
    if not tables:
        raise DataError(f"no day given to materialize for {view.name}")
    table = pa.concat_tables(tables)
    order = pc.sort_indices(
        table, sort_keys=[(view.join_key, "ascending"), ("event_timestamp", "descending")]
    )
    table = table.take(order)
    keys = table.column(view.join_key)
    if len(keys) == 0:
        return table
    # After the sort an entity's newest row is the first of its run of equal keys.
    first = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
    mask = pa.concat_arrays([pa.array([True]), first.combine_chunks()])
    return table.filter(mask)


def _timestamp(instant: datetime) -> bytes:
    ts = Timestamp()
    ts.FromDatetime(instant if instant.tzinfo else instant.replace(tzinfo=UTC))
    return ts.SerializeToString()


def _nanos(raw: bytes | None) -> int:
    if not raw:
        return 0
    ts = Timestamp()
    ts.ParseFromString(raw)
    return ts.seconds * 1_000_000_000 + ts.nanos


def write_view(store: FeatureStore, client: Any, view: BatchView, table: pa.Table) -> int:
    """Write ``table`` (one row per entity: join key, ``event_timestamp`` and the view's
    features) to Redis in Feast's layout; rows whose entity already holds a snapshot at
    least as new are skipped, as Feast skips them. Returns the rows written."""
    config = store.config
    online = config.online_store
    ttl = online.key_ttl_seconds if isinstance(online, RedisOnlineStoreConfig) else None
    eksv = config.entity_key_serialization_version
    ts_field = f"_ts:{view.name}".encode()
    feats = view_features(view)
    fields = [online_field(view.name, f.name) for f in feats]
    written = 0
    for start in range(0, table.num_rows, CHUNK):
        chunk = table.slice(start, CHUNK)
        keys = online_keys(
            store.project, view.join_key, chunk.column(view.join_key).to_pylist(), eksv
        )
        instants = chunk.column("event_timestamp").to_pylist()
        stamps = {t: _timestamp(t) for t in set(instants)}
        nanos = {t: _nanos(stamp) for t, stamp in stamps.items()}
        columns = [encode_column(f.dtype, chunk.column(f.name)) for f in feats]
        # execute_command: redis-py's per-command helpers cost more than the write itself.
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("HGET", key, ts_field)
        stored = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for i, (key, instant, prev) in enumerate(zip(keys, instants, stored, strict=True)):
            stamp = stamps[instant]
            if prev and nanos[instant] <= _nanos(prev):
                continue  # Feast keeps the stored snapshot: not older than this one
            args = [key, ts_field, stamp]
            for field, column in zip(fields, columns, strict=True):
                args += (field, column[i])
            pipe.execute_command("HSET", *args)
            if ttl:
                pipe.execute_command("EXPIRE", key, ttl)
            written += 1
        pipe.execute()
    return written


def materialize_days(
    store: FeatureStore,
    redis_url: str,
    features_dir: Path,
    days: list[date],
    start: datetime,
    end: datetime,
) -> int:
    """Write every view's newest snapshot per entity over ``days`` into the online
    store, and record ``[start, end)`` as materialized in the registry (as
    ``FeatureStore.materialize(start, end)`` would). Returns the rows written."""
    client = sync_client(redis_url)  # one Redis or a cluster; Feast keys and values are bytes
    written = 0
    try:
        for view in VIEWS:
            written += write_view(store, client, view, newest_per_entity(features_dir, view, days))
            store.registry.apply_materialization(
                store.get_feature_view(view.name), store.project, start, end
            )
    finally:
        client.close()
    return written
