"""Unit figures for the scale sheet (docs/scale-sheet.md), measured on a simulated world.

Local only and bounded (about a minute, plus Spark's start when asked):

1. **Batch features in the online store**: ``MEMORY USAGE`` of every Feast hash (one per
   card, one per merchant, all views of an entity in one hash) after the bench world's
   days are materialized (bench/world.py: 3,000 cards, 300 merchants).
2. **Session state**: the world's last day of transactions applied by the streaming
   updater (Redis Streams source, batched apply) into an empty database; ``MEMORY
   USAGE`` of each card's ``{card:<id>}:ev`` + ``:ids`` keys, fitted as
   ``bytes = fixed + per_event * events`` over the cards. The same run gives the
   updater's events/s (a short run: bench/bench_stream.py is the real throughput bench).
3. **Decision log**: held-out transactions scored in-process by the service's Scorer
   (micro-batches of 64, no HTTP) with the Redis decision log on, as
   ``FRAUD_DECISION_LOG=redis`` does; bytes per entry = (stream + dedup markers) / entries.
4. **Declared states**: after the world's batch backfilled them over its history,
   ``MEMORY USAGE`` of every key of every declared state (``{agg:<state>:<key>}:t`` and
   ``:ids``), per state and in all per card of the world (the sheet scales that with the
   card count). The world holds 14 days: a state's 30-day day tiles are not all there
   yet, so the figure is low by up to 32 bytes per missing tile.
5. **Daily batch time**: one day's snapshot (both views) computed over the raw history
   with DuckDB and, with ``--spark``, Spark ``local[*]`` (the second day timed, so the
   JVM start is not counted), on the bench world and on a larger one
   (``--batch-cards``, 30 days, built once under bench/results/).

Scoring throughput is not measured here: the scale sheet cites bench/README.md
(bench_http's held rate). Prints a table and writes bench/results/footprint.json.

    python -m bench.bench_footprint [--spark] [--batch-cards 30000]
    python -m bench.bench_footprint --sheet   # the derived sheet from the last results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import redis
import redis.asyncio as aioredis

from batch_jobs.daily_features import compute_day
from batch_jobs.materialize import newest_per_entity
from batch_jobs.simulate import SimConfig, simulate
from bench.bench_stream import throughput
from bench.world import CFG, ROOT, BenchWorld, bench_world
from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import online_keys, open_store
from fraud_scoring.features import declarations, producible_features, views
from fraud_scoring.session import events_key, ids_key
from fraud_scoring.storage import partition_file
from service.core.model import ModelHolder, load_model
from service.core.online_features import OnlineFeatureReader
from service.core.scoring import Scorer
from service.loop.decision_log import DecisionLog
from service.resources import log_producer
from service.settings import ServiceSettings as Settings
from streaming.state import SessionWriter

log = logging.getLogger("bench.footprint")
RESULTS = Path(__file__).resolve().parent / "results"
SESSION_DB = 1  # the updater's run flushes its database; the world's Feast keys stay in 0


def memory(client: Any, keys: Sequence[bytes | str]) -> list[int]:
    """``MEMORY USAGE <key> SAMPLES 0`` (every element counted) of each key, pipelined."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
    return [int(v or 0) for v in pipe.execute()]


def batch_features(world: BenchWorld) -> dict[str, Any]:
    """Bytes per entity hash in Feast's layout, per entity type (card, merchant)."""
    store = open_store(world.data_dir, world.redis_url)
    client = redis.Redis.from_url(world.redis_url)
    last = CFG.start + timedelta(days=CFG.days - 2)  # the last materialized day
    days = [CFG.start + timedelta(days=i) for i in range(CFG.days - 1)]
    out: dict[str, Any] = {}
    for view in views():
        ids = newest_per_entity(world.data_dir / "features", view, days)[view.join_key]
        keys = online_keys(store.project, view.join_key, ids.to_pylist())
        sizes = memory(client, keys)
        if not all(sizes):
            raise RuntimeError(f"{view.name}: {sizes.count(0)} entities have no Feast hash")
        out.setdefault(view.entity, {"entities": len(keys), "bytes_per_entity": 0.0})
        # All views of one entity share one hash: count each hash once per entity type.
        out[view.entity]["bytes_per_entity"] = float(np.mean(sizes))
    out["as_of"] = last.isoformat()
    return out


