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
   ``--warm`` transactions, stopped (SIGSTOP) while the backlog is appended, and let go;
   the time and the process's CPU until the N-th decision is in the output stream;
3. **event-time lag** at 50 % and 90 % of the candidate's backlog rate: the same process
   then gets transactions appended at a fixed rate for ``--seconds`` each, their
   ``event_time`` stamped at the append (the world's own lie in January; only here is
   "now minus event time" meaningful). Lag = the decision's entry time in the output
   stream minus the event time, queueing delay = the decision's ``timing.queue_ms``,
   both read back from the output stream; then the process is stopped (SIGTERM) and its
   own exit summary printed: event-time lag, queueing delay, commits and their interval,
   the oldest uncommitted age, the in-flight high-water mark.

Every transaction carries an id of its own per step (a repeated id is answered from its
claim and costs less). Both record into the same world, so later steps see cards with a
few more transactions in their history. The machine is a shared 2-core VM: compare the
ratios within one run.

Usage: ``python -m bench.bench_score_stream [--events 5000] [--max-batch 32,128]
[--seconds 5] [--no-pin]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
from bench.world import BenchWorld, bench_world

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


def api_step(
    world: BenchWorld,
    txns: Sequence[dict[str, Any]],
    b: int,
    a: argparse.Namespace,
    pin: bool,
    single: bool = False,
) -> dict[str, float]:
    """The service with max batch ``b``: calls of ``b`` transactions, two in flight, or
    (``single``) one transaction per call, ``2b`` in flight."""
    per_call, callers = (0, 2 * b) if single else (b, 2)
    spool = tempfile.mkdtemp(prefix="bench-api-spool-")
    svc = start(
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
    try:
        proc = psutil.Process(svc.proc.pid)
        store = redis.Redis.from_url(world.redis_url)
        tag = f"api{'1' if single else ''}{b}"
        warm = fresh(txns[: a.warm], f"{tag}w")
        assert asyncio.run(post_all(svc.url, warm, per_call, callers)) == 0, "warm-up failed"
        run = fresh(txns, tag)
        c0, r0, t0 = cpu_s(proc), redis_cpu_s(store), time.perf_counter()
        errors = asyncio.run(post_all(svc.url, run, per_call, callers))
        wall = time.perf_counter() - t0
        cpu, rcpu = cpu_s(proc) - c0, redis_cpu_s(store) - r0
    finally:
        svc.stop()
    n = len(run)
    return {"n": n, "errors": errors, "wall": wall, "cpu": cpu, "redis_cpu": rcpu}


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


def stream_step(
    world: BenchWorld, txns: Sequence[dict[str, Any]], b: int, a: argparse.Namespace, pin: bool
) -> dict[str, Any]:
    stream, output = f"bench-txns-{RUN}-{b}", f"bench-decisions-{RUN}-{b}"
    client: Any = redis.Redis.from_url(world.redis_url)
    tmp = Path(tempfile.mkdtemp(prefix="bench-score-stream-"))
    log = tmp / "score-stream.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")},
        "REDIS_URL": world.redis_url,
        "FRAUD_DATA_DIR": str(world.data_dir),
        "FRAUD_MODEL_REPO": str(world.model_repo),
        "FRAUD_MAX_EVENT_SKEW_S": "0",  # the simulated world lies in the past
        "FRAUD_DECISION_SPOOL_DIR": str(tmp / "spool"),
        "FRAUD_STREAM_NAME": stream,
        "FRAUD_SCORE_STREAM_OUTPUT": output,
    }
    argv = [sys.executable, "-m", "cli", "score-stream", "--consumer", "bench"]
    argv += ["--max-batch", str(b), "--max-wait-ms", str(a.max_wait_ms)]
    argv += ["--commit-interval-ms", str(a.commit_interval_ms), "--metrics-port", "0"]
    if pin:
        argv = ["taskset", "-c", "0", *argv]
    warm = fresh(txns[: a.warm], f"ss{b}w")
    xadd(client, stream, warm)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    out_d: dict[str, Any] = {}
    try:
        ps = psutil.Process(proc.pid)
        wait_for(client, output, len(warm), proc, log)
        time.sleep(0.5)  # its commit
        os.kill(proc.pid, signal.SIGSTOP)
        run = fresh(txns, f"ss{b}")
        xadd(client, stream, run)
        c0, r0, t0 = cpu_s(ps), redis_cpu_s(client), time.perf_counter()
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(client, output, len(warm) + len(run), proc, log)
        wall = time.perf_counter() - t0
        cpu, rcpu = cpu_s(ps) - c0, redis_cpu_s(client) - r0
        out_d.update(n=len(run), errors=0, wall=wall, cpu=cpu, redis_cpu=rcpu)
        capacity = len(run) / wall
        written = len(warm) + len(run)
        steps = []
        for frac in (0.5, 0.9):
            last = client.xrevrange(output, count=1)[0][0]
            live = fresh(txns, f"ss{b}p{int(frac * 100)}")
            stamped = paced(client, stream, live, frac * capacity, a.seconds)
            written += len(stamped)
            wait_for(client, output, written, proc, log)
            lag, queue = read_back(client, output, last, stamped)
            steps.append((frac, frac * capacity, len(stamped), lag, queue))
        out_d["paced"] = steps
        time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    summary = [ln for ln in log.read_text().splitlines() if "score-stream stopping" in ln]
    out_d["summary"] = summary[-1].split("score-stream stopping: ", 1)[-1] if summary else "?"
    return out_d


