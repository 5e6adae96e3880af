"""``fraud-scoring score-stream`` on Redis Streams beside the batched API, in one run.

Per ``--max-batch`` value B (default 32 and 128), on the same simulated world
(``bench/world.py``) and the same Redis-protocol server (pinned with this process to
core 1; the candidate and the baseline to core 0 with ``taskset``):

1. **baseline**: ``fraud-scoring serve`` (one worker, the batcher's max batch and
   preferred size B, max wait ``--max-wait-ms``) answering ``POST /v1/score/batch`` calls
   of B transactions each, two calls in flight (its admission capacity, two
   micro-batches), closed loop, for the backlog's N held-out transactions: decisions/s
   and decisions per service CPU-second (user + system of the pinned process);
   and the same service answering ``POST /v1/score``, one transaction per call, 2B
   callers in flight (the way a consumer calling the API per event does; the batcher
   re-batches them up to B): the API a payment system calls, HTTP in the way per event;
2. **candidate**: ``fraud-scoring score-stream`` (the same B and max wait) on a Redis
   stream holding the same N transactions as a backlog: it is started, warmed on
   ``--warm`` transactions, stopped (SIGSTOP) while a backlog is appended, and let go;
   the time and the process's CPU until the backlog's last decision is in the output
   stream (then stopped again until its next measure);
3. **event-time lag** at 50 % and 90 % of the candidate's backlog rate: the same process
   then gets transactions appended at a fixed rate for ``--seconds`` each, their
   ``event_time`` stamped at the append (the world's own lie in January; only here is
   "now minus event time" meaningful). Lag = the decision's entry time in the output
   stream minus the event time, queueing delay = the decision's ``timing.queue_ms``,
   both read back from the output stream; then the process is stopped (SIGTERM) and its
   own exit summary printed: event-time lag, queueing delay, commits and their interval,
   the oldest uncommitted age, the in-flight high-water mark.

Each contender is started and warmed once per B; then each is measured ``--rounds`` times
(default 3), one after another in an order that rotates each round, and before every
measure the store is put back as it was before the first (every key but the streams:
DUMP once, then RESTORE: ``bench.world.StoreState``). So every measure records the same
transactions, with ids of their own, into the same state: the live path (each event
after its keys' newest), as in production. (Until 2026-12-07 one measure each ran in a
row on the store the previous ones had recorded into: the first took the live path and
the later ones replayed behind its events, the exactness corrections' costlier path, and
one noisy measure each swung the ratios between 0.8x and 1.5x.) The rows print medians
and the range of CPU per decision; the ratios are per round (the two measured minutes
apart at most) and their median. The machine is a shared 2-core VM: compare the ratios
within one run.

Usage: ``python -m bench.bench_score_stream [--events 5000] [--max-batch 32,128]
[--rounds 3] [--seconds 5] [--no-pin]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import redis

from bench.bench_http import Conn, start
from bench.world import BenchWorld, StoreState, bench_world

RUN = "s" + secrets.token_hex(3)


def fresh(txns: Sequence[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """The transactions with ids of their own for one step."""
    return [{**t, "transaction_id": f"{t['transaction_id']}-{RUN}-{tag}"} for t in txns]


def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# -- the baseline: POST /v1/score/batch ------------------------------------------------


async def post_all(url: str, txns: Sequence[dict[str, Any]], batch: int, concurrency: int) -> int:
    """``txns`` in calls of ``batch`` to ``/v1/score/batch`` (``batch`` 0: one per call to
    ``/v1/score``), ``concurrency`` calls in flight; the errors."""
    host, port = url.removeprefix("http://").split(":")
    wires = []
    for s in range(0, len(txns), batch or 1):
        if batch:
            path, doc = "/v1/score/batch", {"transactions": list(txns[s : s + batch])}
        else:
            path, doc = "/v1/score", txns[s]
        body = json.dumps(doc).encode()
        wires.append(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nX-Request-Timeout-Ms: 30000\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    statuses: collections.Counter[int] = collections.Counter()
    todo = iter(wires)

    async def caller() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = Conn(reader, writer)
        try:
            for wire in todo:
                statuses[await conn.post(wire)] += 1
        finally:
            writer.close()

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    errors = sum(n for status, n in statuses.items() if status != 200)
    if errors:
        print(f"    {errors} calls not answered 200: {dict(statuses)}", flush=True)
    return errors


class Api:
    """The service with max batch ``b``: calls of ``b`` transactions, two in flight, or
    (``single``) one transaction per call, ``2b`` in flight; started and warmed once,
    then measured once per round (:meth:`measure`)."""

    def __init__(
        self,
        world: BenchWorld,
        txns: Sequence[dict[str, Any]],
        b: int,
        a: argparse.Namespace,
        pin: bool,
        single: bool = False,
    ) -> None:
        self.per_call, self.callers = (0, 2 * b) if single else (b, 2)
        self.tag = f"api{'1' if single else ''}{b}"
        spool = tempfile.mkdtemp(prefix="bench-api-spool-")
        self.svc = start(
            world,
            True,
            {
                "FRAUD_MAX_BATCH_SIZE": str(b),
                "FRAUD_PREFERRED_BATCH_SIZES": json.dumps([b]),
                "FRAUD_MAX_BATCH_REQUEST": str(b),
                "FRAUD_MAX_QUEUE_DELAY_MS": str(a.max_wait_ms),
                "FRAUD_REQUEST_TIMEOUT_MS": "30000",
                "FRAUD_DECISION_SPOOL_DIR": spool,
                # single calls: room for 2B callers (admission refuses the calls past the
                # two micro-batches it holds while a caller's next call is already in)
                **({"FRAUD_MAX_INFLIGHT": str(4 * b)} if single else {}),
            },
            cpus="0" if pin else None,
        )
        self.proc = psutil.Process(self.svc.proc.pid)
        self.store = redis.Redis.from_url(world.redis_url)
        warm = fresh(txns[: a.warm], f"{self.tag}w")
        assert asyncio.run(post_all(self.svc.url, warm, self.per_call, self.callers)) == 0, (
            "warm-up failed"
        )

    def measure(self, run: Sequence[dict[str, Any]]) -> dict[str, float]:
        c0, r0, t0 = cpu_s(self.proc), redis_cpu_s(self.store), time.perf_counter()
        errors = asyncio.run(post_all(self.svc.url, run, self.per_call, self.callers))
        wall = time.perf_counter() - t0
        cpu, rcpu = cpu_s(self.proc) - c0, redis_cpu_s(self.store) - r0
        return {"n": len(run), "errors": errors, "wall": wall, "cpu": cpu, "redis_cpu": rcpu}

    def stop(self) -> None:
        self.svc.stop()


# -- the candidate: score-stream -------------------------------------------------------


def xadd(client: Any, stream: str, txns: Sequence[dict[str, Any]]) -> None:
    for s in range(0, len(txns), 2000):
        pipe = client.pipeline(transaction=False)
        for t in txns[s : s + 2000]:
            pipe.xadd(stream, {"data": json.dumps(t)})
        pipe.execute()


def wait_for(client: Any, output: str, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    end = time.monotonic() + 300
    while (client.xlen(output) if client.exists(output) else 0) < n:
        if proc.poll() is not None:
            raise SystemExit(
                f"score-stream exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > end:
            raise SystemExit(f"score-stream: {n} decisions not written in 300 s")
        time.sleep(0.005)


def paced(
    client: Any, stream: str, txns: Sequence[dict[str, Any]], rate: float, seconds: float
) -> dict[str, float]:
    """Append ``txns`` at ``rate``/s for ``seconds``, each stamped with its append time;
    their event times (ms) by id."""
    n = min(len(txns), int(rate * seconds))
    stamped: dict[str, float] = {}
    t0 = time.perf_counter()
    while len(stamped) < n:
        due = min(n, int(rate * (time.perf_counter() - t0)) + 1)
        if due > len(stamped):
            now = datetime.now(UTC)
            pipe = client.pipeline(transaction=False)
            for t in txns[len(stamped) : due]:
                pipe.xadd(stream, {"data": json.dumps({**t, "event_time": now.isoformat()})})
                stamped[t["transaction_id"]] = now.timestamp() * 1e3
            pipe.execute()
        time.sleep(0.002)
    return stamped


def read_back(
    client: Any, output: str, after: bytes, stamped: dict[str, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Event-time lag and queueing delay (ms) of the decisions written after ``after``;
    the lag from the output entry's id (the server's time of the write)."""
    lags, queue = [], []
    for eid, f in client.xrange(output, min=b"(" + after):
        d = json.loads(f[b"d"])
        lags.append(int(eid.split(b"-")[0]) - stamped[d["transaction_id"]])
        queue.append(d["timing"]["queue_ms"])
    return np.asarray(lags), np.asarray(queue)


