"""Training job: point-in-time training set through Feast, LightGBM, calibrated ONNX.

The training set joins each transaction with the batch snapshots that existed at its
own event time (Feast ``get_historical_features``: snapshot ``event_timestamp <= t``
and within the view's TTL), then computes request features with the same function the
scoring service uses. Labels are those that have arrived by ``labels_as_of``, one per
transaction by ``batch_jobs.labels``' precedence (analyst > chargeback > any other
source, the newest within a source; a transaction without one is taken as legitimate).

Days are split by time, never shuffled: warm-up (skipped: no batch history yet) |
training | validation | holdout. The calibration is fitted on a pool of the
validation slice and cross-fitted blocks of training days (``calibration_pool``; the fit:
``batch_jobs.calibration``, the graphs: ``batch_jobs.onnx_export``); the
thresholds are chosen on the validation slice; the holdout is only measured on, so its
figures are out of sample. The holdout ends ``label_delay_days`` before
``labels_as_of``, so its labels are mostly in. The exported ONNX model outputs the
calibrated probability; every number in the metadata comes from running that export in
ONNX Runtime on the validation slice and the holdout (``batch_jobs.evaluate``).
Labels that look incomplete (``label_coverage``) or a model that fails a publishing
gate are not published (``PublishRefused``) unless ``force`` is set, which the
metadata records with every value of the ``TrainConfig``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import duckdb
import lightgbm as lgb
import numpy as np
import onnx
import pandas as pd
import yaml
from feast import FeatureStore
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from tqdm import tqdm

from batch_jobs import declared_sql
from batch_jobs.calibration import CalibrationPool, fit_calibration
from batch_jobs.daily_features import snapshot_time
from batch_jobs.evaluate import (
    HOLDOUT_FILE,
    REPORT_DIR,
    Holdout,
    choose_thresholds,
    decision_metrics,
    quality,
    reliability,
    report_data,
    served_metrics,
    served_scores,
)
from batch_jobs.evaluation_report import report_files
from batch_jobs.feature_plan import history_days
from batch_jobs.labels import known_frauds, newest_label_time
from batch_jobs.onnx_export import (
    lightgbm_margin_onnx,
    onnx_margins,
    tensor_margin_onnx,
    with_calibration,
)
from batch_jobs.progress import phase
from batch_jobs.training_set import point_in_time_join
from feature_repo.definitions import apply_definitions
from fraud_scoring import features as F
from fraud_scoring import session
from fraud_scoring.drift import REFERENCE_FILE, build_reference
from fraud_scoring.feast_store import open_store
from fraud_scoring.model_repo import (
    Calibration,
    DecisionCosts,
    FeatureSpec,
    LabelAgeDay,
    LabelCoverage,
    ModelError,
    ModelMetadata,
    ModelNotFound,
    PublishRefused,
    load_metadata,
    next_version,
    publish,
    resolve,
)
from fraud_scoring.storage import DataError, partition_days, partition_dir

log = logging.getLogger(__name__)


class LightGBMParams(BaseModel):
    """LightGBM's settings (``lightgbm.LGBMClassifier`` keyword arguments). The defaults
    fit the demo world; on other data a few of them (``num_leaves``, ``learning_rate``,
    ``n_estimators``, ``min_child_samples``) matter most."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_estimators: int = Field(default=300, ge=1)
    learning_rate: float = Field(default=0.05, gt=0)
    num_leaves: int = Field(default=31, ge=2)
    max_depth: int = -1  # -1: no limit
    min_child_samples: int = Field(default=20, ge=1)
    subsample: float = Field(default=0.8, gt=0, le=1)
    subsample_freq: int = Field(default=1, ge=0)
    colsample_bytree: float = Field(default=0.8, gt=0, le=1)
    reg_alpha: float = Field(default=0.0, ge=0)
    reg_lambda: float = Field(default=0.0, ge=0)
    # No class re-weighting (scale_pos_weight) by default: it only shifts and stretches
    # the margin, which the calibration then has to undo; ranking is no better with it.
    scale_pos_weight: float = Field(default=1.0, gt=0)
    # None: one thread per CPU this process may run on (its affinity, e.g. under taskset
    # or a container's cpuset). More OpenMP threads than CPUs spin against each other: two
    # threads pinned to one core made a 1 s fit take minutes.
    n_jobs: int | None = Field(default=None, ge=1)


