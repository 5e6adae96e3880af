"""The direct materializer (batch_jobs/materialize.py) against Feast's own path.

The same two simulated days are materialized once by ``FeatureStore.materialize`` and
once by the direct writer, each into a Redis of its own: every key and every hash field
must be byte for byte the same, and Feast's ``get_online_features`` must read back the
snapshot values from the direct writer's Redis. With ``key_ttl_seconds`` set, both
paths also leave every key expiring.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import redis
import yaml

from batch_jobs.batch import run_batch
from batch_jobs.simulate import SimConfig, simulate
from fraud_scoring.feast_store import REPO_DIR, open_store
from fraud_scoring.features import view_features, views
from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.storage import partition_file


def _dump(url: str) -> dict[bytes, dict[bytes, bytes]]:
    client: Any = redis.Redis.from_url(url)
    try:
        # Feast's hashes only: the batch job's markers hold each run's own time, and
        # the declared states ({agg:...}) are not Feast's.
        keys = client.scan_iter(count=1000, _type="hash")
        return {k: client.hgetall(k) for k in keys if not k.startswith((b"{agg:", b"fraud:seen:"))}
    finally:
        client.close()


def test_direct_writer_leaves_feasts_exact_redis_state(tmp_path: Path) -> None:
    cfg = SimConfig(cards=250, merchants=30, days=3, seed=13)
    simulate(cfg, tmp_path / "raw")
    days = [cfg.start + timedelta(days=i) for i in range(cfg.days)]
    with embedded_redis() as feast_url, embedded_redis() as direct_url:
        # Two runs each, as a backfill then a re-run of the newest day.
        for url, how in ((feast_url, "feast"), (direct_url, "direct")):
            run_batch(tmp_path, days[:2], url, materializer=how)  # type: ignore[arg-type]
            run_batch(tmp_path, days[1:], url, materializer=how)  # type: ignore[arg-type]
        want, got = _dump(feast_url), _dump(direct_url)
        assert len(want) > 250
        assert got == want

        store = open_store(tmp_path, direct_url)
        for view in views():
            snap = pq.read_table(partition_file(tmp_path / "features", view.name, days[-1]))
            sample = snap.to_pandas().sample(20, random_state=3)
            online = store.get_online_features(
                features=[f"{view.name}:{f.name}" for f in view_features(view)],
                entity_rows=[{view.join_key: k} for k in sample[view.join_key]],
            ).to_dict()
            for f in view_features(view):
                if f.dtype == "string":
                    assert online[f.name] == list(sample[f.name]), f.name
                else:  # float32 comes back as a Python float of the same float32
                    np.testing.assert_array_equal(
                        np.array(online[f.name], dtype=sample[f.name].dtype),
                        sample[f.name].to_numpy(),
                        err_msg=f.name,
                    )


def test_direct_writer_sets_the_key_ttl_as_feast_does(tmp_path: Path) -> None:
    ttl = 7 * 86_400
    config = yaml.safe_load((REPO_DIR / "feature_store.yaml").read_text())
    config["online_store"]["key_ttl_seconds"] = ttl
    store_yaml = tmp_path / "feature_store.yaml"
    store_yaml.write_text(yaml.safe_dump(config))
    cfg = SimConfig(cards=40, merchants=8, days=2, seed=5)
    simulate(cfg, tmp_path / "raw")
    days = [cfg.start + timedelta(days=i) for i in range(cfg.days)]
    with embedded_redis() as feast_url, embedded_redis() as direct_url:
        ttls = {}
        for url, how in ((feast_url, "feast"), (direct_url, "direct")):
            run_batch(tmp_path, days, url, store_yaml, materializer=how)  # type: ignore[arg-type]
            client: Any = redis.Redis.from_url(url)
            try:
                ttls[how] = {
                    k: client.ttl(k)
                    for k in client.scan_iter(_type="hash")
                    if not k.startswith((b"{agg:", b"fraud:seen:"))  # declared states
                }
            finally:
                client.close()
        assert _dump(direct_url) == _dump(feast_url)
    assert ttls["direct"].keys() == ttls["feast"].keys()
    assert len(ttls["direct"]) > 40
    for how in ("feast", "direct"):
        assert all(ttl - 60 <= t <= ttl for t in ttls[how].values()), how