def declared_state(world: BenchWorld) -> dict[str, Any]:
    """Bytes Redis keeps per key of each declared state (tiles hash + ids), and in all per
    card of the world."""
    client = redis.Redis.from_url(world.redis_url)
    states: dict[str, Any] = {}
    total = 0
    for spec in declarations().specs:
        tiles = sorted(client.scan_iter(match=f"{{agg:{spec.id}:*}}:t", count=1000))
        ids = [k[: -len(b":t")] + b":ids" for k in tiles]
        sizes = np.array(memory(client, tiles)) + np.array(memory(client, ids))
        states[spec.id] = {
            "entity": "x".join(spec.entity),
            "keys": len(tiles),
            "bytes_per_key": float(sizes.mean()) if len(tiles) else 0.0,
        }
        total += int(sizes.sum())
    return {"states": states, "bytes": total, "bytes_per_card": total / CFG.cards}


def session_state(world: BenchWorld) -> dict[str, Any]:
    """The last day's events through the updater, then the bytes per card and event."""
    events = world.held_out(limit=10**9)
    payloads = [json.dumps(e).encode() for e in events]
    url = f"{world.redis_url.rstrip('/')}/{SESSION_DB}"
    run = throughput(url, payloads, SessionWriter)
    client = redis.Redis.from_url(url)
    per_card: dict[str, int] = {}
    for e in events:
        per_card[e["card_id"]] = per_card.get(e["card_id"], 0) + 1
    cards = sorted(per_card)
    ev = memory(client, [events_key(c) for c in cards])
    ids = memory(client, [ids_key(c) for c in cards])
    n = np.array([per_card[c] for c in cards], dtype=float)
    total = np.array(ev) + np.array(ids)
    per_event, fixed = np.polyfit(n, total, 1)
    return {
        "events": len(events),
        "cards": len(cards),
        "events_per_card_day": len(events) / len(cards),
        "bytes_per_card_mean": float(total.mean()),
        "fit_fixed_bytes": float(fixed),
        "fit_bytes_per_event": float(per_event),
        "updater": run,
    }


async def _score(world: BenchWorld, n: int) -> dict[str, Any]:
    settings = Settings(
        redis_url=world.redis_url,
        data_dir=world.data_dir,
        model_repo=world.model_repo,
        decision_log="redis",
        decision_log_stream="footprint-decisions",
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    client = aioredis.Redis.from_url(world.redis_url)
    producer = log_producer(settings, world.redis_url, settings.decision_log_stream)
    dlog = DecisionLog(producer, settings.decision_log_buffer)
    dlog.start()
    with ThreadPoolExecutor(1) as pool:
        scorer = Scorer(
            client,
            OnlineFeatureReader(store.project),
            ModelHolder(model),
            settings,
            pool,
            dlog.submit,
        )
        txns = [Transaction.model_validate(r) for r in world.held_out(n)]
        for s in range(0, len(txns), 64):
            results = await scorer.score_batch(txns[s : s + 64])
            # Every decision answered: the log keeps what was answered (as the batcher
            # tells it in the service).
            dlog.answered(results, [True] * len(results))
    await dlog.stop(drain_s=30)
    await producer.close()
    await client.aclose()
    return {"scored": len(txns)}


def decision_log(world: BenchWorld, n: int) -> dict[str, Any]:
    """Bytes per decision-log entry (stream entry + its dedup marker)."""
    client: Any = redis.Redis.from_url(world.redis_url)
    stream = "footprint-decisions"
    client.delete(stream)
    scored = asyncio.run(_score(world, n))["scored"]
    entries = int(client.xlen(stream))
    if entries == 0:
        raise RuntimeError("the decision log holds no entry after scoring")
    markers = [k for k in client.scan_iter(match=f"{{{stream}}}:seen:*", count=1000)]
    stream_bytes = memory(client, [stream])[0]
    marker_bytes = sum(memory(client, markers))
    return {
        "scored": scored,
        "entries": entries,
        "stream_bytes_per_entry": stream_bytes / entries,
        "marker_bytes_per_entry": marker_bytes / max(len(markers), 1),
        "bytes_per_entry": (stream_bytes + marker_bytes) / entries,
    }


def _raw_rows(raw: Path, day: date) -> int:
    """Raw transaction rows of the 90 days up to ``day`` (what a day's snapshot scans)."""
    files = (partition_file(raw, "transactions", day - timedelta(days=i)) for i in range(91))
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files if f.exists())


def _timed(compute: Callable[[Path, date], dict], raw: Path, day: date) -> dict[str, Any]:
    t0 = time.perf_counter()
    tables = compute(raw, day)
    s = time.perf_counter() - t0
    rows = _raw_rows(raw, day)
    return {
        "seconds": s,
        "raw_rows_scanned": rows,
        "snapshot_rows": sum(t.num_rows for t in tables.values()),
        "us_per_raw_row": s / rows * 1e6,
    }


