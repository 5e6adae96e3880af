"""Model quality measured on what is served: the exported ONNX model run by ONNX Runtime.

Everything here starts from the served scores of a holdout (``Holdout``, stored with
each model version as ``holdout.parquet``): ranking metrics, calibration (expected
calibration error, Brier score, a reliability table with 95 % intervals, the
observed/predicted ratio per probability band), thresholds chosen in money
(``choose_thresholds``, on an earlier slice than the one they are measured on) and the
evaluation report (``report_files``, PNG + JSON + Markdown; the figures are described
in docs/model-quality.md). ``evaluate_version`` re-runs it for any stored version.

Holdout negatives are down-sampled; every number here weights each row by ``weight``
(the number of holdout transactions it stands for).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pandas as pd
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score

from batch_jobs.labels import known_frauds
from fraud_scoring.model_repo import (
    DecisionCosts,
    ModelError,
    ModelMetadata,
    ReliabilityBin,
    Thresholds,
    load_metadata,
    resolve,
)
from fraud_scoring.storage import staging_dir

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


def report_files(data: dict[str, Any]) -> dict[str, bytes]:
    """The report as files: ``evaluation.json`` (``data``), four PNG figures and
    ``report.md`` that shows them."""
    return {
        "evaluation.json": json.dumps(data, indent=2).encode(),
        **figures(data),
        "report.md": _markdown(data).encode(),
    }


def pyplot() -> Any:
    """matplotlib's pyplot drawing into files only (never a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig: Any) -> bytes:
    """``fig`` as PNG bytes (the figure is closed)."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def figures(data: dict[str, Any], rows: str = "holdout") -> dict[str, bytes]:
    """The report's PNG figures (``figure_objects``) as PNG bytes, by file name."""
    return {name: png(fig) for name, fig in figure_objects(data, rows).items()}


def figure_objects(data: dict[str, Any], rows: str = "holdout") -> dict[str, Any]:
    """The report's matplotlib figures from its data, by file name (docs/model-quality.md
    describes them): ``pr_curve`` (with ``operating_points``, else derived from
    ``thresholds`` and ``at_thresholds`` or ``metrics`` when they hold the decision
    metrics), ``reliability`` (intervals when its bins have them) with ``metrics.ece``,
    ``score_histogram`` with ``thresholds``, ``decisions_per_day`` (partial days when
    its rows say so). A figure whose key is absent is left out; ``rows`` names the rows
    in the titles."""
    plt = pyplot()
    figs: dict[str, Any] = {}
    if "pr_curve" in data:
        figs["pr_curve.png"] = _pr_figure(plt, data, rows)
    if "reliability" in data:
        figs["reliability.png"] = _reliability_figure(plt, data)
    if "score_histogram" in data:
        figs["score_histogram.png"] = _score_figure(plt, data)
    if "decisions_per_day" in data:
        figs["decisions_per_day.png"] = _per_day_figure(plt, data["decisions_per_day"], rows)
    return figs


def _operating_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    if "operating_points" in data:
        return list(data["operating_points"])
    m = data.get("at_thresholds") or data.get("metrics") or {}
    if data.get("thresholds") and "flagged_precision" in m and "review_rate" in m:
        return operating_points(data["thresholds"], m)
    return []


def _pr_figure(plt: Any, data: dict[str, Any], rows: str) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.plot(data["pr_curve"]["recall"], data["pr_curve"]["precision"], label="served model")
    for op, (marker, colour) in zip(
        _operating_points(data), (("o", "tab:orange"), ("s", "tab:red")), strict=False
    ):
        what = f"{op['name']}, p >= {op['threshold']:.3g}"
        if op["share"] <= 0:  # nothing at or above it: no point on the curve
            ax.plot([], [], ls="none", marker=marker, c=colour, label=f"{what}: nothing")
            continue
        ax.plot(
            op["recall"],
            op["precision"],
            ls="none",
            marker=marker,
            ms=8,
            c=colour,
            label=f"{what}: precision {op['precision']:.1%}, recall {op['recall']:.1%}",
        )
    ax.set(
        xlabel="recall",
        ylabel="precision",
        xlim=(0, 1.02),
        ylim=(0, 1.02),
        title=f"Precision-recall ({rows}, served)",
    )
    ax.legend(loc="lower left", fontsize="small")
    return fig


