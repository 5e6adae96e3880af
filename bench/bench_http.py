"""Open-loop load against the real HTTP service: a bare endpoint, the naive path and the
batching executor, side by side in one run.

Requests are sent on a fixed schedule (constant arrival rate), whether or not earlier
ones have answered, and latency is measured from the *scheduled* send time, so slow
responses cannot hide queueing (no coordinated omission). For each offered load and
each service mode it prints achieved throughput, p50/p99/p99.9 of answered requests,
the share shed with 503, the share of other errors, and the service's CPU time per
request (user + system), which is the noise-robust figure on a shared machine.

The protocol (bench/README.md): the ceiling is ``bench.bare_app`` (same FastAPI/uvicorn
stack, pydantic body in, fixed answer out). Each server runs in its own subprocess (one
uvicorn worker unless ``--workers``) pinned with ``taskset`` to the first core, the load
generator to the second (when the machine has two or more; ``--no-pin`` to share).
For each of bare, naive and batched: p50 at 50 req/s, a rising ladder to the highest
rate held (p99 <= 10 ms, no errors, < 0.1 % shed; a step that fails gets one more try,
the machine being shared), CPU per request at half the bare endpoint's held rate, then
2x the held rate (overload) and a short step back at half of that
(recovery). ``gen lag`` (p99 of how late the generator started requests) says when the
generator itself fell behind; ``p99 sent`` (from the moment a request was written) is
the part the server is answerable for. The summary prints the ratios against the goals.

    python -m bench.bench_http [--seconds 3] [--modes bare,naive,batched]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import psutil
import uvloop

from bench.world import BenchWorld, bench_world
from service.edge.server import ServiceProcess, spawn


@dataclass
class Result:
    mode: str
    offered: float
    achieved: float
    p50: float
    p99: float
    p999: float
    shed: float
    errors: float
    p99_sent: float = float("nan")  # p99 from the moment the request was written
    cpu_ms: float = float("nan")  # service CPU time per answered request (any status)
    gen_lag_p99: float = float("nan")  # how late the generator itself started requests
    # What the errors were: HTTP status, or "conn" for a connection the server dropped.
    error_kinds: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.error_kinds.items()))
        return (
            f"{self.mode:<9} {self.offered:>8,.0f} {self.achieved:>9,.0f} "
            f"{self.p50:>8.2f} {self.p99:>8.2f} {self.p999:>8.2f} {self.p99_sent:>8.2f} "
            f"{self.shed:>7.1%} "
            f"{self.errors:>7.1%} {self.cpu_ms:>7.3f} {self.gen_lag_p99:>8.2f}"
            + (f"  ({kinds})" if kinds else "")
        )


HEADER = (
    f"{'mode':<9} {'offered':>8} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'p99.9 ms':>8} {'p99 sent':>8} {'shed':>7} {'errors':>7} {'cpu ms':>7} {'gen lag':>8}"
)


T = TypeVar("T")

HELD_P99_MS = 10.0


def start(
    world: BenchWorld,
    batching: bool,
    extra: dict[str, str],
    cpus: str | None = None,
    cwd: str | None = None,
) -> ServiceProcess:
    return spawn(
        {
            "REDIS_URL": world.redis_url,
            "FRAUD_DATA_DIR": str(world.data_dir),
            "FRAUD_MODEL_REPO": str(world.model_repo),
            "FRAUD_BATCHING": str(batching).lower(),
            "FRAUD_REQUEST_TIMEOUT_MS": "50",
            "FRAUD_MAX_EVENT_SKEW_S": "0",  # the simulated world lies in the past
            **extra,
        },
        output=subprocess.DEVNULL,
        cpus=cpus,
        cwd=cwd,
    )


class Conn:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol: far
    cheaper per request than a general client, so the generator is not the bottleneck."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def post(self, request: bytes) -> int:
        self.writer.write(request)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return int(status_line.split()[1])


async def open_loop(
    url: str, bodies: list[bytes], rate: float, seconds: float, mode: str, max_conns: int = 64
) -> Result:
    """One open-loop run. The generator's own garbage collector is off while it runs: a
    full collection over the benchmark world's objects stalls the sender for 100-200 ms,
    which showed up as late starts and a burst the service had to shed."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return await _open_loop(url, bodies, rate, seconds, mode, max_conns)
    finally:
        gc.enable()
        gc.unfreeze()