def batch_time(raw: Path, last: date, spark: bool) -> dict[str, Any]:
    """One day's snapshot on DuckDB and (``spark``) Spark local[*], timed."""
    out = {"duckdb": _timed(compute_day, raw, last)}
    if spark:
        from batch_jobs.spark_engine import compute_day_spark, spark_run

        with spark_run("local[*]") as session:
            compute_day_spark(session, raw, last - timedelta(days=1))  # JVM and code warm-up
            out["spark_local"] = _timed(lambda r, d: compute_day_spark(session, r, d), raw, last)
            out["spark_local"]["cores"] = os.cpu_count()
    return out


# --- the derived sheet (docs/scale-sheet.md); each assumption is a named constant ----------
# Figures measured elsewhere in this repository, cited rather than re-run:
# bench/README.md: bench_http, batched, one pinned core (2026-12-08: 300 and 200 in two runs,
# the typical endpoint 3,000 and 4,000, the hand-written features of 811ee54 1,500 and 1,200;
# 800 - 1,200 in the better runs of 2026-12-07)
SCORING_HELD_PER_CORE = 300
# The store's CPU per decision on the scoring path (bench_http's store ms: 206-358 us at
# micro-batches of 2-28, 2026-12-07) plus the updater's second recording of it (~35 us:
# bench_store_time's last table): what a shard's one core spends per decision.
STORE_CPU_US_PER_DECISION = 340
MATERIALIZE_ROWS_PER_S = 43_000  # docs/scale-out.md: bench_materialize, direct writer, low end
HEADROOM = 1.5  # Redis memory: fragmentation, replication buffers, fork copy-on-write on save
SHARD_GB = 25.0  # usable memory per Redis Cluster master
UTILIZATION = 0.6  # scoring cores planned at 60 % of the held rate (p99 <= 10 ms there)
UPDATER_UTILIZATION = 0.5  # updaters planned at half their measured events/s
MEAN_TO_PEAK = 0.5  # the day's mean rate is half the peak decisions/s of the table
MERCHANTS_PER_CARD = 0.1  # the simulated worlds' ratio (3,000 cards, 300 merchants)
HISTORY_DAYS = 90  # a day's snapshot scans 90 days of raw history (the longest window)
LOG_RETENTION_DAYS = 3  # FRAUD_DECISION_LOG_RETENTION_S default
EXECUTOR_CORES = 80  # e.g. 20 executors x 4 cores, as in docs/scale-out.md's spark-submit
CARDS = (1_000_000, 10_000_000, 100_000_000)
RATES = (1_000, 10_000, 100_000)


