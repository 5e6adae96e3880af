"""Two model versions on the same logged traffic: ``fraud-scoring evaluate --compare A B``.

The rows are the decisions of UTC days ``first``..``last`` (``raw/decisions``, written
by ``decisions compact``) that *both* versions scored: the champion and the challenger
of a shadow or canary run, either way round (``champion_version``/``champion_score``
beside ``challenger_version``/``challenger_score``). Labels are joined by
:func:`batch_jobs.decisions.decisions_with_labels` as of ``as_of``: a label counts only
if it had arrived before it.

Per version: ranking quality (ROC AUC, PR AUC) on the labelled rows, precision and
recall of the rows its own thresholds (from its metadata, default variant) flag for
review or decline, and the decision mix its thresholds give on every paired row. Then
how often the two disagree (a 3x3 table, with the labelled frauds among the
disagreements), and what was served: how many rows each decided (``routed_to``) and the
logged decision mix. The mixes by threshold leave out the hard rules and the settings'
threshold overrides the service adds; the served mix has them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from sklearn.metrics import average_precision_score, roc_auc_score

from batch_jobs.decisions import decisions_with_labels
from fraud_scoring.model_repo import Thresholds, load_metadata, resolve
from fraud_scoring.storage import DataError

DECISIONS = ("approve", "review", "decline")


@dataclass(frozen=True)
class Paired:
    """The rows both versions scored: ``a``/``b`` their scores, ``label`` 1/0 or -1 (no
    label had arrived), ``routed_to`` and ``decision`` as logged."""

    a: np.ndarray
    b: np.ndarray
    label: np.ndarray
    routed_to: list[str]
    decision: list[str]


def paired_scores(t: pa.Table, a: str, b: str) -> Paired:
    """The rows of the labelled decision view ``t`` scored by both ``a`` and ``b``."""
    cols = set(t.column_names)
    n = t.num_rows

    def col(name: str, fallback: str | None = None) -> list[Any]:
        if name in cols:
            return t.column(name).to_pylist()
        return t.column(fallback).to_pylist() if fallback else [None] * n

    champ_v, champ_s = col("champion_version", "model_version"), col("champion_score", "score")
    chal_v, chal_s = col("challenger_version"), col("challenger_score")
    routed, decision, fraud = col("routed_to"), col("decision"), col("is_fraud")
    rows: list[tuple[float, float, int, str, str]] = []
    for i in range(n):
        if chal_s[i] is None or champ_s[i] is None:
            continue
        by = {champ_v[i]: champ_s[i], chal_v[i]: chal_s[i]}
        if a in by and b in by:
            label = -1 if fraud[i] is None else int(fraud[i])
            rows.append((by[a], by[b], label, routed[i] or "champion", decision[i]))
    return Paired(
        a=np.array([r[0] for r in rows], np.float64),
        b=np.array([r[1] for r in rows], np.float64),
        label=np.array([r[2] for r in rows], np.int8),
        routed_to=[r[3] for r in rows],
        decision=[r[4] for r in rows],
    )


def decide(p: np.ndarray, th: Thresholds) -> np.ndarray:
    """The decision a score gets from thresholds alone (no hard rules)."""
    return np.where(p >= th.decline, "decline", np.where(p >= th.review, "review", "approve"))


def _share(values: np.ndarray | list[str]) -> dict[str, float]:
    n = len(values)
    counts = Counter(str(v) for v in values)
    return {d: counts[d] / n if n else 0.0 for d in DECISIONS}


def _precision_recall(y: np.ndarray, flagged: np.ndarray) -> tuple[float | None, float | None]:
    precision = float(y[flagged].mean()) if flagged.any() else None
    recall = float(y[flagged].sum() / y.sum()) if y.sum() else None
    return precision, recall


def model_figures(p: np.ndarray, label: np.ndarray, th: Thresholds) -> dict[str, Any]:
    """One version's figures on the paired rows (``label`` -1: unlabelled)."""
    known = label >= 0
    y, pk = label[known].astype(np.int8), p[known]
    both = 0 < y.sum() < len(y)  # ranking metrics need both classes
    fp, fr = _precision_recall(y, pk >= th.review)
    dp, dr = _precision_recall(y, pk >= th.decline)
    return {
        "thresholds": {"review": th.review, "decline": th.decline},
        "roc_auc": float(roc_auc_score(y, pk)) if both else None,
        "pr_auc": float(average_precision_score(y, pk)) if both else None,
        "flagged_precision": fp,
        "flagged_recall": fr,
        "decline_precision": dp,
        "decline_recall": dr,
        "decision_mix": _share(decide(p, th)),
        "mean_score": float(p.mean()) if len(p) else None,
    }


