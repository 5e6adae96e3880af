"""The whole vector the model sees: served (Redis through the real updater, the scorer's
own read and assembly) equals the training frame's row, feature by feature; and the
scorer's read-your-writes (a burst counts its own earlier attempts while the event log
lags) over real HTTP, real Redis and a real updater process. Both tests run twice: on
one Redis and on a Redis Cluster of three primaries (``online_store``), where the
service's batch read becomes one pipeline per node and the batch job, the updater and
the service use cluster clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from batch_jobs.train import feature_columns, load_transactions
from batch_jobs.training_set import point_in_time_join
from cli.settings import Settings
from fraud_scoring import features as F
from fraud_scoring.events import Transaction, raw_row_to_event
from fraud_scoring.feast_store import open_store
from fraud_scoring.redis_clients import async_client
from fraud_scoring.redis_server import EmbeddedCluster
from fraud_scoring.session import epoch_us, to_us
from service.core.model import ModelHolder
from service.core.online_features import OnlineFeatureReader
from service.core.scoring import Scorer
from tests.conftest import World, materialize_world, private_db, start_server, stop_server
from tests.conftest_streaming import (
    connect,
    dump_state,
    encode,
    start_updater,
    wait_for,
    xadd_all,
)

STREAM = "transactions"
LIVE_ONLY = ("aggregation", "derived")


@pytest.fixture(scope="module")
def cluster_store(world: World, request: pytest.FixtureRequest) -> Callable[[], str]:
    """``cluster_store()``: the test cluster materialized by the batch job once for the
    module, each later call deleting every key written since (the tests only read the
    batch's keys: session and declared state, streams, claims and logs go)."""
    cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
    materialize_world(world, cluster.url)
    client = connect(cluster.url)
    batch = set(client.scan_iter(count=1000, target_nodes=client.PRIMARIES))

    def fresh() -> str:
        written = set(client.scan_iter(count=1000, target_nodes=client.PRIMARIES)) - batch
        pipe = client.pipeline(transaction=False)  # one round trip per node, not per key
        for key in written:
            pipe.delete(key)
        pipe.execute()
        return cluster.url

    return fresh


@pytest.fixture(params=["redis", "cluster"])
def online_store(request: pytest.FixtureRequest, world: World) -> Callable[[int], str]:
    """``online_store(db)``: the URL of an online store holding the world's batch
    features and no session state: database ``db`` of the world's server, or the test
    cluster (it has database 0 only), materialized by the batch job."""
    if request.param == "redis":
        return lambda db: private_db(world, db)
    fresh = request.getfixturevalue("cluster_store")
    return lambda _db: fresh()


def _drain(url: str, log: Path, *args: str) -> None:
    """Run the real updater over the stream until its group has read and acknowledged
    everything, then let it exit."""
    client = connect(url)
    p = start_updater(url, log, "--stream", STREAM, "--idle-exit-s", "0.5", *args)

    def drained() -> bool:
        groups = client.xinfo_groups(STREAM)
        return bool(groups) and groups[0]["lag"] == 0 and groups[0]["pending"] == 0

    wait_for(drained, 120, "the updater to drain the stream")
    assert p.wait(timeout=30) == 0, log.read_text()[-3000:]


def test_served_vector_equals_the_training_row(
    world: World, tmp_path: Path, online_store: Callable[[int], str]
) -> None:
    """1,200 held-out transactions: every model feature served == the training frame's."""
    url = online_store(2)
    lateness = str(2 * 86400)
    raw = world.data_dir / "raw"
    day = world.last_day
    # The held-out day and the one before it (24 h windows), as the raw history.
    history = load_transactions(raw, day - timedelta(days=1), day)
    rng = np.random.default_rng(11)

    # The event log: shuffled (so many events arrive late), 5 % sent twice.
    rows = pd.read_parquet(raw / "transactions")
    rows = rows[rows["transaction_id"].isin(set(history["transaction_id"]))]
    events = [raw_row_to_event(r) for r in rows.to_dict("records")]
    events += [events[i] for i in rng.choice(len(events), len(events) // 20, replace=False)]
    events = [events[i] for i in rng.permutation(len(events))]
    xadd_all(connect(url), STREAM, encode(events))
    # Lateness of two days: a fully shuffled log must not be trimmed by retention.
    _drain(url, tmp_path / "updater.log", "--allowed-lateness-s", lateness)

    # Training's side: Feast's point-in-time join and the training job's features.
    held = history[history["event_time"].dt.date == day]
    sample = (
        held.sample(1200, random_state=5)
        .rename(columns={"event_time": "event_timestamp"})
        .reset_index(drop=True)
    )
    store = open_store(world.data_dir, world.redis_url)
    joined = point_in_time_join(store, sample)
    offline = feature_columns(joined, history)

    # Serving's side: the scorer's own read (one pipeline) and assembly, on Redis.
    ids = joined["transaction_id"].tolist()
    by_id = {r["transaction_id"]: r for r in rows.to_dict("records")}
    txns = [Transaction.model_validate(raw_row_to_event(by_id[i])) for i in ids]
    # The scorer records each transaction with the updater's own limits (as deployed:
    # one FRAUD_ALLOWED_LATENESS_S), so its copies are duplicates and trim nothing.
    settings = Settings(record_scored=True, allowed_lateness_s=float(lateness))
    online = asyncio.run(_served(url, store.project, txns, settings))

    kinds = F.all_features()
    # Declared aggregations are exact for live reads, not for reads far behind a busy
    # key's present (this test reads after the whole day was applied): they are checked
    # in live order below (test_live_order_vector_equals_the_training_row).
    names = [n for n in F.default_model_features() if kinds[n].kind not in LIVE_ONLY]
    assert {"hour_of_day_local", "card_txn_count_30d", "merchant_fraud_rate_90d"} <= set(names)
    mismatches = _compare(names, ids, online, offline)
    assert not mismatches, f"served != training on {len(ids)} rows: {mismatches}"
    # The comparison means something: the rows have history, bursts and new cards.
    assert (offline["card_txn_count_1m"] > 0).sum() >= 5
    assert (offline["card_txn_count_1h"] > 0).sum() > 50
    assert (offline["card_has_snapshot"] == 1).mean() > 0.5


def _compare(
    names: list[str], ids: list[str], online: dict[str, Any], offline: dict[str, Any]
) -> dict[str, str]:
    kinds = F.all_features()
    mismatches: dict[str, str] = {}
    for name in names:
        on = np.asarray(online[name], dtype=np.float64)
        off = np.asarray(offline[name], dtype=np.float64)
        if kinds[name].dtype == "int64":
            bad = on != off
        else:
            bad = ~np.isclose(on, off, rtol=1e-5, atol=1e-9)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            mismatches[name] = f"{bad.sum()} rows, e.g. {ids[i]}: served {on[i]}, trained {off[i]}"
    return mismatches


def test_live_order_vector_equals_the_training_row(
    world: World, online_store: Callable[[int], str]
) -> None:
    """Events arrive as they would live (0-3 s after their event time, 5 % twice) through
    the real updater (in process, on the stream); 1,000 held-out transactions are scored
    by the real scorer as they arrive (each read, assembled and recorded in one round
    trip, micro-batches of the attempts that arrive together), the labels recorded in the
    label states as the daily batch does (once the clock passes when the store has
    them): every model feature, declared ones included, equals the training row, and the
    generic check names the feature, the row and the values."""
    from batch_jobs.declared_sql import load_label_events, record_labels
    from streaming.metrics import UpdaterMetrics
    from streaming.sources import RedisStreamSource
    from streaming.state import SessionWriter
    from streaming.updater import Updater

    url = online_store(4)
    client = connect(url)
    raw = world.data_dir / "raw"
    day = world.last_day
    history = load_transactions(raw, day - timedelta(days=1), day)
    rows = pd.read_parquet(raw / "transactions")
    rows = rows[rows["transaction_id"].isin(set(history["transaction_id"]))].reset_index()
    held = rows[rows["event_time"].dt.date == day].sample(1000, random_state=8)
    queries = set(held["transaction_id"])
    rng = np.random.default_rng(12)
    ts = epoch_us(rows) / 1e6
    arrival = ts + np.where(rows["transaction_id"].isin(queries), 3.0, rng.uniform(0, 3, len(rows)))
    again = rng.choice(len(rows), len(rows) // 20, replace=False)
    order = sorted([(a, i) for i, a in enumerate(arrival)] + [(arrival[i] + 60, i) for i in again])
    events = [raw_row_to_event(r) for r in rows.to_dict("records")]
    ids = rows["transaction_id"].tolist()
    labels = load_label_events(raw, 0.0)
    due_labels = labels.sort_values("available_us").to_dict("records")
    decl = F.declarations()

    lateness = 2 * 86400.0
    settings = Settings(record_scored=True, allowed_lateness_s=lateness)
    source = RedisStreamSource(client, STREAM, "updater", "u1")
    updater = Updater(
        source, SessionWriter(client, lateness), UpdaterMetrics.create(), poll_timeout_s=0.001
    )
    served: dict[str, dict[str, float]] = {}

    async def run() -> None:
        nonlocal due_labels
        aclient = async_client(url)
        store = open_store(world.data_dir, world.redis_url)
        with ThreadPoolExecutor(1) as pool:
            scorer = Scorer(
                aclient, OnlineFeatureReader(store.project), ModelHolder(), settings, pool
            )
            pending: list[int] = []
            k = 0
            while k < len(order):
                a, i = order[k]
                if ids[i] not in queries or i in served_ix:
                    pending.append(i)
                    k += 1
                    continue
                # The attempts arriving together form one micro-batch (up to 64).
                batch = []
                while k < len(order) and len(batch) < 64 and order[k][0] - a < 0.002:
                    j = order[k][1]
                    if ids[j] not in queries or j in served_ix:
                        break  # it arrived before the rest: it goes to the updater first
                    batch.append(j)
                    served_ix.add(j)
                    k += 1
                now_us = int(a * 1e6)
                due = [r for r in due_labels if r["available_us"] <= now_us]
                if due:  # the daily batch has recorded these labels by now
                    record_labels(client, decl, pd.DataFrame(due), lateness + 3600)
                    due_labels = due_labels[len(due) :]
                if pending:  # everything that arrived before: through the updater
                    xadd_all(client, STREAM, encode([events[j] for j in pending]))
                    read = 0
                    while read < len(pending):  # not until an empty poll: it blocks
                        read += updater.step()
                    pending = []
                txns = [Transaction.model_validate(events[j]) for j in batch]
                cols = (await scorer.read_features(txns))[0]
                for n, j in enumerate(batch):
                    served[ids[j]] = {f: float(cols[f][n]) for f in cols if cols[f].dtype != object}
                xadd_all(client, STREAM, encode([events[j] for j in batch]))
        await aclient.aclose()

    served_ix: set[int] = set()
    asyncio.run(run())

    store = open_store(world.data_dir, world.redis_url)
    sample = held.rename(columns={"event_time": "event_timestamp"}).reset_index(drop=True)
    joined = point_in_time_join(store, sample)
    offline = feature_columns(joined, history, labels=labels)
    qids = joined["transaction_id"].tolist()
    online = {n: [served[t][n] for t in qids] for n in F.default_model_features()}
    mismatches = _compare(F.default_model_features(), qids, online, offline)
    assert not mismatches, f"served != training on {len(qids)} rows: {mismatches}"
    # It compares something: busy merchants, declared windows with history.
    assert (offline["merchant_txn_count_1h"] > 0).sum() > 100
    assert (offline["device_txn_count_1d"] > 0).sum() > 10
    assert (offline["merchant_fraud_count_lag7d_30d"] > 0).sum() > 10


async def _served(
    url: str, project: str, txns: list[Transaction], settings: Settings
) -> dict[str, np.ndarray]:
    client = async_client(url)
    with ThreadPoolExecutor(1) as pool:
        scorer = Scorer(client, OnlineFeatureReader(project), ModelHolder(), settings, pool)
        try:
            parts = [
                (await scorer.read_features(txns[i : i + 64]))[0] for i in range(0, len(txns), 64)
            ]
        finally:
            await client.aclose()
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _attempt(i: int, record: bool = True) -> dict[str, Any]:
    return {
        "transaction_id": f"burst-{i}",
        "card_id": "c-burst",
        "merchant_id": "m00001",
        "amount": 1.5 + i,
        "currency": "USD",
        "event_time": f"2026-01-16T12:00:{10 + 5 * i:02d}+00:00",
        "country": "US",
        "channel": "ecom",
        "mcc": "5999",
        "device_id": "d-burst",
    }


def _velocity(body: dict[str, Any]) -> str:
    return next((r["message"] for r in body["reasons"] if r["code"] == "VELOCITY_10M"), "")


def test_a_burst_sees_its_own_earlier_attempts(
    world: World, tmp_path: Path, online_store: Callable[[int], str]
) -> None:
    """Updater stopped: the fifth attempt counts the four before it; the updater's later
    copies of the same events change nothing."""
    url = online_store(3)
    client = connect(url)
    srv = start_server(world, tmp_path, REDIS_URL=url)
    try:
        with srv.client() as c:
            # A what-if call first: scored, not recorded.
            r = c.post("/v1/score", json=_attempt(0), headers={"X-Fraud-Record": "false"})
            assert r.status_code == 200, r.text
            assert client.zcard("{card:c-burst}:ev") == 0
            bodies = []
            for i in range(5):  # one at a time: each attempt its own micro-batch
                r = c.post("/v1/score", json=_attempt(i))
                assert r.status_code == 200, r.text
                bodies.append(r.json())
            bad = c.post("/v1/score", json=_attempt(9), headers={"X-Fraud-Record": "maybe"})
            assert bad.status_code == 422 and "X-Fraud-Record" in bad.text
    finally:
        stop_server(srv)
    # Every decision is in the log, each review in the review queue, none left in the
    # spool (on a Cluster the review queue once failed and stopped the log's writer).
    assert "left in" not in srv.log.read_text(), srv.log.read_text()[-2000:]
    assert client.xlen("decisions") == 5  # the what-if call is not recorded
    reviews = sum(b["decision"] == "review" for b in bodies)
    assert reviews > 0 and client.zcard("{decisions}:review") == reviews
    assert _velocity(bodies[3]) == "3 transactions on this card in the last 10 minutes."
    assert _velocity(bodies[4]) == "4 transactions on this card in the last 10 minutes."
    state = dump_state(client)
    assert len(state[b"{card:c-burst}:ev"]) == 5

    # The 1-minute count the fifth attempt read: the stored state as of its time.
    from fraud_scoring import declared as D

    fifth = Transaction.model_validate(_attempt(4))
    t5 = to_us(fifth.event_time)
    spec = next(s for s in F.declarations().specs if "card_txn_count_1m" in s.feature_names())
    pipe = client.pipeline(transaction=False)
    D.queue_read(pipe, spec, fifth.card_id, t5)
    (read,) = D.parse_reads(spec, pipe.execute(), [t5])
    assert D.online_row(spec, read, t5)[0]["card_txn_count_1m"] == 4
    declared = {k: client.dump(k) for k in client.scan_iter(match="{agg:*:t")}
    assert declared

    # The event log catches up: the same five events through the real updater.
    xadd_all(client, STREAM, encode([_attempt(i) for i in range(5)]))
    _drain(url, tmp_path / "updater.log")
    assert dump_state(client) == state
    assert {k: client.dump(k) for k in client.scan_iter(match="{agg:*:t")} == declared


def test_backdating_each_attempt_does_not_hide_a_burst(
    world: World, tmp_path: Path, online_store: Callable[[int], str]
) -> None:
    """A card-testing burst whose every attempt is stamped 25 s earlier than the last
    (all inside the event-time bound) counts its earlier attempts exactly as the honest
    burst 25 s apart does, and is declined no later: each is read and recorded at its
    effective time, just after the card's newest recorded event."""
    url = online_store(4)
    srv = start_server(world, tmp_path, REDIS_URL=url, FRAUD_MAX_EVENT_SKEW_S="600")
    now = datetime.now(UTC).replace(microsecond=0)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        with srv.client() as c:
            for name, start, step in (
                ("honest", now - timedelta(seconds=300), 25),
                ("backdated", now, -25),
            ):
                runs[name] = []
                for i in range(13):  # one at a time: each attempt its own micro-batch
                    # Each burst at its own merchant and device: the model reads their
                    # short windows too (distinct cards, device velocity), which the other
                    # burst would fill.
                    body = _attempt(i) | {
                        "transaction_id": f"{name}-{i}",
                        "card_id": f"c-{name}",
                        "merchant_id": f"m-{name}",
                        "device_id": f"d-{name}",
                        "amount": 1.5,
                        "event_time": (start + timedelta(seconds=step * i)).isoformat(),
                    }
                    r = c.post("/v1/score", json=body)
                    assert r.status_code == 200, r.text
                    runs[name].append(r.json())
            metrics = c.get("/metrics").text
    finally:
        stop_server(srv)
    for i in range(3, 13):  # the 10-minute window holds both whole bursts
        want = f"{i} transactions on this card in the last 10 minutes."
        assert _velocity(runs["honest"][i]) == want, (i, runs["honest"][i])
        assert _velocity(runs["backdated"][i]) == want, (i, runs["backdated"][i])
    decisions = {n: [b["decision"] for b in bodies] for n, bodies in runs.items()}
    first = {n: d.index("decline") if "decline" in d else None for n, d in decisions.items()}
    # Declined no later than the honest burst (its attempts sit 1 µs apart at their
    # effective times, so its 1-minute window and time since the last are, if anything,
    # more alarming than 25 s apart).
    assert first["honest"] is not None and first["backdated"] is not None, decisions
    assert first["backdated"] <= first["honest"], decisions
    assert "fraud_backdated_transactions_total 12.0" in metrics


def test_forward_dating_each_attempt_does_not_hide_a_burst(
    world: World, tmp_path: Path, online_store: Callable[[int], str]
) -> None:
    """A burst stamped 400 s ahead of the clock (inside the event-time bound) is recorded
    like the honest one: its attempts count in velocity, and a reused id with other
    content is refused (409). Past FRAUD_MAX_FUTURE_SKEW_S (what the store records) a
    live transaction is refused (422), never answered without being recorded."""
    url = online_store(4)
    srv = start_server(
        world,
        tmp_path,
        REDIS_URL=url,
        FRAUD_MAX_EVENT_SKEW_S="600",
        FRAUD_MAX_FUTURE_SKEW_S="500",
        FRAUD_IDEMPOTENCY_TTL_S="3600",
    )
    ahead = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=400)
    bodies = []

    def attempt(i: int, **over: Any) -> dict[str, Any]:
        return (
            _attempt(i)
            | {
                "transaction_id": f"ahead-{i}",
                "card_id": "c-ahead",
                "merchant_id": "m-ahead",
                "device_id": "d-ahead",
                "amount": 1.5,
                "event_time": (ahead + timedelta(seconds=i)).isoformat(),
            }
            | over
        )

    try:
        with srv.client() as c:
            for i in range(13):
                r = c.post("/v1/score", json=attempt(i))
                assert r.status_code == 200, r.text
                bodies.append(r.json())
            again = c.post("/v1/score", json=attempt(12, amount=99.0))
            late = c.post(
                "/v1/score",
                json=attempt(13, event_time=(ahead + timedelta(seconds=200)).isoformat()),
            )
    finally:
        stop_server(srv)
    for i in range(3, 13):
        want = f"{i} transactions on this card in the last 10 minutes."
        assert _velocity(bodies[i]) == want, (i, bodies[i])
    assert again.status_code == 409, again.text
    assert late.status_code == 422, late.text
    [problem] = late.json()["detail"]
    assert problem["field"] == "event_time" and "FRAUD_MAX_FUTURE_SKEW_S" in problem["message"]


def test_a_replay_behind_a_busy_key_says_which_features_are_inexact(
    world: World, tmp_path: Path
) -> None:
    """A card with 40 recorded attempts, then a replay (X-Fraud-Record: false) of a time
    before 35 of them: the store cannot take them all out of the read, so the answer
    lists the card's velocity features in features.inexact and says degraded; a live
    answer lists none."""
    url = private_db(world, 6)
    srv = start_server(world, tmp_path, REDIS_URL=url)
    start = datetime(2026, 1, 16, 12, 0, tzinfo=UTC)

    def attempt(i: int) -> dict[str, Any]:
        return _attempt(i) | {
            "transaction_id": f"busy-{i}",
            "card_id": "c-busy",
            "event_time": (start + timedelta(seconds=i)).isoformat(),
        }

    try:
        with srv.client() as c:
            live = c.post("/v1/score/batch", json={"transactions": [attempt(i) for i in range(40)]})
            replay = c.post(
                "/v1/score",
                json=attempt(100) | {"event_time": (start + timedelta(seconds=4.5)).isoformat()},
                headers={"X-Fraud-Record": "false"},
            )
    finally:
        stop_server(srv)
    assert live.status_code == 200, live.text
    assert all(not r["features"]["inexact"] and not r["degraded"] for r in live.json()["results"])
    assert replay.status_code == 200, replay.text
    body = replay.json()
    assert "card_txn_count_1m" in body["features"]["inexact"], body
    assert body["degraded"] is True and body["model_version"] != "rules-only"


def test_the_daily_batch_leaves_the_label_states_training_computes(world: World) -> None:
    """The world's batch steps for the declared states (backfill up to the day before the
    held-out one, then each day's labels) leave label and delayed states that, read as of
    held-out transactions, equal what training computes from the raw labels. They run
    into a store of their own: the world's store is the other tests' to write (a
    held-out transaction they score moves a key's present past these reads')."""
    from batch_jobs.batch import backfill_declared, record_day_labels
    from batch_jobs.declared_sql import load_label_events, training_columns
    from fraud_scoring import declared as D
    from fraud_scoring.redis_server import embedded_redis

    decl = F.declarations()
    specs = [s for s in decl.specs if s.whole_tiles]
    assert any(s.source == "labels" for s in specs)
    raw = world.data_dir / "raw"
    days = [world.start + timedelta(days=i) for i in range(world.days - 1)]
    history = load_transactions(raw, world.start, world.last_day)
    held = history[history["event_time"].dt.date == world.last_day].sample(400, random_state=3)
    q = held.rename(columns={"event_time": "event_timestamp"}).reset_index(drop=True)
    only = D.Declarations(tuple(specs), (), decl.source)
    trained = training_columns(only, q, history, labels=load_label_events(raw, 0.0))
    rows = q.to_dict("records")
    t_us = [int(x) for x in epoch_us(q[["event_timestamp"]])]
    with embedded_redis() as url:
        client = connect(url)
        for spec in decl.specs:  # as backfilled: run_batch backfills only the others
            if not spec.whole_tiles:
                client.set(spec.backfilled_key(), "test")
        assert backfill_declared(raw, days[-1], url, 300.0) > 0  # as run_batch calls them
        record_day_labels(raw, days, url, 300.0)
        for spec in specs:
            keys = [spec.key_value(r) for r in rows]
            pipe = client.pipeline(transaction=False)
            for key, t in zip(keys, t_us, strict=True):
                if key is not None:
                    D.queue_read(pipe, spec, key, t)
            at = [t for k, t in zip(keys, t_us, strict=True) if k]
            states = iter(D.parse_reads(spec, pipe.execute(), at))
            for i, (key, t) in enumerate(zip(keys, t_us, strict=True)):
                got, exact = D.online_row(spec, next(states) if key else None, t)
                assert exact
                for name, v in got.items():
                    want = trained[name][i]
                    assert v == pytest.approx(want, rel=1e-9, abs=1e-6), (name, rows[i])
        client.close()
    assert (trained["merchant_fraud_count_lag7d_30d"] > 0).sum() > 20
    assert (trained["card_fraud_count_30d"] > 0).sum() >= 0  # a card's own labels: rare


def test_a_burst_split_across_batches_in_flight_sees_its_earlier_attempts(
    world: World, online_store: Callable[[int], str]
) -> None:
    """Micro-batches in flight at once (FRAUD_BATCHES_IN_FLIGHT) send their store round
    trips in the order they formed: eight attempts of one card, one batch each, started
    together behind a batch of 60 other transactions, count 0, 1, ..., 7 earlier ones,
    as one batch at a time does; each is recorded once."""
    url = online_store(8)
    others = [
        Transaction.model_validate(
            _attempt(0)
            | {"transaction_id": f"other-{i}", "card_id": f"c-other-{i}", "device_id": None}
        )
        for i in range(60)
    ]
    attempts = [Transaction.model_validate(_attempt(i)) for i in range(8)]
    settings = Settings(redis_url=url, data_dir=world.data_dir, model_repo=world.model_repo)

    async def run() -> list[float]:
        client = async_client(url)
        with ThreadPoolExecutor(1) as pool:
            project = open_store(world.data_dir, url).project
            scorer = Scorer(client, OnlineFeatureReader(project), ModelHolder(), settings, pool)
            try:
                got = await asyncio.gather(
                    scorer.read_features([*others, attempts[0]]),
                    *(scorer.read_features([a]) for a in attempts[1:]),
                )
            finally:
                await client.aclose()
        return [float(got[0][0]["card_txn_count_10m"][-1])] + [
            float(g[0]["card_txn_count_10m"][0]) for g in got[1:]
        ]

    assert asyncio.run(run()) == [float(i) for i in range(8)]
    assert connect(url).zcard("{card:c-burst}:ev") == 8


def test_turns_pass_in_the_order_taken() -> None:
    """A later batch's round trip waits for the earlier one's even when it is ready
    first; a failed or cancelled batch passes its turn on (once the earlier has)."""
    from service.core.turns import Turns

    async def run() -> list[str]:
        turns, done, claimed = Turns(), [], asyncio.Event()

        async def batch(name: str, ready: asyncio.Event | None, fail: bool = False) -> None:
            turn = turns.take()
            try:
                if ready is not None:
                    await ready.wait()  # e.g. its id claims, still out
                if fail:
                    raise RuntimeError(name)
                await Turns.wait(turn[0])
                done.append(name)
            finally:
                Turns.done(turn)

        async def late_claims() -> None:
            # "a"'s claims come back only after every other batch had its turn to run (and
            # "c" and "d" wait on theirs): a few passes of the event loop, no clock.
            for _ in range(5):
                await asyncio.sleep(0)
            assert done == []  # nobody passed "a"
            claimed.set()

        await asyncio.gather(
            batch("a", claimed),
            batch("b", None, fail=True),
            batch("c", None),
            batch("d", None),
            late_claims(),
            return_exceptions=True,
        )
        return done

    assert asyncio.run(run()) == ["a", "c", "d"]
