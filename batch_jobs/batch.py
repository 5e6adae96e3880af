"""The daily feature refresh: compute snapshots for a day (or a range) and materialize them.

Idempotent per day: re-running a day replaces that day's parquet and writes its values
to Redis. Feast's Redis writer keeps the newest snapshot per entity (it skips a row
not newer than the stored one), so backfilling an old day never overwrites a newer
online value; and when a re-run day's snapshot is the one online, its stored time is
cleared first (:func:`forget_recomputed`; the direct writer applies the same rule
while it writes) so that corrected values replace it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Literal

import pyarrow as pa
from feast import FeatureStore
from tqdm import tqdm

from batch_jobs import declared_sql
from batch_jobs.daily_features import compute_day, snapshot_time, write_day
from batch_jobs.feature_plan import history_days, record_backfilled
from batch_jobs.materialize import materialize_days
from batch_jobs.progress import phase
from feature_repo.definitions import apply_definitions
from fraud_scoring import declared as D
from fraud_scoring.feast_store import batch_marker_key, online_key, open_store, stored_time
from fraud_scoring.features import declarations, views
from fraud_scoring.redis_clients import sync_client

log = logging.getLogger(__name__)

# One day's snapshots from the raw history: daily_features.compute_day (DuckDB) or
# spark_engine.compute_day_spark bound to a session.
DayCompute = Callable[[Path, date], dict[str, pa.Table]]
# "direct": batch_jobs/materialize.py writes Feast's Redis layout itself (the default,
# tens of thousands of rows/s); "feast": FeatureStore.materialize (the reference path).
Materializer = Literal["direct", "feast"]


@dataclass
class BatchReport:
    days: int
    rows_written: int
    compute_s: float
    materialized_rows: int
    materialize_s: float  # the writer's own time: Feast's rows into the online store
    # Recording the declared states after it (the backfill of new states, the day's labels).
    declared_s: float = 0.0

    @property
    def materialize_rows_per_s(self) -> float:
        return self.materialized_rows / self.materialize_s if self.materialize_s else 0.0


def day_range(first: date, last: date) -> list[date]:
    if last < first:
        raise ValueError(f"--to {last} is before --from {first}")
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def forget_recomputed(
    store: FeatureStore,
    redis_url: str,
    entities: set[tuple[str, str]],
    snapshots_s: set[int],
) -> int:
    """Clear the stored snapshot time (``_ts:<view>``) of each (view, entity) whose
    online value came from one of the snapshots being recomputed, so that Feast, which
    skips rows not newer than the stored time, writes the recomputed values. Entities
    already holding a newer snapshot are left alone. Returns how many were cleared.
    Two pipelined round trips, whatever the number of entities."""
    by_name = {v.name: v for v in views()}
    eksv = store.config.entity_key_serialization_version
    items = sorted(entities)
    keys = [online_key(store.project, by_name[v].join_key, e, eksv) for v, e in items]
    client = sync_client(redis_url)  # Feast keys are bytes
    try:
        pipe = client.pipeline(transaction=False)
        for (view, _), key in zip(items, keys, strict=True):
            pipe.hget(key, f"_ts:{view}")
        stale = []
        for (view, _), key, raw in zip(items, keys, pipe.execute(), strict=True):
            if raw and stored_time(raw) in snapshots_s:
                stale.append((key, f"_ts:{view}"))
        pipe = client.pipeline(transaction=False)
        for key, field in stale:
            pipe.hdel(key, field)
        pipe.execute()
    finally:
        client.close()
    return len(stale)


def mark_materialized(redis_url: str, project: str) -> None:
    """Set each view's marker (:func:`fraud_scoring.feast_store.batch_marker_key`) to now,
    after its snapshots are written: the service reads a missing marker as "this store
    holds no batch features" (e.g. Redis restarted empty) and applies its degraded policy."""
    client = sync_client(redis_url)
    try:
        now = datetime.now(UTC).isoformat()
        pipe = client.pipeline(transaction=False)  # one SET each: on a cluster, other slots
        for v in views():
            pipe.set(batch_marker_key(project, v.name), now)
        pipe.execute()
    finally:
        client.close()


def backfill_declared(
    raw: Path,
    last: date,
    redis_url: str,
    allowed_lateness_s: float,
    label_available_after_s: float = 0.0,
) -> int:
    """Record the raw history up to ``last`` into every declared state whose backfilled
    marker is missing (a new state, or the store was emptied), with a progress line per
    state; states already backfilled are left to the updater (and, label states, to
    :func:`record_day_labels`). Returns the events recorded."""
    decl = declarations()
    client = sync_client(redis_url)
    try:
        states = declared_sql.missing_states(client, decl)
        if not states:
            return 0
        first = last - history_days(states)
        history = declared_sql.load_history(raw, first, last)
        if history.empty:
            return 0
        labels = declared_sql.labels_for(states, raw, label_available_after_s, last=last)
        only = dataclasses.replace(decl, specs=tuple(states))
        n = declared_sql.backfill_tiles(
            client,
            only,
            history,
            allowed_lateness_s + D.HORIZON_S,
            progress=lambda m: log.info("declared backfill: %s", m),
            labels=labels,
        )
        log.info(
            "declared backfill: %d events from %s..%s into %s",
            n,
            first,
            last,
            ", ".join(s.id for s in states),
        )
        return n
    finally:
        client.close()