def _reliability_figure(plt: Any, data: dict[str, Any]) -> Any:
    rel = data["reliability"]
    fig, (ax, axn) = plt.subplots(
        2, 1, figsize=(5.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]}
    )
    ax.plot([0, 1], [0, 1], ls="--", c="grey", lw=1, label="perfect calibration")
    x = [b["mean_probability"] for b in rel]
    rate = [b["fraud_rate"] for b in rel]
    if rel and all("fraud_rate_low" in b for b in rel):
        err = [
            [max(r - b["fraud_rate_low"], 0) for r, b in zip(rate, rel, strict=True)],
            [max(b["fraud_rate_high"] - r, 0) for r, b in zip(rate, rel, strict=True)],
        ]
        ax.errorbar(x, rate, yerr=err, fmt="o-", capsize=3, label="observed, 95 % interval")
    else:
        ax.plot(x, rate, "o-", label="observed")
    ax.set(
        ylabel="observed fraud rate",
        title=f"Reliability (ECE {data['metrics']['ece']:.4f})",
    )
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(loc="upper left", fontsize="small")
    axn.bar(
        [b["lo"] for b in rel],
        [b["rows"] for b in rel],
        width=[b["hi"] - b["lo"] for b in rel],
        align="edge",
        color="lightgrey",
        edgecolor="k",
    )
    axn.set_xscale("symlog", linthresh=1e-3)
    axn.set(xlabel="predicted probability (mean per bin)", ylabel="transactions")
    if rel:
        axn.set_yscale("log")
    return fig


def _threshold_lines(th: dict[str, float]) -> list[tuple[str, float, str]]:
    """The score histogram's threshold lines (legend label, threshold, line style); one
    line when review and decline coincide."""
    if th["review"] == th["decline"]:
        return [(f"review = decline: p >= {th['decline']:.3g}", th["decline"], "--")]
    return [
        (f"review: p >= {th['review']:.3g}", th["review"], ":"),
        (f"decline: p >= {th['decline']:.3g}", th["decline"], "--"),
    ]