def sheet(res: dict[str, Any]) -> str:
    """The derived tables as Markdown, from measured ``res`` and the constants above."""
    bf, ss, dl = res["batch_features"], res["session_state"], res["decision_log"]
    merchant_b = bf["merchant"]["bytes_per_entity"]
    card_b = bf["card"]["bytes_per_entity"] + MERCHANTS_PER_CARD * merchant_b
    active = ss["cards"] / CFG.cards  # share of cards with session state on a day
    fixed_b, event_b = ss["fit_fixed_bytes"], ss["fit_bytes_per_event"]
    # Declared states per card (every entity's keys, spread over the world's cards): a
    # key keeps its state for its longest window, whether or not it was active today.
    declared_b = res.get("declared_state", {}).get("bytes_per_card", 0.0)
    updater = ss["updater"]["events_per_s"] * UPDATER_UTILIZATION
    core_us = res["batch_marginal_us_per_raw_row"].get("spark_local", float("nan")) * (
        res["batch_time_large_world"].get("spark_local", {}).get("cores", 1)
    )
    gb = 1e9
    lines = [
        "| cards | decisions/s (peak) | batch features GB | session + declared GB | "
        f"online store GB x{HEADROOM} | shards @ {SHARD_GB:.0f} GB | decision log GB (Redis, "
        f"{LOG_RETENTION_DAYS} d) | store cores (CPU) | scoring cores | updaters | nightly "
        f"Spark min ({EXECUTOR_CORES} cores) | materialize min |",
        "|" + "---:|" * 12,
    ]
    for n in CARDS:
        for r in RATES:
            events_day = r * MEAN_TO_PEAK * 86_400
            feast = n * card_b / gb
            sess = (n * active * fixed_b + events_day * event_b + n * declared_b) / gb
            store = (feast + sess) * HEADROOM
            dlog = events_day * LOG_RETENTION_DAYS * dl["bytes_per_entry"] / gb
            cores = math.ceil(r / (SCORING_HELD_PER_CORE * UTILIZATION))
            # Each shard serves on one core: the shards are at least these.
            store_cores = math.ceil(r * STORE_CPU_US_PER_DECISION / 1e6 / UTILIZATION)
            updaters = math.ceil(r / updater)
            spark_min = events_day * HISTORY_DAYS * core_us / 1e6 / EXECUTOR_CORES / 60
            mat_min = n * (1 + MERCHANTS_PER_CARD) / MATERIALIZE_ROWS_PER_S / 60
            lines.append(
                f"| {n / 1e6:,.0f}M | {r:,} | {feast:,.1f} | {sess:,.1f} | {store:,.1f} | "
                f"{math.ceil(store / SHARD_GB)} | {dlog:,.0f} | {store_cores} | {cores} | "
                f"{updaters} | "
                f"{spark_min:,.0f} | {mat_min:,.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--decisions", type=int, default=2000, help="transactions scored")
    p.add_argument("--batch-cards", type=int, default=30_000, help="cards of the batch world")
    p.add_argument("--spark", action="store_true", help="also time Spark local[*]")
    p.add_argument(
        "--sheet", action="store_true", help="print the derived sheet from the last results only"
    )
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.sheet:
        log.info("%s", sheet(json.loads((RESULTS / "footprint.json").read_text())))
        return
    res: dict[str, Any] = {"machine_cpus": os.cpu_count()}
    with bench_world() as world:
        res["batch_features"] = batch_features(world)
        res["declared_state"] = declared_state(world)
        res["session_state"] = session_state(world)
        res["decision_log"] = decision_log(world, a.decisions)
        last = CFG.start + timedelta(days=CFG.days - 1)
        res["batch_time_bench_world"] = batch_time(world.data_dir / "raw", last, a.spark)
    big = SimConfig(cards=a.batch_cards, merchants=a.batch_cards // 30, days=30, seed=5)
    raw = ROOT.parent / f"batch-world-{big.cards}" / "raw"
    if not raw.exists():
        simulate(big, raw)
    res["batch_time_large_world"] = batch_time(
        raw, big.start + timedelta(days=big.days - 1), a.spark
    )
    # The slope between the two worlds: the time each further raw row costs, without the
    # fixed cost of a job (Spark's planning and scheduling is seconds even for no rows).
    small, large = res["batch_time_bench_world"], res["batch_time_large_world"]
    res["batch_marginal_us_per_raw_row"] = {
        e: (large[e]["seconds"] - small[e]["seconds"])
        / (large[e]["raw_rows_scanned"] - small[e]["raw_rows_scanned"])
        * 1e6
        for e in large
    }
    report(res)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "footprint.json").write_text(json.dumps(res, indent=2))
    log.info("wrote %s\n\n%s", RESULTS / "footprint.json", sheet(res))


def report(res: dict[str, Any]) -> None:
    bf, ss, dl = res["batch_features"], res["session_state"], res["decision_log"]
    rows = [
        ("Feast hash per card (bytes)", bf["card"]["bytes_per_entity"]),
        ("Feast hash per merchant (bytes)", bf["merchant"]["bytes_per_entity"]),
        ("session state per card, mean (bytes)", ss["bytes_per_card_mean"]),
        ("  at events per card-day", ss["events_per_card_day"]),
        ("  fit: fixed per card (bytes)", ss["fit_fixed_bytes"]),
        ("  fit: per event (bytes)", ss["fit_bytes_per_event"]),
        ("declared states per card of the world (bytes)", res["declared_state"]["bytes_per_card"]),
        ("updater events/s (wall, short run)", ss["updater"]["events_per_s"]),
        ("updater events per CPU-second", ss["updater"]["events_per_cpu_s"]),
        ("decision log per entry (bytes)", dl["bytes_per_entry"]),
    ]
    for world in ("batch_time_bench_world", "batch_time_large_world"):
        for engine, t in res[world].items():
            rows.append((f"{world[11:]} {engine}: raw rows scanned", t["raw_rows_scanned"]))
            rows.append((f"{world[11:]} {engine}: seconds per day", t["seconds"]))
            rows.append((f"{world[11:]} {engine}: us per raw row", t["us_per_raw_row"]))
    for engine, us in res["batch_marginal_us_per_raw_row"].items():
        rows.append((f"{engine}: marginal us per raw row", us))
    for sid, st in res["declared_state"]["states"].items():
        rows.append(
            (f"  {st['entity']} {sid[:16]}: bytes/key, {st['keys']} keys", st["bytes_per_key"])
        )
    for label, v in rows:
        log.info("%-48s %14s", label, f"{v:,.2f}" if v < 100 else f"{v:,.0f}")


if __name__ == "__main__":
    main()
