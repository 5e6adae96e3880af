"""What a declared key costs as its traffic grows: the tiled read (``declared.queue_read``) of a
merchant key and of a card (every state the card's features read: its velocity counts
and sums, time since last, distinct merchants and countries, a changed country) holding
10 to 100,000 events in their windows, in one run; and the Redis bytes each keeps.

    python -m bench.bench_declared [--events 10,1000,10000,100000] [--repeat 200]

Per size: p50 and p99 of one read's round trip (queue, Redis, parse, the features),
Redis's own time per read (``INFO commandstats``: what bounds a service's held rate
when Redis shares its cores) and ``MEMORY USAGE`` of the keys. The merchant spec is the
default file's merchant windows; the card's are the default file's card states. Goal
(issue 22): p50 within 1.5x from 10 to 100,000. Events are spread over the last 7 days,
a tenth of them in the last hour; the card's come from 500 merchants and 5 countries.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import redis

from fraud_scoring import declared as D
from fraud_scoring import session
from fraud_scoring.features import declarations
from fraud_scoring.redis_server import embedded_redis

US = D.US
DAY_US = 86_400 * US
T = 1_767_225_600 * US + 9 * 3600 * US


def times(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    recent = n // 10
    return np.concatenate(
        [T - rng.integers(1, 7 * DAY_US, n - recent), T - rng.integers(1, 3600 * US, recent)]
    )


def fill(client: Any, specs: list[D.Spec], key: str, ts: np.ndarray) -> None:
    """Record ``ts``'s events (in time order) in ``specs``' states of ``key``."""
    order = np.sort(ts)
    for spec in specs:
        limits = D.Limits.for_spec(spec, 300 + D.HORIZON_S)  # the service's default
        for i in range(0, len(order), 2000):
            rows = [
                {
                    "transaction_id": f"t{i + j}",
                    "card_id": key,
                    "merchant_id": key if spec.entity == ("merchant_id",) else f"m{(i + j) % 500}",
                    "country": ("US", "GB", "FR", "DE", "NL")[(i + j) % 5],
                    "amount": 10.0 + (i + j) % 7,
                }
                for j in range(len(order[i : i + 2000]))
            ]
            pipe = client.pipeline(transaction=False)
            evs = D.events_for(spec, rows, [int(t) for t in order[i : i + 2000]])
            D.queue_apply(pipe, spec, evs, limits)
            pipe.execute()


def fill_history(client: Any, card: str, ts: np.ndarray) -> None:
    """Apply ``ts``'s events (in time order) to ``card``'s history ({card:<id>}:ev/:ids),
    as the updater does, with the service's default lateness."""
    limits = session.SessionLimits(allowed_lateness_s=300)
    order = np.sort(ts)
    for i in range(0, len(order), 64):  # a micro-batch's events of one card at most
        evs = [
            session.SessionEvent(int(t), f"t{i + j}", 10.0, f"m{(i + j) % 500}", "US")
            for j, t in enumerate(order[i : i + 64])
        ]
        pipe = client.pipeline(transaction=False)
        session.queue_apply_many(pipe, {card: evs}, limits)
        pipe.execute()


def read(client: Any, specs: list[D.Spec], key: str) -> dict[str, float]:
    pipe = client.pipeline(transaction=False)
    for spec in specs:
        D.queue_read(pipe, spec, key, T)
    replies = pipe.execute()
    feats: dict[str, float] = {}
    for spec, reply in zip(specs, replies, strict=True):
        (state,) = D.parse_reads(spec, [reply], [T])
        got, _ = D.online_row(spec, state, T, own=D.value_code("US"))
        feats.update(got)
    return feats


def redis_usec(client: Any) -> float:
    """Redis's own time in commands so far (INFO commandstats), µs."""
    return sum(float(v["usec"]) for v in client.info("commandstats").values())


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
    decl = declarations()
    merchant = [s for s in decl.specs if s.entity == ("merchant_id",)]
    card = [s for s in decl.specs if s.entity == ("card_id",)]
    print(f"merchant states: {[[w.label for w in s.windows] for s in merchant]}")
    print(f"card states: {[s.feature_names() for s in card]}")
    print(
        f"{'events':>8} | {'merchant p50':>12} {'p99':>7} {'redis us':>8} {'bytes':>8} | "
        f"{'card p50':>8} {'p99':>7} {'redis us':>8} {'bytes':>8} | {'per state':>9} "
        f"{'history':>8}   (ms, one read; Redis's own time per read; bytes per key; the "
        "largest state's; the card's history, {card:<id>}:ev + :ids)"
    )
    largest = 0
    base: tuple[float, float] | None = None
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        for n in sizes:
            client.flushdb()
            for script in (*D.SCRIPTS, session.APPLY_MANY_LUA):
                client.script_load(script)
            ts = times(n)
            rows = []
            for specs, key in ((merchant, f"m{n}"), (card, f"c{n}")):
                fill(client, specs, key, ts)
                client.config_resetstat()
                p50, p99 = timed(lambda s=specs, k=key: read(client, s, k), args.repeat)
                srv = redis_usec(client) / (args.repeat + 1)
                per = [memory(client, [s.prefix(key) + p for p in (":t", ":ids")]) for s in specs]
                rows.append((p50, p99, srv, sum(per)))
                largest = max(per)
            fill_history(client, f"c{n}", ts)
            history = memory(client, [session.events_key(f"c{n}"), session.ids_key(f"c{n}")])
            (m50, m99, msrv, mb), (c50, c99, csrv, cb) = rows
            base = base or (m50, c50)
            print(
                f"{n:>8,} | {m50:>12.3f} {m99:>7.3f} {msrv:>8.1f} {mb:>8,} | "
                f"{c50:>8.3f} {c99:>7.3f} {csrv:>8.1f} {cb:>8,} | {largest:>9,} {history:>8,}   "
                f"p50 {m50 / base[0]:.2f}x / {c50 / base[1]:.2f}x of 10"
            )
    print(
        "bytes: a key keeps its tiles (bounded by the windows) and its newest events and "
        "values (bounded); no ids (one marker per transaction instead; a Redis Cluster and "
        "label states keep the ids of the last FRAUD_ALLOWED_LATENESS_S + 1 h per key); "
        f"the card's history keeps its last 24 h, at most its newest {session.HISTORY_CAP}"
    )
    with embedded_redis() as url:  # a transaction's marker, recorded in every card state
        client = redis.Redis.from_url(url)
        for script in D.SCRIPTS:
            client.script_load(script)
        fill(client, card, "c1", times(1))
        mark = memory(client, [D.marker("t0")])
    print(
        f"per transaction (not per key): its marker, {mark:,} B with the card's "
        f"{len([s for s in card if not s.arrivals])} transaction states, for "
        f"FRAUD_ALLOWED_LATENESS_S + 2 h after its last recording"
    )
    verdict = "met" if largest <= 64 * 1024 else "NOT MET"
    print(
        f"goal (issue 37): a key with {sizes[-1]:,} events holds <= 64 KB per state: the "
        f"largest state holds {largest:,} B: {verdict}"
    )


if __name__ == "__main__":
    main()
