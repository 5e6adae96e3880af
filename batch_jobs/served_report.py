"""The served-traffic report: the model measured on the decisions it actually made.

``fraud-scoring evaluate --served --from D1 --to D2`` reads the compacted decision log
(``raw/decisions``, days by decision time) joined with the labels that had arrived before
``as_of`` (:func:`batch_jobs.decisions.decisions_with_labels`: training's point-in-time
rule) and reports, per model version present in the log:

* precision and recall at the version's thresholds (``decision_metrics``) and of the
  decisions as logged (which also hold threshold overrides and the amount rule), with
  PR-AUC / ROC-AUC when both classes are present;
* calibration: the reliability table and expected calibration error;
* drift: PSI per model input and of the score against the version's ``reference.json``
  (``fraud_scoring.drift``), or "no reference" for a version trained before it;

and the decision mix per day over all versions. The label rule is training's: a
transaction is fraud when a fraud label (chargeback or feedback) had arrived before
``as_of``, else legitimate; so the last days' precision is a floor (their chargebacks
are still coming) and the report counts how many rows had any label at all.

Outputs (:func:`write_served_report`): ``served.json``, ``report.md`` and the PNG figures
drawn by the training-time report's code (``batch_jobs.evaluation_report.figures``), plus one PSI
chart per version, in one folder replaced atomically.
"""

from __future__ import annotations

import json
import logging
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sklearn.metrics import precision_recall_curve

from batch_jobs.decisions import decisions_with_labels
from batch_jobs.evaluate import (
    decision_metrics,
    expected_calibration_error,
    quality,
    reliability,
    score_histogram,
)
from batch_jobs.evaluation_report import figures, png, pyplot, write_report
from fraud_scoring.drift import Binner, expected_shares, load_reference
from fraud_scoring.model_repo import DecisionCosts, ModelError, ModelMetadata, load_metadata
from fraud_scoring.storage import DataError

log = logging.getLogger(__name__)

DECISIONS = ("approve", "review", "decline")
PSI_MODERATE, PSI_MAJOR = 0.1, 0.25


def served_report(
    raw: Path,
    first: date,
    last: date,
    as_of: datetime,
    model_repo: Path,
    model_name: str,
) -> dict[str, Any]:
    """The report's data (also written as ``served.json``) for decisions made on UTC days
    ``first..last`` with the labels known at ``as_of`` (timezone-aware). Raises DataError
    when the range holds no compacted decisions."""
    table = decisions_with_labels(raw, first, last, as_of)
    if table.num_rows == 0:
        raise DataError(f"no decisions under {raw / 'decisions'} for {first}..{last}")
    known = table.column("is_fraud").to_numpy(zero_copy_only=False)
    y_all = np.asarray([v is True for v in known], np.int8)
    days = pc.strftime(table.column("decided_at"), format="%Y-%m-%d").to_numpy(zero_copy_only=False)
    decision = table.column("decision").to_numpy(zero_copy_only=False).astype(str)
    per_day = []
    for day in sorted(set(days)):
        m = days == day
        row: dict[str, Any] = {"day": day}
        row.update({d: int((m & (decision == d)).sum()) for d in DECISIONS})
        row["frauds"] = int(y_all[m].sum())
        row["frauds_flagged"] = int((y_all[m] & (decision[m] != "approve")).sum())
        per_day.append(row)
    versions = table.column("model_version").to_numpy(zero_copy_only=False).astype(str)
    rules_only = versions == "rules-only"  # degraded: no model, no score
    return {
        "model": model_name,
        "from": first.isoformat(),
        "to": last.isoformat(),
        "labels_as_of": as_of.isoformat(),
        "label_rule": "the standing label among those arrived before labels_as_of "
        "(analyst > chargeback > other, newest first within a source: training's rule), "
        "else legitimate",
        "rows": table.num_rows,
        "labels": {
            "fraud": int(y_all.sum()),
            "legitimate": int(sum(v is False for v in known)),
            "none": int(sum(v is None for v in known)),
        },
        "decisions_per_day": per_day,
        "rules_only_decisions": int(rules_only.sum()),
        "versions": {
            v: _version_report(
                table.filter(pa.array(versions == v)), y_all[versions == v], model_repo, model_name
            )
            for v in sorted(set(versions[~rules_only]), key=lambda s: (len(s), s))
        },
    }


