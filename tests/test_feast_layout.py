"""The Feast seam: how the store is opened, and the Redis layout the service reads itself.

The scoring service reads batch features straight from Feast's Redis hashes (one
pipelined round trip per micro-batch). That layout is Feast's internal one, pinned by
``feast[redis]>=0.67,<0.68``; these tests fail when a Feast release changes it, so an
upgrade is a deliberate change and not a silent wrong read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import hiredis
import mmh3
import numpy as np
import pyarrow.parquet as pq
import pytest
import redis
import yaml
from feast import FeatureStore

from batch_jobs.batch import run_batch
from batch_jobs.daily_features import snapshot_time
from batch_jobs.simulate import SimConfig, simulate
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import (
    REPO_DIR,
    online_field,
    online_key,
    open_store,
    repo_config,
    stored_time,
)
from fraud_scoring.features import batch_features, view_features, views
from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.storage import partition_dir
from service.core.in_flight import Commands
from service.core.online_features import OnlineFeatureReader


@dataclass(frozen=True)
class Materialized:
    store: FeatureStore
    redis_url: str
    data_dir: Path
    day: date  # the newest materialized snapshot's day


@pytest.fixture(scope="module")
def materialized(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Materialized]:
    """Two simulated days through the daily job and Feast into a Redis of its own (the
    session world's keys stay untouched)."""
    root = tmp_path_factory.mktemp("feast-layout")
    cfg = SimConfig(cards=150, merchants=20, days=2, seed=7)
    simulate(cfg, root / "raw")
    days = [cfg.start, cfg.start + timedelta(days=1)]
    with embedded_redis() as url:
        run_batch(root, days, url)
        yield Materialized(open_store(root, url), url, root, days[-1])


def _ids(m: Materialized, view: str, column: str, n: int) -> list[str]:
    table = pq.read_table(partition_dir(m.data_dir / "features", view, m.day))
    return sorted(table.column(column).to_pylist())[:n]


def test_reader_returns_what_get_online_features_returns(materialized: Materialized) -> None:
    m = materialized
    cards = [*_ids(m, "card_30d", "card_id", 6), "c-never-seen"]
    merchants = [*_ids(m, "merchant_90d", "merchant_id", 6), "m-never-seen"]
    t = snapshot_time(m.day) + timedelta(hours=1)  # the snapshot is fresh
    txns = [
        Transaction.model_validate(
            {
                "transaction_id": f"t{i}",
                "card_id": card,
                "merchant_id": merchant,
                "amount": 10.0,
                "currency": "USD",
                "event_time": t.isoformat(),
                "country": "US",
                "channel": "pos",
                "mcc": "5411",
            }
        )
        for i, (card, merchant) in enumerate(zip(cards, merchants, strict=True))
    ]
    feast = m.store.get_online_features(
        features=m.store.get_feature_service("fraud_model"),
        entity_rows=[{"card_id": x.card_id, "merchant_id": x.merchant_id} for x in txns],
    ).to_dict()

    reader = OnlineFeatureReader(m.store.project, m.store.config.entity_key_serialization_version)
    client = redis.Redis.from_url(m.redis_url)
    try:
        for script in reader.scripts:  # the reader's scripts (batch features, session)
            client.script_load(script)
        pipe = client.pipeline(transaction=False)
        reader.queue(pipe, txns)
        ours = reader.parse(pipe.execute(), txns)  # one HMGET_LUA call
        # The service's held connection: one HMGET per transaction and view, packed
        # already (as hiredis packs them), sent as they are: the same rows.
        commands = Commands()
        reader.queue(commands, txns)
        assert commands == [
            hiredis.pack_command(("HMGET", reader.key(v, getattr(t, v.join_key)), *fields))
            for t in txns
            for v, fields in zip(reader.views, reader._fields.values(), strict=True)
        ]
        conn = client.connection_pool.get_connection()
        try:
            conn.send_packed_command([b"".join(commands)])
            replies = [conn.read_response() for _ in commands]
        finally:
            client.connection_pool.release(conn)
        held = reader.parse(replies, txns)
        assert (held.missing, held.stale) == (ours.missing, ours.stale)
        assert held.columns.keys() == ours.columns.keys()
        for name, column in ours.columns.items():
            np.testing.assert_array_equal(held.columns[name], column)
    finally:
        client.close()

    found = 0
    for f in batch_features():
        for i in range(len(txns)):
            want = feast[f.name][i]
            assert f.name not in ours.stale[i], (f.name, i)
            if want is None:
                assert f.name in ours.missing[i], (f.name, i)
                continue
            found += 1
            assert f.name not in ours.missing[i], (f.name, i)
            assert ours.columns[f.name][i] == want, (f.name, i)
    # Six known entities per view, every feature present; the unknown ones all missing.
    assert found == 6 * len(batch_features())
    assert set(ours.missing[-1]) == {f.name for f in batch_features()}


def test_redis_layout_is_the_pinned_one(materialized: Materialized) -> None:
    """Keys: Feast's entity key serialization v3 followed by the project name. Fields:
    the little-endian murmur3 of ``<view>:<feature>`` per feature, ``_ts:<view>`` for the
    snapshot time (a protobuf Timestamp)."""
    m = materialized
    assert m.store.project == "fraud_scoring"
    assert m.store.config.entity_key_serialization_version == 3

    def u32(n: int) -> bytes:
        return struct.pack("<I", n)

    string_type = 2  # feast.types.Value_pb2.ValueType.STRING
    # entity count, (type, length, join key), (type, length, value), project
    assert (
        online_key("fraud_scoring", "card_id", "c0000001")
        == u32(1)
        + u32(string_type)
        + u32(7)
        + b"card_id"
        + u32(string_type)
        + u32(8)
        + b"c0000001"
        + b"fraud_scoring"
    )
    assert online_field("card_30d", "card_txn_count_30d") == bytes.fromhex("4f3b8573")
    for view in views():
        for f in view_features(view):
            expected = struct.pack("<I", mmh3.hash(f"{view.name}:{f.name}", signed=False))
            assert online_field(view.name, f.name) == expected

    client: Any = redis.Redis.from_url(m.redis_url)  # Feast keys are bytes
    try:
        for view in views():
            (entity_id,) = _ids(m, view.name, view.join_key, 1)
            key = online_key(m.store.project, view.join_key, entity_id)
            fields = set(client.hkeys(key))
            assert fields == {online_field(view.name, f.name) for f in view_features(view)} | {
                f"_ts:{view.name}".encode()
            }
            raw_ts = client.hget(key, f"_ts:{view.name}")
            assert raw_ts is not None
            assert stored_time(raw_ts) == snapshot_time(m.day).timestamp()
    finally:
        client.close()


def test_open_store_takes_paths_from_its_arguments_not_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FRAUD_DATA_DIR", raising=False)
    monkeypatch.delenv("FRAUD_FEAST_REDIS", raising=False)
    store = open_store(tmp_path / "data", "redis://:s3cret@redis.example:6390/4")
    assert "FRAUD_DATA_DIR" not in os.environ and "FRAUD_FEAST_REDIS" not in os.environ
    assert store.config.registry.path == str(tmp_path / "data" / "feast" / "registry.db")
    assert store.config.registry.cache_ttl_seconds == 60  # the rest comes from the yaml
    assert store.config.online_store.connection_string == "redis.example:6390,password=s3cret,db=4"
    assert (tmp_path / "data" / "feast").is_dir()


def test_an_override_yaml_is_read_and_gets_the_same_paths(tmp_path: Path) -> None:
    """``FRAUD_FEATURE_STORE_YAML`` (e.g. the Helm chart's ConfigMap): its settings are
    used; the registry path and Redis connection still come from the settings."""
    shipped = yaml.safe_load((REPO_DIR / "feature_store.yaml").read_text())
    custom = tmp_path / "feature_store.yaml"
    custom.write_text(
        yaml.safe_dump(
            {
                **shipped,
                "registry": "/elsewhere/registry.db",
                "online_store": {"type": "redis", "key_ttl_seconds": 86400},
            }
        )
    )
    config = repo_config(tmp_path, "rediss://redis.example:6379/0", custom)
    assert config.registry.path == str(tmp_path / "feast" / "registry.db")
    assert config.online_store.key_ttl_seconds == 86400
    assert config.online_store.connection_string == "redis.example:6379,db=0,ssl=true"

    custom.write_text(yaml.safe_dump({**shipped, "online_store": {"type": "sqlite"}}))
    with pytest.raises(ValueError, match="online_store must be a mapping with type: redis"):
        repo_config(tmp_path, "redis://localhost:6379/0", custom)
    with pytest.raises(FileNotFoundError, match=r"feature_store\.yaml not found"):
        repo_config(tmp_path, "redis://localhost:6379/0", tmp_path / "nope.yaml")
