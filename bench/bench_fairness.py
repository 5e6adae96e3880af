"""Fairness under a heavy batch caller (issue 38, item 3): does a light key keep its
single calls served while another key floods the batch endpoint?

The protocol of the third hardening round, against the real service (batching on, auth
required, two keys, the default 100 ms deadline, default admission settings):

1. **capacity**: closed loop, the ``heavy`` key alone on 4 connections of 32-transaction
   calls to ``POST /v1/score/batch`` (4 x 32 = the default admission capacity) for
   ``--capacity-seconds``: the calls/s the service serves kept just full;
2. **flood**: open loop (fixed arrival times, latency from the scheduled send, one
   connection pool per key) for ``--seconds``: ``heavy`` offers ``--factor`` (3) times
   that capacity in 32-transaction calls (or ``--heavy-rate`` calls/s) while ``light``
   sends ``--light-rate`` (50) single ``POST /v1/score`` calls per second.

Every transaction carries an id never sent before, so each is a new decision (a body
sent twice would be a retry, answered from the kept answer, or refused 409 in a batch).

Printed: the capacity; the heavy key's offered and served calls/s; the light key's
share served (200) and its p50/p99; the service's refusals by reason
(``fraud_rejections_total``, read from ``/metrics`` before and after the flood with a
third, metrics-only key); the goal line ``light key served >= 95 %: met / NOT MET``.
The service runs pinned to core 0 with ``taskset``, the generator (and the Redis server
it starts) on core 1 when the machine has two cores (as ``bench_http``).

    python -m bench.bench_fairness [--seconds 10] [--light-rate 50] [--factor 3]
        [--baseline REF]

``--baseline REF`` first runs the protocol against an earlier commit's service (checked
out in a temporary ``git worktree``), and offers this checkout's the same heavy rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import secrets
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_http import run, start
from bench.bench_overload import Phase, Stream, checkout, closed_loop, open_loop, request
from bench.world import BenchWorld, bench_world
from service.edge.auth import KeyEntry, Scope, append_key, new_key

BATCH = 32
DEADLINE_MS = 100.0  # the service's default FRAUD_REQUEST_TIMEOUT_MS
CONNS = 128 // BATCH  # batch calls the default admission capacity holds
GOAL = 0.95
_REJECTED = re.compile(r'^fraud_rejections_total\{[^}]*reason="([a-z_]+)"[^}]*\} (\S+)$', re.M)


def fresh_calls(
    host: str, path: str, key: str, rows: list[dict[str, Any]], size: int, n: int, tag: str
) -> list[bytes]:
    """``n`` calls of ``size`` transactions (``size`` 1: the single-call body), the rows
    cycled, each transaction with an id of its own (``<tag>-<n>``)."""
    out = []
    k = 0
    for _ in range(n):
        txns = []
        for _ in range(size):
            txns.append({**rows[k % len(rows)], "transaction_id": f"{tag}-{k}"})
            k += 1
        body = txns[0] if size == 1 else {"transactions": txns}
        out.append(request(host, path, key, json.dumps(body).encode()))
    return out


def rejections(url: str, key: str) -> Counter[str]:
    """The service's ``fraud_rejections_total`` by reason, summed over model versions."""
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as answer:
        text = answer.read().decode()
    out: Counter[str] = Counter()
    for reason, value in _REJECTED.findall(text):
        out[reason] += int(float(value))
    return out


@dataclass
class Outcome:
    label: str
    capacity: Phase  # the closed loop, heavy alone
    heavy_rate: float  # offered calls/s
    flood: Phase
    raw: dict[str, np.ndarray]
    refused: Counter[str]
    seconds: float
    light_rate: float

    @property
    def light_served(self) -> float:
        st, is_light = self.raw["status"], self.raw["light"]
        return float((is_light & (st == 200)).sum() / is_light.sum())

    def report(self) -> None:
        st, lat, is_light = self.raw["status"], self.raw["lat"], self.raw["light"]
        light_ok, heavy_ok = is_light & (st == 200), ~is_light & (st == 200)
        q = np.quantile(lat[light_ok], [0.5, 0.99]) if light_ok.any() else [np.nan, np.nan]
        other = Counter(int(s) for s in st if s not in (200, 503))
        cap = self.capacity
        served = self.light_served
        print(
            f"\n== {self.label} (generator lag p99 {self.flood.gen_lag_p99:.1f} ms)\n"
            f"capacity (closed loop, heavy alone, {CONNS} connections): "
            f"{cap.served / BATCH:,.1f} calls/s of {BATCH} = {cap.served:,.0f} transactions/s "
            f"(p50 {cap.p50:.1f} ms, p99 {cap.p99:.1f} ms, 503 {cap.shed:.0%})\n"
            f"heavy key: offered {self.heavy_rate:,.1f} calls/s, served "
            f"{heavy_ok.sum() / self.seconds:,.1f} calls/s "
            f"({heavy_ok.sum() * BATCH / self.seconds:,.0f} transactions/s), "
            f"503 {float((st[~is_light] == 503).mean()):.1%}\n"
            f"light key: offered {self.light_rate:g} calls/s, served {served:.1%} "
            f"(p50 {q[0]:.1f} ms, p99 {q[1]:.1f} ms from the scheduled send), "
            f"503 {float((st[is_light] == 503).mean()):.1%}\n"
            f"refusals by reason (fraud_rejections_total: a call refused at admission counts "
            f"once, a batch call's transactions refused later each): "
            f"{', '.join(f'{k} {v}' for k, v in sorted(self.refused.items())) or 'none'}"
            + (f"\nother answers: {dict(other)}" if other else "")
        )
        verdict = "met" if served >= GOAL else "NOT MET"
        print(f"goal: light key served >= {GOAL:.0%}: {verdict}")


