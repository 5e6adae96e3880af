"""What a declared key costs as its traffic grows: the tiled read (``declared.queue_read``) of a
merchant key holding 10 to 100,000 events in its windows, side by side with the card's
session read (``fraud_scoring.session``, the hand-written per-card state) holding the
same events in its 24 h, in one run; and the Redis bytes each key keeps.

    python -m bench.bench_declared [--events 10,1000,10000,100000] [--repeat 200]

Per size: p50 and p99 of one read's round trip (queue, Redis, parse, the features),
Redis's own time per read (``INFO commandstats``: what bounds a service's held rate
when Redis shares its cores) and ``MEMORY USAGE`` of the keys. The declared spec is the
default file's merchant windows (10m, 1h, 1d, 7d, 30d). Goal (issue): p50 within 1.5x
from 10 to 100,000. Events are spread over the last 7 days, a tenth of them in the last hour.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import redis

from fraud_scoring import declared as D
from fraud_scoring.features import declarations
from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.session import (
    DAY_US,
    US,
    SessionEvent,
    events_key,
    ids_key,
    parse_session_results,
    queue_session_reads,
)
from fraud_scoring.session import SCRIPTS as SESSION_SCRIPTS
from streaming.state import SessionWriter

T = 1_767_225_600 * US + 9 * 3600 * US


def times(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    recent = n // 10
    return np.concatenate(
        [T - rng.integers(1, 7 * DAY_US, n - recent), T - rng.integers(1, 3600 * US, recent)]
    )


def fill_declared(client: Any, spec: D.Spec, key: str, ts: np.ndarray) -> None:
    limits = D.Limits.for_spec(spec, 300 + D.HORIZON_S)  # the service's default
    order = np.sort(ts)
    for i in range(0, len(order), 2000):
        pipe = client.pipeline(transaction=False)
        evs = [
            D.Event(f"t{i + j}", int(t), 10.0 + j % 7) for j, t in enumerate(order[i : i + 2000])
        ]
        D.queue_apply(pipe, spec, {key: evs}, limits)
        pipe.execute()


def read_declared(client: Any, spec: D.Spec, key: str) -> dict[str, float]:
    pipe = client.pipeline(transaction=False)
    D.queue_read(pipe, spec, key, T)
    (state,) = D.parse_reads(spec, pipe.execute(), [T])
    feats, _ = D.online_row(spec, state, T)
    return feats


def redis_usec(client: Any) -> float:
    """Redis's own time in commands so far (INFO commandstats), µs."""
    return sum(float(v["usec"]) for v in client.info("commandstats").values())


def fill_session(client: Any, card: str, ts: np.ndarray) -> None:
    writer = SessionWriter(client, allowed_lateness_s=8 * 86400)
    day = ts[ts > T - DAY_US]
    events = [SessionEvent(int(t), f"s{i}", 10.0, "m", "US") for i, t in enumerate(day)]
    for i in range(0, len(events), 2000):
        writer.apply([(card, e) for e in events[i : i + 2000]])


def read_session(client: Any, card: str) -> Any:
    pipe = client.pipeline(transaction=False)
    queue_session_reads(pipe, [card], [T / US], ["x"])
    return parse_session_results(pipe.execute(), [card], [T / US], ["x"], ["US"])


def memory(client: Any, keys: list[str]) -> int:
    """Bytes Redis holds for ``keys`` (MEMORY USAGE)."""
    return sum(int(client.memory_usage(k) or 0) for k in keys)


def timed(fn: Any, repeat: int) -> tuple[float, float]:
    fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    a = np.asarray(out) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", default="10,1000,10000,100000")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    sizes = [int(x) for x in args.events.split(",")]
    spec = next(s for s in declarations().specs if s.entity == ("merchant_id",))
    print(f"declared spec: merchant_id, windows {[w.label for w in spec.windows]}")
    print(
        f"{'events':>8} | {'declared p50':>12} {'p99':>7} {'redis us':>8} {'bytes':>8} | "
        f"{'session p50':>11} {'p99':>7} {'redis us':>8} {'bytes':>9}   "
        "(ms, one read; Redis's own time per read; bytes per key)"
    )
    base = None
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        for n in sizes:
            client.flushdb()
            for script in (*D.SCRIPTS, *SESSION_SCRIPTS):
                client.script_load(script)
            ts = times(n)
            key, card = f"m{n}", f"c{n}"
            fill_declared(client, spec, key, ts)
            fill_session(client, card, ts)
            client.config_resetstat()
            d50, d99 = timed(lambda k=key: read_declared(client, spec, k), args.repeat)
            d_srv = redis_usec(client) / (args.repeat + 1)
            client.config_resetstat()
            s50, s99 = timed(lambda c=card: read_session(client, c), args.repeat)
            s_srv = redis_usec(client) / (args.repeat + 1)
            p = spec.prefix(key)
            dbytes = memory(client, [p + ":t", p + ":ids"])
            sbytes = memory(client, [events_key(card), ids_key(card)])
            base = base or d50
            print(
                f"{n:>8,} | {d50:>12.3f} {d99:>7.3f} {d_srv:>8.1f} {dbytes:>8,} | "
                f"{s50:>11.3f} {s99:>7.3f} {s_srv:>8.1f} {sbytes:>9,}   "
                f"declared p50 {d50 / base:.2f}x of 10"
            )
    print(
        "bytes: the declared key keeps its tiles (bounded by the windows), its newest "
        "events (bounded) and the ids of the last horizon (FRAUD_ALLOWED_LATENESS_S + "
        "1 h: the one part that grows with the key's traffic in that span); the session "
        "key keeps every event of the card's last 24 h"
    )


if __name__ == "__main__":
    main()
