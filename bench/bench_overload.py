"""Overload: the batched service at 3x its capacity, with a heavy and a light caller.

Two API keys share one service: ``heavy`` sends batch-endpoint calls of 32
transactions, ``light`` sends single-transaction calls. In one run (protocol in
bench/README.md):

1. **capacity** (the baseline): closed loop, the heavy key alone on as many connections
   as the admission capacity holds batch calls (4 x 32 = 128 by default), for
   ``--seconds``: the transactions/s the service serves when it is kept just full;
2. **3x overload**: open loop (fixed arrival times, latency from the scheduled send), the
   heavy key offering 3x that capacity in batch calls while the light key sends single
   calls (``--light-rate``), for ``--seconds``;
3. **after**: at once, 2 s at a quarter of the capacity plus the light calls, to see how
   soon every call is answered 200 within the deadline again;
4. **big calls**: the heavy key sends ``--big-rate`` (8) calls/s of 64 transactions (the
   default ``FRAUD_MAX_BATCH_REQUEST``, half the capacity), then of 128 (the capacity: more
   than the limit, refused 413, never admitted alone),
   beside the light calls, for ``--seconds`` each: the light key's share served;
5. **capacity 2**: the closed loop of 1 once more. The capacity the percentages use is the
   mean of 1 and 5: one closed-loop run moves by up to a third from run to run.

It prints, for each phase, offered and served transactions/s, served as % of capacity,
p50/p99 of accepted calls (vs the deadline, ``FRAUD_REQUEST_TIMEOUT_MS`` = 100), the share
shed with 503 and their p99, other errors, and the light key's share served; then the
recovery time (from the end of the overload to the first call after which every call
was answered 200 within the deadline) and the goals of issue 15. The service runs pinned
to core 0 with ``taskset``, the generator to core 1 (when the machine has two cores).

    python -m bench.bench_overload [--seconds 5] [--light-rate 100] [--baseline REF]

``--baseline REF`` (a git commit of this repository, e.g. ``2752a9b``, the code before
admission by work) first runs the same protocol against that commit's service, checked
out in a temporary ``git worktree`` and started from it, then against this checkout's:
both tables in one run, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.bench_http import Conn, run, start
from bench.world import BenchWorld, bench_world
from service.edge.auth import KeyEntry, Scope, append_key, new_key

BATCH = 32
AFTER_S = 2.0
DEADLINE_MS = 100.0
CONNS = max(1, 128 // BATCH)  # batch calls the default admission capacity holds
# The default largest call (half the capacity), and the capacity (refused 413: it could
# only run alone).
BIG_CALLS = (64, 128)


@dataclass
class Stream:
    """One caller: its requests (cycled), transactions per request, calls per second."""

    name: str
    requests: list[bytes]
    weight: int
    rate: float


@dataclass
class Phase:
    name: str
    seconds: float
    offered: float = 0.0  # transactions/s
    served: float = 0.0  # transactions/s answered 200
    p50: float = float("nan")
    p99: float = float("nan")  # accepted calls, from the scheduled send
    shed: float = 0.0  # share of calls answered 503
    shed_p99: float = float("nan")
    errors: Counter[str] = field(default_factory=Counter)
    light_served: float = float("nan")  # share of the light key's calls answered 200
    gen_lag_p99: float = float("nan")

    def line(self, capacity: float) -> str:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "0"
        return (
            f"{self.name:<12} {self.offered:>9,.0f} {self.served:>9,.0f} "
            f"{self.served / capacity:>7.0%} {self.p50:>7.1f} {self.p99:>7.1f} "
            f"{self.shed:>6.1%} {self.shed_p99:>8.2f} {self.light_served:>7.1%} "
            f"{self.gen_lag_p99:>7.2f}  {errs}"
        )


HEADER = (
    f"{'phase':<12} {'offered':>9} {'served':>9} {'% cap':>7} {'p50 ms':>7} {'p99 ms':>7} "
    f"{'503':>6} {'503 p99':>8} {'light':>7} {'gen lag':>7}  other errors"
)


def request(host: str, path: str, key: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Pool:
    """Keep-alive connections of one caller (reopened when the server closed one)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Conn] = []

    async def post(self, req: bytes) -> int:
        conn = None
        while self.idle:
            c = self.idle.pop()
            if not c.reader.at_eof():
                conn = c
                break
            c.writer.close()
        if conn is None:
            conn = Conn(*await asyncio.open_connection(self.host, self.port))
        try:
            status = await conn.post(req)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            conn.writer.close()
            return -1
        self.idle.append(conn)
        return status

    def close(self) -> None:
        for c in self.idle:
            c.writer.close()