def _score_figure(plt: Any, data: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    hist = data["score_histogram"]
    e = np.asarray(hist["log10_edges"])
    for key, label in (("legit_share", "legitimate"), ("fraud_share", "fraud")):
        ax.stairs(hist[key], e, label=label)
    # Labelled in the legend, not beside the lines: close thresholds never overprint.
    for label, t, ls in _threshold_lines(data["thresholds"]):
        ax.axvline(np.log10(max(t, 1e-9)), ls=ls, c="k", label=label)
    ax.set(xlabel="log10(probability)", ylabel="share of class", title="Scores by class")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def _per_day_figure(plt: Any, per_day: list[dict[str, Any]], rows: str) -> Any:
    from matplotlib.patches import Patch

    fig, (ax, axf) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    x = np.arange(len(per_day))
    partial = [bool(r.get("partial")) for r in per_day]
    bars = []
    for d, off in (("review", -0.2), ("decline", 0.2)):
        bars.append(ax.bar(x + off, [r[d] for r in per_day], width=0.4, label=d))
    caught = [r["frauds_flagged"] for r in per_day]
    missed = [r["frauds"] - r["frauds_flagged"] for r in per_day]
    bars.append(axf.bar(x, caught, width=0.6, color="tab:green", label="caught (flagged)"))
    bars.append(
        axf.bar(x, missed, width=0.6, bottom=caught, color="tab:red", label="missed (approved)")
    )
    for group in bars:
        for patch, part in zip(group.patches, partial, strict=True):
            if part:
                patch.set_hatch("//")
                patch.set_edgecolor("k")
    ax.set(ylabel="transactions", title=f"Reviews and declines per day ({rows})")
    axf.set(ylabel="frauds", title="Fraud caught and missed per day")
    extra = []
    if any(partial):
        extra = [Patch(facecolor="white", edgecolor="k", hatch="//", label="partial day")]
    ax.legend(handles=[*bars[:2], *extra], fontsize="small")
    axf.legend(handles=[*bars[2:], *extra], fontsize="small")
    labels = [_day_label(r, "\n") for r in per_day]
    axf.set_xticks(x, labels, rotation=30, ha="right")
    return fig


def _day_label(r: dict[str, Any], sep: str = " ") -> str:
    """A per-day row's day, marked when partial (with its hours holding rows)."""
    if not r.get("partial"):
        return str(r["day"])
    return f"{r['day']}{sep}partial" + (f" ({r['hours']} h)" if "hours" in r else "")


def _markdown(d: dict[str, Any]) -> str:
    m, th, c = d["metrics"], d["thresholds"], d["costs"]
    lines = [
        f"# Model {d['model']} v{d['version']}: evaluation",
        "",
        f"Holdout {d['holdout_window'][0]} .. {d['holdout_window'][1]}, labels as of "
        f"{d['labels_as_of']}; {m['rows']:,.0f} transactions, {m['frauds']:.0f} frauds. "
        "Every number comes from the exported ONNX model run in ONNX Runtime.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| PR-AUC | {m['pr_auc']:.4f} |",
        f"| ROC-AUC | {m['roc_auc']:.4f} |",
        f"| expected calibration error | {m['ece']:.4f} |",
        f"| Brier score | {m['brier']:.5f} |",
        "",
        *_thresholds_md(d["threshold_choice"], th, c),
        "## Recall per fraud pattern and for new cards",
        "",
        "| pattern | frauds | flagged | declined |",
        "|---|---|---|---|",
        *(
            f"| {k} | {v['frauds']} | {v['recall_flagged']:.1%} | {v['recall_declined']:.1%} |"
            for k, v in (d["pattern_recall"] | d.get("segment_recall", {})).items()
        ),
        "",
        *_calibration_md(d["calibration"], d["calibration_bands"]),
        "## Reliability",
        "",
        "| probability | transactions | mean probability | fraud rate | 95 % interval |",
        "|---|---|---|---|---|",
        *(
            f"| [{b['lo']:g}, {b['hi']:g}) | {b['rows']:,.0f} | {b['mean_probability']:.4f} "
            f"| {b['fraud_rate']:.4f} | [{b['fraud_rate_low']:.4f}, {b['fraud_rate_high']:.4f}] |"
            for b in d["reliability"]
        ),
        "",
        "## Decisions per day",
        "",
        "| day | approve | review | decline | frauds | frauds flagged |",
        "|---|---|---|---|---|---|",
        *(
            f"| {_day_label(r)} | {r['approve']:,.0f} | {r['review']:,.0f} "
            f"| {r['decline']:,.0f} "
            f"| {r['frauds']} | {r['frauds_flagged']} |"
            for r in d["decisions_per_day"]
        ),
        "",
        *_label_coverage_md(d.get("label_coverage"), d.get("overridden_gates", [])),
        *_config_md(d.get("training_config", {})),
        "![precision-recall](pr_curve.png) ![reliability](reliability.png)",
        "![scores by class](score_histogram.png) ![decisions per day](decisions_per_day.png)",
        "",
    ]
    return "\n".join(lines)


def _decision_rows(cols: list[dict[str, Any]]) -> list[str]:
    """Table rows of ``decision_metrics`` figures, one column per dict."""

    def row(what: str, cell: Any) -> str:
        return f"| {what} | " + " | ".join(cell(x) for x in cols) + " |"

    return [
        row(
            "flagged (review or decline): precision / recall",
            lambda x: f"{x['flagged_precision']:.1%} / {x['flagged_recall']:.1%}",
        ),
        row(
            "declined: precision / recall",
            lambda x: f"{x['decline_precision']:.1%} / {x['decline_recall']:.1%}",
        ),
        row(
            "review rate / decline rate",
            lambda x: f"{x['review_rate']:.2%} / {x['decline_rate']:.2%}",
        ),
        row(
            "cost per transaction (approve all)",
            lambda x: f"{x['cost_per_txn']:.3f} ({x['cost_per_txn_approve_all']:.3f})",
        ),
    ]


def _thresholds_md(choice: dict[str, Any], th: dict[str, float], c: dict[str, float]) -> list[str]:
    costs = (
        f"the least cost with fraud loss {c['fraud_loss_share']:g} x amount, review "
        f"{c['review_cost']:g}, false decline {c['false_decline_cost']:g} + "
        f"{c['false_decline_amount_share']:g} x amount, review rate at most "
        f"{c['max_review_rate']:.1%}"
    )
    head = f"Thresholds (probability): review >= {th['review']:.4g}, decline >= {th['decline']:.4g}"
    best = choice["hindsight"]
    hind = (
        f"review >= {best['thresholds']['review']:.4g}, decline >= "
        f"{best['thresholds']['decline']:.4g}"
    )
    if choice["chosen_on"] is None:
        return [
            f"{head}; chosen on this holdout for {costs}: every figure below is "
            "in-sample (this version predates out-of-sample thresholds).",
            "",
            "| at the thresholds | holdout (chosen here: in-sample) |",
            "|---|---|",
            *_decision_rows([choice["in_sample"]]),
            "",
        ]
    start = choice["chosen_on"][0][:10]
    last = datetime.fromisoformat(choice["chosen_on"][1]) - timedelta(days=1)  # end excluded
    end = f"{last:%Y-%m-%d}"
    cols = [choice["out_of_sample"], best]
    names = [
        "**holdout, never seen by the choice (out-of-sample)**",
        f"holdout's own best in hindsight ({hind}; in-sample)",
    ]
    if choice["in_sample"] is not None:
        cols.insert(0, choice["in_sample"])
        names.insert(0, f"validation {start} .. {end} (chosen here: in-sample)")
    return [
        f"{head}; chosen on the validation slice {start} .. {end} (before the holdout) "
        f"for {costs}. What they do where they were chosen, on the holdout they never "
        "saw (what serving can expect), and what the holdout's own least-cost "
        "thresholds would have done on it:",
        "",
        "| at the thresholds | " + " | ".join(names) + " |",
        "|---" * (len(cols) + 1) + "|",
        *_decision_rows(cols),
        "",
    ]


def _calibration_md(cal: dict[str, Any] | None, bands: list[dict[str, Any]]) -> list[str]:
    out = ["## Calibration bands", ""]
    if cal is not None:
        how = (
            f"a logit linear between {len(cal['knots'])} knots, at the margins where "
            f"Platt's a = {cal['a']:.4g}, b = {cal['b']:.4g} gives "
            + ", ".join(f"{1 / (1 + np.exp(-(cal['a'] * k + cal['b']))):.3g}" for k in cal["knots"])
            if cal.get("knots")
            else f"a = {cal['a']:.4g}, b = {cal['b']:.4g}"
        )
        out += [
            f"Calibration: {cal['method']} ({how}) on {cal['rows']:,.0f} transactions "
            f"with {cal['positives']} frauds"
            + (f", {cal['source']}" if cal.get("source") else "")
            + (f". {cal['reason']}" if cal.get("reason") else "")
            + ".",
            "",
        ]
    lo, hi = BAND_RATIO

    def verdict(b: dict[str, Any]) -> str:
        if not b["judged"]:
            return f"not judged (fewer than {BAND_MIN_FRAUDS} frauds)"
        return "within" if b["within"] else "**outside**"

    def ratio(b: dict[str, Any]) -> str:
        if b["ratio"] is None:
            return "-"
        return f"{b['ratio']:.2f} [{b['ratio_low']:.2f}, {b['ratio_high']:.2f}]"

    return [
        *out,
        f"Observed fraud rate over mean probability on the holdout, per band, with a 95 % "
        f"interval; a band holding at least {BAND_MIN_FRAUDS} frauds should lie within "
        f"[{lo:g}, {hi:g}].",
        "",
        "| probability | transactions | frauds | mean probability | fraud rate "
        "| observed / predicted [95 %] | verdict |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| [{b['lo']:g}, {b['hi']:g}{']' if b['hi'] >= 1 else ')'} | {b['rows']:,.0f} "
            f"| {b['frauds']:.0f} | {b['mean_probability']:.4f} | {b['fraud_rate']:.4f} "
            f"| {ratio(b)} | {verdict(b)} |"
            for b in bands
        ),
        "",
    ]


