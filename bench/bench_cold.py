"""What a call costs when it starts cold: each step of a lone request, back to back and
after a pause.

Under load every request is warm (the code and data of the last one are still in the
caches); at a few hundred requests per second each one starts after a pause, and on a VM
that may cost several times the warm figure (bench/README.md, "Cold calls"). Measured
in one process on uvloop, pinned to core 0 with the Redis server on core 1 (as the
service runs in ``bench_http``), each call 400 times:

* ``PING, raw socket``: the floor of one Redis round trip (hiredis parsing, no client);
* ``PING, held connection``: the scorer's round trip (``HeldConnections``);
* ``PING, redis-py pipeline``: what the scorer used before (a pool checkout per call);
* ``ONNX, one row``: the model alone, inline, a different row each call;
* ``micro-batch of one``: ``Scorer.score_batch`` for one transaction (its one round trip,
  the features, the model, the decision).

    python -m bench.bench_cold [--gaps 0,2,20] [--calls 400] [--spin]

``--spin`` waits by spinning instead of sleeping (the core never idles): whether the
slowdown comes from the core going idle or from time passing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import numpy as np
import uvloop

from bench.world import BenchWorld, pinned_world, world_scorer
from fraud_scoring.events import Transaction
from fraud_scoring.redis_clients import HeldConnections

PING = b"*1\r\n$4\r\nPING\r\n"


class _RawPing(asyncio.Protocol):
    """One PING at a time on a plain socket, parsed by hiredis."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.reply: asyncio.Future[Any] | None = None

    def connection_made(self, transport: Any) -> None:  # uvloop's is no asyncio.Transport
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        reply = self.reader.gets()
        if reply is not False and self.reply is not None:
            self.reply.set_result(reply)

    async def ping(self) -> Any:
        self.reply = asyncio.get_running_loop().create_future()
        self.transport.write(PING)
        return await self.reply


def pause(seconds: float, spin: bool) -> None:
    if spin:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(seconds)  # blocking: the core goes idle, nothing else runs


async def measure(
    call: Callable[[int], Awaitable[object]], gap_s: float, calls: int, spin: bool
) -> tuple[float, float]:
    """p50 wall time and mean CPU time of ``call`` (ms), each call after ``gap_s``."""
    wall, cpu = [], []
    for i in range(calls):
        if gap_s:
            pause(gap_s, spin)
        c0, t0 = time.process_time(), time.perf_counter()
        await call(i)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return float(np.median(wall)) * 1e3, float(np.mean(cpu)) * 1e3


async def run(world: BenchWorld, gaps: list[float], calls: int, spin: bool) -> None:
    scorer, client, model = world_scorer(world)  # as the service builds them
    held = HeldConnections(client)
    host, _, port = world.redis_url.split("//", 1)[1].split("/", 1)[0].rpartition(":")
    _, raw = await asyncio.get_running_loop().create_connection(_RawPing, host, int(port))
    txns = [Transaction.model_validate(r) for r in world.held_out(calls * (len(gaps) + 1))]
    # A row of its own per call, as served: one row sent again and again walks the same
    # path down every tree, all in cache, and read ~25 µs where served rows cost ~250 µs
    # (the model's ~18,000 tree nodes are ~1 MB, mostly out of cache between calls).
    rows = np.random.default_rng(0).random((4096, len(model.meta.features)), dtype=np.float32)
    rows *= np.random.default_rng(1).choice([1.0, 10.0, 1000.0], rows.shape).astype(np.float32)

    async def predict(i: int) -> object:
        return model.predict(rows[i % len(rows)][None, :])

    async def pipeline_ping(_: int) -> object:
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("PING")
        return await pipe.execute()

    steps: list[tuple[str, Callable[[int], Awaitable[object]]]] = [
        ("PING, raw socket", lambda _: raw.ping()),
        ("PING, held connection", lambda _: held.round_trip([("PING",)])),
        ("PING, redis-py pipeline", pipeline_ping),
        ("ONNX, one row", predict),
    ]
    batches = iter(range(len(txns)))
    steps.append(("micro-batch of one", lambda _: scorer.score_batch([txns[next(batches)]])))
    for _, call in steps:  # warm-up: connections, scripts, caches
        for i in range(min(50, calls)):
            await call(i)
    wait = "spinning" if spin else "sleeping"
    print(f"p50 wall ms / mean CPU ms per call, {calls} calls, after a pause ({wait}):")
    print(f"{'call':<26}" + "".join(f"{f'{g * 1e3:g} ms':>20}" for g in gaps))
    for name, call in steps:
        cells = []
        for g in gaps:
            w, c = await measure(call, g, calls, spin)
            cells.append(f"{w:>9.3f} / {c:<8.3f}")
        print(f"{name:<26}" + "".join(f"{cell:>20}" for cell in cells))
    await client.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gaps", default="0,2,20", help="pauses before each call, ms")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--spin", action="store_true", help="pause by spinning, not sleeping")
    a = p.parse_args()
    gaps = [float(g) / 1e3 for g in a.gaps.split(",")]
    with pinned_world() as (world, pin):
        print(f"(pinned: this process to core 0, Redis to core 1: {pin}; event loop: uvloop)")
        uvloop.run(run(world, gaps, a.calls, a.spin))


if __name__ == "__main__":
    main()
