"""The scorer's micro-batch against the store's own time: ``Scorer.score_batch`` on the
bench world's held-out transactions, ``--batch`` at a time, one after another (no HTTP,
no batcher), this process pinned to core 0 and the Redis-protocol server it starts to
core 1; then the store's ``INFO commandstats`` over the same calls, per command.

    python -m bench.bench_store_time [--batch 24] [--batches 160]

Per micro-batch: wall and CPU time of this process (the difference is mostly waiting
for the store); per transaction: the store's time by command (the recording script is
the largest ``evalsha``; the commands a script runs are counted in their own rows too),
then each script's own time per call and per transaction (the ``SLOWLOG``, every command
logged during the measured batches); then the streaming updater's recording of the same
transactions after the service's (its pipeline: the card history, every declared state),
each script's time: what the second recorder of every transaction costs the store. What
bench/README.md's "the recording script" figures were measured with (2026-12-07).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import uvloop

from bench.world import BenchWorld, pinned_world, world_scorer
from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring import session
from fraud_scoring.events import Transaction
from service.core import online_features


async def run(world: BenchWorld, batch: int, batches: int) -> None:
    scorer, client, _ = world_scorer(world)
    warm = 20
    rows = world.held_out((batches + warm) * batch)
    txns = [Transaction.model_validate(r) for r in rows]
    groups = [txns[i : i + batch] for i in range(0, len(txns) - batch + 1, batch)]
    if len(groups) < warm + 1:
        raise SystemExit(f"the world holds {len(txns)} held-out transactions: too few")
    for g in groups[:warm]:
        await scorer.score_batch(g)
    measured = groups[warm:]
    await client.config_resetstat()
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", 200_000)
    await client.slowlog_reset()
    c0, t0 = time.process_time(), time.perf_counter()
    for g in measured:
        await scorer.score_batch(g)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(measured)
    stats = await client.info("commandstats")
    scripts = await script_times(client)
    each = f"wall {wall / n * 1e3:.2f} ms, CPU {cpu / n * 1e3:.2f} ms each"
    print(f"{n} micro-batches of {batch}: {each}")
    report(stats, scripts, n * batch)
    # The streaming updater records every transaction too, after the service did: its
    # pipeline (the card history, then every declared state) over the same micro-batches.
    # The scripting engine starts afresh first: its collector would otherwise charge the
    # garbage the service's recording left to the first script that allocates (here the
    # card history: ~4x its own time in a trial).
    await client.script_flush()
    for script in (*D.SCRIPTS, session.APPLY_LUA, session.APPLY_MANY_LUA):
        await client.script_load(script)
    await client.config_set("slowlog-log-slower-than", 0)
    await client.config_set("slowlog-max-len", 200_000)
    await client.slowlog_reset()
    horizon_s = scorer.settings.allowed_lateness_s + D.HORIZON_S
    decl = F.declarations()
    for g in measured:
        pipe = client.pipeline(transaction=False)
        by_card: dict[str, list[session.SessionEvent]] = {}
        for t in g:
            by_card.setdefault(t.card_id, []).append(session.to_session_event(t))
        session.queue_apply_many(pipe, by_card, scorer.limits)
        ts_us = [session.to_us(t.event_time) for t in g]
        rows = D.transaction_rows(g)
        D.queue_batch(pipe, decl, rows, ts_us, [True] * len(g), horizon_s, read=False)
        await pipe.execute()
    again = await script_times(client)
    await client.aclose()
    print(
        f"\nthe streaming updater's recording of the same {n * batch} transactions after "
        "the service's (duplicates: the markers and ids name them)"
    )
    print_scripts(again, n * batch)


def report(stats: dict[str, Any], scripts: dict[str, tuple[int, float]], txns: int) -> None:
    """The store's time per transaction by command, then by script."""
    print(f"{'command':<24}{'calls/txn':>10}{'µs/call':>10}{'µs/txn':>10}")
    total = 0.0
    for name, v in sorted(stats.items(), key=lambda kv: -float(kv[1]["usec"])):
        if name == "cmdstat_config|resetstat":
            continue
        per_txn = float(v["usec"]) / txns
        total += per_txn
        print(
            f"{name.removeprefix('cmdstat_'):<24}{v['calls'] / txns:>10.2f}"
            f"{float(v['usec_per_call']):>10.1f}{per_txn:>10.1f}"
        )
    print(f"{'sum of the rows':<24}{'':>10}{'':>10}{total:>10.1f}")
    print(
        "(commands a script runs are counted in their own rows and in its evalsha's time: "
        "the sum counts them twice; evalsha alone is the scripts with what they call)"
    )
    print()
    print_scripts(scripts, txns)


def print_scripts(scripts: dict[str, tuple[int, float]], txns: int) -> None:
    print(f"{'script (SLOWLOG)':<24}{'calls/txn':>10}{'µs/call':>10}{'µs/txn':>10}")
    for name, (calls, usec) in sorted(scripts.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<24}{calls / txns:>10.2f}{usec / calls:>10.1f}{usec / txns:>10.1f}")


async def script_times(client: Any) -> dict[str, tuple[int, float]]:
    """Calls and µs per script of the measured batches, from the SLOWLOG (every command
    logged, threshold 0): each EVALSHA by its script's file."""
    names = {
        D.APPLY_STATES_SHA: "apply_states.lua",
        D.APPLY_SHA: "apply.lua",
        session.APPLY_SHA: "card history (one)",
        session.APPLY_MANY_SHA: "card history",
        online_features.HMGET_SHA: "feast rows (HMGET_LUA)",
    }
    out: dict[str, tuple[int, float]] = {}
    for entry in await client.slowlog_get(200_000):
        args = entry["command"].split()
        if len(args) < 2 or args[0].upper() != b"EVALSHA":
            continue
        name = names.get(args[1].decode(), args[1].decode()[:12])
        calls, usec = out.get(name, (0, 0.0))
        out[name] = (calls + 1, usec + entry["duration"])
    await client.config_set("slowlog-log-slower-than", 10_000)
    await client.config_set("slowlog-max-len", 128)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=24, help="transactions per micro-batch")
    p.add_argument("--batches", type=int, default=160, help="micro-batches measured")
    a = p.parse_args()
    with pinned_world() as (world, _):
        uvloop.run(run(world, a.batch, a.batches))


if __name__ == "__main__":
    main()