def _label_coverage_md(cov: dict[str, Any] | None, overridden: list[str]) -> list[str]:
    if cov is None:
        return []
    latest = (
        f"; the latest version {cov['latest_version']}'s holdout: {cov['latest_version_rate']:.4f}"
        if cov.get("latest_version")
        else ""
    )
    verdict = (
        ["**Labels looked incomplete; published with --force:**", ""]
        + [f"- {r}" for r in cov["incomplete"]]
        if cov["incomplete"]
        else ["Labels looked complete (no day's slice below the threshold)."]
    )
    return [
        "## Label coverage",
        "",
        f"Expected labelled fraud rate {cov['expected_rate']:.4f} (the training slice's: "
        f"every day is older than the {cov['label_delay_days']}-day label delay){latest}; "
        f"a slice below {cov['min_fraction']:g} x is refused.",
        "",
        *verdict,
        "",
        "| day | slice | label age (days) | transactions | frauds | fraud rate |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['day']} | {r['part']} | {r['age_days']} | {r['rows']:,} | {r['frauds']} "
            f"| {r['fraud_rate']:.4f} |"
            for r in cov["days"]
        ),
        "",
        *(["Gates overridden (--force): " + "; ".join(overridden), ""] if overridden else []),
    ]


def _config_md(cfg: dict[str, Any]) -> list[str]:
    """The training run's settings, nested ones (``lightgbm``, ``costs``) as ``a.b``."""
    if not cfg:
        return []
    flat: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    return [
        "## Training configuration",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in flat.items()),
        "",
    ]