class TrainConfig(BaseModel):
    """Knobs of one training run; the defaults fit the demo world (3,000 cards, 21 days).

    Read from a YAML file by :func:`load_train_config` (``fraud-scoring train --config``);
    every value is recorded in the model metadata (``training_config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    holdout_days: int = Field(default=3, ge=1)  # about 140 frauds on the demo world
    valid_days: int = Field(default=2, ge=1)  # between training and holdout: calibration
    warmup_days: int = Field(default=7, ge=0)  # first days have no batch history: skip
    # Chargebacks arrive up to 20 days late (the simulator's range): the holdout ends
    # this long before labels_as_of, and later days are left out.
    label_delay_days: int = Field(default=20, ge=0)
    labels_as_of: AwareDatetime | None = None  # None: now (what a scheduled run wants)
    max_train_negatives: int = Field(default=60_000, ge=1)
    # Per slice (validation, holdout); weighted back.
    max_holdout_negatives: int = Field(default=60_000, ge=1)
    seed: int = 7
    model_name: str = "fraud"
    features: tuple[str, ...] | None = None  # None: F.default_model_features()
    costs: DecisionCosts = Field(default_factory=DecisionCosts)
    lightgbm: LightGBMParams = Field(default_factory=LightGBMParams)
    # Calibration (docs/model-quality.md#the-score-is-a-probability) is fitted on a
    # pool: the validation slice, scored by the model, and blocks of valid_days
    # training days back from it, each scored by a model fitted without it (on the other
    # training days and the validation slice: as many days as the served model's). Two
    # validation days hold too few frauds, and too few of the rarer patterns, to
    # calibrate between 0.001 and 0.1. At most this many blocks, the most recent (None:
    # every training day); each costs one more fit per variant, so the default keeps
    # training's cost bounded whatever the history's length; 0: the validation slice.
    calibration_blocks: int | None = Field(default=8, ge=0)
    # "auto": the piecewise-linear logit once the pool holds min_piecewise_positives
    # frauds, else Platt (the reason is recorded).
    calibration_method: Literal["auto", "platt", "piecewise"] = "auto"
    min_piecewise_positives: int = Field(default=100, ge=1)
    # Publishing gates. Each of training, validation and holdout needs this many frauds
    # (never overridable: there is nothing to fit or measure without them).
    min_positives: int = Field(default=10, ge=1)
    warn_holdout_positives: int = 100
    min_holdout_pr_auc: float = Field(default=0.3, ge=0, le=1)
    min_holdout_roc_auc: float = Field(default=0.8, ge=0, le=1)
    # Largest drop of holdout PR-AUC or ROC-AUC allowed against the latest version.
    max_regression: float = Field(default=0.05, ge=0)
    # Label coverage: the validation's and the holdout's labelled fraud rate must reach
    # this fraction of the training slice's, and the holdout's that of the latest
    # version's holdout (``label_coverage``).
    min_label_coverage: float = Field(default=0.25, ge=0, le=1)
    force: bool = False  # publish despite failed metric or label gates (recorded)
    # When a day's snapshot reaches the online store after its cutoff (midnight UTC):
    # the nightly batch's schedule plus its run time. Training joins each transaction to
    # the snapshot serving has at its time (0: the moment the day ends, as when the
    # batch ran before serving started: the demo, the tests).
    batch_available_after_s: float = Field(default=0.0, ge=0)


def load_train_config(path: Path | None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config file's values (YAML, the fields of :class:`TrainConfig`), then
    ``overrides`` (e.g. command-line flags; ``lightgbm`` merged key by key). Raises
    ValueError naming the file and each bad field."""
    raw: Any = {}
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the training config ({exc})") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of training settings")
    values = {**raw}
    for k, v in (overrides or {}).items():
        if k == "lightgbm" and isinstance(values.get(k), dict):
            values[k] = {**values[k], **v}
        else:
            values[k] = v
    try:
        return TrainConfig.model_validate(values)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{path or 'training config'}: {errs}") from None


@dataclass(frozen=True)
class Split:
    """The time split, whole UTC days: training ``first..valid_start-1``, validation
    ``valid_start..holdout_start-1``, holdout ``holdout_start..holdout_last``."""

    first: date
    valid_start: date
    holdout_start: date
    holdout_last: date

    def at(self, d: date) -> pd.Timestamp:
        return pd.Timestamp(_midnight(d))


def _midnight(d: date) -> datetime:
    """The start of UTC day ``d``."""
    return datetime.combine(d, datetime.min.time(), UTC)


def plan_split(
    days: list[date], cfg: TrainConfig, labels_as_of: datetime, where: Path | None = None
) -> Split:
    """Split the raw days (the partitions under ``where``, named in errors); days whose
    labels are not in yet (within ``label_delay_days`` of ``labels_as_of``) are left
    out. Raises DataError when too few days remain."""
    labelled_until = (labels_as_of - timedelta(days=cfg.label_delay_days)).date()
    usable = [d for d in days if d < labelled_until]
    need = cfg.warmup_days + 1 + cfg.valid_days + cfg.holdout_days
    if len(usable) < need:
        raise DataError(
            f"need at least {need} days of raw history before {labelled_until} "
            f"(labels as of {labels_as_of:%Y-%m-%d} minus a {cfg.label_delay_days}-day "
            f"label delay), found {len(usable)}"
            + (f" under {where} ({len(days)} day partitions in all)" if where else "")
        )
    last = usable[-1]
    if last < days[-1]:
        log.info("days after %s left out: their labels are not in yet", last)
    holdout_start = last - timedelta(days=cfg.holdout_days - 1)
    valid_start = holdout_start - timedelta(days=cfg.valid_days)
    first = usable[cfg.warmup_days]
    if first >= valid_start:
        raise DataError(f"no training days left between {first} and {valid_start}")
    return Split(first, valid_start, holdout_start, last)