def measure(
    world: BenchWorld,
    a: argparse.Namespace,
    pin: bool,
    label: str,
    code: str | None,
    heavy_rate: float | None,
) -> Outcome:
    """The protocol against the service started from ``code`` (a checkout's path; None:
    this one); the heavy key offers ``heavy_rate`` calls/s, or ``--factor`` times the
    capacity measured here."""
    tag = "f" + secrets.token_hex(3)
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.jsonl"
        keys = {}
        for key_id, scope in (
            ("heavy", Scope.SCORE),
            ("light", Scope.SCORE),
            ("ops", Scope.METRICS),
        ):
            key, digest = new_key(key_id)
            append_key(keys_file, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({scope})))
            keys[key_id] = key
        extra = {
            "FRAUD_AUTH": "required",
            "FRAUD_API_KEYS_FILE": str(keys_file),
            "FRAUD_REQUEST_TIMEOUT_MS": f"{DEADLINE_MS:g}",
        }
        if code is not None:  # that checkout's packages first on the path
            extra["PYTHONPATH"] = os.pathsep.join(
                filter(None, [code, os.environ.get("PYTHONPATH")])
            )
        service = start(world, True, extra, "0" if pin else None, cwd=code)
        try:
            host = service.url.removeprefix("http://").split(":")[0]
            rows = world.held_out(5000)

            def heavy_calls(n: int, part: str) -> list[bytes]:
                return fresh_calls(
                    host, "/v1/score/batch", keys["heavy"], rows, BATCH, n, f"{tag}-{part}"
                )

            # Enough fresh calls for the closed loops at up to ~20,000 transactions/s.
            most = int(20_000 / BATCH * a.capacity_seconds) + 10
            gc.collect()
            gc.freeze()
            gc.disable()  # as in bench_http: a full collection stalls the generator
            run(closed_loop(service.url, Stream("heavy", heavy_calls(60, "w"), BATCH, 1), 2, 1.0))
            base = run(
                closed_loop(
                    service.url,
                    Stream("heavy", heavy_calls(most, "c"), BATCH, 1),
                    CONNS,
                    a.capacity_seconds,
                )
            )
            rate = heavy_rate or a.factor * base.served / BATCH
            heavy = Stream("heavy", heavy_calls(int(rate * a.seconds) + 1, "h"), BATCH, rate)
            n_light = int(a.light_rate * a.seconds) + 1
            light = Stream(
                "light",
                fresh_calls(host, "/v1/score", keys["light"], rows, 1, n_light, f"{tag}-l"),
                1,
                a.light_rate,
            )
            time.sleep(1)
            before = rejections(service.url, keys["ops"])
            (phase,), raw = run(open_loop(service.url, [("flood", a.seconds, [heavy, light])]))
            refused = rejections(service.url, keys["ops"]) - before
        finally:
            gc.enable()
            gc.unfreeze()
            service.stop()
    return Outcome(label, base, rate, phase, raw, refused, a.seconds, a.light_rate)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="length of the flood")
    p.add_argument("--capacity-seconds", type=float, default=3.0, help="closed-loop length")
    p.add_argument("--factor", type=float, default=3.0, help="heavy load as a multiple of capacity")
    p.add_argument("--heavy-rate", type=float, help="heavy calls/s (default: --factor x capacity)")
    p.add_argument("--light-rate", type=float, default=50.0, help="light key's calls per second")
    p.add_argument("--no-pin", action="store_true", help="let service and generator share cores")
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="first run the protocol against this git commit's service; the heavy rate "
        "measured there is used for both",
    )
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the generator (this process) on the other core
    outcomes = []
    with bench_world() as world:
        rate = a.heavy_rate
        if a.baseline:
            with checkout(a.baseline) as code:
                first = measure(world, a, pin, f"baseline: {a.baseline}", code, rate)
            outcomes.append(first)
            rate = first.heavy_rate
        outcomes.append(measure(world, a, pin, "this checkout", None, rate))
    print(
        f"\n(service pinned to core 0, generator to core 1: {pin}; deadline {DEADLINE_MS:g} ms;"
        f" flood {a.seconds:g} s)"
    )
    for o in outcomes:
        o.report()


if __name__ == "__main__":
    main()
