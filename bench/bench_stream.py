"""Benchmark of the streaming updater (Redis Streams source, embedded Redis-protocol server).

Two figures, each beside a baseline:

1. **Throughput**: events/s that one updater process applies from a pre-filled stream
   (poll -> validate -> apply -> ack: the cards' histories and every declared state of
   ``feature_repo/features.yaml``), with the batched, pipelined apply (one round trip
   per batch) against the same loop applying one event per round trip (histories only).
   Also the updater's CPU seconds, since the target is "per updater CPU-second" (Redis
   runs in its own process; its CPU seconds are shown too), and the same with a hot key
   (``--hot-share`` of the events on one card and one merchant). With ``--baseline REF``
   the throughput runs of this checkout and of git revision ``REF`` (a temporary
   worktree, the same bench file and flags) alternate, twice each, in one run.
2. **Event-to-servable lag** at a fixed rate: ``fraud-scoring emit`` (a separate process)
   appends events at ``--rate`` events/s while the updater runs; lag is the time from
   the stream entry's id (the server's append time, millisecond resolution, so up to
   1 ms too high) to the moment the batch's effect is in Redis. Baseline: the same
   loop on a fixed 100 ms trigger (micro-batches) instead of a blocking read.

Usage: ``python bench/bench_stream.py [--events 60000] [--rate 2000] [--seconds 10]
[--baseline REF] [--throughput-only]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis

from batch_jobs.simulate import SimConfig, live_events
from fraud_scoring.redis_server import embedded_redis
from streaming.metrics import UpdaterMetrics
from streaming.sources import Message, RedisStreamSource
from streaming.state import ApplyResult, CardEvent, SessionWriter
from streaming.updater import Updater

STREAM = "bench"


class LagRecorder:
    """Stands in for the lag histogram and keeps every observation."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, v: float) -> None:
        self.values.append(v)


class UnpipelinedWriter(SessionWriter):
    """Baseline: one round trip per event."""

    def apply(
        self, events: Sequence[CardEvent], rows: Sequence[Mapping[str, Any]] | None = None
    ) -> ApplyResult:
        return self.apply_unpipelined(events)  # session state only


class SleepingSource(RedisStreamSource):
    """Baseline: a fixed 100 ms trigger (micro-batch interval) instead of a blocking read."""

    def poll(self, max_messages: int, timeout_s: float) -> list[Message]:
        time.sleep(0.1)
        return super().poll(max_messages, 0.001)


def fill(client: Any, payloads: Sequence[bytes]) -> None:
    client.delete(STREAM)
    for s in range(0, len(payloads), 5000):
        pipe = client.pipeline(transaction=False)
        for p in payloads[s : s + 5000]:
            pipe.xadd(STREAM, {"data": p})
        pipe.execute()


def throughput(url: str, payloads: Sequence[bytes], writer_cls: type[SessionWriter]) -> dict:
    client: Any = redis.Redis.from_url(url, socket_timeout=10)
    client.flushdb()
    fill(client, payloads)
    updater = Updater(
        RedisStreamSource(client, STREAM, "g", "bench"),
        writer_cls(client, allowed_lateness_s=300),
        UpdaterMetrics.create(),
        batch_size=1000,
    )
    redis_cpu = _redis_cpu_s(client)
    wall, cpu = time.perf_counter(), time.process_time()
    updater.run(max_messages=len(payloads))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    redis_cpu = _redis_cpu_s(client) - redis_cpu
    n = updater.totals.messages
    return {
        "events": n,
        "wall_s": wall,
        "cpu_s": cpu,
        "events_per_s": n / wall,
        "events_per_cpu_s": n / cpu,
        "redis_cpu_us_per_event": redis_cpu / n * 1e6,
    }