class Stream:
    """``fraud-scoring score-stream`` with max batch ``b``: started, warmed on ``--warm``
    transactions, then stopped (SIGSTOP) but while it is measured: each
    :meth:`measure` appends a backlog and lets it go until the backlog's last decision
    is in the output stream."""

    def __init__(
        self,
        world: BenchWorld,
        txns: Sequence[dict[str, Any]],
        b: int,
        a: argparse.Namespace,
        pin: bool,
    ) -> None:
        self.stream, self.output = f"bench-txns-{RUN}-{b}", f"bench-decisions-{RUN}-{b}"
        self.client: Any = redis.Redis.from_url(world.redis_url)
        tmp = Path(tempfile.mkdtemp(prefix="bench-score-stream-"))
        self.log = tmp / "score-stream.log"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")},
            "REDIS_URL": world.redis_url,
            "FRAUD_DATA_DIR": str(world.data_dir),
            "FRAUD_MODEL_REPO": str(world.model_repo),
            "FRAUD_MAX_EVENT_SKEW_S": "0",  # the simulated world lies in the past
            "FRAUD_DECISION_SPOOL_DIR": str(tmp / "spool"),
            "FRAUD_STREAM_NAME": self.stream,
            "FRAUD_SCORE_STREAM_OUTPUT": self.output,
        }
        argv = [sys.executable, "-m", "cli", "score-stream", "--consumer", "bench"]
        argv += ["--max-batch", str(b), "--max-wait-ms", str(a.max_wait_ms)]
        argv += ["--commit-interval-ms", str(a.commit_interval_ms), "--metrics-port", "0"]
        if pin:
            argv = ["taskset", "-c", "0", *argv]
        warm = fresh(txns[: a.warm], f"ss{b}w")
        xadd(self.client, self.stream, warm)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        self.written = len(warm)
        self.wait(self.written)
        time.sleep(0.5)  # its commit
        os.kill(self.proc.pid, signal.SIGSTOP)

    def wait(self, n: int) -> None:
        wait_for(self.client, self.output, n, self.proc, self.log)

    def measure(self, run: Sequence[dict[str, Any]]) -> dict[str, float]:
        xadd(self.client, self.stream, run)
        c0, r0, t0 = cpu_s(self.ps), redis_cpu_s(self.client), time.perf_counter()
        os.kill(self.proc.pid, signal.SIGCONT)
        self.written += len(run)
        self.wait(self.written)
        wall = time.perf_counter() - t0
        cpu, rcpu = cpu_s(self.ps) - c0, redis_cpu_s(self.client) - r0
        time.sleep(0.2)  # its commit, outside the next contender's measure
        os.kill(self.proc.pid, signal.SIGSTOP)
        return {"n": len(run), "errors": 0, "wall": wall, "cpu": cpu, "redis_cpu": rcpu}

    def lag_steps(
        self, txns: Sequence[dict[str, Any]], capacity: float, b: int, seconds: float
    ) -> list[tuple[float, float, int, np.ndarray, np.ndarray]]:
        """Event-time lag and queueing delay at 50 % and 90 % of ``capacity``."""
        os.kill(self.proc.pid, signal.SIGCONT)
        steps = []
        for frac in (0.5, 0.9):
            last = self.client.xrevrange(self.output, count=1)[0][0]
            live = fresh(txns, f"ss{b}p{int(frac * 100)}")
            stamped = paced(self.client, self.stream, live, frac * capacity, seconds)
            self.written += len(stamped)
            self.wait(self.written)
            lag, queue = read_back(self.client, self.output, last, stamped)
            steps.append((frac, frac * capacity, len(stamped), lag, queue))
        time.sleep(0.2)
        return steps

    def stop(self) -> str:
        """Stop it (SIGTERM); its exit summary."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        summary = [ln for ln in self.log.read_text().splitlines() if "score-stream stopping" in ln]
        return summary[-1].split("score-stream stopping: ", 1)[-1] if summary else "?"


NAMES = ("API /v1/score/batch", "API /v1/score, one per call", "score-stream (Redis Streams)")


def line(name: str, runs: Sequence[dict[str, Any]]) -> str:
    """One contender's measures: medians, and the range of CPU per decision."""
    rate = float(np.median([r["n"] / r["wall"] for r in runs]))
    us = [r["cpu"] / r["n"] * 1e6 for r in runs]
    redis_us = float(np.median([r["redis_cpu"] / r["n"] * 1e6 for r in runs]))
    errors = sum(r["errors"] for r in runs)
    return (
        f"  {name:<30} {rate:7.0f} decisions/s  {1e6 / float(np.median(us)):6.0f} per CPU-s  "
        f"({np.median(us):4.0f} us CPU each, {min(us):.0f}-{max(us):.0f} over {len(us)}; "
        f"Redis {redis_us:4.0f} us; errors {errors})"
    )