def load_transactions(
    raw: Path, first: date, last: date, labels_as_of: datetime | None = None
) -> pd.DataFrame:
    """Raw transactions of ``first..last`` (the contract's columns and the declared
    fields) with ``label`` = 1 for every transaction whose
    standing label among those that had arrived before ``labels_as_of`` (default: now)
    is fraud (``batch_jobs.labels.known_frauds``: analyst > chargeback > other), and
    ``fraud_pattern`` when the raw history has it (the simulator's ground truth; else
    None)."""
    days = [d for d in partition_days(raw, "transactions") if first <= d <= last]
    if not days:
        raise DataError(f"no raw transactions under {raw / 'transactions'} in {first}..{last}")
    files = [str(partition_dir(raw, "transactions", d) / "part-0.parquet") for d in days]
    # A team's declared fields (the declarations' and updater's columns; a day written
    # before one was declared lacks it: null there).
    own = [n for n, _ in F.declarations().fields]
    reader = "read_parquet($f, union_by_name = true)" if own else "read_parquet($f)"
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        src = con.sql(f"SELECT * FROM {reader} LIMIT 0", params={"f": files})
        pattern = "fraud_pattern" if "fraud_pattern" in src.columns else "NULL AS fraud_pattern"
        mcc = "mcc" if "mcc" in src.columns else "NULL AS mcc"
        fields = "".join(f', "{c}"' if c in src.columns else f', NULL AS "{c}"' for c in own)
        txns = con.sql(
            "SELECT transaction_id, card_id, merchant_id, amount, event_time, utc_offset_min,"
            f" country, channel, device_id, {mcc}, {pattern}{fields} FROM {reader}"
            " ORDER BY event_time",
            params={"f": files},
        ).df()
    except duckdb.Error as exc:
        raise DataError(f"reading raw history: {exc}") from exc
    finally:
        con.close()
    known = known_frauds(raw, labels_as_of or datetime.now(UTC))
    txns["label"] = txns["transaction_id"].isin(known).astype(np.int8)
    return txns


# How the declared aggregations are computed for training: (declarations, rows, history)
# -> columns (declared_sql.training_columns; declared_spark.spark_training_columns bound
# to a session computes the same).
# Called with the keyword ``labels`` too (declared_sql.load_label_events; None without
# label states).
DeclaredColumns = Callable[..., dict[str, np.ndarray]]


def feature_columns(
    joined: pd.DataFrame,
    history: pd.DataFrame | None = None,
    declared: DeclaredColumns | None = None,
    labels: pd.DataFrame | None = None,
) -> dict[str, np.ndarray]:
    """Every feature column for a joined frame, assembled by the function the scoring
    service uses (:func:`fraud_scoring.features.build_features`); this only adapts the
    frame into its inputs.

    The declared aggregations (the card's velocity among them) are computed as of each
    row's own event time by their DuckDB compilation (``batch_jobs/declared_sql.py``),
    counting events from ``history``: pass the full raw history (negatives in ``joined``
    are sampled, so ``joined`` alone would undercount). Default: ``joined`` itself.
    ``labels`` (``declared_sql.load_label_events``) feed the label states.
    """
    batch = F.apply_defaults({f.name: joined[f.name].to_numpy(object) for f in F.batch_features()})
    request = F.RequestColumns(
        amount=joined["amount"].to_numpy(np.float64),
        event_us=session.epoch_us(joined),  # exact µs whatever the datetime resolution
        utc_offset_s=joined["utc_offset_min"].to_numpy(np.float64) * 60,
        country=joined["country"].to_numpy(object),
        channel=joined["channel"].to_numpy(object),
        has_device=joined["device_id"].notna().to_numpy(),
        fields={
            n: pd.to_numeric(joined[n], errors="coerce").to_numpy(np.float64)
            if n in joined
            else np.full(len(joined), np.nan)
            for n in F.declarations().field_reads
        },
    )
    src = (
        history if history is not None else joined.rename(columns={"event_timestamp": "event_time"})
    )
    aggs = (declared or declared_sql.training_columns)(F.declarations(), joined, src, labels=labels)
    return F.build_features(batch, request, aggs)


_SLICES = ("training", "validation", "holdout")


def _available_join(
    sample: pd.DataFrame,
    after_s: float,
    store: FeatureStore,
    pit_join: Callable[[pd.DataFrame], pd.DataFrame] | None,
) -> pd.DataFrame:
    """The point-in-time join as of when each snapshot is *available* online: a
    snapshot (event time = its cutoff) is used from cutoff + ``after_s``, so the join
    looks up ``t - after_s`` (a 00:30 transaction, with the batch at 01:30, gets the
    day before's snapshot, as serving does). Rows keep their own event time."""
    asked = sample
    if after_s > 0:
        shift = timedelta(seconds=after_s)
        asked = sample.assign(event_timestamp=sample["event_timestamp"] - shift)
    joined = pit_join(asked) if pit_join else point_in_time_join(store, asked)
    if after_s > 0:
        own = sample.set_index("transaction_id")["event_timestamp"]
        joined["event_timestamp"] = joined["transaction_id"].map(own).to_numpy()
    return joined


