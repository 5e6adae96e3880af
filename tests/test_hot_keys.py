"""Hot keys: a card with thousands of events in its windows is read at a bounded cost
and still gets its exact declared features, a micro-batch's writes go in one call, and
a card with 10,000 events scores without a refusal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.session import DAY_US, US, SessionEvent
from tests.conftest import World, start_server, stop_server
from tests.conftest_streaming import connect, stream_redis
from tests.declared_reference import reference
from tests.test_service import TXN

__all__ = ["stream_redis"]

MINUTE_US, HOUR_US = 60 * US, 3600 * US
MIDNIGHT = 1_767_225_600 * US  # 2026-01-01T00:00:00Z
T = MIDNIGHT + 9 * HOUR_US + 17 * US + 250  # the scored transactions' time (µs)


def heavy_card(n: int, seed: int = 7) -> pd.DataFrame:
    """``n`` transactions of one card over the 26 h before ``T``, densest in the last
    hour (a card-testing burst), 400 merchants, 4 countries, ties on one microsecond."""
    rng = np.random.default_rng(seed)
    ts = np.concatenate(
        [
            T - rng.integers(1, 26 * HOUR_US, n // 2),
            T - rng.integers(1, HOUR_US, n - n // 2 - 10),
            np.full(10, T - 30 * MINUTE_US),
        ]
    )
    return pd.DataFrame(
        {
            "transaction_id": [f"t{i:05d}" for i in range(n)],
            "card_id": "heavy",
            "merchant_id": [f"m{k}" for k in rng.integers(0, 400, n)],
            "device_id": None,
            "amount": np.round(rng.lognormal(3, 1.5, n), 2),
            "channel": "ecom",
            "mcc": "5411",
            "country": rng.choice(["US", "DE", "FR", "BR"], n),
            "event_time": pd.to_datetime(ts * 1000, utc=True),
        }
    )


@pytest.mark.parametrize("n", [100, 10_000])
def test_a_heavy_cards_read_is_bounded_and_exact(stream_redis: str, n: int) -> None:
    """A card with ``n`` events (recorded by the updater's script, shuffled): every one
    of its declared features read as of ``T`` equals the reference, and what crosses the
    wire is bounded by the declared windows, not by the card's traffic."""
    client = connect(stream_redis)
    client.flushdb()
    decl = F.declarations()
    specs = [s for s in decl.specs if s.entity == ("card_id",)]
    hist = heavy_card(n)
    rows = hist.sample(frac=1.0, random_state=1).to_dict("records")
    ts = [int(pd.Timestamp(r["event_time"]).value // 1000) for r in rows]
    for script in D.SCRIPTS:
        client.script_load(script)
    for spec in specs:
        limits = D.Limits.for_spec(spec, horizon_s=2 * 86400)
        for lo in range(0, len(rows), 500):
            pipe = client.pipeline(transaction=False)
            D.queue_apply(
                pipe, spec, D.events_for(spec, rows[lo : lo + 500], ts[lo : lo + 500]), limits
            )
            pipe.execute()
    q = pd.DataFrame(
        [{**rows[0], "transaction_id": "new", "event_timestamp": pd.Timestamp(T * 1000, tz="UTC")}]
    )
    pipe = client.pipeline(transaction=False)
    for spec in specs:
        D.queue_read(pipe, spec, "heavy", T)
    replies = pipe.execute()
    served: dict[str, float] = {}
    for spec, reply in zip(specs, replies, strict=True):
        bound = sum(slots * D.TILE.size for slots in spec.widths.values())
        bound += D.NEWEST * D.NEWEST_REC.size + D.DISTINCT_CAP * D.NEWEST_REC.size
        assert sum(len(x or b"") for x in reply) <= bound, spec.feature_names()
        (state,) = D.parse_reads(spec, [reply], [T])
        feats, exact = D.online_row(spec, state, T, own=spec.own_code(q.iloc[0].to_dict()))
        assert exact
        served.update(feats)
    raw = yaml.safe_load(Path(decl.source).read_text())
    raw["aggregations"] = [a for a in raw["aggregations"] if a["entity"] == "card_id"]
    ref = reference(raw, q, hist, "event_timestamp")
    assert set(ref) == set(served)
    for name, want in ref.items():
        assert served[name] == pytest.approx(want[0], rel=1e-9), name
    if n == 10_000:
        assert served["card_txn_count_1h"] > 4000
        assert served["card_distinct_merchants_1h"] == D.DISTINCT_CAP


def test_a_micro_batchs_writes_in_one_call_match_the_per_card_calls(stream_redis: str) -> None:
    """The scorer records a micro-batch's cards in one ``APPLY_MANY_LUA`` call: the state
    and the per-card replies (added, duplicates, late, dropped) are those of one
    ``APPLY_LUA`` call per card, late and duplicate events included."""
    from fraud_scoring.session import (
        SCRIPTS,
        SessionLimits,
        events_key,
        ids_key,
        queue_apply,
        queue_apply_many,
    )

    client = connect(stream_redis)
    for script in SCRIPTS:
        client.script_load(script)
    limits = SessionLimits(allowed_lateness_s=60)

    def batch(prefix: str) -> dict[str, list[SessionEvent]]:
        e = [SessionEvent(T - k * MINUTE_US, f"t{k}", 10.0 + k, "m1", "US") for k in range(6)]
        return {
            f"{prefix}a": e[:3],
            f"{prefix}b": [e[3], e[3]],  # a duplicate
            f"{prefix}c": [e[5], SessionEvent(e[5].ts_us - 3 * DAY_US, "t-old", 1.0, "m", "US")],
        }

    replies = {}
    for prefix, queue in (("one-", queue_apply), ("many-", queue_apply_many)):
        for _ in range(2):  # the second time, every event is a duplicate
            pipe = client.pipeline(transaction=False)
            queue(pipe, batch(prefix), limits)
            got = pipe.execute()
            replies[prefix] = got if prefix == "one-" else got[0]
    assert replies["one-"] == replies["many-"]
    for card in "abc":
        one, many = f"one-{card}", f"many-{card}"
        assert client.zrange(events_key(one), 0, -1, withscores=True) == client.zrange(
            events_key(many), 0, -1, withscores=True
        )
        assert client.hgetall(ids_key(one)) == client.hgetall(ids_key(many))
        assert client.pttl(events_key(many)) > 0


def test_a_card_with_10000_events_scores_without_a_refusal(world: World, tmp_path: Path) -> None:
    """Over real HTTP: a card whose windows hold 10,000 events (a card-testing attack,
    recorded by the updater's own script) is scored like any other, and so are the
    transactions that share its micro-batches."""
    client = connect(world.redis_url)
    for script in D.SCRIPTS:  # the world's server may not hold them (a test flushed them)
        client.script_load(script)
    specs = [s for s in F.declarations().specs if s.entity == ("card_id",)]
    hist = heavy_card(10_000).assign(card_id="c-hot-http")
    rows = hist.to_dict("records")
    ts = [int(pd.Timestamp(r["event_time"]).value // 1000) for r in rows]
    for spec in specs:
        limits = D.Limits.for_spec(spec, horizon_s=2 * 86400)
        for lo in range(0, len(rows), 1000):
            evs = D.events_for(spec, rows[lo : lo + 1000], ts[lo : lo + 1000])
            pipe = client.pipeline(transaction=False)
            D.queue_apply(pipe, spec, evs, limits)
            pipe.execute()
    at = pd.Timestamp((T + US) * 1000, tz="UTC").isoformat()
    hot = {**TXN, "card_id": "c-hot-http", "event_time": at}
    srv = start_server(world, tmp_path)
    try:
        with srv.client() as c:
            for i in range(20):
                batch = [
                    {**hot, "transaction_id": f"hot-{i}"},
                    {**TXN, "transaction_id": f"calm-{i}", "event_time": at},
                ]
                r = c.post("/v1/score/batch", json={"transactions": batch})
                assert r.status_code == 200, r.text
                assert all(x["score"] is not None for x in r.json()["results"])
            r = c.post("/v1/score", json={**hot, "transaction_id": "hot-last"})
            assert r.status_code == 200, r.text
            assert r.json()["timing"]["feature_read_ms"] < 50
    finally:
        stop_server(srv)