async def closed_loop(
    url: str, stream: Stream, conns: int, seconds: float, backoff_s: float = 0.005
) -> Phase:
    """``conns`` callers each sending the next call when the last one is answered, or
    ``backoff_s`` after a 503: admission by cost may hold fewer calls than ``conns``
    (those that fit the deadline), and callers retrying a refusal at once would spend the
    service's core on refusals, not keep it full."""
    host, port = url.removeprefix("http://").split(":")
    pool = Pool(host, int(port))
    lat: list[float] = []
    status: list[int] = []
    end = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            t = time.perf_counter()
            status.append(await pool.post(stream.requests[i % len(stream.requests)]))
            lat.append((time.perf_counter() - t) * 1e3)
            i += conns
            if status[-1] == 503:
                await asyncio.sleep(backoff_s)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(conns)))
    elapsed = time.perf_counter() - t0
    pool.close()
    st, la = np.array(status), np.array(lat)
    ok = st == 200
    phase = Phase("capacity", seconds)
    phase.served = phase.offered = ok.sum() * stream.weight / elapsed
    phase.p50, phase.p99 = _quantiles(la[ok])
    phase.shed = float((st == 503).mean())
    phase.errors = Counter(str(s) for s in st if s not in (200, 503))
    return phase


def _quantiles(x: np.ndarray) -> tuple[float, float]:
    if not len(x):
        return float("nan"), float("nan")
    return float(np.median(x)), float(np.quantile(x, 0.99))


async def open_loop(
    url: str, phases: Sequence[tuple[str, float, Sequence[Stream]]]
) -> tuple[list[Phase], dict[str, np.ndarray]]:
    """Consecutive open-loop phases ``(name, seconds, streams)`` as one schedule (a
    phase's backlog carries into the next). Each stream has its own connections."""
    host, port = url.removeprefix("http://").split(":")
    pools: dict[str, Pool] = {}
    sched: list[tuple[float, int, Stream, int]] = []  # (time, phase, stream, index)
    start_s = 0.0
    for p, (_, seconds, streams) in enumerate(phases):
        for s in streams:
            pools.setdefault(s.name, Pool(host, int(port)))
            n = int(s.rate * seconds)
            sched += [(start_s + i / s.rate, p, s, i) for i in range(n)]
        start_s += seconds
    sched.sort(key=lambda e: e[0])
    n = len(sched)
    lat, lag = np.full(n, np.nan), np.full(n, np.nan)
    status = np.zeros(n, dtype=int)
    t0 = time.perf_counter() + 0.05

    async def one(j: int, at: float, s: Stream, i: int) -> None:
        lag[j] = (time.perf_counter() - (t0 + at)) * 1e3
        status[j] = await pools[s.name].post(s.requests[i % len(s.requests)])
        lat[j] = (time.perf_counter() - (t0 + at)) * 1e3

    tasks = []
    for j, (at, _, s, i) in enumerate(sched):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(j, at, s, i)))
    await asyncio.gather(*tasks)
    for pool in pools.values():
        pool.close()
    phase_of = np.array([e[1] for e in sched])
    weight = np.array([e[2].weight for e in sched])
    light = np.array([e[2].name == "light" for e in sched])
    results = []
    for p, (name, seconds, streams) in enumerate(phases):
        m = phase_of == p
        st, la = status[m], lat[m]
        ok = st == 200
        r = Phase(name, seconds)
        r.offered = sum(s.rate * s.weight for s in streams)
        r.served = float((weight[m] * ok).sum()) / seconds
        r.p50, r.p99 = _quantiles(la[ok])
        r.shed = float((st == 503).mean())
        r.shed_p99 = _quantiles(la[st == 503])[1]
        r.errors = Counter("conn" if s == -1 else str(s) for s in st if s not in (200, 503))
        if light[m].any():
            r.light_served = float((st[light[m]] == 200).mean())
        r.gen_lag_p99 = float(np.quantile(lag[m], 0.99))
        results.append(r)
    times = np.array([e[0] for e in sched])
    raw = {"at": times, "phase": phase_of, "status": status, "lat": lat, "light": light}
    return results, raw


def recovery_s(raw: dict[str, np.ndarray], after: int, start_s: float, deadline_ms: float) -> float:
    """From the start of phase ``after`` (at ``start_s`` in the schedule) to the first
    call after which every call was answered 200 within the deadline."""
    m = raw["phase"] == after
    at, good = raw["at"][m], (raw["status"][m] == 200) & (raw["lat"][m] <= deadline_ms)
    if good.all():
        return 0.0
    last_bad = np.nonzero(~good)[0][-1]
    if last_bad + 1 >= len(at):
        return float("inf")  # not recovered within the phase
    return float(at[last_bad + 1] - start_s)


ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def checkout(ref: str) -> Iterator[str]:
    """``ref`` of this repository checked out in a temporary worktree (removed after)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "baseline")
        git = ["git", "-C", str(ROOT)]
        subprocess.run([*git, "worktree", "add", "--detach", "-q", path, ref], check=True)
        try:
            yield path
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", path], check=False)


@dataclass
class Result:
    label: str
    base: Phase
    phases: list[Phase]
    recovery_s: float
    again: Phase  # the closed loop once more, after the other phases

    @property
    def capacity(self) -> float:
        """The mean of the closed loop before and after the open-loop phases: one run's
        rate moves by up to a third from run to run (how the four calls fall into
        micro-batches), while the overload's served rate barely moves."""
        return (self.base.served + self.again.served) / 2