@dataclass(frozen=True)
class TrainingSet:
    """The sampled rows of one run, time-ordered, as the model sees them: ``x`` float32
    in the order of ``names``; ``part`` 0/1/2 for training/validation/holdout;
    ``weight`` how many transactions each row stands for; ``meta`` the rows' transaction
    id, event time, amount and fraud pattern."""

    split: Split
    labels_as_of: datetime
    coverage: LabelCoverage
    names: list[str]
    x: np.ndarray
    label: np.ndarray
    weight: np.ndarray
    part: np.ndarray
    meta: pd.DataFrame

    def rows(self, mask: np.ndarray) -> Holdout:
        """The rows under ``mask`` as a :class:`Holdout` (what evaluation reads)."""
        m = self.meta[mask]
        return Holdout(
            names=self.names,
            x=self.x[mask],
            label=self.label[mask].astype(np.int8),
            weight=self.weight[mask],
            amount=m["amount"].to_numpy(np.float64),
            event_time=pd.to_datetime(m["event_timestamp"], utc=True).reset_index(drop=True),
            fraud_pattern=m["fraud_pattern"].to_numpy(object),
            transaction_id=m["transaction_id"].to_numpy(object),
        )


def training_set(
    data_dir: Path,
    redis_url: str,
    cfg: TrainConfig,
    latest: tuple[str, float] | None = None,
    feature_store_yaml: Path | None = None,
    pit_join: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
    declared_columns: DeclaredColumns | None = None,
) -> TrainingSet:
    """Split the raw history by time, check the labels, sample and build every feature
    through the point-in-time join (``train``'s first half; ``latest`` is the latest
    version's holdout fraud rate, see ``label_coverage``).

    Raises PublishRefused when a slice holds fewer than ``cfg.min_positives`` frauds,
    or, unless ``cfg.force``, when the labels look incomplete (checked before the join).
    """
    raw = data_dir / "raw"
    labels_as_of = cfg.labels_as_of or datetime.now(UTC)
    split = plan_split(partition_days(raw, "transactions"), cfg, labels_as_of, raw / "transactions")
    # As much history before the first training day as the declared windows (behind
    # their delays) read, as the online backfill records: every window is full.
    decl = F.declarations()
    with _phase("load raw history"):
        history = load_transactions(
            raw, split.first - history_days(list(decl.specs)), split.holdout_last, labels_as_of
        )
        labels = declared_sql.labels_for(
            decl.specs, raw, cfg.batch_available_after_s, arrived_before=labels_as_of
        )
    txns = history[history["event_time"] >= split.at(split.first)].reset_index(drop=True)
    t = txns["event_time"]
    part = np.select(
        [t < split.at(split.valid_start), t < split.at(split.holdout_start)], [0, 1], 2
    )
    coverage = label_coverage(txns, part, labels_as_of, cfg, latest)
    if coverage.incomplete and not cfg.force:
        raise PublishRefused(
            "model not published: labels look incomplete: "
            + "; ".join(coverage.incomplete)
            + " (force overrides this)"
        )
    _check_positives(txns["label"].to_numpy(), part, split, cfg, raw, labels_as_of)
    sample = _sample(txns.assign(part=part), cfg).rename(columns={"event_time": "event_timestamp"})

    with _phase("Feast registry"):
        store = open_store(data_dir, redis_url, feature_store_yaml)
        apply_definitions(store, data_dir)
    with _phase(f"point-in-time join of {len(sample):,} transactions"):
        joined = _available_join(sample, cfg.batch_available_after_s, store, pit_join)
    joined = joined.sort_values(["event_timestamp", "transaction_id"]).reset_index(drop=True)
    with _phase("request, session and spanning features"):
        cols = feature_columns(joined, history, declared_columns, labels)
    names = list(cfg.features) if cfg.features else F.default_model_features()
    return TrainingSet(
        split=split,
        labels_as_of=labels_as_of,
        coverage=coverage,
        names=names,
        x=F.assemble(names, cols),
        label=joined["label"].to_numpy(),
        weight=joined["weight"].to_numpy(),
        part=joined["part"].to_numpy(),
        meta=joined[["transaction_id", "event_timestamp", "amount", "fraud_pattern"]],
    )


