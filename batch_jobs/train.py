"""Training job: point-in-time training set through Feast, LightGBM, ONNX export.

The training set joins each transaction with the batch snapshots that existed at its
own event time (Feast ``get_historical_features``: snapshot ``event_timestamp <= t``
and within the view's TTL), then computes request features with the same function the
scoring service uses. Labels are the chargebacks that have arrived by the time the job
runs (a transaction without one is taken as legitimate). The last ``holdout_days`` are
held out by time, never shuffled in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import duckdb
import lightgbm as lgb
import numpy as np
import pandas as pd
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from batch_jobs.daily_features import snapshot_time
from batch_jobs.training_set import point_in_time_join
from feature_repo.definitions import apply_definitions
from fraud_scoring import features as F
from fraud_scoring import session
from fraud_scoring.feast_store import open_store
from fraud_scoring.model_repo import (
    FeatureSpec,
    ModelMetadata,
    Thresholds,
    next_version,
    publish,
)
from fraud_scoring.storage import DataError, partition_days, partition_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    holdout_days: int = 5
    warmup_days: int = 7  # first days have no batch history: skip them
    max_train_negatives: int = 60_000
    max_holdout_negatives: int = 60_000  # sampled, then weighted back in the metrics
    seed: int = 7
    model_name: str = "fraud"


def load_transactions(
    raw: Path, first: date, last: date, labels_as_of: datetime | None = None
) -> pd.DataFrame:
    """Raw transactions of ``first..last`` with ``label`` = 1 for every fraud chargeback
    that had arrived before ``labels_as_of`` (default: now)."""
    days = [d for d in partition_days(raw, "transactions") if first <= d <= last]
    if not days:
        raise DataError(f"no raw transactions under {raw / 'transactions'} in {first}..{last}")
    files = [str(partition_dir(raw, "transactions", d) / "part-0.parquet") for d in days]
    label_days = partition_days(raw, "labels")
    cutoff = labels_as_of or datetime.now(UTC)
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone='UTC'")
        txns = con.sql(
            "SELECT transaction_id, card_id, merchant_id, amount, event_time, utc_offset_min,"
            " country, channel, device_id FROM read_parquet($f) ORDER BY event_time",
            params={"f": files},
        ).df()
        if label_days:
            lf = [str(partition_dir(raw, "labels", d) / "part-0.parquet") for d in label_days]
            known = con.sql(
                "SELECT DISTINCT transaction_id FROM read_parquet($f)"
                " WHERE label_time < $c AND is_fraud",
                params={"f": lf, "c": cutoff},
            ).df()
        else:
            known = pd.DataFrame({"transaction_id": pd.Series([], dtype=str)})
    except duckdb.Error as exc:
        raise DataError(f"reading raw history: {exc}") from exc
    finally:
        con.close()
    txns["label"] = txns["transaction_id"].isin(set(known["transaction_id"])).astype(np.int8)
    return txns


def keep_every_row(sample: pd.DataFrame, joined: pd.DataFrame) -> pd.DataFrame:
    """Feast's point-in-time join with no row lost.

    Feast's file offline store drops an entity row outright when the entity has
    snapshots but none within ``[t - TTL, t]`` (its TTL filter keeps only rows with no
    match at all), e.g. a card's first transactions, before its first snapshot exists.
    Those are exactly the "no usable snapshot" rows the service fills with defaults, so
    they are put back here with null batch features (defaults are applied later).
    """
    if joined["transaction_id"].duplicated().any():
        raise DataError("the point-in-time join returned a transaction twice")
    lost = len(sample) - len(joined)
    if lost:
        log.info("%d transactions had no snapshot within the TTL (Feast drops them): kept", lost)
    feats = [c for c in joined.columns if c not in sample.columns]
    return sample.merge(joined[["transaction_id", *feats]], on="transaction_id", how="left")


def feature_columns(
    joined: pd.DataFrame, history: pd.DataFrame | None = None
) -> dict[str, np.ndarray]:
    """Every feature column for a joined frame, assembled by the function the scoring
    service uses (:func:`fraud_scoring.features.build_features`); this only adapts the
    frame into its inputs.

    Session features are computed as of each row's own event time by the same function
    the updater and the scorer use (``fraud_scoring.session``), counting events from
    ``history``: pass the full raw history (negatives in ``joined`` are sampled, so
    ``joined`` alone would undercount). Default: ``joined`` itself.
    """
    batch = F.apply_defaults({f.name: joined[f.name].to_numpy(object) for f in F.BATCH_FEATURES})
    request = F.RequestColumns(
        amount=joined["amount"].to_numpy(np.float64),
        event_us=session.epoch_us(joined),  # exact µs whatever the datetime resolution
        utc_offset_s=joined["utc_offset_min"].to_numpy(np.float64) * 60,
        country=joined["country"].to_numpy(object),
        channel=joined["channel"].to_numpy(object),
        has_device=joined["device_id"].notna().to_numpy(),
    )
    sess = session.offline_session_features(joined, history=history)
    return F.build_features(batch, sess, request)


def choose_thresholds(y: np.ndarray, score: np.ndarray, weight: np.ndarray) -> Thresholds:
    """Thresholds from the (weighted) holdout; a transaction is flagged when its score is
    at or above a threshold.

    decline: the lowest threshold at which holdout precision is at least 90 % and at
    most 0.1 % of legitimate transactions would be declined; review: likewise with
    precision >= 30 % and at most 1 % of legitimate ones reviewed. Cuts fall only
    between distinct scores (``score >= t`` takes a whole group of equal scores), and
    need at least 5 frauds above them. With no such cut the threshold is 1.0.
    """
    order = np.argsort(-score, kind="stable")
    s, yo, w = score[order], y[order], weight[order]
    cut = np.r_[s[1:] != s[:-1], True]  # last row of each group of equal scores
    flagged_w = np.cumsum(w)[cut]
    fraud_w = np.cumsum(w * yo)[cut]
    legit_share = np.cumsum(w * (yo == 0))[cut] / max(float(w[yo == 0].sum()), 1e-12)
    frauds = np.cumsum(yo)[cut]
    threshold = s[cut]

    def lowest(precision: float, legit_pass: float) -> float:
        ok = np.flatnonzero(
            (fraud_w >= precision * flagged_w) & (legit_share <= legit_pass) & (frauds >= 5)
        )
        return float(threshold[ok[-1]]) if len(ok) else 1.0

    decline, review = lowest(0.9, 0.001), lowest(0.3, 0.01)
    return Thresholds(review=min(review, decline), decline=decline)


def train(
    data_dir: Path,
    redis_url: str,
    model_repo: Path,
    cfg: TrainConfig,
    feature_store_yaml: Path | None = None,
) -> ModelMetadata:
    raw = data_dir / "raw"
    days = partition_days(raw, "transactions")
    if len(days) < cfg.warmup_days + cfg.holdout_days + 1:
        raise DataError(
            f"need at least {cfg.warmup_days + cfg.holdout_days + 1} days of raw "
            f"history under {raw}, found {len(days)}"
        )
    first, last = days[cfg.warmup_days], days[-1]
    holdout_start = last - timedelta(days=cfg.holdout_days - 1)
    # A day before the first training day so that 24-hour session windows are full.
    with _phase("load raw history"):
        labels_as_of = datetime.now(UTC)  # recorded in the metadata
        history = load_transactions(raw, first - timedelta(days=1), last, labels_as_of)
    txns = history[
        history["event_time"] >= pd.Timestamp(datetime.combine(first, datetime.min.time(), UTC))
    ].reset_index(drop=True)
    hold_ts = pd.Timestamp(datetime.combine(holdout_start, datetime.min.time(), UTC))
    is_hold = txns["event_time"] >= hold_ts
    rng = np.random.default_rng(cfg.seed)
    neg = np.flatnonzero(~is_hold & (txns["label"] == 0))
    if len(neg) > cfg.max_train_negatives:
        neg = rng.choice(neg, cfg.max_train_negatives, replace=False)
    hneg = np.flatnonzero(is_hold & (txns["label"] == 0))
    hold_neg_weight = len(hneg) / max(min(len(hneg), cfg.max_holdout_negatives), 1)
    if len(hneg) > cfg.max_holdout_negatives:
        hneg = rng.choice(hneg, cfg.max_holdout_negatives, replace=False)
    keep = np.sort(np.concatenate([neg, hneg, np.flatnonzero(txns["label"] == 1)]))
    sample = txns.iloc[keep].rename(columns={"event_time": "event_timestamp"})

    store = open_store(data_dir, redis_url, feature_store_yaml)
    apply_definitions(store, data_dir)
    with _phase(f"Feast point-in-time join of {len(sample):,} transactions"):
        joined = point_in_time_join(store, sample)
    joined = joined.sort_values(["event_timestamp", "transaction_id"]).reset_index(drop=True)
    with _phase("request, session and spanning features"):
        cols = feature_columns(joined, history)
    names = F.default_model_features()
    X = F.assemble(names, cols)
    y = joined["label"].to_numpy()
    hold = (pd.to_datetime(joined["event_timestamp"], utc=True) >= hold_ts).to_numpy()
    # Negatives are down-sampled for training and not weighted back: scores rank
    # correctly but are not calibrated probabilities (thresholds come from the holdout).
    hw = np.where(y[hold] == 1, 1.0, hold_neg_weight)
    model = lgb.LGBMClassifier(
        n_estimators=300,
        learning_rate=0.05,
        num_leaves=31,
        min_child_samples=20,
        subsample=0.8,
        subsample_freq=1,
        colsample_bytree=0.8,
        # Balanced classes: fraud scores spread over 0..1 instead of crowding near 0, so
        # thresholds and scores read naturally (they rank, they are not probabilities).
        scale_pos_weight=float((y[~hold] == 0).sum()) / max(float(y[~hold].sum()), 1.0),
        random_state=cfg.seed,
        n_jobs=2,
        verbose=-1,
    )
    with _phase(f"LightGBM on {int((~hold).sum()):,} rows"):
        model.fit(X[~hold], y[~hold])
    score = np.asarray(model.predict_proba(X[hold]))[:, 1]
    metrics = {
        "holdout_pr_auc": float(average_precision_score(y[hold], score, sample_weight=hw)),
        "holdout_roc_auc": float(roc_auc_score(y[hold], score, sample_weight=hw)),
        "holdout_rows": float(hw.sum()),
        "holdout_fraud_rate": float((y[hold] * hw).sum() / hw.sum()),
        "train_rows": float((~hold).sum()),
        "train_positives": float(y[~hold].sum()),
    }
    onnx_bytes = export_onnx(model, len(names))
    # The tensor-op variant: every node runs on a GPU (tree ensembles run only on CPU).
    with _phase("tensor-op MLP"):
        mlp = train_tensor_model(X[~hold], y[~hold], cfg.seed)
    tensor_score = np.asarray(mlp.predict_proba(X[hold]))[:, 1]
    metrics["tensor_holdout_pr_auc"] = float(
        average_precision_score(y[hold], tensor_score, sample_weight=hw)
    )
    metrics["tensor_holdout_roc_auc"] = float(
        roc_auc_score(y[hold], tensor_score, sample_weight=hw)
    )
    meta = ModelMetadata(
        name=cfg.model_name,
        version=next_version(model_repo, cfg.model_name),
        created_at=datetime.now(UTC),
        framework=f"lightgbm {lgb.__version__}",
        features=[FeatureSpec(name=n, dtype="float32") for n in names],
        training_window=(datetime.combine(first, datetime.min.time(), UTC), hold_ts),
        labels_as_of=labels_as_of,
        holdout_window=(hold_ts, snapshot_time(last)),
        thresholds=choose_thresholds(y[hold], score, hw),
        metrics=metrics,
        feature_importance=importance(model, names),
        variants={"tensor": TENSOR_FILE},
        variant_thresholds={"tensor": choose_thresholds(y[hold], tensor_score, hw)},
    )
    files = {"model.onnx": onnx_bytes, TENSOR_FILE: export_tensor_onnx(mlp, len(names))}
    meta = publish(model_repo, cfg.model_name, files, meta)
    log.info("published %s", model_repo / cfg.model_name / meta.version)
    return meta


@contextmanager
def _phase(what: str) -> Iterator[None]:
    """Log the start and the duration of one step: training runs for minutes at scale."""
    log.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    log.info("%s: done in %.1fs", what, time.perf_counter() - t0)


def importance(model: lgb.LGBMClassifier, names: list[str]) -> dict[str, float]:
    gain = model.booster_.feature_importance(importance_type="gain")
    total = float(gain.sum()) or 1.0
    return {n: round(float(g) / total, 6) for n, g in zip(names, gain, strict=True)}


TENSOR_FILE = "model_tensor.onnx"


def train_tensor_model(x: np.ndarray, y: np.ndarray, seed: int) -> Pipeline:
    """A small MLP on standardized inputs: Sub/Div/MatMul/Add/Relu/Sigmoid only."""
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


def export_tensor_onnx(model: Pipeline, n_features: int) -> bytes:
    """The MLP as a plain ONNX graph of standard ops (Sub, Div, MatMul, Add, Relu, Sigmoid,
    Concat) that the CUDA execution provider runs in full. skl2onnx would emit
    ai.onnx.ml Scaler/ArrayFeatureExtractor nodes, which run only on CPU."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    scaler: StandardScaler = model.named_steps["scale"]
    mlp: MLPClassifier = model.named_steps["mlp"]
    f32 = np.float32
    inits = [
        numpy_helper.from_array(np.asarray(scaler.mean_, f32), "mean"),
        numpy_helper.from_array(np.asarray(scaler.scale_, f32), "scale"),
        numpy_helper.from_array(np.ones((1, 1), f32), "one"),
    ]
    nodes = [
        helper.make_node("Sub", ["input", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "scale"], ["h0"]),
    ]
    h = "h0"
    layers = list(zip(mlp.coefs_, mlp.intercepts_, strict=True))
    for k, (w, b) in enumerate(layers):
        inits += [
            numpy_helper.from_array(np.asarray(w, f32), f"w{k}"),
            numpy_helper.from_array(np.asarray(b, f32), f"b{k}"),
        ]
        nodes += [
            helper.make_node("MatMul", [h, f"w{k}"], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"]),
        ]
        last = k == len(layers) - 1
        h = "p1" if last else f"h{k + 1}"
        nodes.append(helper.make_node("Sigmoid" if last else "Relu", [f"a{k}"], [h]))
    nodes += [
        helper.make_node("Sub", ["one", "p1"], ["p0"]),
        helper.make_node("Concat", ["p0", "p1"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "fraud_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, n_features])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 2])],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return bytes(m.SerializeToString())


def export_onnx(model: lgb.LGBMClassifier, n_features: int) -> bytes:
    """LightGBM → ONNX with one float input ``input`` [N, F] and ``probabilities`` [N, 2]."""
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    onx = convert_lightgbm(
        model,
        initial_types=[("input", FloatTensorType([None, n_features]))],
        zipmap=False,
        target_opset=15,
    )
    return bytes(onx.SerializeToString())
