"""The evaluation report of a model version: its figures (PNG), its numbers (JSON) and a
page that says what they mean (Markdown), from :func:`batch_jobs.evaluate.report_data`;
and :func:`evaluate_version`, which re-runs the evaluation of a stored version and
rewrites its report (``<version>/evaluation/``). The figures are described in
docs/model-quality.md.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from batch_jobs.evaluate import (
    BAND_MIN_FRAUDS,
    BAND_RATIO,
    HOLDOUT_FILE,
    REPORT_DIR,
    Holdout,
    operating_points,
    report_data,
    served_scores,
)
from batch_jobs.labels import known_frauds
from fraud_scoring.model_repo import ModelError, load_metadata, resolve
from fraud_scoring.storage import staging_dir

log = logging.getLogger(__name__)


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