def present_states(redis_url: str) -> list[D.Spec]:
    """The declared states whose backfilled marker the store holds."""
    client = sync_client(redis_url)
    try:
        missing = {s.id for s in declared_sql.missing_states(client, declarations())}
    finally:
        client.close()
    return [s for s in declarations().specs if s.id not in missing]


def record_day_labels(
    raw: Path,
    days: list[date],
    redis_url: str,
    allowed_lateness_s: float,
    label_available_after_s: float = 0.0,
) -> int:
    """Record the labels that arrived on ``days`` in the declared label states (each
    counts from the midnight after its arrival day plus ``label_available_after_s``, or
    later: the batch must run before then), but those the service recorded when they
    arrived (``live``: they count from their arrival and are in the states already).
    Idempotent; returns the labels recorded."""
    decl = declarations()
    labels = declared_sql.labels_for(
        decl.specs, raw, label_available_after_s, first=min(days), last=max(days)
    )
    if labels is None:
        return 0
    if "live" in labels:
        labels = labels[~labels["live"].fillna(False).astype(bool)]
    client = sync_client(redis_url)
    try:
        n = declared_sql.record_labels(client, decl, labels, allowed_lateness_s + D.HORIZON_S)
    finally:
        client.close()
    log.info("%s", labels_line(len(labels), n, min(days), max(days)))
    return n


def labels_line(arrived: int, recorded: int, first: date, last: date) -> str:
    """The batch's line on the arrivals (labels, decisions) of ``first..last`` that it
    recorded in the declared states: ``recorded`` new records (one per arrival and state
    of its source; an arrival already recorded, by this run's backfill or an earlier run,
    is not recorded again)."""
    span = f"{first}" if first == last else f"{first}..{last}"
    if not arrived:
        return f"declared labels: no label or decision arrived on {span}"
    if not recorded:
        return (
            f"declared labels: the {arrived:,} arrival(s) of {span} were recorded already "
            "(by the backfill or an earlier run): nothing new to record"
        )
    return f"declared labels: {arrived:,} arrival(s) of {span}, {recorded:,} new record(s)"


def run_batch(
    data_dir: Path,
    days: list[date],
    redis_url: str,
    feature_store_yaml: Path | None = None,
    materialize: bool = True,
    compute: DayCompute = compute_day,
    materializer: Materializer = "direct",
    allowed_lateness_s: float = 300.0,
    label_available_after_s: float = 0.0,
) -> BatchReport:
    """Compute (with ``compute``: DuckDB unless told), write and (optionally)
    materialize the snapshots of ``days``; both materializers leave the same Redis
    state (tests/test_materialize.py). Materializing also backfills the declared states
    the store does not hold yet (:func:`backfill_declared`; recorded as applied, so
    ``features plan`` does not list them again) and records the labels and decisions
    that arrived on ``days`` (:func:`record_day_labels`; ``label_available_after_s`` is
    ``FRAUD_BATCH_AVAILABLE_AFTER_S``)."""
    raw, feats = data_dir / "raw", data_dir / "features"
    t0 = time.perf_counter()
    rows = 0
    entities: set[tuple[str, str]] = set()  # Feast writes the newest row per entity
    for day in tqdm(days, desc="daily features", unit="day", disable=None):
        tables = compute(raw, day)
        write_day(feats, day, tables)
        rows += sum(t.num_rows for t in tables.values())
        for view in views():
            entities.update((view.name, k) for k in tables[view.name][view.join_key].to_pylist())
        log.debug("features for %s: %s", day, {k: v.num_rows for k, v in tables.items()})
    compute_s = time.perf_counter() - t0
    if not materialize:
        return BatchReport(len(days), rows, compute_s, 0, 0.0)

    store = open_store(data_dir, redis_url, feature_store_yaml)
    apply_definitions(store, data_dir)
    recomputed = {int(snapshot_time(d).timestamp()) for d in days}
    # Materialize exactly the snapshots of these days: [first snapshot, last snapshot].
    start, end = snapshot_time(min(days)), snapshot_time(max(days)) + timedelta(seconds=1)
    with phase(f"materialize {len(entities):,} entity rows ({materializer})", log):
        t1 = time.perf_counter()
        if materializer == "feast":
            forget_recomputed(store, redis_url, entities, recomputed)
            store.materialize(start_date=start, end_date=end)
        else:  # one read of the stored times serves both rules
            materialize_days(store, redis_url, feats, days, start, end, recomputed)
        mark_materialized(redis_url, store.project)
        mat_s = time.perf_counter() - t1
    with phase("declared states: backfill of new states, the days' labels", log):
        t2 = time.perf_counter()
        backfill_declared(raw, max(days), redis_url, allowed_lateness_s, label_available_after_s)
        record_day_labels(raw, days, redis_url, allowed_lateness_s, label_available_after_s)
        record_backfilled(data_dir, declarations(), present_states(redis_url))
        declared_s = time.perf_counter() - t2
    report = BatchReport(len(days), rows, compute_s, len(entities), mat_s, declared_s)
    log.info(
        "materialized %d entity rows in %.2fs (%.0f rows/s, the writer alone); declared "
        "states recorded in %.2fs",
        report.materialized_rows,
        mat_s,
        report.materialize_rows_per_s,
        declared_s,
    )
    return report
