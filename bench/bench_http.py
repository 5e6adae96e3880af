"""Open-loop load: the scoring service, naive and batched, against a typical endpoint.

A typical FastAPI endpoint (the ceiling), the naive path and the batching executor,
side by side in one run.

Requests are sent on a fixed schedule (constant arrival rate), whether or not earlier
ones have answered, and latency is measured from the *scheduled* send time, so slow
responses cannot hide queueing (no coordinated omission). For each offered load and
each server it prints achieved throughput, p50/p99/p99.9 of answered requests, the share
shed with 503, the share of other errors, the service's CPU time per request (user +
system), which is the noise-robust figure on a shared machine, and whether the step
*held* (:func:`why_not_held`, the one rule the ladder and the summary both read).

The protocol (bench/README.md): the ceiling is ``bench.typical_app``, a FastAPI endpoint
as users write one (the ``Transaction`` body parameter, a ``response_model``, a fixed
answer); ``bench.bare_app`` (body parsed by hand, fixed bytes out) is an extra reference
row. Each server runs in its own subprocess (one uvicorn worker unless ``--workers``)
pinned with ``taskset`` to the first core, the load generator to the second (when the
machine has two or more; ``--no-pin`` to share). For each server: p50 at 50 req/s, a
rising ladder to the highest rate held (p99 <= 10 ms, no errors, < 0.1 % shed, >= 95 %
of the offered rate answered; a step that fails gets one more try, the machine being
shared), CPU per request at half the typical endpoint's held rate, then 2x the held rate
(overload) and a short step at half of that (recovery). ``gen lag`` (p99 of how late the
generator started requests) says when the generator itself fell behind; ``p99 sent``
(from the moment a request was written) is the part the server is answerable for. After
the rows, each standing goal is printed as a line, met or NOT MET.

Every request carries a transaction id of its own: the service claims each id it records
(one id, one transaction), so a body sent twice would be answered as a retry (nothing
recorded, the kept answer), a cheaper path than a new decision. And before every step of
a scoring service the store is put back as it was before the first
(``bench.world.StoreState``: every key but the streams): the transactions are the world's
held-out ones at their own times, so without it every step after the first replayed
behind the events the earlier steps recorded at the same times (the exactness
corrections' path, ~20 % more CPU for a micro-batch of one) instead of the live path
production takes. (Until 2026-12-07 it did: every service row was a replay.)

``--baseline REF`` runs the service modes of an earlier commit beside this checkout's,
step by step at the same offered rates (REF checked out in a temporary git worktree, its
service started from there), and prints the ratio of each pair.

    python -m bench.bench_http [--seconds 3] [--modes bare,typical,naive,batched]
        [--baseline REF] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import uvloop

from bench.world import BenchWorld, StoreState, bench_world
from service.edge.server import ServiceProcess, ServiceStartError, spawn

ROOT = Path(__file__).resolve().parent.parent

HELD_P99_MS = 10.0
HELD_MAX_SHED = 0.001
HELD_MIN_ACHIEVED = 0.95  # of the offered rate
LIGHT_RATE = 50.0
# Every held-out transaction of the world's last day (~5,900): a step cycles through them
# (with fresh ids), so only a step of more than ~1,900 req/s for 3 s sends some of them
# twice, the second time a replay behind the first's recording.
HELD_OUT = 10**6
CEILINGS = ("typical", "bare")  # the first of these in --modes is the goals' ceiling
APPS = {"typical": "bench.typical_app", "bare": "bench.bare_app"}
FRACTIONS = "0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4,0.5,0.6,0.7,0.8,0.9,1.0"
CEILING_LADDER = "500,1000,1500,2000,2500,3000,4000,5000,6000,7000,8000"


@dataclass
class Result:
    mode: str  # the row's label: server, and step unless it is a ladder rung
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
    # How long the service's threads were ready to run but waited for a core (others'
    # processes on its pinned core), per request: the machine's share of the latency.
    rq_ms: float = float("nan")
    # Requests per executed micro-batch in the step (the service's fraud_batch_size
    # histogram read before and after it; nan for a server without one, or naive).
    batch: float = float("nan")
    # CPU per offered request of the Redis-protocol server (when it runs on this machine:
    # nan otherwise, and for servers that do not use it) and of this process, the load
    # generator: beside ``cpu_ms`` they say which core ran out first (the store shares
    # the generator's core).
    store_ms: float = float("nan")
    gen_ms: float = float("nan")
    # What the errors were: HTTP status, or "conn" for a connection the server dropped.
    error_kinds: dict[str, int] = field(default_factory=dict)
    server: str = ""  # which server (a mode, or mode@REF)
    step: str = ""  # warm, light, ladder, half, 2x, rec

    def line(self) -> str:
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.error_kinds.items()))
        why = why_not_held(self)
        return (
            f"{self.mode:<22} {self.offered:>8,.0f} {self.achieved:>9,.0f} "
            f"{self.p50:>8.2f} {self.p99:>8.2f} {self.p999:>8.2f} {self.p99_sent:>8.2f} "
            f"{self.shed:>7.2%} {self.errors:>7.2%} {self.cpu_ms:>7.3f} {self.rq_ms:>6.2f} "
            f"{self.store_ms:>8.3f} {self.gen_ms:>6.3f} "
            f"{self.batch:>6.1f} {self.gen_lag_p99:>8.2f}  {'yes' if not why else 'no: ' + why}"
            + (f"  ({kinds})" if kinds else "")
        )


HEADER = (
    f"{'mode':<22} {'offered':>8} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'p99.9 ms':>8} {'p99 sent':>8} {'shed':>7} {'errors':>7} {'cpu ms':>7} {'rq ms':>6} "
    f"{'store ms':>8} {'gen ms':>6} {'batch':>6} {'gen lag':>8}  held"
)


def why_not_held(r: Result) -> str:
    """Why a step did not hold its rate ("" when it did): the one rule the ladder stops
    on, the rows print and the summary reads. Held: answered p99 <= 10 ms, no errors,
    under 0.1 % shed and at least 95 % of the offered rate answered."""
    why = []
    if r.errors > 0:
        why.append("errors")
    if r.shed >= HELD_MAX_SHED:
        why.append("shed")
    if not r.achieved >= HELD_MIN_ACHIEVED * r.offered:
        why.append("rate")
    if not r.p99 <= HELD_P99_MS:  # nan (nothing answered) is not held either
        why.append("p99")
    return ",".join(why)


def held(r: Result) -> bool:
    return not why_not_held(r)


def served_all(r: Result) -> bool:
    """Everything offered was answered 200 (whatever the latency): a CPU-per-request
    figure from such a step is not lowered by cheaply shed requests."""
    return not (set(why_not_held(r).split(",")) - {"p99", ""})


def held_rate(rows: Sequence[Result]) -> float:
    """The highest offered rate among ``rows`` that held (0 if none), whichever load step
    it was (the ladder, half, 2x, recovery; not the light step at 50 req/s, which measures
    the p50): what the summary and the goal lines call a server's held rate, read from the
    very rows printed. A ladder that stops below a server's capacity (short
    ``--fractions``) thus still counts a 2x step it held."""
    return max((r.offered for r in rows if r.step != "light" and held(r)), default=0.0)


T = TypeVar("T")


def start(
    world: BenchWorld,
    batching: bool,
    extra: dict[str, str],
    cpus: str | None = None,
    cwd: str | None = None,
    output: Any = subprocess.DEVNULL,
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
        output=output,
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


# Fresh transaction ids: this process's tag, then a step number and the request's index.
_RUN_TAG = "b" + secrets.token_hex(3)
_STEPS = itertools.count()
_TEMPLATES: dict[int, tuple[Sequence[bytes], list[tuple[bytes, bytes]]]] = {}
_MARK = "\x00id\x00"


def _templates(bodies: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
    """Each body split around its ``transaction_id``'s value (cached per body list)."""
    cached = _TEMPLATES.get(id(bodies))
    if cached is not None and cached[0] is bodies:
        return cached[1]
    out = []
    marker = json.dumps(_MARK).encode()
    for b in bodies:
        doc = json.loads(b)
        doc["transaction_id"] = _MARK
        pre, post = json.dumps(doc).encode().split(marker)
        out.append((pre + b'"', b'"' + post))
    _TEMPLATES[id(bodies)] = (bodies, out)
    return out