def train(
    data_dir: Path,
    redis_url: str,
    model_repo: Path,
    cfg: TrainConfig,
    feature_store_yaml: Path | None = None,
    pit_join: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
    declared_columns: DeclaredColumns | None = None,
) -> ModelMetadata:
    """Train, calibrate, evaluate and publish a model version; returns its metadata.

    ``pit_join`` replaces Feast's point-in-time join of the batch features (e.g.
    ``spark_engine.point_in_time_join_spark`` bound to a session and the features
    folder); it must keep ``training_set.point_in_time_join``'s contract.
    ``declared_columns`` replaces the DuckDB compilation of the declared aggregations
    (e.g. ``declared_spark.spark_training_columns`` bound to a session).

    Raises PublishRefused (nothing published) when a slice holds fewer than
    ``cfg.min_positives`` frauds, or, unless ``cfg.force``, when the labels look
    incomplete (``label_coverage``, checked before fitting) or the served model's
    holdout metrics fail a gate (``publishing_gates``); DataError when the raw history
    is too short or unreadable.
    """
    ts = training_set(
        data_dir,
        redis_url,
        cfg,
        latest_fraud_rate(model_repo, cfg.model_name),
        feature_store_yaml,
        pit_join,
        declared_columns,
    )
    split, coverage, labels_as_of = ts.split, ts.coverage, ts.labels_as_of
    names, X, y, w = ts.names, ts.x, ts.label, ts.weight
    tr, va, ho = (ts.part == k for k in range(3))
    hold = ts.rows(ho)

    with _phase(f"LightGBM on {int(tr.sum()):,} rows") as bar:
        model = fit_lightgbm(cfg, X[tr], y[tr], bar)
    # The tensor-op variant: every node runs on a GPU (tree ensembles run only on CPU).
    with _phase("tensor-op MLP"):
        mlp = train_tensor_model(X[tr], y[tr], cfg.seed)
    graphs = {
        "default": lightgbm_margin_onnx(model, len(names)),
        "tensor": tensor_margin_onnx(mlp, len(names)),
    }
    pools = {v: calibration_pool(ts, cfg, v, g) for v, g in graphs.items()}
    files: dict[str, bytes] = {}
    calibration: dict[str, Calibration] = {}
    scores: dict[str, np.ndarray] = {}  # on the holdout
    val_scores: dict[str, np.ndarray] = {}  # on the validation slice
    with _phase("calibration, and the served models' scores"):
        for variant, fname in (("default", "model.onnx"), ("tensor", TENSOR_FILE)):
            calibration[variant] = cal = fit_calibration(pools[variant], cfg)
            files[fname] = with_calibration(graphs[variant], cal)
            scores[variant] = served_scores(files[fname], hold.x)
            val_scores[variant] = served_scores(files[fname], X[va])
    # Thresholds are chosen on the validation slice and measured on the holdout, which
    # the choice never saw (the figures serving can expect); their figures on the
    # validation slice are kept beside them (in-sample).
    val = ts.rows(va)
    thresholds = {
        v: choose_thresholds(val.label, p, val.weight, val.amount, cfg.costs)
        for v, p in val_scores.items()
    }
    metrics: dict[str, float] = {
        "train_rows": float(tr.sum()),
        "train_positives": float(y[tr].sum()),
    }
    for variant, prefix in (("default", ""), ("tensor", "tensor_")):
        m = served_metrics(hold, scores[variant], thresholds[variant], cfg.costs)
        metrics.update({f"{prefix}holdout_{k}": v for k, v in m.items()})
        m = decision_metrics(
            val.label, val_scores[variant], val.weight, val.amount, thresholds[variant], cfg.costs
        )
        metrics.update({f"{prefix}validation_{k}": v for k, v in m.items()})

    with _phase("publishing gates (the latest version on this holdout)"):
        champion = champion_metrics(model_repo, cfg, hold, split)
    failed = coverage.incomplete + publishing_gates(metrics, champion, cfg)
    if failed and not cfg.force:
        raise PublishRefused(
            "model not published: " + "; ".join(failed) + " (force overrides these gates)"
        )
    if failed:
        log.warning("publishing despite failed gates (forced): %s", "; ".join(failed))
    meta = ModelMetadata(
        name=cfg.model_name,
        version=next_version(model_repo, cfg.model_name),
        created_at=datetime.now(UTC),
        framework=f"lightgbm {lgb.__version__}",
        features=[FeatureSpec(name=n, dtype="float32") for n in names],
        training_window=(split.at(split.first), split.at(split.valid_start)),
        labels_as_of=labels_as_of,
        holdout_window=(split.at(split.holdout_start), snapshot_time(split.holdout_last)),
        thresholds=thresholds["default"],
        metrics=metrics,
        feature_importance=importance(model, names),
        variants={"tensor": TENSOR_FILE},
        variant_thresholds={"tensor": thresholds["tensor"]},
        calibration=calibration,
        costs=cfg.costs,
        reliability={v: reliability(hold.label, p, hold.weight) for v, p in scores.items()},
        forced=cfg.force,
        overridden_gates=failed,
        training_config=cfg.model_dump(mode="json"),
        label_coverage=coverage,
        thresholds_chosen_on=(split.at(split.valid_start), split.at(split.holdout_start)),
    )
    with _phase("drift reference, evaluation report, publish"):
        files[HOLDOUT_FILE] = hold.to_parquet()
        files[REFERENCE_FILE] = reference_json(X[va | ho], w[va | ho], names, files, split)
        report = report_files(report_data(meta, hold, scores["default"], labels_as_of))
        files.update({f"{REPORT_DIR}/{k}": v for k, v in report.items()})
        meta = publish(model_repo, cfg.model_name, files, meta)
    log.info("published %s", model_repo / cfg.model_name / meta.version)
    return meta