def _redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def lag_at_rate(url: str, rate: float, seconds: float, sleeping: bool) -> dict:
    client: Any = redis.Redis.from_url(url, socket_timeout=10)
    client.flushdb()
    client.xgroup_create(STREAM, "g", id="$", mkstream=True)
    rec = LagRecorder()
    metrics = dataclasses.replace(UpdaterMetrics.create(), lag=rec)  # type: ignore[arg-type]
    source_cls = SleepingSource if sleeping else RedisStreamSource
    updater = Updater(
        source_cls(client, STREAM, "g", "bench"),
        SessionWriter(client, allowed_lateness_s=300),
        metrics,
        batch_size=1000,
    )
    n_events = int(rate * seconds)
    # ~3 transactions per card-day; size the simulation to about n_events.
    cards = max(100, n_events // 3)
    env = {**os.environ, "REDIS_URL": url}
    thread = threading.Thread(target=updater.run, daemon=True)
    thread.start()
    emitter = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "emit",
            "--stream",
            STREAM,
            "--cards",
            str(cards),
            "--events-per-s",
            str(rate),
            "--seed",
            "3",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    sent = int(emitter.stdout.split()[1].replace(",", ""))
    deadline = time.monotonic() + 30
    while updater.totals.messages < sent and time.monotonic() < deadline:
        time.sleep(0.01)
    updater.stop()
    thread.join()
    lag = np.array(rec.values) * 1000
    return {
        "events": len(lag),
        "p50_ms": float(np.percentile(lag, 50)),
        "p99_ms": float(np.percentile(lag, 99)),
        "max_ms": float(lag.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=60_000, help="events for the throughput run")
    ap.add_argument("--baseline-events", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s for the lag run")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the lag run")
    ap.add_argument(
        "--hot-share", type=float, default=0.3, help="share of the hot-key run's events on one key"
    )
    ap.add_argument(
        "--baseline", metavar="REF", help="also run the throughput of git revision REF, alternated"
    )
    ap.add_argument(
        "--throughput-only", action="store_true", help="only the batched throughput runs, as JSON"
    )
    args = ap.parse_args()
    if args.baseline:
        compare(args)
        return

    feed = live_events(
        SimConfig(
            cards=max(100, args.events // 3), merchants=500, days=1, txns_per_card_day=3.0, seed=1
        )
    )
    payloads = [json.dumps(e).encode() for e in feed][: args.events]
    # The same events with a share moved onto one card at one merchant (a hot key: a
    # card-testing burst, a busy merchant).
    rng = np.random.default_rng(5)
    hot_events = [dict(e) for e in feed[: args.events]]
    for i in np.flatnonzero(rng.random(len(hot_events)) < args.hot_share):
        hot_events[i].update(card_id="c-hot", merchant_id="m-hot")
    hot_payloads = [json.dumps(e).encode() for e in hot_events]
    del feed, hot_events
    # The bench's own data (the events, twice) is not the updater's heap: frozen, the
    # collector does not scan it again and again on the updater's CPU account.
    gc.collect()
    gc.freeze()
    with embedded_redis() as url:
        fast = throughput(url, payloads, SessionWriter)
        hot = throughput(url, hot_payloads, SessionWriter)
        if args.throughput_only:
            print(json.dumps({"throughput": fast, "throughput_hot_key": hot}))
            return
        slow = throughput(url, payloads[: args.baseline_events], UnpipelinedWriter)
        lag = lag_at_rate(url, args.rate, args.seconds, sleeping=False)
        lag_base = lag_at_rate(url, args.rate, args.seconds, sleeping=True)

    print(f"\nthroughput, one updater process ({os.cpu_count()} CPUs on this machine)")
    print(f"{'':34}{'batched apply':>16}{'per-event apply':>18}")
    for key, label in (
        ("events", "events"),
        ("events_per_s", "events/s (wall)"),
        ("events_per_cpu_s", "events per updater CPU-second"),
    ):
        print(f"{label:34}{fast[key]:>16,.0f}{slow[key]:>18,.0f}")
    print(f"\nwith a hot key ({args.hot_share:.0%} of the events on one card and merchant)")
    print(f"{'':34}{'no hot key':>16}{'hot key':>18}")
    for key, label in (
        ("events_per_s", "events/s (wall)"),
        ("events_per_cpu_s", "events per updater CPU-second"),
        ("redis_cpu_us_per_event", "Redis CPU µs per event"),
    ):
        print(f"{label:34}{fast[key]:>16,.0f}{hot[key]:>18,.0f}")
    print(f"\nevent-to-servable lag at {args.rate:,.0f} events/s for {args.seconds:.0f}s")
    print(f"{'':34}{'blocking read':>16}{'100 ms trigger':>18}")
    for key, label in (
        ("events", "events"),
        ("p50_ms", "p50 ms"),
        ("p99_ms", "p99 ms"),
        ("max_ms", "max ms"),
    ):
        fmt = ",.0f" if key == "events" else ",.1f"
        print(f"{label:34}{lag[key]:>16{fmt}}{lag_base[key]:>18{fmt}}")
    print(
        json.dumps(
            {
                "throughput": fast,
                "throughput_hot_key": hot,
                "throughput_baseline": slow,
                "lag": lag,
                "lag_baseline": lag_base,
            }
        )
    )


def compare(args: argparse.Namespace) -> None:
    """Throughput of this checkout and of ``args.baseline``, alternated twice: this bench
    file run in a subprocess per side, the baseline's code first on its path."""
    here = Path(__file__).resolve().parent.parent
    flags = ["--events", str(args.events), "--hot-share", str(args.hot_share)]
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(here), "worktree", "add", "--detach", str(tree), args.baseline],
            check=True,
            capture_output=True,
        )
        try:
            runs: dict[str, list[dict]] = {"this checkout": [], args.baseline: []}
            for _ in range(2):
                for label, root in (("this checkout", here), (args.baseline, tree)):
                    out = subprocess.run(
                        [
                            sys.executable,
                            str(Path(__file__).resolve()),
                            *flags,
                            "--throughput-only",
                        ],
                        cwd=root,
                        env={**os.environ, "PYTHONPATH": str(root)},
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "remove", "--force", str(tree)], check=True
            )
    print(f"\nthroughput, one updater process ({os.cpu_count()} CPUs), two runs each, alternated")
    print(f"{'':34}{'this checkout':>22}{args.baseline[:20]:>22}")
    for run, title in (("throughput", "no hot key"), ("throughput_hot_key", "hot key")):
        print(
            f"{title} ({args.hot_share:.0%} of the events on one card and merchant)"
            if run == "throughput_hot_key"
            else title
        )
        for key, label in (
            ("events_per_s", "events/s (wall)"),
            ("events_per_cpu_s", "events per updater CPU-second"),
            ("redis_cpu_us_per_event", "Redis CPU µs per event"),
        ):
            cells = []
            for side in runs.values():
                v = sorted(r[run][key] for r in side)
                cells.append(f"{v[0]:,.0f} – {v[-1]:,.0f}")
            print(f"  {label:32}{cells[0]:>22}{cells[1]:>22}")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