def _version_report(
    t: pa.Table, y: np.ndarray, model_repo: Path, model_name: str
) -> dict[str, Any]:
    """Quality, calibration and drift of one model version's logged decisions."""
    version = t.column("model_version")[0].as_py()
    p = t.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    amount = t.column("amount").to_numpy(zero_copy_only=False).astype(np.float64)
    decision = t.column("decision").to_numpy(zero_copy_only=False).astype(str)
    w = np.ones(len(p))
    flagged, declined = decision != "approve", decision == "decline"
    frauds = max(int(y.sum()), 1)

    def precision(m: np.ndarray) -> float:
        return float(y[m].mean()) if m.any() else 0.0

    rel = reliability(y, p, w)
    out: dict[str, Any] = {
        "rows": len(p),
        "frauds": int(y.sum()),
        "as_decided": {
            "flagged_precision": precision(flagged),
            "flagged_recall": float(y[flagged].sum() / frauds),
            "decline_precision": precision(declined),
            "decline_recall": float(y[declined].sum() / frauds),
            **{f"{d}_rate": float((decision == d).mean()) for d in DECISIONS},
        },
        "metrics": {"ece": expected_calibration_error(rel), "mean_score": float(p.mean())},
        "reliability": [b.model_dump() for b in rel],
        "score_histogram": score_histogram(y, p, w),
    }
    if 0 < y.sum() < len(y):  # ranking metrics need both classes
        out["metrics"].update(quality(y, p, w))
        prec, rec, _ = precision_recall_curve(y, p)
        keep = np.unique(np.linspace(0, len(prec) - 1, min(len(prec), 300)).astype(int))
        out["pr_curve"] = {"precision": prec[keep].tolist(), "recall": rec[keep].tolist()}
    try:
        path = model_repo / model_name / version
        meta = load_metadata(path)
    except ModelError as exc:
        log.warning("model v%s: %s; no thresholds or reference", version, exc)
        out["thresholds"] = None
        out["drift"] = {"reference": False, "why": f"model version {version} not found"}
        return out
    th = meta.thresholds
    out["thresholds"] = th.model_dump()
    out["at_thresholds"] = decision_metrics(y, p, w, amount, th, meta.costs or DecisionCosts())
    out["drift"] = _drift(t, p, meta, path)
    return out


def _drift(t: pa.Table, p: np.ndarray, meta: ModelMetadata, path: Path) -> dict[str, Any]:
    """PSI of each model input and of the score against the version's reference."""
    try:
        ref = load_reference(path)
    except ModelError as exc:
        return {"reference": False, "why": str(exc)}
    if ref is None:
        return {"reference": False, "why": "no reference (trained before references were stored)"}
    names = meta.feature_names
    x = feature_matrix(t.column("features"), names)
    bins = [ref.features[n] for n in names]
    binner = Binner.of(bins)
    values = binner.psi(binner.counts(x), expected_shares(bins))
    score_bins = ref.scores["default"]
    score_psi = Binner.of([score_bins]).psi(
        Binner.of([score_bins]).counts(p.reshape(-1, 1)), expected_shares([score_bins])
    )
    psi = {n: float(v) for n, v in zip(names, values, strict=True)}
    return {
        "reference": True,
        "reference_window": [w.isoformat() for w in ref.window],
        "features": dict(sorted(psi.items(), key=lambda kv: -kv[1])),
        "score_psi": float(score_psi[0]),
        "shifted": [n for n, v in psi.items() if v >= PSI_MAJOR],
    }


def feature_matrix(column: pa.ChunkedArray, names: list[str]) -> np.ndarray:
    """The logged vectors (a ``map<string, double>`` column) as rows in the order of
    ``names``. Raises DataError when a row lacks one of them."""
    arr = column.combine_chunks()
    n, k = len(arr), len(names)
    keys = arr.keys.to_numpy(zero_copy_only=False)
    items = arr.items.to_numpy(zero_copy_only=False).astype(np.float64)
    if len(keys) == n * k and np.array_equal(keys, np.tile(np.asarray(names, object), n)):
        return items.reshape(n, k)  # the log keeps the model's order: the usual case
    x = np.empty((n, k))
    for i, row in enumerate(arr.to_pylist()):
        d = dict(row)
        try:
            x[i] = [d[name] for name in names]
        except KeyError as exc:
            raise DataError(f"a logged vector lacks the model's feature {exc}") from exc
    return x


def served_files(data: dict[str, Any]) -> dict[str, bytes]:
    """``served.json``, ``report.md`` and the figures: per version ``v<N>-*.png`` (the
    training report's figures on served rows, and the PSI chart), and the decision mix
    per day."""
    files: dict[str, bytes] = {"served.json": json.dumps(data, indent=2).encode()}
    for v, vd in data["versions"].items():
        th = vd["thresholds"] or {"review": 1.0, "decline": 1.0}
        for name, blob in figures({**vd, "thresholds": th}, rows="served").items():
            files[f"v{v}-{name}"] = blob
        if vd["drift"].get("reference"):
            files[f"v{v}-psi.png"] = _psi_figure(v, vd["drift"])
    files.update(figures({"decisions_per_day": data["decisions_per_day"]}, rows="served"))
    files["report.md"] = _markdown(data).encode()
    return files