def reference_json(
    x: np.ndarray, w: np.ndarray, names: list[str], files: dict[str, bytes], split: Split
) -> bytes:
    """The version's reference distribution (``fraud_scoring.drift``): the validation and
    holdout rows, the latest before serving starts and weighted back to every transaction
    (training's negatives are sampled without weights), and each variant's served score
    on them."""
    variants = {"default": "model.onnx", "tensor": TENSOR_FILE}
    ref = build_reference(
        names,
        x,
        w,
        {v: served_scores(files[f], x) for v, f in variants.items()},
        source="validation+holdout, weighted back to every transaction",
        window=(split.at(split.valid_start), snapshot_time(split.holdout_last)),
    )
    return ref.model_dump_json(indent=1).encode()


def latest_fraud_rate(model_repo: Path, name: str) -> tuple[str, float] | None:
    """The latest published version and its holdout's labelled fraud rate (None: no
    version, or one that did not record it)."""
    try:
        latest = load_metadata(resolve(model_repo, name))
    except ModelNotFound:
        return None
    rate = latest.metrics.get("holdout_fraud_rate")
    return None if rate is None else (latest.version, rate)


def label_coverage(
    txns: pd.DataFrame,
    part: np.ndarray,
    labels_as_of: datetime,
    cfg: TrainConfig,
    latest: tuple[str, float] | None = None,
) -> LabelCoverage:
    """The labelled fraud rate per day (``txns``: every transaction, ``label`` as of
    ``labels_as_of``; ``part``: 0/1/2 for training/validation/holdout) beside what the
    label delay implies, and the checks that fail (``incomplete``).

    Every day used is at least ``label_delay_days`` old, so its labels should be in and
    its rate about the training slice's: the validation's or the holdout's rate surely
    below ``min_label_coverage`` times it (beyond Poisson noise, :func:`_surely_below`)
    fails, as does a holdout rate below that fraction of
    the ``latest`` version's holdout rate (``(version, rate)``). Each failure names the
    days furthest below, with their observed and expected rates."""
    frac = cfg.min_label_coverage
    label = txns["label"].to_numpy()
    day = txns["event_time"].dt.date.to_numpy()
    days: list[LabelAgeDay] = []
    for d in sorted(set(day)):
        m = day == d
        end = datetime.combine(d + timedelta(days=1), datetime.min.time(), UTC)
        n, k = int(m.sum()), int(label[m].sum())
        days.append(
            LabelAgeDay(
                day=d,
                part=_SLICES[int(part[m][0])],
                age_days=(labels_as_of - end).days,
                rows=n,
                frauds=k,
                fraud_rate=k / n,
            )
        )
    rate = {
        name: float(label[part == k].mean()) if (part == k).any() else 0.0
        for k, name in enumerate(_SLICES)
    }
    expected = rate["training"]
    failed = []

    def short(name: str, want: float, against: str) -> None:
        mine = [r for r in days if r.part == name]
        low = sorted((r for r in mine if r.fraud_rate < frac * want), key=lambda r: r.fraud_rate)
        ages = f"{min(r.age_days for r in mine)}-{max(r.age_days for r in mine)}"
        failed.append(
            f"the {name} {mine[0].day}..{mine[-1].day} (labels {ages} days old) has a "
            f"labelled fraud rate of {rate[name]:.4f}, below {frac:g} x the expected "
            f"{want:.4f} ({against})"
            + (
                "; days below: "
                + ", ".join(f"{r.day} {r.fraud_rate:.4f} ({r.age_days} days old)" for r in low)
                if low
                else ""
            )
        )

    implied = f"the training slice's; a {cfg.label_delay_days}-day label delay implies all in"
    for name in ("validation", "holdout"):
        if _surely_below(label[part == _SLICES.index(name)], frac * expected):
            short(name, expected, implied)
    if latest is not None and _surely_below(label[part == 2], frac * latest[1]):
        short("holdout", latest[1], f"the latest version {latest[0]}'s holdout")
    return LabelCoverage(
        expected_rate=expected,
        min_fraction=frac,
        label_delay_days=cfg.label_delay_days,
        latest_version=latest[0] if latest else None,
        latest_version_rate=latest[1] if latest else None,
        days=days,
        incomplete=failed,
    )


def _surely_below(label: np.ndarray, rate: float) -> bool:
    """Whether a slice's fraud rate is below ``rate`` beyond chance: even the one-sided
    95 % upper bound of its Poisson count is (a few frauds a day swing widely; only a
    shortfall no noise explains refuses a model)."""
    from scipy.stats import chi2

    n, k = len(label), int(label.sum())
    return n > 0 and float(chi2.ppf(0.95, 2 * (k + 1))) / 2 / n < rate


