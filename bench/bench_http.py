"""Open-loop load against the real HTTP service: naive path vs the batching executor.

Requests are sent on a fixed schedule (constant arrival rate), whether or not earlier
ones have answered, and latency is measured from the *scheduled* send time, so slow
responses cannot hide queueing (no coordinated omission). For each offered load and
each service mode it prints achieved throughput, p50/p99/p99.9 of answered requests,
the share shed with 503, the share of other errors, and the service's CPU time per
request (user + system), which is the noise-robust figure on a shared machine. The load
generator runs in this process; the service runs in a subprocess (one uvicorn worker)
on the same 2 cores, so under overload the generator itself falls behind: ``gen lag``
(p99 of how late requests were started) says by how much, and ``p99 sent`` (latency
from the moment a request was written) is the part the service is answerable for.

    python -m bench.bench_http [--rates 250,500,1000,1500,2000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import psutil

from bench.world import BenchWorld, bench_world
from service.server import ServiceProcess, spawn


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


def start(world: BenchWorld, batching: bool, extra: dict[str, str]) -> ServiceProcess:
    return spawn(
        {
            "REDIS_URL": world.redis_url,
            "FRAUD_DATA_DIR": str(world.data_dir),
            "FRAUD_MODEL_REPO": str(world.model_repo),
            "FRAUD_BATCHING": str(batching).lower(),
            "FRAUD_REQUEST_TIMEOUT_MS": "50",
            **extra,
        },
        output=subprocess.DEVNULL,
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
    url: str, bodies: list[bytes], rate: float, seconds: float, mode: str, max_conns: int = 256
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="250,500,1000,1500,2000,3000")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    import json

    results: list[Result] = []
    with bench_world() as world:
        bodies = [json.dumps(r).encode() for r in world.held_out(5000)]
        for mode, batching in (("naive", False), ("batched", True)):
            service = start(world, batching, {})
            proc, url = service.proc, service.url
            try:
                asyncio.run(open_loop(url, bodies, 200, 2, mode))  # warm-up
                server = psutil.Process(proc.pid)
                for rate in rates:
                    cpu0 = sum(server.cpu_times()[:2])
                    res = asyncio.run(open_loop(url, bodies, rate, a.seconds, mode))
                    res.cpu_ms = (sum(server.cpu_times()[:2]) - cpu0) * 1e3 / (rate * a.seconds)
                    results.append(res)
                    print(res.line(), flush=True)
            finally:
                service.stop()
    print("\n" + HEADER)
    for r in results:
        print(r.line())
    print()
    for mode in ("naive", "batched"):
        held = [
            r.offered
            for r in results
            if r.mode == mode
            and r.p99 < 10
            and r.shed < 0.01
            and r.errors < 0.001
            and r.achieved >= 0.95 * r.offered
        ]
        print(
            f"{mode}: highest offered load held with p99 < 10 ms: "
            f"{max(held) if held else 0:,.0f} req/s"
        )


if __name__ == "__main__":
    main()