def _requests(host: str, bodies: Sequence[bytes], n: int, fresh_ids: bool) -> list[bytes]:
    def request(body: bytes) -> bytes:
        return (
            f"POST /v1/score HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    if not fresh_ids:
        return [request(b) for b in bodies]
    templates = _templates(bodies)
    tag = f"{_RUN_TAG}-{next(_STEPS)}-"
    return [
        request(pre + f"{tag}{i}".encode() + post)
        for i, (pre, post) in zip(range(n), itertools.cycle(templates))
    ]


async def open_loop(
    url: str,
    bodies: Sequence[bytes],
    rate: float,
    seconds: float,
    mode: str,
    max_conns: int = 64,
    fresh_ids: bool = True,
) -> Result:
    """One open-loop run. The generator's own garbage collector is off while it runs: a
    full collection over the benchmark world's objects stalls the sender for 100-200 ms,
    which showed up as late starts and a burst the service had to shed.

    ``fresh_ids`` (default): every request gets a transaction id never sent before (the
    body's own, replaced), so each is a new decision, never a retry of an earlier one."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        return await _open_loop(url, bodies, rate, seconds, mode, max_conns, fresh_ids)
    finally:
        gc.enable()
        gc.unfreeze()


async def _open_loop(
    url: str,
    bodies: Sequence[bytes],
    rate: float,
    seconds: float,
    mode: str,
    max_conns: int,
    fresh_ids: bool,
) -> Result:
    host, port = url.removeprefix("http://").split(":")
    n = int(rate * seconds)
    requests = _requests(host, bodies, n, fresh_ids)
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


GENERATOR = psutil.Process()  # this process


def store_process(store: StoreState | None) -> psutil.Process | None:
    """The Redis-protocol server behind ``store`` when it runs on this machine (a
    redis-server or valkey-server process listening on its port), else None."""
    if store is None:
        return None
    kw = store.client.connection_pool.connection_kwargs
    port = kw.get("port")
    if kw.get("host") not in ("127.0.0.1", "localhost", "::1") or port is None:
        return None
    for p in psutil.process_iter(["name", "cmdline"]):
        name, cmdline = p.info["name"] or "", p.info["cmdline"] or []
        if name.startswith(("redis-server", "valkey-server")) and any(
            a.endswith(f":{port}") for a in cmdline
        ):
            return p
    return None


def _cpu(proc: psutil.Process | None) -> float:
    """A process's CPU seconds so far (user + system); nan without one."""
    if proc is None:
        return float("nan")
    try:
        return float(sum(proc.cpu_times()[:2]))
    except psutil.NoSuchProcess:
        return float("nan")


class Server:
    """One server under test: its process (and worker children), CPU accounting, and
    the bodies it is sent (None: the caller's)."""

    def __init__(
        self,
        service: ServiceProcess,
        connections: int = 64,
        name: str = "",
        bodies: Sequence[bytes] | None = None,
        store: StoreState | None = None,
    ) -> None:
        self.service, self.connections = service, connections
        self.name, self.bodies, self.store = name, bodies, store
        self.proc = psutil.Process(service.proc.pid)
        self.store_proc = store_process(store)

    def cpu_s(self) -> float:
        procs = [self.proc, *self.proc.children(recursive=True)]
        total = 0.0
        for p in procs:
            # A worker may exit between listing and reading.
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(p.cpu_times()[:2])
        return total

    def batches(self) -> tuple[float, float]:
        """The service's executed micro-batches so far and the requests they held (its
        ``fraud_batch_size`` histogram on /metrics); nan where there is none."""
        import urllib.request

        count = total = float("nan")
        try:
            with urllib.request.urlopen(self.service.url + "/metrics", timeout=5) as r:
                text = r.read().decode()
        except (OSError, ValueError):
            return count, total
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("fraud_batch_size_count"):
                count = (0.0 if math.isnan(count) else count) + float(value)
            elif name.startswith("fraud_batch_size_sum"):
                total = (0.0 if math.isnan(total) else total) + float(value)
        return count, total

    def runqueue_s(self) -> float:
        """Time the server's threads spent runnable but not running (Linux schedstat;
        nan elsewhere)."""
        total = 0
        try:
            pids = [self.proc.pid, *(c.pid for c in self.proc.children(recursive=True))]
        except psutil.NoSuchProcess:
            return float("nan")
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                return float("nan")
            for tid in tids:
                # A thread may exit between listing and reading.
                with (
                    contextlib.suppress(OSError, ValueError, IndexError),
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f,
                ):
                    total += int(f.read().split()[1])
        return total / 1e9

    def step(
        self, bodies: Sequence[bytes], rate: float, seconds: float, mode: str, step: str = ""
    ) -> Result:
        if self.store is not None:  # every step on the live path (bench.world.StoreState)
            self.store.restore()
            time.sleep(0.3)  # the server frees the replaced values in the background
        batches0 = self.batches()
        store0, gen0 = _cpu(self.store_proc), _cpu(GENERATOR)
        cpu0, rq0 = self.cpu_s(), self.runqueue_s()
        res = run(
            open_loop(
                self.service.url, self.bodies or bodies, rate, seconds, mode, self.connections
            )
        )
        res.cpu_ms = (self.cpu_s() - cpu0) * 1e3 / (rate * seconds)
        res.rq_ms = (self.runqueue_s() - rq0) * 1e3 / (rate * seconds)
        res.store_ms = (_cpu(self.store_proc) - store0) * 1e3 / (rate * seconds)
        res.gen_ms = (_cpu(GENERATOR) - gen0) * 1e3 / (rate * seconds)
        batches1 = self.batches()  # read outside the CPU window
        if batches1[0] > batches0[0]:
            res.batch = (batches1[1] - batches0[1]) / (batches1[0] - batches0[0])
        res.server, res.step = self.name or mode, step
        print(res.line(), flush=True)
        return res


@dataclass
class Protocol:
    seconds: float
    retry: bool = True  # a step that does not hold gets one more try
    warm_s: float = 2.0


class Table:
    """Every printed line (rows and ratio lines) in order, and the rows themselves."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.rows: list[Result] = []

    def add(self, r: Result) -> Result:
        self.lines.append(r.line())
        self.rows.append(r)
        return r

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def of(self, server: str) -> list[Result]:
        return [r for r in self.rows if r.server == server]


def ratio_line(now: Result, before: Result, ref: str) -> str:
    def x(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "n/a"

    return (
        f"{'  now / ' + ref:<22} {'':>8} "
        f"{x(now.achieved, before.achieved):>9} {x(now.p50, before.p50):>8} "
        f"{x(now.p99, before.p99):>8} {'':>8} {'':>8} {'':>7} {'':>7} "
        f"{x(now.cpu_ms, before.cpu_ms):>7} {x(now.rq_ms, before.rq_ms):>6} "
        f"{x(now.batch, before.batch):>6}"
    )


def measure(
    servers: Sequence[Server],
    bodies: Sequence[bytes],
    ladder: Sequence[float],
    half_rate: float | None,
    proto: Protocol,
    table: Table,
    ref: str = "",
) -> None:
    """The servers through the protocol (module docstring), step by step: with more than
    one (this checkout's service and the baseline's), each step runs on each server back
    to back at the same rate, followed by their ratio. Every step lands in ``table``."""
    seconds = proto.seconds

    def step(srv: Server, rate: float, kind: str, secs: float = seconds) -> Result:
        label = srv.name if kind == "ladder" else f"{srv.name} {kind}"
        return table.add(srv.step(bodies, rate, secs, label, kind))

    def pair(rows: list[Result]) -> None:
        if len(rows) == 2 and ref:
            table.note(ratio_line(rows[0], rows[1], ref))

    for srv in servers:
        run(open_loop(srv.service.url, srv.bodies or bodies, 200, proto.warm_s, "warm"))
    pair([step(srv, LIGHT_RATE, "light") for srv in servers])
    climbing = list(servers)
    for rate in ladder:
        rows, still = [], []
        for srv in climbing:
            r = step(srv, rate, "ladder")
            if not held(r) and proto.retry:  # the machine is shared: one more try
                time.sleep(1)  # let a backlog drain first
                r = step(srv, rate, "ladder")
            rows.append(r)
            if held(r):
                still.append(srv)
            else:
                time.sleep(1)
        pair(rows)
        climbing = still
        if not climbing:
            break
    # The half and 2x steps' rates come from the ladder alone (the light step at 50 req/s
    # holds for every server: a 2x step at 100 req/s would test no overload).
    first = held_rate([r for r in table.of(servers[0].name) if r.step == "ladder"])
    # CPU at half the ceiling's held rate (its own, for the ceiling itself).
    half = half_rate or (first / 2 if first else ladder[0] / 2)
    pair([step(srv, half, "half") for srv in servers])
    time.sleep(1)
    over_rate = 2 * (first or ladder[0])  # the first server's 2x, for both
    pair([step(srv, over_rate, "2x") for srv in servers])
    pair([step(srv, over_rate / 4, "rec", 1.0) for srv in servers])


@dataclass
class Summary:
    """One server's figures, all read from its rows in the table."""

    server: str
    held: float
    light: Result | None
    half: Result | None
    overload: Result | None
    recovery: Result | None

    @classmethod
    def of(cls, server: str, rows: Sequence[Result]) -> Summary:
        def last(step: str) -> Result | None:
            found = [r for r in rows if r.step == step]
            return found[-1] if found else None

        return cls(server, held_rate(rows), last("light"), last("half"), last("2x"), last("rec"))


def _f(r: Result | None, attr: str) -> float:
    return getattr(r, attr) if r is not None else float("nan")


def report(summaries: dict[str, Summary], ceiling: str | None) -> None:
    top = summaries.get(ceiling) if ceiling else None
    vs = f"vs {ceiling}" if ceiling else "vs -"
    print(
        f"\n{'server':<18} {'held req/s':>10} {vs:>11} {'cpu ms @half':>12} {vs:>11} "
        f"{'p50 @50/s':>9} {'- ' + (ceiling or '-'):>9} {'2x: p99':>8} {'shed':>6} "
        f"{'errors':>6} {'rec p99':>8}"
    )
    for s in summaries.values():
        ratio = s.held / top.held if top and top.held else float("nan")
        cpu_ratio = _f(s.half, "cpu_ms") / _f(top.half, "cpu_ms") if top else float("nan")
        extra = _f(s.light, "p50") - _f(top.light, "p50") if top else float("nan")
        print(
            f"{s.server:<18} {s.held:>10,.0f} {ratio:>10.0%} {_f(s.half, 'cpu_ms'):>12.3f} "
            f"{cpu_ratio:>10.2f}x {_f(s.light, 'p50'):>9.2f} {extra:>+9.2f} "
            f"{_f(s.overload, 'p99'):>8.1f} {_f(s.overload, 'shed'):>6.0%} "
            f"{_f(s.overload, 'errors'):>6.1%} {_f(s.recovery, 'p99'):>8.1f}"
        )
    if top is None or ceiling is None:
        print("\n(no ceiling endpoint in --modes: no goal lines)")
        return
    for name, s in summaries.items():
        if name in CEILINGS:
            continue
        print()
        for line in goal_lines(s, top, ceiling):
            print(line)


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def goal_lines(s: Summary, top: Summary, ceiling: str) -> list[str]:
    """The standing goals of issue 37 (and issue 10's 2x line) for one service against
    the ceiling, each with its verdict. For ``batched`` they are the goals; for the
    others (naive, a baseline) information."""
    role = "goals" if s.server == "batched" else "information"
    out = [f"{role}: {s.server} vs the {ceiling} endpoint (this run)"]
    goal_a = f"  (a) held rate (p99 <= {HELD_P99_MS:.0f} ms) >= 0.6x {ceiling}'s"
    if not top.held:
        out.append(
            f"{goal_a}: cannot be judged: the {ceiling} endpoint held no rung of its ladder "
            "(lower --ceiling-ladder, or the machine is too busy); the steps below ran at "
            "rates taken from its lowest rung"
        )
    else:
        r = s.held / top.held
        out.append(
            f"{goal_a}: {s.held:,.0f} / {top.held:,.0f} req/s = {r:.2f}x: {_verdict(r >= 0.6)} "
            f"(stretch 0.8x: {_verdict(r >= 0.8)})"
        )
    h, th = s.half, top.half
    if h is None or th is None:
        out.append("  (b) CPU per request: no step at half the ceiling's rate")
    else:
        c = h.cpu_ms / th.cpu_ms
        cond = f"at {h.offered:,.0f} req/s (half {ceiling}'s held rate) <= 1.5x {ceiling}'s"
        if served_all(h):
            out.append(
                f"  (b) CPU per request {cond}: {h.cpu_ms:.3f} / {th.cpu_ms:.3f} ms = "
                f"{c:.2f}x: {_verdict(c <= 1.5)}"
            )
        else:
            out.append(
                f"  (b) CPU per request {cond}: {c:.2f}x, but it did not serve that rate "
                f"({why_not_held(h)}: {h.shed:.1%} shed, {h.errors:.1%} errors, "
                f"{h.achieved:,.0f} answered/s), so part of the load cost little: NOT MET"
            )
    if s.light is not None and top.light is not None:
        d = s.light.p50 - top.light.p50
        out.append(
            f"  (c) p50 at {LIGHT_RATE:.0f} req/s <= {ceiling}'s + 1 ms: {s.light.p50:.2f} vs "
            f"{top.light.p50:.2f} ms = {d:+.2f} ms: {_verdict(d <= 1.0)}"
        )
    o = s.overload
    if o is not None:
        overload = o.shed > 0
        out.append(
            f"  (d) at the 2x step ({o.offered:,.0f} req/s) accepted p99 <= 50 ms with "
            f"the excess shed, no other errors (issue 10): {o.p99:.1f} ms, {o.shed:.1%} shed, "
            f"{o.errors:.1%} errors: {_verdict(o.p99 <= 50 and o.errors == 0)}"
            + ("" if overload else " (nothing shed: not overload for it)")
        )
    return out


def check_typical_shape() -> None:
    """The typical endpoint's answer model still has the service's answer's shape."""
    from bench.typical_app import ScoreOut as Typical
    from service.edge.schemas import ScoreOut

    def bare(x: Any) -> Any:
        if isinstance(x, dict):
            skip = ("description", "examples", "title")
            return {k: bare(v) for k, v in x.items() if k not in skip}
        return [bare(v) for v in x] if isinstance(x, list) else x

    schemas = [bare(m.model_json_schema(mode="serialization")) for m in (Typical, ScoreOut)]
    if schemas[0] != schemas[1]:
        print(
            "warning: bench/typical_app.py's ScoreOut no longer has the fields of "
            "service.edge.schemas.ScoreOut; update it, or the ceiling answers another shape",
            flush=True,
        )


# -- the baseline ------------------------------------------------------------------------


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """``ref`` checked out in a temporary git worktree (removed after)."""
    safe = "".join(c if c.isalnum() else "-" for c in ref)[:40]
    path = Path(tempfile.mkdtemp(prefix=f"bench-{safe}-")) / "tree"
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(path)], check=False)
        subprocess.run([*git, "worktree", "prune"], check=False)
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no output)"
    return "\n".join("      " + t for t in text[-lines:]) or "      (no output)"


