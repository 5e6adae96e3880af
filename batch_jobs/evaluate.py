"""Model quality measured on what is served: the exported ONNX model run by ONNX Runtime.

Everything here starts from the served scores of a holdout (``Holdout``, stored with
each model version as ``holdout.parquet``): ranking metrics, calibration (expected
calibration error, Brier score, a reliability table with 95 % intervals, the
observed/predicted ratio per probability band), thresholds chosen in money
(``choose_thresholds``, on an earlier slice than the one they are measured on) and the
evaluation report's data (``report_data``; its files, PNG + JSON + Markdown, and
``evaluate_version``, which re-runs it for any stored version:
``batch_jobs.evaluation_report``).

Holdout negatives are down-sampled; every number here weights each row by ``weight``
(the number of holdout transactions it stands for).
"""

from __future__ import annotations

import io
import itertools
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pandas as pd
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from fraud_scoring.model_repo import (
    DecisionCosts,
    ModelError,
    ModelMetadata,
    ReliabilityBin,
    Thresholds,
)

log = logging.getLogger(__name__)

HOLDOUT_FILE = "holdout.parquet"
REPORT_DIR = "evaluation"
# Reliability bins: finer near 0, where almost every transaction's probability lies.
RELIABILITY_EDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)
# Calibration bands, where review and decline decisions are made: [0.001, 0.003) ...
# [0.1, 1]. A band is judged once it holds BAND_MIN_FRAUDS frauds: its observed fraud
# rate over its mean probability should lie within BAND_RATIO.
BAND_EDGES = (0.001, 0.003, 0.01, 0.03, 0.1, 1.0)
BAND_MIN_FRAUDS = 30
BAND_RATIO = (0.7, 1.4)
# The two-sided 95 % normal quantile: the reliability diagram's Wilson intervals.
Z95 = 1.959963984540054
# A UTC day with rows in fewer of its hours than this is partial (cut short, or a gap).
FULL_DAY_HOURS = 24
_META_COLUMNS = ("transaction_id", "event_time", "amount", "fraud_pattern", "label", "weight")


@dataclass(frozen=True)
class Holdout:
    """The held-out rows exactly as the model saw them.

    ``x`` is float32 in the order of ``names``; ``label`` is the label as of the
    training job's ``labels_as_of``; ``fraud_pattern`` is the simulator's ground truth
    (None for legitimate rows, or where the raw history has no such column).
    """

    names: list[str]
    x: np.ndarray
    label: np.ndarray
    weight: np.ndarray
    amount: np.ndarray
    event_time: pd.Series
    fraud_pattern: np.ndarray
    transaction_id: np.ndarray

    def to_parquet(self) -> bytes:
        frame = pd.DataFrame(
            {
                "transaction_id": self.transaction_id,
                "event_time": self.event_time.to_numpy(),
                "amount": self.amount,
                "fraud_pattern": self.fraud_pattern,
                "label": self.label,
                "weight": self.weight,
            }
        )
        feats = pd.DataFrame(self.x, columns=[f"f:{n}" for n in self.names])
        buf = io.BytesIO()
        pd.concat([frame, feats], axis=1).to_parquet(buf, index=False)
        return buf.getvalue()

    @classmethod
    def read(cls, path: Path) -> Holdout:
        try:
            frame = pd.read_parquet(path)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path}: cannot read the stored holdout: {exc}") from exc
        missing = [c for c in _META_COLUMNS if c not in frame.columns]
        if missing:
            raise ModelError(f"{path}: stored holdout lacks columns {missing}")
        feats = [c for c in frame.columns if c.startswith("f:")]
        return cls(
            names=[c[2:] for c in feats],
            x=frame[feats].to_numpy(np.float32),
            label=frame["label"].to_numpy(np.int8),
            weight=frame["weight"].to_numpy(np.float64),
            amount=frame["amount"].to_numpy(np.float64),
            event_time=pd.to_datetime(frame["event_time"], utc=True),
            fraud_pattern=frame["fraud_pattern"].to_numpy(object),
            transaction_id=frame["transaction_id"].to_numpy(object),
        )