def _check_positives(
    label: np.ndarray,
    part: np.ndarray,
    split: Split,
    cfg: TrainConfig,
    raw: Path,
    labels_as_of: datetime,
) -> None:
    """PublishRefused when a slice has too few frauds to fit or measure anything; the
    message says when the newest label under ``raw`` arrived (a stopped feed shows)."""
    bounds = (split.first, split.valid_start, split.holdout_start, split.holdout_last)
    short = []
    for k, name in enumerate(_SLICES):
        n = int(label[part == k].sum())
        last = bounds[k + 1] - timedelta(days=1) if k < 2 else bounds[3]
        if n < cfg.min_positives:
            short.append(f"the {name} window {bounds[k]}..{last} holds {n} known frauds")
        elif k == 2 and n < cfg.warn_holdout_positives:
            log.warning(
                "the holdout holds only %d known frauds (fewer than %d): its metrics and "
                "thresholds are noisy; consider more holdout_days",
                n,
                cfg.warn_holdout_positives,
            )
    if short:
        newest = newest_label_time(raw, labels_as_of)
        arrived = (
            f"the newest label arrived {newest:%Y-%m-%d %H:%M} UTC (label_time), "
            f"{(labels_as_of - newest).total_seconds() / 86_400:.1f} days before labels as of "
            f"{labels_as_of:%Y-%m-%d %H:%M}"
            if newest is not None
            else f"no label arrived before {labels_as_of:%Y-%m-%d %H:%M} (labels as of)"
        )
        raise PublishRefused(
            f"model not published: {'; '.join(short)} (at least {cfg.min_positives} "
            f"needed in each; {arrived}: are the labels in?)"
        )


def _sample(txns: pd.DataFrame, cfg: TrainConfig) -> pd.DataFrame:
    """Every fraud plus at most the configured number of negatives per slice, with
    ``weight``: how many transactions each row stands for. The model is fitted on the
    training rows without weights (their negatives are not weighted back: the
    calibration absorbs the shift); the calibration pool and every metric use them."""
    rng = np.random.default_rng(cfg.seed)
    label, part = txns["label"].to_numpy(), txns["part"].to_numpy()
    weight = np.ones(len(txns))
    keep = [np.flatnonzero(label == 1)]
    for k, cap in enumerate((cfg.max_train_negatives, *(2 * [cfg.max_holdout_negatives]))):
        neg = np.flatnonzero((part == k) & (label == 0))
        if len(neg) > cap:
            weight[neg] = len(neg) / cap
            neg = rng.choice(neg, cap, replace=False)
        keep.append(neg)
    return txns.assign(weight=weight).iloc[np.sort(np.concatenate(keep))]


def champion_metrics(
    model_repo: Path, cfg: TrainConfig, hold: Holdout, split: Split
) -> dict[str, float] | None:
    """The latest published version's holdout PR-AUC and ROC-AUC (None: no version).

    Measured on this run's holdout when possible (the latest's features can be built
    and its training ended before this holdout starts), else its recorded metrics."""
    try:
        path = resolve(model_repo, cfg.model_name)
    except ModelNotFound:
        return None
    latest = load_metadata(path)
    if set(latest.feature_names) <= set(hold.names) and latest.training_window[1] <= split.at(
        split.holdout_start
    ):
        idx = [hold.names.index(n) for n in latest.feature_names]
        try:
            p = served_scores(path / "model.onnx", hold.x[:, idx], latest.input_name)
        except ModelError as exc:
            log.warning("latest version %s not scored on this holdout: %s", latest.version, exc)
        else:
            q = quality(hold.label, p, hold.weight)
            return {"version": float(latest.version), **q}
    return {
        "version": float(latest.version),
        "pr_auc": latest.metrics.get("holdout_pr_auc", 0.0),
        "roc_auc": latest.metrics.get("holdout_roc_auc", 0.0),
    }


def publishing_gates(
    metrics: dict[str, float], champion: dict[str, float] | None, cfg: TrainConfig
) -> list[str]:
    """The metric gates a new model fails (empty: publishable): holdout PR-AUC and
    ROC-AUC floors, and no drop of more than ``cfg.max_regression`` against
    ``champion`` (the latest version, see ``champion_metrics``)."""
    failed = []
    for key, floor in (("pr_auc", cfg.min_holdout_pr_auc), ("roc_auc", cfg.min_holdout_roc_auc)):
        value = metrics[f"holdout_{key}"]
        if value < floor:
            failed.append(f"holdout {key} {value:.4f} is below the floor {floor:g}")
        if champion is not None and value < champion[key] - cfg.max_regression:
            failed.append(
                f"holdout {key} {value:.4f} is more than {cfg.max_regression:g} below the "
                f"latest version {champion['version']:.0f} ({champion[key]:.4f})"
            )
    return failed


def _phase(what: str) -> AbstractContextManager[tqdm]:
    """One step's start and duration in the log, and on a terminal a live line
    (:func:`batch_jobs.progress.phase`): training runs for minutes at scale."""
    return phase(what, log)


def importance(model: lgb.LGBMClassifier, names: list[str]) -> dict[str, float]:
    gain = model.booster_.feature_importance(importance_type="gain")
    total = float(gain.sum()) or 1.0
    return {n: round(float(g) / total, 6) for n, g in zip(names, gain, strict=True)}


