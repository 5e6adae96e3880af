"""The declared-feature engine alone: CPU per transaction of a micro-batch's declared read
+ record + assembly for the shipped ``feature_repo/features.yaml``, at micro-batch sizes
1, 8 and 64, live and replay, for the columnar path the service runs
(``fraud_scoring.declared.columnar``) beside the row-by-row path
(``declared.queue_batch`` + ``declared.parse_batch``, unchanged since 2ec2c63, the last
landed commit before the columnar path: the reference) in the same run, batch by batch
interleaved.

    python -m bench.bench_engine [--batches 300] [--sizes 1,8,64] [--cards 2000]
        [--baseline REF [--rounds 2]]

The store (an embedded Redis-protocol server unless ``REDIS_URL``) holds two days of
history for ``--cards`` cards, 200 merchants and 500 devices. *live*: transactions just
after the history, each recorded (read-your-writes), new ids, a burst of one card now
and then; *replay*: transactions inside the history, not recorded (what-if calls).
Per row: the engine's CPU per transaction (``engine``: queueing the commands and
turning the replies into the declared columns; process CPU time, so Redis's own work
and the wait are not in it), the transport's (``redis-py``: packing the commands and
parsing the replies, the same for both paths), and the goal: engine <= 15 us at 64 and
<= 150 us at 1 (issue 37).

``--baseline REF``: the same benchmark of commit REF (a temporary git worktree) and of
this checkout, each in a process of its own, alternated ``--rounds`` times; per row both
columnar figures and how much faster this checkout's is once each is divided by its own
run's row-by-row figure (the same code in both: what a noisy machine did to one run cancels
out).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from fraud_scoring import declared as D
from fraud_scoring.declared import columnar as C
from fraud_scoring.features import declarations
from fraud_scoring.redis_server import embedded_redis

US = D.US
HORIZON_S = 300.0 + D.HORIZON_S  # the service's default
NOW = 1_767_225_600 * US + 9 * 3600 * US
GOALS = {1: 150.0, 64: 15.0}


def txn(rng: np.random.Generator, i: str, cards: int) -> dict[str, Any]:
    return {
        "transaction_id": i,
        "card_id": f"c{rng.integers(0, cards)}",
        "merchant_id": f"m{rng.integers(0, 200)}",
        "device_id": None if rng.random() < 0.3 else f"d{rng.integers(0, 500)}",
        "amount": round(float(rng.lognormal(3, 1)), 2),
        "country": str(rng.choice(["US", "US", "US", "GB", "FR"])),
        "channel": str(rng.choice(["pos", "ecom"])),
        "mcc": "5411",
    }


def fill(client: Any, decl: D.Declarations, cards: int) -> int:
    """Two days of history: ~12 events per card."""
    rng = np.random.default_rng(1)
    n = cards * 12
    ts = np.sort(NOW - rng.integers(1, 2 * 86_400 * US, n))
    for at in range(0, n, 2000):
        rows = [txn(rng, f"h{at + j}", cards) for j in range(min(2000, n - at))]
        pipe = client.pipeline(transaction=False)
        D.queue_batch(
            pipe, decl, rows, ts[at : at + 2000].tolist(), [True] * len(rows), HORIZON_S, read=False
        )
        pipe.execute()
    return n


def batches(mode: str, size: int, count: int, cards: int, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(count):
        rows = [txn(rng, f"{mode}{size}-{seed}-{b}-{i}", cards) for i in range(size)]
        if mode == "live":
            ts = [NOW + (b * size + i) * 1000 for i in range(size)]
            if size > 1 and b % 10 == 0:  # a burst: two attempts of one card
                rows[1]["card_id"] = rows[0]["card_id"]
        else:
            ts = (NOW - rng.integers(60 * US, 86_400 * US, size)).tolist()
        out.append((rows, ts, [mode == "live"] * size))
    return out


def run_columnar(client: Any, decl: D.Declarations, rows: Any, ts: Any, rec: Any) -> float:
    """One micro-batch; returns the seconds spent outside the engine (redis-py's
    packing, the round trip and parsing the replies)."""
    pipe = client.pipeline(transaction=False)
    plan = C.queue_batch(pipe, decl, D.BatchColumns(rows, ts), rec, HORIZON_S)
    t1 = time.perf_counter()
    replies = pipe.execute(raise_on_error=False)
    t2 = time.perf_counter()
    nreads = plan.read_commands
    C.parse_batch(plan, replies[:nreads], replies[nreads:], ts)
    return t2 - t1


def run_rows(client: Any, decl: D.Declarations, rows: Any, ts: Any, rec: Any) -> float:
    pipe = client.pipeline(transaction=False)
    plan = D.queue_batch(pipe, decl, rows, ts, rec, HORIZON_S)
    t1 = time.perf_counter()
    replies = pipe.execute(raise_on_error=False)
    t2 = time.perf_counter()
    nreads = sum(1 for _, _, k in plan.reads if k is not None)
    D.parse_batch(plan, replies[:nreads], replies[nreads:], rows, ts)
    return t2 - t1


def measure(
    client: Any, decl: D.Declarations, work: list[Any], fns: dict[str, Callable[..., Any]]
) -> dict[str, tuple[float, float]]:
    """Per path: engine and transport CPU (µs per transaction). The paths take turns
    chunk by chunk (CPU time is read per chunk: one clock read per micro-batch costs
    more than a micro-batch of one on some machines); each batch's ids are new to each
    path. The engine's CPU is the path's wall time outside the round trip (on a quiet
    machine the engine never waits), the rest of the CPU redis-py's."""
    cpu = {name: 0.0 for name in fns}
    wall = {name: [0.0, 0.0] for name in fns}  # total, round trip
    n = sum(len(rows) for rows, _, _ in work)
    chunk = 10
    for at in range(0, len(work), chunk):
        for k, (name, fn) in enumerate(fns.items()):
            part = [
                ([r | {"transaction_id": f"{r['transaction_id']}-{k}"} for r in rows], ts, rec)
                for rows, ts, rec in work[at : at + chunk]
            ]
            c0, w0 = time.process_time(), time.perf_counter()
            trip = sum(fn(client, decl, rows, ts, rec) for rows, ts, rec in part)
            cpu[name] += time.process_time() - c0
            wall[name][0] += time.perf_counter() - w0
            wall[name][1] += trip
    out = {}
    for name in fns:
        engine = min(cpu[name], wall[name][0] - wall[name][1])
        out[name] = (engine / n * 1e6, (cpu[name] - engine) / n * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--sizes", default="1,8,64")
    ap.add_argument("--cards", type=int, default=2000)
    ap.add_argument("--baseline", metavar="REF", help="also run commit REF's, alternated")
    ap.add_argument("--rounds", type=int, default=2, help="alternations with --baseline")
    args = ap.parse_args()
    if args.baseline:
        own = ["--batches", str(args.batches), "--sizes", args.sizes, "--cards", str(args.cards)]
        against(args.baseline, own, args.rounds)
        return
    decl = declarations()
    print(f"{len(decl.specs)} declared states, {len(decl.aggregate_names())} features")
    fns = {"columnar": run_columnar, "row-by-row (2ec2c63)": run_rows}
    with embedded_redis() if "REDIS_URL" not in os.environ else _given() as url:
        client = redis.Redis.from_url(url)
        client.flushdb()
        for script in D.SCRIPTS:
            client.script_load(script)
        print(f"history: {fill(client, decl, args.cards):,} events")
        print(
            f"{'mode':>6} {'batch':>5} | {'columnar us/txn':>15} {'row-by-row':>10} "
            f"{'ratio':>6} | {'redis-py us/txn':>15} | goal"
        )
        for mode in ("live", "replay"):
            for size in (int(s) for s in args.sizes.split(",")):
                count = max(3, args.batches * 8 // max(size, 8))
                work = batches(mode, size, count, args.cards, seed=size)
                measure(client, decl, work[:2], fns)  # warm caches
                got = measure(client, decl, work, fns)
                (col, tr), (ref, _) = got["columnar"], got["row-by-row (2ec2c63)"]
                goal = GOALS.get(size)
                verdict = (
                    ""
                    if goal is None
                    else f"engine <= {goal:g} us: {'met' if col <= goal else 'NOT MET'}"
                )
                print(
                    f"{mode:>6} {size:>5} | {col:>15.1f} {ref:>10.1f} {ref / col:>5.1f}x | "
                    f"{tr:>15.1f} | {verdict}"
                )


def against(ref: str, own_args: list[str], rounds: int) -> None:
    """This benchmark of ``ref`` and of this checkout, alternated ``rounds`` times."""
    from bench.bench_http import ROOT, worktree

    rows: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = {ref: {}, "now": {}}
    with worktree(ref) as tree:
        for r in range(rounds):
            for name, where in ((ref, tree), ("now", ROOT)):
                env = {**os.environ, "PYTHONPATH": str(where)}
                out = subprocess.run(
                    [sys.executable, "-m", "bench.bench_engine", *own_args],
                    cwd=where, env=env, capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                print(f"-- round {r + 1}, {name}:\n{out}", flush=True)
                for line in out.splitlines():
                    part = line.split("|")
                    if len(part) >= 3 and part[0].split()[:1] in (["live"], ["replay"]):
                        mode, size = part[0].split()
                        col, ref_rows = part[1].split()[:2]
                        rows[name].setdefault((mode, size), []).append(
                            (float(col), float(ref_rows))
                        )
    print(f"columnar us/txn, {ref} -> this checkout; faster: each divided by its run's row-by-row")
    for key, now in rows["now"].items():
        was = rows[ref].get(key, [])
        if not was:
            continue
        speed = [(b[0] / b[1]) / (a[0] / a[1]) for a, b in zip(now, was, strict=False)]
        print(
            f"{key[0]:>6} {key[1]:>5} | "
            f"{' '.join(f'{b[0]:.0f}' for b in was)} -> {' '.join(f'{a[0]:.0f}' for a in now)} | "
            f"faster {' '.join(f'{x:.2f}x' for x in speed)}"
        )


class _given:
    def __enter__(self) -> str:
        return os.environ["REDIS_URL"]

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