async def _open_loop(
    url: str, bodies: list[bytes], rate: float, seconds: float, mode: str, max_conns: int
) -> Result:
    host, port = url.removeprefix("http://").split(":")
    requests = [
        (
            f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(b)}\r\n\r\n"
        ).encode()
        + b
        for b in bodies
    ]
    n = int(rate * seconds)
    lat = np.full(n, np.nan)
    gen_lag = np.full(n, np.nan)
    lat_sent = np.full(n, np.nan)
    status = np.zeros(n, dtype=int)
    idle: list[Conn] = []
    opened = 0
    free = asyncio.Condition()

    async def acquire() -> Conn:
        nonlocal opened
        async with free:
            while not idle and opened >= max_conns:
                await free.wait()
            while idle:
                c = idle.pop()
                if not c.reader.at_eof():
                    return c
                # The server closed it while idle (keep-alive timeout): a real client
                # reconnects too, so this is not counted as an error.
                c.writer.close()
                opened -= 1
            opened += 1
        return Conn(*await asyncio.open_connection(host, int(port)))

    async def release(c: Conn) -> None:
        async with free:
            idle.append(c)
            free.notify()

    t0 = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal opened
        sched = t0 + i / rate
        gen_lag[i] = (time.perf_counter() - sched) * 1e3
        conn = await acquire()  # waiting for a connection counts as latency
        sent = time.perf_counter()
        try:
            status[i] = await conn.post(requests[i % len(requests)])
            await release(conn)
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            status[i] = -1
            async with free:
                opened -= 1
                free.notify()
        lat[i] = (time.perf_counter() - sched) * 1e3
        lat_sent[i] = (time.perf_counter() - sent) * 1e3

    tasks = []
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    for c in idle:
        c.writer.close()
    ok = status == 200
    ok_lat = lat[ok] if ok.any() else np.array([np.nan])
    return Result(
        mode,
        rate,
        ok.sum() / elapsed,
        float(np.median(ok_lat)),
        float(np.quantile(ok_lat, 0.99)),
        float(np.quantile(ok_lat, 0.999)),
        float((status == 503).mean()),
        float(((status != 200) & (status != 503)).mean()),
        p99_sent=float(np.quantile(lat_sent[ok], 0.99)) if ok.any() else float("nan"),
        gen_lag_p99=float(np.quantile(gen_lag, 0.99)),
        error_kinds=dict(
            Counter("conn" if s == -1 else str(s) for s in status if s not in (200, 503))
        ),
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run the generator on uvloop: less CPU per request, so it stays ahead longer."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def held(r: Result) -> bool:
    return (
        r.p99 <= HELD_P99_MS and r.errors == 0 and r.shed < 0.001 and r.achieved >= 0.95 * r.offered
    )


@dataclass
class ModeSummary:
    mode: str
    held: float = 0.0
    cpu_half: float = float("nan")  # CPU ms per request at half the bare held rate
    half_held: bool = False  # whether that step was held (else the CPU figure is overload)
    p50_light: float = float("nan")  # p50 at 50 req/s
    overload: Result | None = None
    recovery: Result | None = None


class Server:
    """One server under test: its process (and worker children) and CPU accounting."""

    def __init__(self, service: ServiceProcess, connections: int = 64) -> None:
        self.service, self.connections = service, connections
        self.proc = psutil.Process(service.proc.pid)

    def cpu_s(self) -> float:
        procs = [self.proc, *self.proc.children(recursive=True)]
        total = 0.0
        for p in procs:
            # A worker may exit between listing and reading.
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(p.cpu_times()[:2])
        return total

    def step(self, bodies: list[bytes], rate: float, seconds: float, mode: str) -> Result:
        cpu0 = self.cpu_s()
        res = run(open_loop(self.service.url, bodies, rate, seconds, mode, self.connections))
        res.cpu_ms = (self.cpu_s() - cpu0) * 1e3 / (rate * seconds)
        print(res.line(), flush=True)
        return res


def measure(
    server: Server,
    mode: str,
    bodies: list[bytes],
    ladder: list[float],
    half_rate: float | None,
    seconds: float,
    results: list[Result],
) -> ModeSummary:
    """One server through the protocol (module docstring); every step lands in ``results``."""
    s = ModeSummary(mode)
    run(open_loop(server.service.url, bodies, 200, 2, "warm"))
    light = server.step(bodies, 50, seconds, mode)
    s.p50_light = light.p50
    results.append(light)
    for rate in ladder:
        r = server.step(bodies, rate, seconds, mode)
        results.append(r)
        if not held(r):  # the machine is shared: a step gets one more try
            time.sleep(1)  # let a backlog drain first
            r = server.step(bodies, rate, seconds, mode + " again")
            results.append(r)
        if not held(r):
            time.sleep(1)
            break
        s.held = rate
    # CPU at half the ceiling's held rate (its own, for the ceiling itself).
    half = server.step(bodies, half_rate or s.held / 2, seconds, mode + " half")
    s.cpu_half, s.half_held = half.cpu_ms, held(half)
    results.append(half)
    time.sleep(1)
    over_rate = 2 * (s.held or ladder[0])
    s.overload = server.step(bodies, over_rate, seconds, mode + " 2x")
    s.recovery = server.step(bodies, over_rate / 4, 1.0, mode + " rec")
    results += [s.overload, s.recovery]
    return s


def report(summaries: dict[str, ModeSummary]) -> None:
    bare = summaries.get("bare")
    print(
        f"\n{'mode':<9} {'held req/s':>10} {'vs bare':>8} {'cpu ms @half':>12} {'vs bare':>8} "
        f"{'p50 @50/s':>9} {'- bare':>7} {'2x: p99':>8} {'shed':>6} {'errors':>6} {'rec p99':>8}"
    )
    for s in summaries.values():
        ratio = s.held / bare.held if bare and bare.held else float("nan")
        cpu_ratio = s.cpu_half / bare.cpu_half if bare else float("nan")
        extra = s.p50_light - bare.p50_light if bare else float("nan")
        o, r = s.overload, s.recovery
        assert o is not None and r is not None
        print(
            f"{s.mode:<9} {s.held:>10,.0f} {ratio:>8.0%} {s.cpu_half:>12.3f} {cpu_ratio:>7.2f}x "
            f"{s.p50_light:>9.2f} {extra:>+7.2f} {o.p99:>8.1f} {o.shed:>6.0%} "
            f"{o.errors:>6.1%} {r.p99:>8.1f}"
        )
    b = summaries.get("batched")
    if bare and b and b.overload:
        print(
            "\ngoals (batched vs bare, this run): "
            f"held {b.held / bare.held if bare.held else 0:.0%} (>= 60 %); "
            f"CPU/request {b.cpu_half / bare.cpu_half:.2f}x (<= 1.5x"
            + ("" if b.half_held else "; not held there, so partly shed: not comparable")
            + "); "
            f"p50 @50 req/s {b.p50_light - bare.p50_light:+.2f} ms (<= +1 ms); "
            f"2x: accepted p99 {b.overload.p99:.1f} ms (<= 50 ms), "
            f"other errors {b.overload.errors:.1%} (0)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="length of each step")
    p.add_argument("--modes", default="bare,naive,batched")
    p.add_argument(
        "--bare-ladder",
        default="1000,2000,3000,4000,5000,6000,7000,8000",
        help="rates (req/s) tried on the bare endpoint, rising; stops at the first not held",
    )
    p.add_argument("--workers", type=int, default=1, help="uvicorn workers of the service")
    p.add_argument(
        "--connections",
        type=int,
        default=256,
        help="most keep-alive connections the generator opens (enough that it never waits "
        "for one below overload: a generator out of connections turns into a closed loop "
        "and hides the server's own shedding)",
    )
    p.add_argument("--no-pin", action="store_true", help="let servers and generator share cores")
    a = p.parse_args()
    modes = a.modes.split(",")
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    server_cpus = "0" if pin else None
    if pin:
        os.sched_setaffinity(0, {1})  # the generator (this process) on the other core
    extra = {"FRAUD_WORKERS": str(a.workers)} if a.workers > 1 else {}
    results: list[Result] = []
    summaries: dict[str, ModeSummary] = {}
    with bench_world() as world:
        bodies = [json.dumps(r).encode() for r in world.held_out(5000)]
        bare_ladder = [float(r) for r in a.bare_ladder.split(",")]
        bare_held = bare_ladder[-1]
        if "bare" in modes:
            server = Server(
                spawn(
                    {},
                    command=("-m", "bench.bare_app"),
                    cpus=server_cpus,
                    output=subprocess.DEVNULL,
                ),
                a.connections,
            )
            try:
                summaries["bare"] = measure(
                    server, "bare", bodies, bare_ladder, None, a.seconds, results
                )
                bare_held = summaries["bare"].held or bare_ladder[0]
            finally:
                server.service.stop()
        # The service ladder: from 5 % of the bare endpoint's held rate up to all of it.
        fractions = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
        ladder = [float(round(bare_held * f)) for f in fractions]
        for mode in ("naive", "batched"):
            if mode not in modes:
                continue
            server = Server(start(world, mode == "batched", extra, server_cpus), a.connections)
            try:
                summaries[mode] = measure(
                    server, mode, bodies, ladder, bare_held / 2, a.seconds, results
                )
            finally:
                server.service.stop()
    print(
        f"\n(servers pinned to core 0, generator to core 1: {pin}; workers: {a.workers}; "
        f"connections: up to {a.connections})"
    )
    print(HEADER)
    for r in results:
        print(r.line())
    report(summaries)


if __name__ == "__main__":
    main()
