"""What a card's session read costs as its event count grows: the bounded read
(``READ_LUA``: the newest ``READ_CAP`` events in full, the rest as server-side totals)
against reading and decoding every event of the 24 h in Python (the read before it).

    python -m bench.bench_session_read [--events 10,128,1000,5000] [--repeat 50]

Per card size: the client's CPU per read (queueing, parsing, decoding and the feature
function: the event loop's share) and the wall time of the round trip (what Redis spends
in the script shows up here, not on the event loop). Both read the same events and
produce the same features (checked first).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import redis

from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.session import (
    DAY_US,
    HOUR_US,
    LONGEST_WINDOW_US,
    READ_LUA,
    US,
    SessionEvent,
    decode_member,
    events_key,
    parse_session_results,
    queue_session_reads,
    session_features,
)
from streaming.state import SessionWriter

T = 1_767_225_600 * US + 9 * HOUR_US


def events(n: int) -> list[SessionEvent]:
    rng = np.random.default_rng(n)
    return [
        SessionEvent(
            int(T - rng.integers(1, DAY_US)), f"t{i}", float(rng.lognormal(3, 1)), "m", "US"
        )
        for i in range(n)
    ]


def unbounded(client: Any, card: str) -> tuple[float, ...]:
    """The read before the cap: every event of the window, decoded in Python."""
    rows = client.zrangebyscore(events_key(card), T - LONGEST_WINDOW_US, f"({T}", withscores=True)
    return session_features([decode_member(m, s) for m, s in rows], T, "x", "US")


def bounded(client: Any, card: str) -> tuple[float, ...]:
    pipe = client.pipeline(transaction=False)
    queue_session_reads(pipe, [card], [T / US], ["x"])
    cols = parse_session_results(pipe.execute(), [card], [T / US], ["x"], ["US"])
    return tuple(float(c[0]) for c in cols.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", default="10,128,1000,5000")
    p.add_argument("--repeat", type=int, default=50)
    a = p.parse_args()
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        client.script_load(READ_LUA)
        writer = SessionWriter(client, allowed_lateness_s=300)
        print(f"{'events':>7} {'read':>10} {'client CPU us':>14} {'wall us':>9}")
        for n in (int(x) for x in a.events.split(",")):
            card = f"c{n}"
            writer.apply([(card, e) for e in events(n)])
            assert unbounded(client, card) == bounded(client, card)
            for name, read in (("all", unbounded), ("bounded", bounded)):
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(a.repeat):
                    read(client, card)
                cpu = (time.process_time() - cpu0) / a.repeat * 1e6
                wall = (time.perf_counter() - wall0) / a.repeat * 1e6
                print(f"{n:>7} {name:>10} {cpu:>14.0f} {wall:>9.0f}")


if __name__ == "__main__":
    main()