def measure(
    world: BenchWorld, a: argparse.Namespace, pin: bool, label: str, code: str | None
) -> Result:
    """The three phases against the service started from ``code`` (a checkout's path;
    None: this one)."""
    deadline_ms = DEADLINE_MS
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.jsonl"
        keys = {}
        for key_id in ("heavy", "light"):
            key, digest = new_key(key_id)
            append_key(
                keys_file, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({Scope.SCORE}))
            )
            keys[key_id] = key
        extra = {
            "FRAUD_AUTH": "required",
            "FRAUD_API_KEYS_FILE": str(keys_file),
            "FRAUD_REQUEST_TIMEOUT_MS": str(deadline_ms),
        }
        if code is not None:  # that checkout's packages first on the path
            extra["PYTHONPATH"] = os.pathsep.join(
                filter(None, [code, os.environ.get("PYTHONPATH")])
            )
        service = start(world, True, extra, "0" if pin else None, cwd=code)
        try:
            host = service.url.removeprefix("http://").split(":")[0]
            rows = world.held_out(5000)
            batches = [
                request(
                    host,
                    "/v1/score/batch",
                    keys["heavy"],
                    json.dumps({"transactions": rows[i : i + BATCH]}).encode(),
                )
                for i in range(0, len(rows) - BATCH, BATCH)
            ]
            singles = [
                request(host, "/v1/score", keys["light"], json.dumps(r).encode()) for r in rows
            ]
            gc.collect()
            gc.freeze()
            gc.disable()  # as in bench_http: a full collection stalls the generator
            heavy = Stream("heavy", batches, BATCH, 1.0)
            run(closed_loop(service.url, heavy, 2, 1.0))  # warm-up
            base = run(closed_loop(service.url, heavy, CONNS, a.seconds))
            capacity = base.served
            time.sleep(1)
            over = Stream("heavy", batches, BATCH, a.factor * capacity / BATCH)
            calm = Stream("heavy", batches, BATCH, 0.25 * capacity / BATCH)
            light = Stream("light", singles, 1, a.light_rate)
            big = [  # fairness under any call size: the largest call allowed, then the capacity
                Stream(
                    "heavy",
                    [
                        request(
                            host,
                            "/v1/score/batch",
                            keys["heavy"],
                            json.dumps({"transactions": rows[i : i + size]}).encode(),
                        )
                        for i in range(0, len(rows) - size, size)
                    ],
                    size,
                    a.big_rate,
                )
                for size in BIG_CALLS
            ]
            phases, raw = run(
                open_loop(
                    service.url,
                    [
                        (f"{a.factor:g}x overload", a.seconds, [over, light]),
                        ("after", AFTER_S, [calm, light]),
                        *((f"{a.big_rate:g}/s x{b.weight}", a.seconds, [b, light]) for b in big),
                    ],
                )
            )
            rec = recovery_s(raw, 1, a.seconds, deadline_ms)
            time.sleep(1)
            again = run(closed_loop(service.url, heavy, CONNS, a.seconds))
            again.name = "capacity 2"
        finally:
            gc.enable()
            service.stop()
    return Result(label, base, phases, rec, again)


def report(r: Result) -> None:
    capacity = r.capacity
    print(f"\n== {r.label}")
    print(HEADER)
    for ph in (r.base, *r.phases, r.again):
        print(ph.line(capacity))
    o = r.phases[0]
    print(
        f"recovery after the overload: {r.recovery_s * 1e3:.0f} ms\n"
        f"capacity (mean of the two closed loops): {capacity:,.0f} transactions/s\n"
        f"goals (issue 15): served {o.served / capacity:.0%} of capacity (>= 90 %); "
        f"accepted p99 {o.p99:.1f} ms (<= {DEADLINE_MS:g}); 503 p99 {o.shed_p99:.2f} ms "
        f"(<= 5); recovery {r.recovery_s * 1e3:.0f} ms (< 1000); light key served "
        f"{o.light_served:.1%}"
    )
    for ph in r.phases[2:]:
        print(f"fairness ({ph.name} heavy calls): light key served {ph.light_served:.1%} (>= 95 %)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="length of capacity and overload")
    p.add_argument("--factor", type=float, default=3.0, help="overload as a multiple of capacity")
    p.add_argument("--light-rate", type=float, default=100.0, help="light key's calls per second")
    p.add_argument(
        "--big-rate", type=float, default=8.0, help="heavy calls/s in the big-call phases"
    )
    p.add_argument("--no-pin", action="store_true", help="let service and generator share cores")
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="also run the protocol against this git commit's service, first (side by side)",
    )
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the generator (this process) on the other core
    results = []
    with bench_world() as world:
        if a.baseline:
            with checkout(a.baseline) as code:
                results.append(measure(world, a, pin, f"baseline: {a.baseline}", code))
        results.append(measure(world, a, pin, "this checkout", None))
    print(f"\n(service pinned to core 0, generator to core 1: {pin}; deadline {DEADLINE_MS:g} ms;")
    print(f" capacity: closed loop, {CONNS} connections of {BATCH}-transaction batch calls)")
    for r in results:
        report(r)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
