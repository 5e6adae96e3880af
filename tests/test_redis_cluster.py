"""The online store on a real Redis Cluster (servers from the project's own binary).

The scoring path over HTTP, the updater and the online/offline consistency test run on a
cluster in tests/test_feature_vector.py (its ``online_store`` fixture). Here: Feast's
own reader on the cluster the batch job wrote, the settings that name a cluster, and
the updater through a failover (a primary killed, its replica taking over) with no
event lost.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
from pydantic import ValidationError

from cli.settings import Settings
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.redis_clients import client_url, is_cluster, sync_client
from fraud_scoring.redis_server import (
    EmbeddedCluster,
    embedded_cluster,
    embedded_redis,
    feast_connection_string,
)
from streaming.state import SessionWriter, card_event
from tests.conftest import World, materialize_world
from tests.conftest_streaming import (
    connect,
    dump_state,
    encode,
    feed,
    start_updater,
    wait_for,
    xadd_all,
)

FEATURES = ["card_30d:card_txn_count_30d", "card_30d:card_amount_sum_30d"]


def test_feast_reads_what_the_batch_job_wrote_on_the_cluster(
    world: World, redis_cluster: EmbeddedCluster
) -> None:
    """The batch job's writer on a cluster; Feast (redis_type: redis_cluster) reads the
    same values from it as from the one-server store, and the keys span every primary."""
    materialize_world(world, redis_cluster.url)
    on_cluster = open_store(world.data_dir, redis_cluster.url)
    assert on_cluster.config.online_store.redis_type == "redis_cluster"
    single = open_store(world.data_dir, world.redis_url)
    day = world.last_day - timedelta(days=1)
    part = world.data_dir / "features" / "card_30d" / f"date={day.isoformat()}" / "part-0.parquet"
    cards = pq.read_table(part, columns=["card_id"]).column(0).to_pylist()[:40]
    rows = [{"card_id": c} for c in cards]
    got = on_cluster.get_online_features(features=FEATURES, entity_rows=rows).to_dict()
    want = single.get_online_features(features=FEATURES, entity_rows=rows).to_dict()
    assert got == want
    assert sum(v is not None for v in got["card_txn_count_30d"]) == len(cards)
    client = sync_client(redis_cluster.url)
    sizes = [client.dbsize(target_nodes=n) for n in client.get_primaries()]
    client.close()
    assert len(sizes) == 3 and min(sizes) > 0, sizes


def test_settings_name_a_cluster() -> None:
    s = Settings(redis_url="redis://:pw@node-0:6379/0", redis_cluster=True)
    assert s.redis_url == "redis://:pw@node-0:6379/0?cluster=true" and is_cluster(s.redis_url)
    assert client_url(s.redis_url) == "redis://:pw@node-0:6379/0"
    # Feast gets no db for a cluster (its cluster client refuses one).
    assert feast_connection_string(s.redis_url) == "node-0:6379,password=pw"
    with pytest.raises(ValidationError, match="REDIS_URL: a Redis Cluster has only database 0"):
        Settings(redis_url="redis://node-0:6379/2", redis_cluster=True)
    with pytest.raises(ValidationError, match="FRAUD_REDIS_CLUSTER needs REDIS_URL"):
        Settings(redis_cluster=True)
    with pytest.raises(ValidationError, match="cluster must be true or false"):
        Settings(redis_url="redis://node-0:6379/0?cluster=maybe")


def promote(node: redis.Redis) -> None:
    """Make a replica its shard's primary. With a 1 s node timeout the cluster may have
    promoted it on its own by now (then it answers that it is no longer a replica):
    either way it ends as the primary."""
    if node.execute_command("ROLE")[0] in (b"master", "master"):
        return
    try:
        node.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
    except redis.ResponseError as err:
        if "to a replica" not in str(err):
            raise
    wait_for(
        lambda: node.execute_command("ROLE")[0] in (b"master", "master"),
        30,
        "the replica to become the primary",
        0.05,
    )


def test_updater_survives_a_failover_without_losing_events(tmp_path: Path) -> None:
    """Events keep coming while a primary is killed, its replica takes over and the old
    primary comes back as a replica: the updater (acknowledging a batch only once a
    replica holds it, FRAUD_REDIS_WAIT_REPLICAS=1) ends in the state of a clean run."""
    events = feed(cards=300)
    half = len(events) // 2
    stream = "transactions"
    with embedded_cluster(primaries=3, replicas=1, node_timeout_ms=1000) as cluster:
        client = connect(cluster.url)
        xadd_all(client, stream, encode(events[:half]))
        stream_owner = client.get_node_from_key(stream).port
        victim = next(n for n in cluster.primaries() if n.port != stream_owner)
        replica = cluster.replica_of(victim)
        log = tmp_path / "updater.log"
        updater = start_updater(
            cluster.url,
            log,
            *("--stream", stream, "--batch-size", "50", "--consumer", "u1"),
            env={"FRAUD_REDIS_WAIT_REPLICAS": "1"},
        )
        try:

            def acked() -> int:
                g = client.xinfo_groups(stream)
                return 0 if not g else int(g[0]["entries-read"] or 0) - int(g[0]["pending"])

            wait_for(lambda: acked() >= half // 3, 60, "the updater to start applying", 0.02)
            victim.process.kill()  # SIGKILL: no goodbye to the cluster
            victim.process.wait()
            xadd_all(client, stream, encode(events[half:]))  # the log keeps growing
            # The promotion waits until the updater has met the dead primary (else a fast
            # updater may finish the first half before the kill and only ever see the
            # new primary, and the test would not exercise the failover).
            wait_for(
                lambda: "retrying" in log.read_text(), 60, "the updater to meet the dead primary"
            )
            promote(connect(replica.url))
            cluster.restart(victim)  # back as the new primary's replica

            def drained() -> bool:
                g = client.xinfo_groups(stream)[0]
                return g["lag"] == 0 and g["pending"] == 0

            wait_for(drained, 60, "the updater to drain the stream", 0.1)
        finally:
            updater.terminate()
            updater.wait(timeout=30)
        text = log.read_text()
        assert "retrying" in text, "the failover never reached the updater"
        served = dump_state(client)
        client.close()

    with embedded_redis() as url:  # the clean run: the same events, in the same order
        clean = connect(url)
        writer = SessionWriter(clean, allowed_lateness_s=300)
        valid = [card_event(Transaction.model_validate_event(e)) for e in events]
        for i in range(0, len(valid), 50):
            writer.apply(valid[i : i + 50])
        assert served == dump_state(clean)


def test_an_embedded_server_whose_port_was_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Between picking a free port and binding it, another process can take it (the
    tests run in parallel): the server then exits at once. The embedded server and every
    cluster node try again on other ports; when every try fails the error carries the
    server's own words."""
    import socket

    from fraud_scoring import redis_server

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = redis_server.free_port
        picks = iter([taken])
        monkeypatch.setattr(redis_server, "free_port", lambda: next(picks, None) or real())
        with embedded_redis() as url:
            assert f":{taken}/" not in url
            assert sync_client(url).ping()
        picks = iter([taken])
        with embedded_cluster(primaries=1) as cluster:
            assert cluster.nodes[0].port != taken
            assert sync_client(cluster.url).ping()
        assert "trying other ports" in caplog.text

        monkeypatch.setattr(redis_server, "free_port", lambda: taken)
        monkeypatch.setattr(redis_server, "_distinct_port", lambda _taken: taken)
        with (
            pytest.raises(redis_server.RedisStartError, match=r"(?i)address already in use"),
            embedded_redis(),
        ):
            pass
