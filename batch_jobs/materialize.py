"""Materialization straight into Feast's Redis layout: what ``FeatureStore.materialize``
writes for the daily snapshots, at tens of thousands of rows a second on one process.

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

Every value, key and Redis command is built a column at a time (batch_jobs/feast_encode.py,
batch_jobs/resp.py, each held byte-equal to the library it stands in for by
tests/test_feast_encode.py), so the only per-row Python left is reading Redis's replies.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import redis
from feast import FeatureStore
from feast.infra.online_stores.redis import RedisOnlineStoreConfig
from google.protobuf.timestamp_pb2 import Timestamp
from redis.cluster import RedisCluster
from redis.crc import key_slot

from batch_jobs import resp
from batch_jobs.feast_encode import timestamp_column, timestamp_nanos, value_column
from fraud_scoring.feast_store import online_field, online_key_column
from fraud_scoring.features import BatchView, view_features, views
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.storage import DataError, read_partition

log = logging.getLogger(__name__)

CHUNK = 10_000  # rows per pair of round trips (read the stored _ts, then write)
THREADS = 2  # chunks in flight, each on a connection of its own


def newest_per_entity(features_dir: Path, view: BatchView, days: Iterable[date]) -> pa.Table:
    """The newest snapshot row of each entity of ``view`` over the partitions of
    ``days`` (what Feast's materialize keeps of an interval). Raises DataError naming a
    missing or unreadable partition."""
    tables = [read_partition(features_dir, view.name, d) for d in sorted(set(days))]
    if not tables:
        raise DataError(f"no day given to materialize for {view.name}")
    table = pa.concat_tables(tables)
    if len(tables) == 1 and pc.count_distinct(table.column(view.join_key)).as_py() == len(table):
        return table  # one day's snapshot: one row per entity already, no sort needed
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


def _stored_nanos(replies: list[bytes | None]) -> npt.NDArray[np.int64]:
    """Epoch nanoseconds of each stored ``_ts`` reply (0 where none), parsing each
    distinct value once: a night's keys hold a few snapshot times between them."""
    nanos: dict[bytes | None, int] = {None: 0, b"": 0}
    for raw in set(replies) - nanos.keys():
        ts = Timestamp()
        ts.ParseFromString(raw)
        nanos[raw] = ts.seconds * 1_000_000_000 + ts.nanos
    return np.fromiter((nanos[r] for r in replies), dtype=np.int64, count=len(replies))


def write_view(
    store: FeatureStore,
    client: Any,
    view: BatchView,
    table: pa.Table,
    recomputed: Collection[int] = (),
) -> int:
    """Write ``table`` (one row per entity: join key, ``event_timestamp`` and the view's
    features) to Redis in Feast's layout; rows whose entity already holds a snapshot at
    least as new are skipped, as Feast skips them, except that a stored snapshot whose
    time (epoch seconds) is in ``recomputed`` is replaced (what
    ``batch.forget_recomputed`` arranges for Feast). Returns the rows written.

    Two round trips per ``CHUNK`` rows, ``THREADS`` chunks at a time, every command
    built column-wise (:mod:`batch_jobs.resp`, :mod:`batch_jobs.feast_encode`): no
    Python work per row but reading the replies."""
    config = store.config
    online = config.online_store
    ttl = online.key_ttl_seconds if isinstance(online, RedisOnlineStoreConfig) else None
    eksv = config.entity_key_serialization_version
    ts_field = f"_ts:{view.name}".encode()
    feats = view_features(view)
    fields = [online_field(view.name, f.name) for f in feats]
    redo = np.fromiter(recomputed, dtype=np.int64) * 1_000_000_000

    def write_chunk(start: int) -> int:
        chunk = table.slice(start, CHUNK)
        keys = online_key_column(
            store.project, view.join_key, chunk.column(view.join_key).combine_chunks(), eksv
        )
        nanos = timestamp_nanos(chunk.column("event_timestamp"))
        read = resp.stream(resp.commands([b"HGET", keys, ts_field]))
        stored = _stored_nanos(resp.round_trip(client, read, len(keys)))
        # Feast skips a row unless it is newer than the stored snapshot.
        fresh = (stored == 0) | (nanos > stored) | np.isin(stored, redo)
        count = int(fresh.sum())
        if not count:
            return 0
        keep = pa.array(fresh)
        args: list[resp.Arg] = [b"HSET", keys.filter(keep), ts_field]
        args.append(timestamp_column(nanos[fresh]))
        for field, feat in zip(fields, feats, strict=True):
            args += (field, value_column(feat.dtype, chunk.column(feat.name).filter(keep)))
        rows = resp.commands(args)
        if ttl:
            expire = resp.commands([b"EXPIRE", keys.filter(keep), str(ttl).encode()])
            rows = pc.binary_join_element_wise(rows, expire, pa.scalar(b""))
        resp.round_trip(client, resp.stream(rows), count * (2 if ttl else 1))
        return count

    # Chunks hold distinct entities (one row each), so they can go in any order; with
    # two in flight one is encoded while Redis works on the other.
    with ThreadPoolExecutor(THREADS, thread_name_prefix="materialize") as pool:
        return sum(pool.map(write_chunk, range(0, table.num_rows, CHUNK)))


def by_node(
    store: FeatureStore, client: Any, view: BatchView, table: pa.Table
) -> Iterator[tuple[redis.Redis, pa.Table]]:
    """``table``'s rows with the plain client of the server their keys live on: the one
    ``client`` for one Redis; on a Redis Cluster, each primary's client and the rows
    whose key's hash slot it owns (:func:`write_view` sends raw commands to one server).
    A slot that moves meanwhile (resharding, failover) answers MOVED: the run fails and
    is run again (idempotent per day)."""
    if not isinstance(client, RedisCluster):
        yield client, table
        return
    eksv = store.config.entity_key_serialization_version
    keys = online_key_column(
        store.project, view.join_key, table.column(view.join_key).combine_chunks(), eksv
    )
    slots = client.nodes_manager.slots_cache
    names = np.array([slots[key_slot(k)][0].name for k in keys.to_pylist()], dtype=object)
    for name in sorted(set(names.tolist())):
        node = client.get_node(node_name=name)
        yield client.get_redis_connection(node), table.take(np.flatnonzero(names == name))


def materialize_days(
    store: FeatureStore,
    redis_url: str,
    features_dir: Path,
    days: list[date],
    start: datetime,
    end: datetime,
    recomputed: Collection[int] = (),
) -> int:
    """Write every view's newest snapshot per entity over ``days`` into the online
    store, and record ``[start, end)`` as materialized in the registry (as
    ``FeatureStore.materialize(start, end)`` would). An entity whose stored snapshot
    time (epoch seconds) is in ``recomputed`` takes the new values even when they are
    not newer (a re-run day's corrected snapshot). Returns the rows written."""
    client = sync_client(redis_url)  # one Redis or a cluster; Feast keys and values are bytes
    written = 0
    try:
        for view in views():
            table = newest_per_entity(features_dir, view, days)
            for node, part in by_node(store, client, view, table):
                written += write_view(store, node, view, part, recomputed)
            store.registry.apply_materialization(
                store.get_feature_view(view.name), store.project, start, end
            )
    finally:
        client.close()
    return written