def compare(
    raw: Path,
    model_repo: Path,
    model_name: str,
    a: str,
    b: str,
    first: date,
    last: date,
    as_of: datetime,
) -> dict[str, Any]:
    """The comparison of versions ``a`` and ``b`` (numbers or 'latest') as plain data
    (see the module's docstring). Raises DataError when no decision partition is in the
    range or no row was scored by both, ModelError when a version is not in the
    repository."""
    meta_a = load_metadata(resolve(model_repo, model_name, a))
    meta_b = load_metadata(resolve(model_repo, model_name, b))
    va, vb = meta_a.version, meta_b.version
    if va == vb:
        raise DataError(f"--compare needs two different versions, got {va} twice")
    p = paired_scores(decisions_with_labels(raw, first, last, as_of), va, vb)
    n = len(p.a)
    if n == 0:
        raise DataError(
            f"no decision in {first}..{last} was scored by both v{va} and v{vb} "
            "(run one as the challenger: FRAUD_CHALLENGER_VERSION)"
        )
    da, db = decide(p.a, meta_a.thresholds), decide(p.b, meta_b.thresholds)
    known = p.label >= 0
    differ = da != db
    matrix = {x: {y: int(((da == x) & (db == y)).sum()) for y in DECISIONS} for x in DECISIONS}
    decided = Counter(p.routed_to)
    return {
        "versions": [va, vb],
        "window": [first.isoformat(), last.isoformat()],
        "labels_as_of": as_of.isoformat(),
        "rows": n,
        "labelled": int(known.sum()),
        "frauds": int((p.label == 1).sum()),
        "models": {
            va: model_figures(p.a, p.label, meta_a.thresholds),
            vb: model_figures(p.b, p.label, meta_b.thresholds),
        },
        "disagreement": {
            "rows": int(differ.sum()),
            "share": float(differ.mean()),
            "labelled_frauds": int((differ & (p.label == 1)).sum()),
            "matrix": matrix,  # matrix[decision of a][decision of b]
        },
        "served": {
            "decided_by": {"champion": decided["champion"], "challenger": decided["challenger"]},
            "decision_mix": _share(p.decision),
        },
    }


def _num(v: float | None, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)


def table_text(r: dict[str, Any]) -> str:
    """The comparison as a plain-text table (what the command prints)."""
    va, vb = r["versions"]
    ma, mb = r["models"][va], r["models"][vb]
    lines = [
        f"v{va} vs v{vb} on {r['rows']:,} decisions both scored, {r['window'][0]}..{r['window'][1]}"
        f" ({r['labelled']:,} labelled, {r['frauds']:,} fraud; labels as of {r['labels_as_of']})",
        "",
        f"{'':<22}{'v' + va:>12}{'v' + vb:>12}",
    ]
    rows: list[tuple[str, float | None, float | None, str]] = [
        ("review threshold", ma["thresholds"]["review"], mb["thresholds"]["review"], ".4g"),
        ("decline threshold", ma["thresholds"]["decline"], mb["thresholds"]["decline"], ".4g"),
        ("ROC AUC", ma["roc_auc"], mb["roc_auc"], ".4f"),
        ("PR AUC", ma["pr_auc"], mb["pr_auc"], ".4f"),
        ("flagged precision", ma["flagged_precision"], mb["flagged_precision"], ".4f"),
        ("flagged recall", ma["flagged_recall"], mb["flagged_recall"], ".4f"),
        ("decline precision", ma["decline_precision"], mb["decline_precision"], ".4f"),
        ("decline recall", ma["decline_recall"], mb["decline_recall"], ".4f"),
    ]
    rows += [(f"{d} share", ma["decision_mix"][d], mb["decision_mix"][d], ".2%") for d in DECISIONS]
    lines += [f"{name:<22}{_num(x, f):>12}{_num(y, f):>12}" for name, x, y, f in rows]
    dis = r["disagreement"]
    lines += [
        "",
        f"disagree on {dis['rows']:,} ({dis['share']:.2%}), {dis['labelled_frauds']:,} of them "
        f"labelled fraud; rows: v{va}'s decision, columns: v{vb}'s",
        f"{'':<10}" + "".join(f"{d:>10}" for d in DECISIONS),
        *(
            f"{x:<10}" + "".join(f"{dis['matrix'][x][y]:>10,}" for y in DECISIONS)
            for x in DECISIONS
        ),
        "",
        "served: decided by champion {champion:,}, challenger {challenger:,}; ".format(
            **r["served"]["decided_by"]
        )
        + ", ".join(f"{d} {s:.2%}" for d, s in r["served"]["decision_mix"].items()),
    ]
    return "\n".join(lines)


def write_report(folder: Path, r: dict[str, Any]) -> Path:
    """Write ``r`` as ``compare-vA-vB-D1-D2.json`` under ``folder``; returns its path."""
    va, vb = r["versions"]
    path = folder / f"compare-v{va}-v{vb}-{r['window'][0]}-{r['window'][1]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2))
    return path