def ratios(runs: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> str:
    """Decisions per CPU-second against ``base``, round by round (the two measured in the
    same round, minutes apart at most), and their median."""
    per = [(b["cpu"] / b["n"]) / (r["cpu"] / r["n"]) for r, b in zip(runs, base, strict=True)]
    each = ", ".join(f"{x:.2f}x" for x in per)
    return f"{float(np.median(per)):.2f}x per CPU-second (rounds: {each})"


def measure_size(
    world: BenchWorld, txns: Sequence[dict[str, Any]], b: int, a: argparse.Namespace, pin: bool
) -> None:
    """The three contenders at max batch ``b``, each measured once per round on the store
    as it was before the first measure (``bench.world.StoreState``), in an order that rotates each
    round; then score-stream's event-time lag."""
    with contextlib.ExitStack() as stack:
        batch = Api(world, txns, b, a, pin)
        stack.callback(batch.stop)
        single = Api(world, txns, b, a, pin, single=True)
        stack.callback(single.stop)
        stream = Stream(world, txns, b, a, pin)
        summary: list[str] = []
        stack.callback(lambda: summary.append(stream.stop()))
        contenders: tuple[Any, ...] = (batch, single, stream)
        state = StoreState(world.redis_url)
        runs: list[list[dict[str, Any]]] = [[], [], []]
        for r in range(a.rounds):
            for i in [(r + k) % 3 for k in range(3)]:
                state.restore()
                runs[i].append(contenders[i].measure(fresh(txns, f"b{b}r{r}c{i}")))
        for name, got in zip(NAMES, runs, strict=True):
            print(line(name, got), flush=True)
        print(f"    score-stream against /v1/score/batch: {ratios(runs[2], runs[0])}", flush=True)
        print(f"    score-stream against /v1/score:       {ratios(runs[2], runs[1])}", flush=True)
        capacity = float(np.median([r["n"] / r["wall"] for r in runs[2]]))
        for frac, rate, sent, lag, queue in stream.lag_steps(txns, capacity, b, a.seconds):
            print(
                f"    at {frac:.0%} of its rate ({rate:.0f}/s, {sent} events): event-time lag "
                f"p50 {np.percentile(lag, 50):.1f} ms p99 {np.percentile(lag, 99):.1f} ms; "
                f"queueing delay at the boundary mean {queue.mean():.2f} ms p99 "
                f"{np.percentile(queue, 99):.2f} ms",
                flush=True,
            )
    print(f"    its exit summary: {summary[0] if summary else '?'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=5000, help="backlog of held-out transactions")
    p.add_argument("--warm", type=int, default=500, help="warm-up transactions per process")
    p.add_argument("--max-batch", default="32,128", help="micro-batch sizes, comma-separated")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--commit-interval-ms", type=float, default=1000.0)
    p.add_argument("--rounds", type=int, default=3, help="measures of each contender per size")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each paced step")
    p.add_argument("--no-pin", action="store_true", help="let everything share the cores")
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # this process and the Redis server it starts: core 1
    with bench_world(os.environ.get("REDIS_URL")) as world:
        txns = sorted(world.held_out(limit=a.events), key=lambda t: t["event_time"])
        print(
            f"{len(txns)} held-out transactions per measure, {a.rounds} rounds; score-stream "
            f"and the API pinned to core {'0' if pin else 'any'}, Redis and this generator "
            f"to core {'1' if pin else 'any'}; max wait {a.max_wait_ms:g} ms, commit "
            f"interval {a.commit_interval_ms:g} ms; baselines: POST /v1/score/batch, B per "
            "call, 2 calls in flight; POST /v1/score, one per call, 2B in flight",
            flush=True,
        )
        for b in (int(x) for x in a.max_batch.split(",")):
            print(f"max batch {b}:", flush=True)
            measure_size(world, txns, b, a, pin)


if __name__ == "__main__":
    main()
