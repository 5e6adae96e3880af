"""Exact replay of a past day: every transaction's feature vector, score and decision,
computed through the training join rather than read from the online store.

A replay against the service (``X-Fraud-Record: false``) reads the online store as it is
now, and a read far behind a busy key's present can be inexact (``features.inexact``,
docs/features.md). This job computes the vectors the way training does, with training's
own functions (``batch_jobs/train.py``): the raw transactions (``load_transactions``),
Feast's point-in-time join of the batch snapshots as of when each was available online
(``_available_join``, honouring ``batch_available_after_s``), the declared aggregations
over the raw history and the label and decision arrivals (``declared_sql``), the request
and derived features (``feature_columns``), assembled in the model's own order
(``features.assemble``). The model runs in ONNX Runtime on CPU (its ``model.onnx``, as
evaluation scores it), and the decision is the service's policy by score: at or above
the decline threshold ``decline``, at or above the review threshold ``review``, else
``approve``; an amount over the review limit makes an ``approve`` a ``review``.

Not replayed: the declared reason codes (they never change the decision), the
challenger's canary routing (the chosen version decides every row), the tensor variant a
service on CUDA serves, and outages (rules-only decisions, refusals).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from batch_jobs import declared_sql
from batch_jobs.evaluate import served_scores
from batch_jobs.feature_plan import history_days
from batch_jobs.train import _available_join, _midnight, feature_columns, load_transactions
from feature_repo.definitions import apply_definitions
from fraud_scoring import features as F
from fraud_scoring.commands import UsageError
from fraud_scoring.feast_store import open_store
from fraud_scoring.model_repo import (
    ModelError,
    ModelMetadata,
    ModelNotFound,
    load_metadata,
    resolve,
    versions,
)
from fraud_scoring.storage import partition_days, partition_file

log = logging.getLogger(__name__)

DECISIONS = ("approve", "review", "decline")
# The output's own columns; a model feature may not take one of these names.
KEY_COLUMNS = ("transaction_id", "event_time")
RESULT_COLUMNS = ("score", "decision")
# The parquet file's key-value metadata entry: what was replayed, with what.
METADATA_KEY = b"fraud_scoring.replay"


@dataclass(frozen=True)
class ReplayPolicy:
    """The service's decision by score (``service/core/decision.py``'s ``Policy``
    without its reasons): the model's thresholds or the service's overrides
    (``FRAUD_REVIEW_THRESHOLD``, ``FRAUD_DECLINE_THRESHOLD``) and its amount rule
    (``FRAUD_REVIEW_AMOUNT_LIMIT``)."""

    review_threshold: float
    decline_threshold: float
    review_amount_limit: float

    @classmethod
    def for_model(
        cls,
        meta: ModelMetadata,
        review_amount_limit: float,
        review_threshold: float | None = None,
        decline_threshold: float | None = None,
    ) -> ReplayPolicy:
        th = meta.thresholds_for("default")
        return cls(
            review_threshold=th.review if review_threshold is None else review_threshold,
            decline_threshold=th.decline if decline_threshold is None else decline_threshold,
            review_amount_limit=review_amount_limit,
        )

    def decide(self, score: np.ndarray, amount: np.ndarray) -> np.ndarray:
        """The decision of each row (object array of ``DECISIONS``). ``amount`` is the
        feature column the model saw (float32, as the service compares it)."""
        s = np.asarray(score, np.float64)
        kind = np.where(s >= self.review_threshold, 1, 0)
        kind = np.where(s >= self.decline_threshold, 2, kind)
        over = np.asarray(amount, np.float64) > self.review_amount_limit
        kind = np.where(over & (kind == 0), 1, kind)
        return np.asarray(DECISIONS, dtype=object)[kind]


@dataclass(frozen=True)
class ReplayResult:
    day: date
    path: Path
    rows: int
    model_name: str
    model_version: str
    decisions: dict[str, int]
    seconds: float

    def text(self) -> str:
        mix = ", ".join(f"{d} {self.decisions.get(d, 0):,}" for d in DECISIONS)
        return (
            f"replay {self.day}: {self.rows:,} transactions, model {self.model_name} "
            f"v{self.model_version}: {mix}; {self.path} in {self.seconds:.1f}s"
        )


def require_day(raw: Path, day: date) -> None:
    """Refuse (UsageError: exit 2) a day without a raw transactions partition, naming it
    and the days on file."""
    if partition_file(raw, "transactions", day).exists():
        return
    days = partition_days(raw, "transactions")
    held = f"the raw history holds {days[0]}..{days[-1]}" if days else "there is no raw history"
    raise UsageError(
        f"--day {day}: no raw transactions partition "
        f"{partition_file(raw, 'transactions', day)} ({held})"
    )


def replay_model(repo: Path, name: str, version: str) -> tuple[Path, ModelMetadata]:
    """The version's directory and metadata. ``latest`` is the highest complete version
    (what a service with the default ``FRAUD_MODEL_VERSION`` serves); an unknown pinned
    version is refused (UsageError: exit 2) naming it and the versions on file."""
    try:
        path = resolve(repo, name, version)
    except ModelNotFound as exc:
        if version == "latest":
            raise
        found = ", ".join(map(str, versions(repo, name))) or "none"
        raise UsageError(
            f"--model-version {version}: no model {name} version {version} under "
            f"{repo / name} (versions: {found})"
        ) from exc
    return path, load_metadata(path)


def default_out(data_dir: Path, meta: ModelMetadata, day: date) -> Path:
    """``<data dir>/replay/<model>/v<version>/day=YYYY-MM-DD.parquet``."""
    return data_dir / "replay" / meta.name / f"v{meta.version}" / f"day={day.isoformat()}.parquet"


@dataclass(frozen=True)
class DayVectors:
    """The day's transactions in (event time, id) order and the model's input matrix."""

    transaction_id: np.ndarray
    event_time: pd.Series
    x: np.ndarray  # float32, in the order of the model's feature names
    columns: dict[str, np.ndarray]  # every feature column (``feature_columns``)


def day_vectors(
    data_dir: Path,
    redis_url: str,
    day: date,
    names: list[str],
    *,
    batch_available_after_s: float = 0.0,
    labels_as_of: datetime | None = None,
    feature_store_yaml: Path | None = None,
    step: tqdm | None = None,
) -> DayVectors:
    """Every transaction of UTC ``day`` through training's join, its vector in the order
    of ``names``. ``labels_as_of`` bounds the label and decision arrivals read (as
    training's ``labels_as_of``; default now): the declared states count only those the
    store had at each transaction's time. ``redis_url`` is Feast's configuration: its
    registry is applied as training applies it; no feature is read from the online store."""
    raw = data_dir / "raw"
    require_day(raw, day)
    as_of = labels_as_of or datetime.now(UTC)

    def done(what: str) -> None:
        if step is not None:
            step.set_postfix_str(what)
            step.update()

    decl = F.declarations()
    # As training loads it: every window of every declared state is full.
    history = load_transactions(raw, day - history_days(list(decl.specs)), day, as_of)
    labels = declared_sql.labels_for(decl.specs, raw, batch_available_after_s, arrived_before=as_of)
    t = history["event_time"]
    start = pd.Timestamp(_midnight(day))
    rows = history[(t >= start) & (t < start + pd.Timedelta(days=1))]
    if rows.empty:
        raise UsageError(
            f"--day {day}: {partition_file(raw, 'transactions', day)} holds no transactions"
        )
    sample = rows.rename(columns={"event_time": "event_timestamp"}).reset_index(drop=True)
    done(f"{len(sample):,} transactions read")
    store = open_store(data_dir, redis_url, feature_store_yaml)
    apply_definitions(store, data_dir)
    joined = _available_join(sample, batch_available_after_s, store, None)
    joined = joined.sort_values(["event_timestamp", "transaction_id"]).reset_index(drop=True)
    done("point-in-time join")
    cols = feature_columns(joined, history, None, labels)
    unknown = [n for n in names if n not in cols]
    if unknown:
        raise ModelError(f"the model needs features the training join does not build: {unknown}")
    done("features")
    return DayVectors(
        transaction_id=joined["transaction_id"].to_numpy(object),
        event_time=pd.to_datetime(joined["event_timestamp"], utc=True),
        x=F.assemble(names, cols),
        columns=cols,
    )


def replay_day(
    data_dir: Path,
    redis_url: str,
    model_repo: Path,
    model_name: str,
    day: date,
    *,
    version: str = "latest",
    review_amount_limit: float = 5000.0,
    review_threshold: float | None = None,
    decline_threshold: float | None = None,
    batch_available_after_s: float = 0.0,
    feature_store_yaml: Path | None = None,
    out: Path | None = None,
) -> ReplayResult:
    """Replay UTC ``day`` with model ``version`` and write the parquet file (default
    :func:`default_out`): ``transaction_id``, ``event_time``, one float32 column per
    model feature in the model's order, ``score`` (float64 of the model's float32) and
    ``decision``; the file's metadata (key ``fraud_scoring.replay``) records the model,
    the policy and the labels' cut-off. Raises UsageError for a day without data or an
    unknown model version, before any work."""
    t0 = time.perf_counter()
    raw = data_dir / "raw"
    require_day(raw, day)
    path, meta = replay_model(model_repo, model_name, version)
    names = meta.feature_names
    clash = [n for n in names if n in KEY_COLUMNS + RESULT_COLUMNS]
    if clash:
        raise ModelError(f"model {meta.name} v{meta.version}: feature names {clash} clash")
    policy = ReplayPolicy.for_model(meta, review_amount_limit, review_threshold, decline_threshold)
    labels_as_of = datetime.now(UTC)
    with tqdm(total=5, desc=f"replay {day}", unit="step", disable=None) as step:
        vec = day_vectors(
            data_dir,
            redis_url,
            day,
            names,
            batch_available_after_s=batch_available_after_s,
            labels_as_of=labels_as_of,
            feature_store_yaml=feature_store_yaml,
            step=step,
        )
        score = served_scores(path / "model.onnx", vec.x, meta.input_name, meta.output_name)
        decision = policy.decide(score, vec.columns["amount"])
        step.set_postfix_str("scored")
        step.update()
        dest = out or default_out(data_dir, meta, day)
        _write(
            dest,
            vec,
            names,
            score,
            decision,
            meta,
            policy,
            day,
            labels_as_of,
            batch_available_after_s,
        )
        step.set_postfix_str("written")
        step.update()
    counts = Counter(decision.tolist())
    return ReplayResult(
        day=day,
        path=dest,
        rows=len(score),
        model_name=meta.name,
        model_version=meta.version,
        decisions={d: counts.get(d, 0) for d in DECISIONS},
        seconds=time.perf_counter() - t0,
    )


def _write(
    dest: Path,
    vec: DayVectors,
    names: list[str],
    score: np.ndarray,
    decision: np.ndarray,
    meta: ModelMetadata,
    policy: ReplayPolicy,
    day: date,
    labels_as_of: datetime,
    batch_available_after_s: float,
) -> None:
    """The replay's parquet file, written beside ``dest`` and renamed into place."""
    arrays: dict[str, pa.Array] = {
        "transaction_id": pa.array(vec.transaction_id, pa.string()),
        "event_time": pa.array(vec.event_time, pa.timestamp("us", tz="UTC")),
    }
    for i, n in enumerate(names):
        arrays[n] = pa.array(vec.x[:, i], pa.float32())
    arrays["score"] = pa.array(np.asarray(score, np.float64), pa.float64())
    arrays["decision"] = pa.array(decision, pa.string())
    info = {
        "day": day.isoformat(),
        "model_name": meta.name,
        "model_version": meta.version,
        "review_threshold": policy.review_threshold,
        "decline_threshold": policy.decline_threshold,
        "review_amount_limit": policy.review_amount_limit,
        "batch_available_after_s": batch_available_after_s,
        "labels_as_of": labels_as_of.isoformat(),
        "written_at": datetime.now(UTC).isoformat(),
    }
    table = pa.table(arrays).replace_schema_metadata({METADATA_KEY: json.dumps(info).encode()})
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