def evaluate_version(
    model_repo: Path, name: str, version: str = "latest", data_dir: Path | None = None
) -> dict[str, Any]:
    """Re-run the evaluation of a stored version and (re)write its report into
    ``<version>/evaluation/``; returns the report data.

    The version's stored holdout is scored by its ``model.onnx`` in ONNX Runtime. With
    ``data_dir``, labels are refreshed from ``data_dir/raw/labels`` as of now (chargebacks
    that arrived after training count), else the labels stored at training are used.
    Thresholds are the metadata's (settings overrides are not applied). Raises
    ModelError when the version is missing or has no stored holdout (trained before
    holdouts were stored).
    """
    path = resolve(model_repo, name, version)
    meta = load_metadata(path)
    if not (path / HOLDOUT_FILE).exists():
        raise ModelError(
            f"{path} has no {HOLDOUT_FILE} (trained before holdouts were stored): retrain it"
        )
    h = Holdout.read(path / HOLDOUT_FILE)
    if h.names != meta.feature_names:
        raise ModelError(f"{path / HOLDOUT_FILE}: features differ from the metadata's")
    as_of = None
    if data_dir is not None:
        as_of = datetime.now(UTC)
        frauds = known_frauds(data_dir / "raw", as_of)
        label = np.isin(h.transaction_id, list(frauds)).astype(np.int8)
        log.info("labels refreshed: %d -> %d holdout frauds", h.label.sum(), label.sum())
        h = Holdout(**{**h.__dict__, "label": label})
    p = served_scores(path / "model.onnx", h.x, meta.input_name, meta.output_name)
    data = report_data(meta, h, p, as_of)
    write_report(path / REPORT_DIR, report_files(data))
    return data


def write_report(folder: Path, files: dict[str, bytes]) -> None:
    """Replace ``folder`` with ``files``: written beside it, then renamed into place."""
    with staging_dir(folder) as tmp:
        for fname, blob in files.items():
            (tmp / fname).write_bytes(blob)
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
