"""Where a micro-batch's CPU goes, step by step: ``Scorer.score_batch`` on the bench
world's held-out transactions, ``--sizes`` at a time, one after another (no HTTP, no
batcher; uvloop and the store health's markers, as the service runs), this process
pinned to core 0 and the Redis-protocol server it starts to core 1, back to back and
after each ``--pauses-ms`` (what a request finds after an idle gap: on a VM the code and
data a batch touches go cold within a millisecond or two, bench/README.md "bench_cold").

    python -m bench.bench_parts [--sizes 1,16] [--pauses-ms 0,20] [--batches 300]

Each step below is timed by a wrapper around the function (process CPU time, so the
store's own work and the wait for it are outside every figure except where a step awaits
the store: ``round trip: send and read``). A step's figure includes the steps listed
under it. Each wrapped call costs ~1.5 us (its two CPU-clock reads are system calls), so
the steps' sum reads a little high. The store is put back before each measure
(``bench.world.StoreState``): every measure is the live path. Profilers that trace every
call (cProfile, line_profiler) inflate a micro-batch's small calls several times over;
these wrappers time a handful of steps only.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import uvloop

from bench.world import BenchWorld, StoreState, pinned_world, world_scorer
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import views
from service.core.store_health import StoreHealth

# (label, module, attribute path, depth): the steps of Scorer.score_batch in the order
# they run; depth nests a step under the one above it.
STEPS: tuple[tuple[str, str, str, int], ...] = (
    ("score_batch (all)", "service.core.scoring", "Scorer.score_batch", 0),
    ("round trip: reads out and in", "service.core.round_trip", "StoreRoundTrip._round_trip", 1),
    ("Feast rows: queue", "service.core.online_features", "OnlineFeatureReader.queue", 2),
    ("declared reads: queue", "fraud_scoring.declared.columnar", "queue_reads", 2),
    ("id claims: queue", "service.core.idempotency", "queue_claims", 2),
    ("round trip: send and read", "service.core.round_trip", "StoreRoundTrip._execute_then", 2),
    ("id claims: replies", "service.core.idempotency", "claimed", 2),
    ("recording: queue", "service.core.round_trip", "StoreRoundTrip._queue_writes", 2),
    ("Feast rows: parse", "service.core.online_features", "OnlineFeatureReader.parse", 1),
    ("declared columns: parse", "fraud_scoring.declared.columnar", "parse_batch", 1),
    ("features: assembly", "fraud_scoring.features", "build_features", 1),
    ("model: matrix", "fraud_scoring.features", "assemble", 1),
    ("model: ONNX Runtime", "service.core.scoring", "Scorer._predict", 1),
    ("decision: rules, reasons, results", "service.core.scoring", "Scorer._decide", 1),
    ("recording: wait + checks", "service.core.round_trip", "StoreRoundTrip._written", 1),
    ("retries: settle", "service.core.scoring", "Scorer._settle", 1),
)


def _timed(label: str, fn: Callable[..., Any], spent: dict[str, float]) -> Callable[..., Any]:
    clock = time.process_time
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + clock() - t

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + clock() - t

    return timed


def _owner(module: str, path: str) -> tuple[Any, str]:
    """The module or class that binds ``module.path``, and the name (every wrapped step
    is called through its module or class, never imported by name elsewhere)."""
    owner: Any = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


def instrument(spent: dict[str, float]) -> list[tuple[Any, str, Any]]:
    """Wrap every step; returns what to put back."""
    undo = []
    for label, module, path, _ in STEPS:
        owner, name = _owner(module, path)
        original = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        undo.append((owner, name, original))
        setattr(owner, name, _timed(label, original, spent))
    return undo


async def measure(
    world: BenchWorld, store: StoreState, size: int, batches: int, pause_s: float
) -> None:
    scorer, client, _ = world_scorer(world)
    # The service's store health: its markers ride on every micro-batch's read.
    project = open_store(world.data_dir, world.redis_url).project
    scorer.health = StoreHealth(
        client, project, [v.name for v in views()], failures=3, open_s=5.0, check_s=5.0
    )
    rows = world.held_out((batches + 20) * size)
    txns = [Transaction.model_validate(r) for r in rows]
    groups = [txns[i : i + size] for i in range(0, len(txns) - size + 1, size)]
    for g in groups[:20]:  # warm: connections, kernels, caches
        await scorer.score_batch(g)
    store.restore()
    spent: dict[str, float] = {}
    undo = instrument(spent)
    measured = groups[20:]
    try:
        t0 = os.times()
        for g in measured:
            if pause_s:
                time.sleep(pause_s)
            await scorer.score_batch(g)
        t1 = os.times()
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
        await client.aclose()
    n = len(measured)
    user, system = (t1.user - t0.user) / n * 1e6, (t1.system - t0.system) / n * 1e6
    print(
        f"\nmicro-batch of {size}, {pause_s * 1e3:g} ms pause before each ({n} batches): "
        f"CPU {user + system:,.0f} us a batch (user {user:,.0f}, system {system:,.0f}), "
        f"{(user + system) / size:,.0f} us a transaction"
    )
    whole = spent.get(STEPS[0][0], 0.0) or 1.0
    for label, _, _, depth in STEPS:
        if label in spent:
            us = spent[label] / n * 1e6
            share = spent[label] / whole
            print(f"  {'  ' * depth}{label:<{44 - 2 * depth}} {us:>8,.0f} us {share:>6.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16", help="micro-batch sizes, comma-separated")
    ap.add_argument("--pauses-ms", default="0,20", help="idle pause before each batch, ms")
    ap.add_argument("--batches", type=int, default=300, help="measured batches per size")
    a = ap.parse_args()
    with pinned_world() as (world, pinned):
        if not pinned:
            print("one core: this process and the store share it (figures read high)")
        store = StoreState(world.redis_url)
        for size in (int(s) for s in a.sizes.split(",")):
            for pause in (float(p) / 1e3 for p in a.pauses_ms.split(",")):
                uvloop.run(measure(world, store, size, a.batches, pause))


if __name__ == "__main__":
    main()