def line(name: str, r: dict[str, Any], base: dict[str, Any] | None) -> str:
    rate, per_cpu = r["n"] / r["wall"], r["n"] / max(r["cpu"], 1e-9)
    vs = ""
    if base is not None:
        vs = (
            f"  ({rate / (base['n'] / base['wall']):.2f}x decisions/s, "
            f"{per_cpu / (base['n'] / max(base['cpu'], 1e-9)):.2f}x per CPU-second)"
        )
    return (
        f"  {name:<28} {r['n']:>6} in {r['wall']:6.2f} s  {rate:7.0f} decisions/s  "
        f"{per_cpu:7.0f} per CPU-s  ({r['cpu'] / r['n'] * 1e6:5.0f} us CPU, Redis "
        f"{r['redis_cpu'] / r['n'] * 1e6:4.0f} us each; errors {r['errors']}){vs}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=5000, help="backlog of held-out transactions")
    p.add_argument("--warm", type=int, default=500, help="warm-up transactions per process")
    p.add_argument("--max-batch", default="32,128", help="micro-batch sizes, comma-separated")
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--commit-interval-ms", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=5.0, help="length of each paced step")
    p.add_argument("--no-pin", action="store_true", help="let everything share the cores")
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # this process and the Redis server it starts: core 1
    with bench_world(os.environ.get("REDIS_URL")) as world:
        txns = sorted(world.held_out(limit=a.events), key=lambda t: t["event_time"])
        print(
            f"{len(txns)} held-out transactions per step; score-stream and the API pinned to "
            f"core {'0' if pin else 'any'}, Redis and this generator to core "
            f"{'1' if pin else 'any'}; max wait {a.max_wait_ms:g} ms, commit interval "
            f"{a.commit_interval_ms:g} ms; baselines: POST /v1/score/batch, B per call, "
            "2 calls in flight; POST /v1/score, one per call, 2B in flight",
            flush=True,
        )
        for b in (int(x) for x in a.max_batch.split(",")):
            print(f"max batch {b}:", flush=True)
            base = api_step(world, txns, b, a, pin)
            print(line("API /v1/score/batch", base, None), flush=True)
            single = api_step(world, txns, b, a, pin, single=True)
            print(line("API /v1/score, one per call", single, None), flush=True)
            cand = stream_step(world, txns, b, a, pin)
            print(line("score-stream (Redis Streams)", cand, base), flush=True)
            print(line("  the same, against /v1/score", cand, single), flush=True)
            for frac, rate, sent, lag, queue in cand["paced"]:
                print(
                    f"    at {frac:.0%} of its rate ({rate:.0f}/s, {sent} events): event-time lag "
                    f"p50 {np.percentile(lag, 50):.1f} ms p99 {np.percentile(lag, 99):.1f} ms; "
                    f"queueing delay at the boundary mean {queue.mean():.2f} ms p99 "
                    f"{np.percentile(queue, 99):.2f} ms",
                    flush=True,
                )
            print(f"    its exit summary: {cand['summary']}", flush=True)


if __name__ == "__main__":
    main()