OLD_WORLD = """
import json, sys
from bench.world import bench_world
with bench_world(sys.argv[1]) as w:
    out = {"data": str(w.data_dir), "models": str(w.model_repo), "bodies": w.held_out(10**6)}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, default=str)
"""


class Baseline:
    """An earlier commit's service, started from its worktree: on this checkout's world
    first; if it cannot serve that (it does not start, or answers mostly errors), on a
    world its own ``bench/world.py`` builds, in a Redis server of its own."""

    def __init__(self, ref: str, tree: Path, stack: contextlib.ExitStack, logs: Path) -> None:
        self.ref, self.tree, self.stack, self.logs = ref, tree, stack, logs
        self.own_world: tuple[BenchWorld, list[bytes]] | None = None
        self.own_state: StoreState | None = None
        self.own_world_error: str | None = None
        self.label = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def env(self) -> dict[str, str]:
        # Its own code first, whatever this venv has installed in editable mode.
        return {"PYTHONPATH": str(self.tree)}

    def _try(
        self,
        world: BenchWorld,
        mode: str,
        extra: dict[str, str],
        cpus: str | None,
        connections: int,
        bodies: Sequence[bytes],
        own: list[bytes] | None,
        store: StoreState | None,
    ) -> tuple[Server | None, str]:
        log = self.logs / f"{mode}-{'own' if own else 'this'}-world.log"
        with log.open("wb") as out:
            try:
                svc = start(
                    world,
                    mode == "batched",
                    {**extra, **self.env()},
                    cpus,
                    str(self.tree),
                    output=out,
                )
            except ServiceStartError as exc:
                return None, f"{exc}; its output:\n{_tail(log)}"
        server = Server(svc, connections, f"{mode}@{self.label}", own, store)
        probe = run(open_loop(svc.url, own or bodies, 50, 1, "probe", connections))
        if probe.achieved < 0.5 * probe.offered:
            svc.stop()
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(probe.error_kinds.items()))
            return None, (
                f"it started but answered {probe.achieved:.0f} of {probe.offered:.0f} req/s "
                f"with 200 ({probe.shed:.0%} 503, other: {kinds or 'none'}); its output:\n"
                f"{_tail(log)}"
            )
        return server, ""

    def start(
        self,
        world: BenchWorld,
        mode: str,
        extra: dict[str, str],
        cpus: str | None,
        connections: int,
        bodies: Sequence[bytes],
        store: StoreState | None = None,
    ) -> Server | None:
        """The baseline's service for ``mode``, or None (said why) when it cannot serve;
        ``store``: the state of ``world``'s store to restore before each step."""
        if self.own_world is None:
            server, why = self._try(world, mode, extra, cpus, connections, bodies, None, store)
            if server is not None:
                print(f"baseline {self.label} ({mode}): serves this checkout's world", flush=True)
                return server
            if "ModuleNotFoundError" in why or "ImportError" in why:
                # Its code does not import here: no world of its own would change that.
                print(
                    f"BASELINE {self.label} NOT MEASURED ({mode}): its code does not import "
                    f"in this venv (it needs other packages): {why}",
                    flush=True,
                )
                return None
            print(
                f"baseline {self.label} ({mode}) cannot serve this checkout's bench world: "
                f"{why}\n  building the world with {self.label}'s own bench/world.py",
                flush=True,
            )
            self._build_own_world()
        if self.own_world is None:
            print(
                f"BASELINE {self.label} NOT MEASURED ({mode}): its own world could not be "
                f"built either: {self.own_world_error}",
                flush=True,
            )
            return None
        own_world, own_bodies = self.own_world
        server, why = self._try(
            own_world, mode, extra, cpus, connections, bodies, own_bodies, self.own_state
        )
        if server is None:
            print(
                f"BASELINE {self.label} NOT MEASURED ({mode}): it cannot serve its own bench "
                f"world either: {why}",
                flush=True,
            )
            return None
        print(
            f"baseline {self.label} ({mode}): serves the world its own code built (its "
            "model and features, its own Redis): the pair compares code and world together",
            flush=True,
        )
        return server

    def _build_own_world(self) -> None:
        from fraud_scoring.redis_server import redis_url

        if not (self.tree / "bench" / "world.py").exists():
            self.own_world_error = f"{self.label} has no bench/world.py"
            return
        url = self.stack.enter_context(redis_url(None))
        out = self.logs / "own-world.json"
        log = self.logs / "own-world.log"
        with log.open("wb") as f:
            done = subprocess.run(
                [sys.executable, "-c", OLD_WORLD, url, str(out)],
                cwd=self.tree,
                env={**os.environ, **self.env()},
                stdout=f,
                stderr=subprocess.STDOUT,
                check=False,
            )
        if done.returncode != 0:
            self.own_world_error = f"exit {done.returncode}; its output:\n{_tail(log)}"
            return
        got = json.loads(out.read_text())
        own = BenchWorld(Path(got["data"]), Path(got["models"]), url)
        self.own_world = (own, [json.dumps(b).encode() for b in got["bodies"]])
        self.own_state = StoreState(url)


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=None, help="length of each step (3)")
    p.add_argument(
        "--modes",
        default="bare,typical,naive,batched",
        help="servers to measure (typical is the goals' ceiling, bare a reference row)",
    )
    p.add_argument(
        "--ceiling-ladder",
        "--bare-ladder",
        default=None,
        help="rates (req/s) tried on the ceiling endpoints (typical, bare), rising; stops at "
        f"the first not held (default {CEILING_LADDER})",
    )
    p.add_argument(
        "--fractions",
        default=None,
        help=f"the services' ladder, as fractions of the ceiling's held rate (default {FRACTIONS})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run that proves the machinery, not a measurement: 1 s steps, ceiling "
        "ladder 250,500,1000, services at 0.1 and 0.25 of the ceiling's held rate",
    )
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="also run the service modes of commit REF (temporary git worktree), step by "
        "step beside this checkout's, and print the ratio of each pair",
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
    seconds = a.seconds or (1.0 if a.quick else 3.0)
    ceiling_ladder = [
        float(r)
        for r in (a.ceiling_ladder or ("250,500,1000" if a.quick else CEILING_LADDER)).split(",")
    ]
    fractions = [
        float(f) for f in (a.fractions or ("0.1,0.25" if a.quick else FRACTIONS)).split(",")
    ]
    proto = Protocol(seconds, warm_s=1.0 if a.quick else 2.0)
    modes = a.modes.split(",")
    ceiling = next((m for m in CEILINGS if m in modes), None)
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    server_cpus = "0" if pin else None
    if pin:
        os.sched_setaffinity(0, {1})  # the generator (this process) on the other core
    extra = {"FRAUD_WORKERS": str(a.workers)} if a.workers > 1 else {}
    if "typical" in modes:
        check_typical_shape()
    table = Table()
    with contextlib.ExitStack() as stack:
        world = stack.enter_context(bench_world())
        baseline: Baseline | None = None
        if a.baseline:
            tree = stack.enter_context(worktree(a.baseline))
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-logs-")))
            baseline = Baseline(a.baseline, tree, stack, logs)
            print(f"baseline {baseline.label} checked out in {tree}", flush=True)
        bodies = [json.dumps(r).encode() for r in world.held_out(HELD_OUT)]
        state = StoreState(world.redis_url)  # before any service has recorded into it
        print(HEADER, flush=True)
        ceiling_held = ceiling_ladder[-1]  # no ceiling measured: the ladder's top
        for mode in CEILINGS[::-1]:  # bare first, then the typical endpoint
            if mode not in modes:
                continue
            server = Server(
                spawn(
                    {},
                    command=("-m", APPS[mode]),
                    cpus=server_cpus,
                    output=subprocess.DEVNULL,
                ),
                a.connections,
                mode,
            )
            try:
                measure([server], bodies, ceiling_ladder, None, proto, table)
            finally:
                server.service.stop()
            if mode == ceiling:
                ceiling_held = held_rate(table.of(mode))
                if not ceiling_held:
                    table.note(
                        f"({mode} held no rung of its ladder: the services' ladder is taken "
                        f"from its lowest rung, {ceiling_ladder[0]:,.0f} req/s)"
                    )
                    ceiling_held = ceiling_ladder[0]
        # The service ladder: fractions of the ceiling's held rate.
        ladder = [float(round(ceiling_held * f)) for f in fractions]
        for mode in ("naive", "batched"):
            if mode not in modes:
                continue
            servers = [
                Server(
                    start(world, mode == "batched", extra, server_cpus),
                    a.connections,
                    mode,
                    store=state,
                )
            ]
            try:
                if baseline is not None:
                    old = baseline.start(
                        world, mode, extra, server_cpus, a.connections, bodies, state
                    )
                    if old is not None:
                        servers.append(old)
                measure(
                    servers,
                    bodies,
                    ladder,
                    ceiling_held / 2,
                    proto,
                    table,
                    baseline.label if baseline else "",
                )
            finally:
                for s in servers:
                    s.service.stop()
    print(
        f"\n(servers pinned to core 0, generator to core 1: {pin}; workers: {a.workers}; "
        f"connections: up to {a.connections}; steps of {seconds:g} s"
        + ("; --quick: not a measurement" if a.quick else "")
        + ")"
    )
    print(HEADER)
    for line in table.lines:
        print(line)
    names = list(dict.fromkeys(r.server for r in table.rows))
    report({n: Summary.of(n, table.of(n)) for n in names}, ceiling)


if __name__ == "__main__":
    main()