def _psi_figure(version: str, drift: dict[str, Any]) -> bytes:
    plt = pyplot()
    feats = drift["features"]
    fig, ax = plt.subplots(figsize=(6, max(3, 0.22 * len(feats))))
    names = list(feats)[::-1]
    ax.barh(names, [feats[n] for n in names])
    for x, style in ((PSI_MODERATE, ":"), (PSI_MAJOR, "--")):
        ax.axvline(x, ls=style, c="grey", lw=1)
    ax.set(xlabel="PSI against the training reference", title=f"Feature drift, model v{version}")
    ax.tick_params(axis="y", labelsize=7)
    return png(fig)


def _markdown(d: dict[str, Any]) -> str:
    lab = d["labels"]
    lines = [
        f"# Model {d['model']} on served traffic, {d['from']} .. {d['to']}",
        "",
        f"{d['rows']:,} logged decisions; labels as of {d['labels_as_of']}: {lab['fraud']} "
        f"fraud, {lab['legitimate']} legitimate, {lab['none']:,} without a label. Rule: "
        f"{d['label_rule']}.",
        "",
        "## Decisions per day",
        "",
        "| day | approve | review | decline | known frauds | flagged |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['day']} | {r['approve']:,} | {r['review']:,} | {r['decline']:,} "
            f"| {r['frauds']} | {r['frauds_flagged']} |"
            for r in d["decisions_per_day"]
        ),
        "",
        "![decisions per day](decisions_per_day.png)",
    ]
    for v, vd in d["versions"].items():
        a, m = vd["as_decided"], vd["metrics"]
        lines += [
            "",
            f"## Model v{v}: {vd['rows']:,} decisions, {vd['frauds']} known frauds",
            "",
            f"- as decided: flagged precision {a['flagged_precision']:.1%}, recall "
            f"{a['flagged_recall']:.1%}; declined precision {a['decline_precision']:.1%}, "
            f"recall {a['decline_recall']:.1%}; review rate {a['review_rate']:.2%}, decline "
            f"rate {a['decline_rate']:.2%}",
        ]
        if "at_thresholds" in vd:
            t, th = vd["at_thresholds"], vd["thresholds"]
            lines.append(
                f"- at the version's thresholds (review >= {th['review']:.4g}, decline >= "
                f"{th['decline']:.4g}): flagged precision {t['flagged_precision']:.1%}, "
                f"recall {t['flagged_recall']:.1%}; cost per transaction "
                f"{t['cost_per_txn']:.3f} (approve all {t['cost_per_txn_approve_all']:.3f})"
            )
        if "pr_auc" in m:
            lines.append(f"- PR-AUC {m['pr_auc']:.4f}, ROC-AUC {m['roc_auc']:.4f}")
        lines.append(f"- calibration error (ECE) {m['ece']:.4f}, mean score {m['mean_score']:.4f}")
        drift = vd["drift"]
        if drift.get("reference"):
            top = list(drift["features"].items())[:5]
            lines += [
                f"- score PSI {drift['score_psi']:.3f}; largest feature PSI: "
                + ", ".join(f"{n} {x:.3f}" for n, x in top),
                f"- shifted (PSI >= {PSI_MAJOR}): {', '.join(drift['shifted']) or 'none'}",
            ]
        else:
            lines.append(f"- drift: {drift['why']}")
        lines += [
            "",
            "| probability | decisions | mean probability | fraud rate |",
            "|---|---|---|---|",
            *(
                f"| [{b['lo']:g}, {b['hi']:g}) | {b['rows']:,.0f} | {b['mean_probability']:.4f} "
                f"| {b['fraud_rate']:.4f} |"
                for b in vd["reliability"]
            ),
            "",
            f"![reliability](v{v}-reliability.png) ![scores](v{v}-score_histogram.png)"
            + (f" ![precision-recall](v{v}-pr_curve.png)" if "pr_curve" in vd else "")
            + (f" ![drift](v{v}-psi.png)" if drift.get("reference") else ""),
        ]
    return "\n".join(lines) + "\n"


def write_served_report(folder: Path, data: dict[str, Any]) -> None:
    """Replace ``folder`` with the report's files."""
    write_report(folder, served_files(data))