TENSOR_FILE = "model_tensor.onnx"


def train_tensor_model(x: np.ndarray, y: np.ndarray, seed: int) -> Pipeline:
    """A small MLP on standardized inputs: Sub/Div/MatMul/Add/Relu only (+ Sigmoid)."""
    mlp = Pipeline(
        [
            ("scale", StandardScaler()),
            (
                "mlp",
                MLPClassifier(
                    hidden_layer_sizes=(64, 32), max_iter=60, early_stopping=True, random_state=seed
                ),
            ),
        ]
    )
    mlp.fit(x, y)
    return mlp


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def fit_lightgbm(
    cfg: TrainConfig, x: np.ndarray, y: np.ndarray, bar: tqdm | None = None
) -> lgb.LGBMClassifier:
    """The boosted trees on rows ``x, y``; each round is shown on ``bar`` (a phase's
    live line) when given."""
    params = cfg.lightgbm.model_dump()
    params["n_jobs"] = params["n_jobs"] or usable_cpus()
    model = lgb.LGBMClassifier(**params, random_state=cfg.seed, verbose=-1)
    if bar is None:
        return model.fit(x, y)

    def shown(env: Any) -> None:
        bar.set_postfix_str(f"round {env.iteration + 1}/{env.end_iteration}")

    return model.fit(x, y, callbacks=[shown])


def margin_graph(
    variant: str, cfg: TrainConfig, x: np.ndarray, y: np.ndarray, bar: tqdm | None = None
) -> onnx.ModelProto:
    """Fit ``variant`` (``default``: LightGBM, ``tensor``: the MLP) on rows ``x, y``;
    its ONNX graph up to the ``margin`` (before calibration); LightGBM's rounds on
    ``bar``."""
    if variant == "default":
        return lightgbm_margin_onnx(fit_lightgbm(cfg, x, y, bar), x.shape[1])
    return tensor_margin_onnx(train_tensor_model(x, y, cfg.seed), x.shape[1])


def calibration_blocks(split: Split, cfg: TrainConfig) -> list[tuple[date, date]]:
    """The training days cross-fitted for the calibration pool, as ``[start, end)``
    day ranges in time order: blocks of ``valid_days`` days back from the validation
    slice, at most ``cfg.calibration_blocks`` (None: to the first training day; the
    earliest block may be shorter)."""
    blocks: list[tuple[date, date]] = []
    end = split.valid_start
    most = cfg.calibration_blocks
    while end > split.first and (most is None or len(blocks) < most):
        start = max(split.first, end - timedelta(days=cfg.valid_days))
        blocks.append((start, end))
        end = start
    return blocks[::-1]


def calibration_pool(
    ts: TrainingSet, cfg: TrainConfig, variant: str, graph: onnx.ModelProto
) -> CalibrationPool:
    """The rows calibration is fitted on for ``variant``, whose served margin graph
    (fitted on the training slice) is ``graph``: the validation slice scored by it
    (out-of-time), then each of :func:`calibration_blocks`, scored by a model of the
    same variant fitted without that block (on the other training days and the
    validation slice: as many days as the served model, so its margins are on the same
    scale). Every score is ONNX Runtime's, on the rows' exact float32 inputs."""
    split, t = ts.split, ts.meta["event_timestamp"]
    va = ts.part == 1
    margins, labels, weights = [onnx_margins(graph, ts.x[va])], [ts.label[va]], [ts.weight[va]]
    blocks = calibration_blocks(split, cfg)
    # The validation rows a fold model trains on, sampled down to the training slice's
    # rate (each row standing for as many transactions as a training row): a fold
    # model sees the served model's class balance, so its margins share their scale.
    train_w = float(ts.weight[ts.part == 0].max(initial=1.0))
    keep = np.random.default_rng(cfg.seed).random(len(ts.weight)) < ts.weight / train_w
    for start, end in blocks:
        blk = ((t >= split.at(start)) & (t < split.at(end))).to_numpy() & (ts.part == 0)
        fold = ((ts.part == 0) & ~blk) | (va & keep)
        with _phase(f"{variant} model without {start}..{end - timedelta(days=1)}") as bar:
            g = margin_graph(variant, cfg, ts.x[fold], ts.label[fold], bar)
        margins.append(onnx_margins(g, ts.x[blk]))
        labels.append(ts.label[blk])
        weights.append(ts.weight[blk])
    last_valid = split.holdout_start - timedelta(days=1)
    source = f"the validation slice {split.valid_start}..{last_valid} scored by the model"
    if blocks:
        source += (
            f" and {len(blocks)} block(s) of training days {blocks[0][0]}.."
            f"{blocks[-1][1] - timedelta(days=1)}, each scored by a model fitted without it"
        )
    return CalibrationPool(
        margin=np.concatenate(margins),
        label=np.concatenate(labels),
        weight=np.concatenate(weights),
        first=blocks[0][0] if blocks else split.valid_start,
        end=split.holdout_start,
        source=source,
    )