def served_scores(
    onnx_model: bytes | Path,
    x: np.ndarray,
    input_name: str = "input",
    output: str = "probabilities",
) -> np.ndarray:
    """Column 1 of the model's ``output`` for float32 rows ``x``, from ONNX Runtime on CPU:
    the numbers the service produces (it reads the same column)."""
    src = str(onnx_model) if isinstance(onnx_model, Path) else onnx_model
    try:
        sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for bad files
        raise ModelError(f"ONNX Runtime cannot load the model: {exc}") from exc
    out = sess.run([output], {input_name: np.ascontiguousarray(x, np.float32)})[0]
    return np.asarray(out, np.float64)[:, 1]


def _bin_index(p: np.ndarray) -> np.ndarray:
    """The reliability bin of each probability (``RELIABILITY_EDGES``; 1.0 in the last)."""
    edges = np.asarray(RELIABILITY_EDGES)
    return np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)


def reliability(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> list[ReliabilityBin]:
    """Weighted reliability table over ``RELIABILITY_EDGES`` (empty bins left out)."""
    edges = np.asarray(RELIABILITY_EDGES)
    idx = _bin_index(p)
    out = []
    for b in range(len(edges) - 1):
        m = idx == b
        rows = float(w[m].sum())
        if rows > 0:
            out.append(
                ReliabilityBin(
                    lo=float(edges[b]),
                    hi=float(edges[b + 1]),
                    rows=rows,
                    mean_probability=float((p[m] * w[m]).sum() / rows),
                    fraud_rate=float((y[m] * w[m]).sum() / rows),
                )
            )
    return out


def wilson_interval(rate: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a proportion ``rate`` observed on
    ``n`` rows; ``n`` may be an effective, non-integer count. (0, 1) when ``n`` is 0."""
    if n <= 0:
        return 0.0, 1.0
    z2n = z * z / n
    centre = (rate + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * float(np.sqrt(rate * (1 - rate) / n + z2n / (4 * n)))
    # It always holds ``rate``; min/max only absorb rounding at the edges.
    return max(0.0, min(centre - half, rate)), min(1.0, max(centre + half, rate))


def effective_rows(y: np.ndarray, w: np.ndarray) -> float:
    """The number of unweighted rows whose fraud rate would be as uncertain as the
    weighted rate of ``y`` under weights ``w`` (each row standing for ``w`` sampled
    transactions): ``r(1 - r) (sum w)^2 / sum w^2 (y - r)^2``, the weighted rate's
    linearised variance. It is the row count with unit weights; with frauds kept and
    negatives sampled it follows the fraud count where the rate is small. A bin of one
    class (no variance to measure) counts ``sum w``: frauds are never sampled."""
    total = float(w.sum())
    if total <= 0:
        return 0.0
    rate = float((y * w).sum()) / total
    spread = float((w**2 * (y - rate) ** 2).sum())
    if not 0 < rate < 1 or spread <= 0:
        return total
    return rate * (1 - rate) * total**2 / spread


def reliability_table(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> list[dict[str, float]]:
    """``reliability``'s bins as dicts with, per bin, ``sampled_rows`` (holdout rows
    before weights), ``frauds`` (weighted), ``effective_rows`` and the 95 % Wilson
    interval of the fraud rate on them (``fraud_rate_low``, ``fraud_rate_high``)."""
    idx = _bin_index(p)
    out = []
    for b in reliability(y, p, w):
        m = idx == RELIABILITY_EDGES.index(b.lo)
        n_eff = effective_rows(y[m], w[m])
        low, high = wilson_interval(b.fraud_rate, n_eff)
        out.append(
            {
                **b.model_dump(),
                "sampled_rows": int(m.sum()),
                "frauds": float((y[m] * w[m]).sum()),
                "effective_rows": n_eff,
                "fraud_rate_low": low,
                "fraud_rate_high": high,
            }
        )
    return out


def calibration_bands(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> list[dict[str, Any]]:
    """Observed against predicted per band of ``BAND_EDGES`` (the last includes 1.0;
    probabilities below the first edge are in no band): ``rows`` (weighted),
    ``sampled_rows``, ``frauds``, ``mean_probability``, ``fraud_rate``, ``ratio`` (fraud
    rate / mean probability) with its 95 % interval (``ratio_low``, ``ratio_high``: the
    Wilson interval of the rate on the band's effective rows over the mean probability),
    ``judged`` (at least ``BAND_MIN_FRAUDS`` frauds) and ``within`` (the ratio inside
    ``BAND_RATIO``; None when not judged). Every band is listed; an empty one has 0 rows
    and None ratios."""
    out = []
    for lo, hi in itertools.pairwise(BAND_EDGES):
        m = (p >= lo) & ((p < hi) | (hi >= 1.0))
        rows, frauds = float(w[m].sum()), float((y[m] * w[m]).sum())
        mean_p = float((p[m] * w[m]).sum() / rows) if rows > 0 else 0.0
        rate = frauds / rows if rows > 0 else 0.0
        low, high = wilson_interval(rate, effective_rows(y[m], w[m]))
        ratio = rate / mean_p if mean_p > 0 else None
        judged = frauds >= BAND_MIN_FRAUDS and ratio is not None
        within = None if ratio is None or not judged else BAND_RATIO[0] <= ratio <= BAND_RATIO[1]
        out.append(
            {
                "lo": lo,
                "hi": hi,
                "rows": rows,
                "sampled_rows": int(m.sum()),
                "frauds": frauds,
                "mean_probability": mean_p,
                "fraud_rate": rate,
                "ratio": ratio,
                "ratio_low": low / mean_p if mean_p > 0 else None,
                "ratio_high": high / mean_p if mean_p > 0 else None,
                "judged": judged,
                "within": within,
            }
        )
    return out


def expected_calibration_error(bins: list[ReliabilityBin]) -> float:
    """Row-weighted mean of |mean probability - fraud rate| over the reliability bins."""
    total = sum(b.rows for b in bins)
    return sum(b.rows * abs(b.mean_probability - b.fraud_rate) for b in bins) / max(total, 1e-12)


def quality(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """Ranking and calibration metrics of probabilities ``p`` for labels ``y``."""
    return {
        "pr_auc": float(average_precision_score(y, p, sample_weight=w)),
        "roc_auc": float(roc_auc_score(y, p, sample_weight=w)),
        "brier": float(np.average((p - y) ** 2, weights=w)),
        "ece": expected_calibration_error(reliability(y, p, w)),
        "rows": float(w.sum()),
        "frauds": float(y.sum()),
        "fraud_rate": float((y * w).sum() / w.sum()),
    }


def _action_costs(
    y: np.ndarray, amount: np.ndarray, costs: DecisionCosts
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row cost of approving, reviewing and declining (before weights)."""
    approve = y * amount * costs.fraud_loss_share
    review = np.full(len(y), costs.review_cost)
    decline = (1 - y) * (costs.false_decline_cost + costs.false_decline_amount_share * amount)
    return approve, review, decline


def choose_thresholds(
    y: np.ndarray, p: np.ndarray, w: np.ndarray, amount: np.ndarray, costs: DecisionCosts
) -> Thresholds:
    """The review and decline thresholds (``p >= threshold``) that minimise the weighted
    holdout cost under ``costs``, with at most ``costs.max_review_rate`` of transactions
    in review.

    Cuts fall only between distinct probabilities (``p >= t`` takes a whole group of equal
    ones). When declining nothing is cheapest the decline threshold is 1.0, and likewise
    for review (then review = decline).
    """
    order = np.argsort(-p, kind="stable")
    s, yo, wo, ao = p[order], y[order], w[order], amount[order]
    appr, rev, dec = (c * wo for c in _action_costs(yo, ao, costs))
    # cut k = "the top k rows"; candidates: 0 and the end of each group of equal scores.
    ends = np.flatnonzero(np.r_[s[1:] != s[:-1], True]) + 1
    cum_w = np.cumsum(wo)
    share = cum_w[ends - 1] / cum_w[-1]
    # Flagging more than a few per cent never pays at fraud rates; bound the search.
    ends = ends[share <= max(0.2, 2 * costs.max_review_rate)]
    if len(ends) > 1000:
        ends = ends[np.linspace(0, len(ends) - 1, 1000).astype(int)]
    k = np.r_[0, ends]

    def upto(v: np.ndarray) -> np.ndarray:
        return np.r_[0.0, np.cumsum(v)][k]

    a_cum, r_cum, d_cum, w_cum = upto(appr), upto(rev), upto(dec), upto(wo)
    # total[i, j]: decline the top k[i], review rows k[i]..k[j], approve the rest.
    total = d_cum[:, None] + (r_cum[None, :] - r_cum[:, None]) + (appr.sum() - a_cum[None, :])
    review_rate = (w_cum[None, :] - w_cum[:, None]) / cum_w[-1]
    ok = (np.arange(len(k))[None, :] >= np.arange(len(k))[:, None]) & (
        review_rate <= costs.max_review_rate + 1e-12
    )
    total = np.where(ok, total, np.inf)
    i, j = np.unravel_index(int(np.argmin(total)), total.shape)
    decline = _cut(s, k[i]) if k[i] > 0 else 1.0
    review = _cut(s, k[j]) if k[j] > k[i] else decline
    return Thresholds(review=min(review, decline), decline=decline)


def _cut(s: np.ndarray, k: int) -> float:
    """The threshold that takes the top ``k`` of the descending scores ``s``: halfway, in
    log-odds, between the last taken and the first left (the same rows in sample, and not
    glued to one slice's score: a threshold equal to a saturated 1.0 would let a later
    0.99998 through); the last taken score when nothing is left."""
    if k >= len(s):
        return float(s[k - 1])
    lo, hi = np.clip(np.array([s[k], s[k - 1]], dtype=np.float64), 1e-9, 1 - 1e-9)
    mid = (np.log(lo / (1 - lo)) + np.log(hi / (1 - hi))) / 2
    t = float(1 / (1 + np.exp(-mid)))
    return t if s[k] < t <= s[k - 1] else float(s[k - 1])  # neighbours too close to split


def decision_metrics(
    y: np.ndarray,
    p: np.ndarray,
    w: np.ndarray,
    amount: np.ndarray,
    th: Thresholds,
    costs: DecisionCosts,
) -> dict[str, float]:
    """What thresholds ``th`` do on the holdout: precision and recall of flagged (review
    or decline) and of declined transactions, review and decline rates, and the cost per
    transaction next to approving everything."""
    dec = p >= th.decline
    flag = p >= th.review
    rev = flag & ~dec
    fw, total = (y * w).sum(), w.sum()
    appr, rcost, dcost = _action_costs(y, amount, costs)
    cost = np.where(dec, dcost, np.where(rev, rcost, appr))

    def precision(m: np.ndarray) -> float:
        return float((y[m] * w[m]).sum() / w[m].sum()) if m.any() else 0.0

    return {
        "flagged_precision": precision(flag),
        "flagged_recall": float((y[flag] * w[flag]).sum() / max(fw, 1e-12)),
        "decline_precision": precision(dec),
        "decline_recall": float((y[dec] * w[dec]).sum() / max(fw, 1e-12)),
        "review_rate": float(w[rev].sum() / total),
        "decline_rate": float(w[dec].sum() / total),
        "cost_per_txn": float((cost * w).sum() / total),
        "cost_per_txn_approve_all": float((appr * w).sum() / total),
    }


def served_metrics(
    h: Holdout, p: np.ndarray, th: Thresholds, costs: DecisionCosts
) -> dict[str, float]:
    """``quality`` and ``decision_metrics`` of served probabilities ``p`` on ``h``."""
    return {
        **quality(h.label, p, h.weight),
        **decision_metrics(h.label, p, h.weight, h.amount, th, costs),
    }


def _decisions(p: np.ndarray, th: Thresholds) -> np.ndarray:
    return np.where(p >= th.decline, "decline", np.where(p >= th.review, "review", "approve"))


def report_data(
    meta: ModelMetadata, h: Holdout, p: np.ndarray, labels_as_of: datetime | None
) -> dict[str, Any]:
    """The figures of the evaluation report as plain data (also written as JSON)."""
    th, costs = meta.thresholds, meta.costs or DecisionCosts()
    y, w = h.label, h.weight
    prec, rec, _ = precision_recall_curve(y, p, sample_weight=w)
    keep = np.unique(np.linspace(0, len(prec) - 1, min(len(prec), 300)).astype(int))
    decision = _decisions(p, th)
    patterns = {}
    pattern = np.where(pd.isna(h.fraud_pattern), "unknown", h.fraud_pattern.astype(str))
    for name in sorted(set(pattern[y == 1])):
        m = (y == 1) & (pattern == name)
        patterns[name] = {
            "frauds": int(m.sum()),
            "recall_flagged": float((decision[m] != "approve").mean()),
            "recall_declined": float((decision[m] == "decline").mean()),
        }
    # New cards (no usable batch snapshot): the model can only tell them from regular
    # ones by what the card has not got, so their recall is reported on its own.
    segments = {}
    if "card_has_snapshot" in h.names:
        no_snapshot = h.x[:, h.names.index("card_has_snapshot")] == 0
        for name, seg in (("new card (no snapshot)", no_snapshot), ("known card", ~no_snapshot)):
            m = (y == 1) & seg
            segments[name] = {
                "frauds": int(m.sum()),
                "recall_flagged": float((decision[m] != "approve").mean()) if m.any() else 0.0,
                "recall_declined": float((decision[m] == "decline").mean()) if m.any() else 0.0,
            }
    days = h.event_time.dt.strftime("%Y-%m-%d").to_numpy()
    hours = hours_with_rows(h.event_time)
    per_day = []
    for day in sorted(set(days)):
        m = days == day
        row: dict[str, Any] = {"day": day}
        for d in ("approve", "review", "decline"):
            row[d] = float(w[m & (decision == d)].sum())
        row["frauds"] = int(y[m].sum())
        row["frauds_flagged"] = int((y[m] & (decision[m] != "approve")).sum())
        row["frauds_missed"] = row["frauds"] - row["frauds_flagged"]
        row["hours"] = hours[day]
        row["partial"] = hours[day] < FULL_DAY_HOURS
        per_day.append(row)
    metrics = served_metrics(h, p, th, costs)
    return {
        "model": meta.name,
        "version": meta.version,
        "labels_as_of": (labels_as_of or meta.labels_as_of or datetime.now(UTC)).isoformat(),
        "holdout_window": [t.isoformat() for t in meta.holdout_window],
        "thresholds": th.model_dump(),
        "costs": costs.model_dump(),
        "metrics": metrics,
        "reliability": reliability_table(y, p, w),
        "calibration_bands": calibration_bands(y, p, w),
        "calibration": meta.calibration["default"].model_dump(mode="json")
        if "default" in meta.calibration
        else None,
        "threshold_choice": threshold_choice(meta, h, p, metrics),
        "pr_curve": {"precision": prec[keep].tolist(), "recall": rec[keep].tolist()},
        "operating_points": operating_points(th.model_dump(), metrics),
        "score_histogram": score_histogram(y, p, w),
        "pattern_recall": patterns,
        "segment_recall": segments,
        "decisions_per_day": per_day,
        "training_config": meta.training_config,
        "label_coverage": meta.label_coverage.model_dump(mode="json")
        if meta.label_coverage
        else None,
        "overridden_gates": meta.overridden_gates,
    }


_DECISION_KEYS = (
    "flagged_precision",
    "flagged_recall",
    "decline_precision",
    "decline_recall",
    "review_rate",
    "decline_rate",
    "cost_per_txn",
    "cost_per_txn_approve_all",
)


def threshold_choice(
    meta: ModelMetadata, h: Holdout, p: np.ndarray, metrics: dict[str, float]
) -> dict[str, Any]:
    """Where the thresholds were chosen and what they do there and after.

    ``in_sample``: their figures on ``chosen_slice``, the slice they were chosen on
    (``chosen_on``: the validation days; the metadata's ``validation_*``, as labelled
    at training); ``out_of_sample``: on this holdout, which the choice never saw
    (``metrics``'s decision figures); ``hindsight``: the thresholds this holdout would
    itself choose and their figures on it (in-sample, for reference). A version without
    ``thresholds_chosen_on`` chose its thresholds on the holdout: its holdout figures
    are in-sample and there is no ``out_of_sample``."""
    costs = meta.costs or DecisionCosts()
    best = choose_thresholds(h.label, p, h.weight, h.amount, costs)
    on_holdout = {k: metrics[k] for k in _DECISION_KEYS}
    chosen = meta.thresholds_chosen_on
    before = {k: meta.metrics.get(f"validation_{k}") for k in _DECISION_KEYS}
    return {
        "chosen_slice": "validation" if chosen else "holdout",
        "chosen_on": [t.isoformat() for t in chosen] if chosen else None,
        "in_sample": (before if None not in before.values() else None) if chosen else on_holdout,
        "out_of_sample": on_holdout if chosen else None,
        "hindsight": {
            "thresholds": best.model_dump(),
            **decision_metrics(h.label, p, h.weight, h.amount, best, costs),
        },
    }


def operating_points(th: dict[str, float], m: dict[str, float]) -> list[dict[str, Any]]:
    """The precision-recall curve's points at thresholds ``th``, from ``decision_metrics``
    figures ``m``: ``flagged`` (p >= review: review or decline) and ``declined``, each with
    its ``threshold``, ``precision``, ``recall`` and ``share`` (of transactions at or above
    it; at 0 nothing is flagged and the point is not on the curve)."""
    return [
        {
            "name": "flagged",
            "threshold": th["review"],
            "precision": m["flagged_precision"],
            "recall": m["flagged_recall"],
            "share": m["review_rate"] + m["decline_rate"],
        },
        {
            "name": "declined",
            "threshold": th["decline"],
            "precision": m["decline_precision"],
            "recall": m["decline_recall"],
            "share": m["decline_rate"],
        },
    ]


def hours_with_rows(event_time: pd.Series) -> dict[str, int]:
    """Per UTC day (``YYYY-MM-DD``) of ``event_time``, how many of its 24 hours hold at
    least one row. A day below ``FULL_DAY_HOURS`` is partial: its data starts late, ends
    early (a holdout's last day cut short) or has a gap of a whole hour."""
    frame = pd.DataFrame(
        {
            "day": event_time.dt.strftime("%Y-%m-%d").to_numpy(),
            "hour": event_time.dt.hour.to_numpy(),
        }
    )
    return {str(d): int(n) for d, n in frame.groupby("day")["hour"].nunique().items()}


def score_histogram(y: np.ndarray, p: np.ndarray, w: np.ndarray) -> dict[str, list[float]]:
    """Share of each class's (weighted) rows per bin of log10(probability)."""
    log_p = np.log10(np.clip(p, 1e-9, 1.0))
    edges = np.linspace(-9, 0, 37)
    return {
        "log10_edges": edges.tolist(),
        "fraud_share": _hist_share(log_p[y == 1], w[y == 1], edges),
        "legit_share": _hist_share(log_p[y == 0], w[y == 0], edges),
    }


def _hist_share(v: np.ndarray, w: np.ndarray, edges: np.ndarray) -> list[float]:
    counts, _ = np.histogram(v, bins=edges, weights=w)
    return (counts / max(float(counts.sum()), 1e-12)).tolist()
