"""Session features: declarations, point-in-time rules and the Redis read/write edges."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import numpy as np
import pandas as pd
import pytest
import redis.asyncio as aioredis

from fraud_scoring import features as F
from fraud_scoring.session import (
    DAY_US,
    NO_PREVIOUS_S,
    READ_LUA,
    SESSION_FEATURES,
    SESSION_NAMES,
    US,
    SessionEvent,
    events_key,
    ids_key,
    offline_session_features,
    parse_session_results,
    queue_session_reads,
    session_features,
)
from streaming.state import SessionWriter
from tests.conftest_streaming import connect, stream_redis

__all__ = ["stream_redis"]

T0 = 1_767_225_600 * US  # 2026-01-01T00:00:00Z in µs


def ev(
    t_s: float, tid: str, amount: float = 10.0, merchant: str = "m1", country: str = "US"
) -> SessionEvent:
    return SessionEvent(T0 + round(t_s * US), tid, amount, merchant, country)


def row(
    events: list[SessionEvent], at_s: float, exclude: str | None = None, country: str | None = None
) -> dict[str, float]:
    return dict(
        zip(
            SESSION_NAMES,
            session_features(events, T0 + round(at_s * US), exclude, country),
            strict=True,
        )
    )


def test_session_features_are_declared_for_the_model() -> None:
    names = F.default_model_features()
    for f in (*SESSION_FEATURES, *F.SPANNING_FEATURES):
        assert f.kind in ("session", "spanning")
        assert f.name in F.all_features()
        assert (f.name in names) == f.model_input
    assert {f.name for f in F.SPANNING_FEATURES} <= set(names)


def test_since_snapshot_counts_the_stream_after_the_snapshot() -> None:
    evs = [ev(3599, "before", 1.0), ev(3600, "at", 2.0), ev(3700, "after", 4.0)]

    def since(at_s: float, snapshot_us: int) -> tuple[float, float]:
        r = dict(
            zip(
                SESSION_NAMES,
                session_features(evs, T0 + round(at_s * US), None, None, snapshot_us),
                strict=True,
            )
        )
        return r["card_txn_count_since_snapshot"], r["card_amount_sum_since_snapshot"]

    assert since(3800, T0 + 3600 * US) == (2, 6.0)  # [snapshot, t): "at" and "after"
    assert since(3800, 0) == (3, 7.0)  # no usable snapshot: the last 24 h
    # A snapshot more than 24 h old: only the stream's last 24 h (documented as inexact).
    assert since(3650 + DAY_US / US, T0) == (1, 4.0)
    cols = F.spanning_features(
        {
            "card_txn_count_30d": [10.0],
            "card_amount_sum_30d": [100.0],
            "card_txn_count_since_snapshot": [2.0],
            "card_amount_sum_since_snapshot": [6.0],
        }
    )
    assert cols["card_txn_count_30d_live"][0] == 12 and cols["card_amount_sum_30d_live"][0] == 106


def test_spanning_count_is_exact_with_a_fresh_snapshot(world: Any) -> None:
    """Snapshot of day D + stream since it == every transaction in [snapshot - 30 d, t)."""
    import pyarrow.parquet as pq

    from batch_jobs.daily_features import snapshot_time
    from fraud_scoring.storage import partition_dir

    day = world.last_day - timedelta(days=1)
    snap = snapshot_time(day)
    card = pq.read_table(
        partition_dir(world.data_dir / "features", F.CARD_VIEW.name, day) / "part-0.parquet"
    ).to_pandas()
    raw = pd.read_parquet(world.data_dir / "raw" / "transactions")
    raw["event_time"] = pd.to_datetime(raw["event_time"], utc=True)
    today = raw[raw["event_time"] >= snap]
    q = today.sample(300, random_state=3).merge(
        card.drop(columns="event_timestamp"), on="card_id", how="left"
    )
    assert q["card_snapshot_time"].notna().sum() > 200  # most cards have a snapshot
    assert (q["card_snapshot_time"].dropna() == snap.timestamp()).all()
    batch = F.apply_defaults(
        {f.name: q[f.name].to_numpy(object) for f in F.view_features(F.CARD_VIEW)}
    )
    sess = offline_session_features(q, history=raw)
    live = F.spanning_features({**batch, **sess})

    by_card = dict(tuple(raw.groupby("card_id")))
    start = snap - timedelta(days=30)
    for i, r in enumerate(q.itertuples()):
        h = by_card[r.card_id]
        inside = h[(h["event_time"] >= start) & (h["event_time"] < r.event_time)]
        inside = inside[inside["transaction_id"] != r.transaction_id]
        assert live["card_txn_count_30d_live"][i] == len(inside), r.transaction_id
        assert live["card_amount_sum_30d_live"][i] == pytest.approx(
            inside["amount"].sum(), rel=1e-5
        )


def test_windows_are_half_open_strictly_before_t() -> None:
    evs = [ev(0, "a", 1.0), ev(60, "b", 2.0), ev(119.999999, "c", 4.0), ev(120, "d", 8.0)]
    r = row(evs, 120)
    # [t-60s, t): b (exactly at t-60 s) and c count; d at t does not; a is 2 minutes old.
    assert r["card_txn_count_1m"] == 2
    assert r["card_amount_sum_1m"] == 6.0
    assert r["card_txn_count_10m"] == 3
    assert r["card_seconds_since_prev_txn"] == 1e-6  # one µs
    empty = row([], 120)
    assert empty["card_seconds_since_prev_txn"] == NO_PREVIOUS_S
    assert empty["card_txn_count_24h"] == 0


def test_country_change_and_distinct_counts() -> None:
    evs = [
        ev(0, "a", merchant="m1", country="US"),
        ev(10, "b", merchant="m2", country="FR"),
        ev(20, "c", merchant="m2", country="FR"),
    ]
    r = row(evs, 30, country="US")
    assert r["card_distinct_merchants_1h"] == 2
    assert r["card_distinct_countries_1h"] == 2
    assert r["card_country_changed"] == 1.0
    assert row(evs, 30, country="FR")["card_country_changed"] == 0.0
    assert row(evs, 30)["card_country_changed"] == 0.0  # country unknown: default


def test_scored_transaction_never_counts_in_its_own_features(stream_redis: str) -> None:
    client = connect(stream_redis)
    writer = SessionWriter(client, allowed_lateness_s=300)
    evs = [ev(0, "t1", 5.0), ev(30, "t2", 7.0), ev(40, "scored", 100.0)]
    writer.apply([("c1", e) for e in evs])  # the updater has already seen "scored"
    at = (T0 + 40 * US) / US
    cases = [
        (at, "scored"),  # the same time: excluded by time and by id
        (at + 0.5, "scored"),  # the scorer's clock says later: excluded by id
        (at + 0.5, "other"),  # a later, different transaction does see it
    ]
    client.script_load(READ_LUA)
    pipe = client.pipeline(transaction=False)
    queued = queue_session_reads(pipe, ["c1"] * 3, [c[0] for c in cases])
    replies = pipe.execute()
    assert len(replies) == queued == 1  # one script call for the batch
    cols = parse_session_results(
        replies, ["c1"] * 3, [c[0] for c in cases], [c[1] for c in cases], ["US"] * 3
    )
    assert list(cols["card_txn_count_1m"]) == [2, 2, 3]
    assert list(cols["card_amount_sum_1m"]) == [12.0, 12.0, 112.0]
    # Offline, each row excludes itself too.
    df = pd.DataFrame(
        {
            "transaction_id": [e.transaction_id for e in evs],
            "card_id": "c1",
            "merchant_id": "m1",
            "amount": [e.amount for e in evs],
            "country": "US",
            "event_time": pd.to_datetime([e.ts_us for e in evs], unit="us", utc=True),
        }
    )
    off = offline_session_features(df)
    assert list(off["card_txn_count_1m"]) == [0, 1, 2]
    assert list(off["card_amount_sum_1m"]) == [0.0, 5.0, 12.0]


def test_apply_is_idempotent_and_state_is_bounded(stream_redis: str) -> None:
    client = connect(stream_redis)
    writer = SessionWriter(client, allowed_lateness_s=60)
    # 3 days of one event every 10 minutes for one card, applied twice, shuffled.
    evs = [ev(600 * i, f"t{i:04d}") for i in range(3 * 144)]
    rng = np.random.default_rng(0)
    first = writer.apply([("c1", evs[i]) for i in rng.permutation(len(evs))])
    again = writer.apply([("c1", e) for e in evs])
    assert first.added + first.dropped >= len(evs) and first.duplicates == 0
    assert again.added == 0 and again.duplicates + again.dropped == len(evs)
    newest = evs[-1].ts_us
    kept = client.zrange(events_key("c1"), 0, -1, withscores=True)
    assert min(s for _, s in kept) >= newest - DAY_US - 60 * US
    assert len(kept) == client.hlen(ids_key("c1")) <= 24 * 6 + 1 + 1
    assert client.ttl(events_key("c1")) > 0
    # Too late to matter: dropped and counted. Late but within retention: applied, counted.
    r = writer.apply([("c1", ev(0, "ancient")), ("c1", ev(600 * 431 - 120, "late"))])
    assert (r.added, r.dropped, r.late) == (1, 1, 2)
    assert not client.hexists(ids_key("c1"), "ancient")
    assert client.hexists(ids_key("c1"), "late")
    # Keys of a card share one hash tag (one Redis Cluster slot).
    assert events_key("c1").startswith("{card:c1}") and ids_key("c1").startswith("{card:c1}")


def test_reads_queue_on_asyncio_pipelines(stream_redis: str) -> None:
    writer = SessionWriter(connect(stream_redis), allowed_lateness_s=300)
    writer.apply([("c1", ev(0, "a", 3.0)), ("c2", ev(1, "b", 4.0))])

    async def read() -> dict[str, np.ndarray]:
        client: Any = aioredis.Redis.from_url(stream_redis)
        await client.script_load(READ_LUA)
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.get("unrelated")  # the scorer's own reads share the pipeline
                queue_session_reads(pipe, ["c1", "c2", "c3"], [(T0 + 5 * US) / US] * 3)
                replies = await pipe.execute()
        finally:
            await client.aclose()
        return parse_session_results(
            replies[1:], ["c1", "c2", "c3"], [(T0 + 5 * US) / US] * 3, ["x", "y", "z"]
        )

    cols = asyncio.run(read())
    assert list(cols["card_amount_sum_1m"]) == [3.0, 4.0, 0.0]
    assert list(cols["card_seconds_since_prev_txn"]) == [5.0, 4.0, NO_PREVIOUS_S]
