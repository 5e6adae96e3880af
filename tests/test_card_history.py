"""A card's history in the online store: the write side every recorder shares."""

from __future__ import annotations

import numpy as np

from fraud_scoring.session import (
    DAY_US,
    FUTURE_ROOM_US,
    HISTORY_CAP,
    US,
    SessionEvent,
    events_key,
    ids_key,
)
from streaming.state import SessionWriter
from tests.conftest_streaming import connect, stream_redis

__all__ = ["stream_redis"]

T0 = 1_767_225_600 * US  # 2026-01-01T00:00:00Z in µs


def ev(
    t_s: float, tid: str, amount: float = 10.0, merchant: str = "m1", country: str = "US"
) -> SessionEvent:
    return SessionEvent(T0 + round(t_s * US), tid, amount, merchant, country)


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
    # 24 h + 900 s (an event may be stamped that far ahead) + the lateness
    assert min(s for _, s in kept) >= newest - DAY_US - FUTURE_ROOM_US - 60 * US
    assert len(kept) == client.hlen(ids_key("c1")) <= 24 * 6 + 1 + 1 + 2
    assert client.ttl(events_key("c1")) > 0
    # Too late to matter: dropped and counted. Late but within retention: applied, counted.
    r = writer.apply([("c1", ev(0, "ancient")), ("c1", ev(600 * 431 - 120, "late"))])
    assert (r.added, r.dropped, r.late) == (1, 1, 2)
    assert not client.hexists(ids_key("c1"), "ancient")
    assert client.hexists(ids_key("c1"), "late")
    # Keys of a card share one hash tag (one Redis Cluster slot).
    assert events_key("c1").startswith("{card:c1}") and ids_key("c1").startswith("{card:c1}")


def test_a_card_keeps_its_newest_events_up_to_the_cap(stream_redis: str) -> None:
    """A card-testing burst (10x the cap in ten minutes) leaves the card's newest
    HISTORY_CAP events and their ids, whatever the traffic; an event pushed out and
    applied again changes nothing (dropped: older than the card's oldest)."""
    client = connect(stream_redis)
    writer = SessionWriter(client, allowed_lateness_s=60)
    n = 10 * HISTORY_CAP
    evs = [ev(600 * i / n, f"b{i:05d}") for i in range(n)]
    for start in range(0, n, 97):  # in calls of several events, as the updater applies
        writer.apply([("c2", e) for e in evs[start : start + 97]])
    kept = client.zrange(events_key("c2"), 0, -1)
    assert len(kept) == HISTORY_CAP == client.hlen(ids_key("c2"))
    newest = {f"b{i:05d}".encode() for i in range(n - HISTORY_CAP, n)}
    assert {m.split(b"\x1f")[0] for m in kept} == newest == set(client.hkeys(ids_key("c2")))
    before = client.zrange(events_key("c2"), 0, -1, withscores=True)
    r = writer.apply([("c2", evs[0]), ("c2", evs[n - 1])])  # pushed out; still held
    assert (r.added, r.duplicates, r.dropped) == (0, 1, 1)
    assert client.zrange(events_key("c2"), 0, -1, withscores=True) == before
    assert client.hlen(ids_key("c2")) == HISTORY_CAP
    assert (
        int(client.memory_usage(events_key("c2"))) + int(client.memory_usage(ids_key("c2")))
        < 64 * 1024
    )


def test_a_call_that_adds_nothing_changes_nothing(stream_redis: str) -> None:
    """The second recorder of every transaction (the updater after the service's
    read-your-writes) finds only duplicates: the card is left as it was, its expiry
    included (set by the call that last added to it)."""
    client = connect(stream_redis)
    writer = SessionWriter(client, allowed_lateness_s=60)
    evs = [ev(60 * i, f"d{i}") for i in range(5)]
    assert writer.apply([("c3", e) for e in evs]).added == 5
    client.pexpire(events_key("c3"), 50_000)
    client.pexpire(ids_key("c3"), 50_000)
    before = client.zrange(events_key("c3"), 0, -1, withscores=True)
    r = writer.apply([("c3", e) for e in evs[2:]] + [("c3", ev(-3 * 86_400, "old"))])
    assert (r.added, r.duplicates, r.dropped) == (0, 3, 1)
    assert client.zrange(events_key("c3"), 0, -1, withscores=True) == before
    assert 0 < client.pttl(events_key("c3")) <= 50_000
    assert 0 < client.pttl(ids_key("c3")) <= 50_000
    assert writer.apply([("c3", ev(600, "d-new"))]).added == 1  # an addition sets it again
    assert client.pttl(events_key("c3")) > 50_000
