"""``fraud-scoring rules test``: what a rules file would have done to the decisions the
service logged (docs/rules.md#testing-a-rules-file).

Reads the compacted decision log (``raw/decisions``, ``fraud-scoring decisions compact``)
of the UTC decision days asked, with the labels known now joined by arrival time
(:func:`fraud_scoring.labels.decisions_with_labels`), each row's logged feature vector,
score and the thresholds of the model version that decided it (the model repository's
metadata, with the settings' overrides for the champion, as the service decides), and the
lists' items as they are now in the online store (``REDIS_URL``; unset: the lists read
as empty, and the report says so). The rules are evaluated by
:func:`service.core.rule_impact.impact`: the service's own expressions and order.
"""

from __future__ import annotations

import argparse
import csv
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from cli.settings import Settings
from fraud_scoring import rules as R
from fraud_scoring.commands import Command, UsageError, aware_time, iso_date
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.storage import partition_file
from service.core import lists
from service.core.decision import DECISIONS
from service.core.rule_impact import Evaluation, FileImpact, InputNotLogged, evaluate
from service.core.rule_log import (
    DEFAULT_DAYS,
    day_range,
    list_lookups,
    list_members_from,
    lists_not_read,
    logged_columns,
    report_doc,
    report_text,
)
from service.core.rules import known_features, known_strings, rules_path


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="rules_command", required=True, metavar="ACTION")
    t = sub.add_parser(
        "test",
        help="what a rules file would have done to the logged decisions",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    t.add_argument(
        "--rules", type=Path, help="the rules file to test (default: FRAUD_RULES_FILE's)"
    )
    t.add_argument("--since", type=iso_date, help="first UTC decision day (YYYY-MM-DD)")
    t.add_argument("--until", type=iso_date, help="last UTC decision day (default: the log's last)")
    t.add_argument(
        "--days",
        type=_positive,
        help=f"the N days ending --until (default {DEFAULT_DAYS}; not with --since)",
    )
    t.add_argument(
        "--as-of",
        type=aware_time,
        help="labels that had arrived before, and the label delay's reference "
        "(RFC 3339; default now)",
    )
    t.add_argument("--json", action="store_true", help="the report as one JSON document")
    t.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help=f"also write {MATCHED_CSV} (each rule's matched transactions), {PER_DAY_CSV} "
        f"and {PER_DAY_PNG} (per rule and day: fraud, false positives, unlabelled within "
        "the label delay) into DIR",
    )


def list_members(
    ruleset: R.RuleSet, strings: dict[str, np.ndarray], url: str | None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Which rows are on each list the rules look up, by its items now in the online
    store, and what was read per list (``{name: items on it among the rows}``, or why
    nothing was)."""
    if not ruleset.list_reads:
        return {}, {}
    if url is None:  # no row on any list (said in the report, not per micro-batch)
        n = len(next(iter(strings.values()), ()))
        none = {R.member_column(name, fld): np.zeros(n, bool) for name, fld in ruleset.list_reads}
        return none, lists_not_read(ruleset)
    lookups = list_lookups(ruleset, strings)
    client = sync_client(url)
    try:
        got = [client.hmget(lists.items_key(n), v) if v else [] for n, v, _ in lookups]
    finally:
        client.close()
    return list_members_from(ruleset, lookups, got)


def rules_report(
    args: argparse.Namespace, settings: Settings
) -> tuple[FileImpact, str, dict, Evaluation, pa.Table, R.RuleSet]:
    """The report of ``rules test`` (its data, its text, its JSON), with the rows behind
    it (the evaluation, the log's table, the rules) for ``--out``."""
    path = args.rules if args.rules is not None else rules_path(settings)
    ruleset = R.load(
        path, set(known_features()), known_strings()
    )  # RulesError (exit 2) names the field
    raw = settings.data_dir / "raw"
    days = day_range(raw, args.since, args.until, args.days)
    as_of = args.as_of or datetime.now(UTC)
    # The compacted log is read with DuckDB (the training stack): imported here, so the
    # serving image's CLI starts and `rules test` alone answers its one-line pointer.
    from fraud_scoring.labels import decisions_with_labels

    table = decisions_with_labels(raw, days[0], days[-1], as_of)
    if table.num_rows == 0:
        files = ", ".join(str(partition_file(raw, "decisions", d)) for d in days)
        raise UsageError(f"no decisions logged {days[0]}..{days[-1]} ({files} hold none)")
    logged = logged_columns(table, ruleset, settings, as_of)
    members, lists_read = list_members(ruleset, dict(logged.strings), settings.redis_url)
    try:
        ev = evaluate(ruleset, logged, members, settings.review_amount_limit)
    except InputNotLogged as exc:
        raise UsageError(str(exc)) from None
    rep = ev.report
    doc = report_doc(rep, ruleset, days, as_of, lists_read)
    return rep, report_text(rep, ruleset, days, as_of, lists_read), doc, ev, table, ruleset


# --out: the matched transactions, the per-day figures and their chart.
MATCHED_CSV, PER_DAY_CSV, PER_DAY_PNG = "matched.csv", "per_day.csv", "per_day.png"
_CHUNK = 65_536  # rows taken from the log per CSV write


def _label_names(is_fraud: np.ndarray) -> np.ndarray:
    out = np.full(len(is_fraud), "", dtype=object)
    out[is_fraud == 1.0] = "fraud"
    out[is_fraud == 0.0] = "legitimate"
    return out


def _iso(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    return pc.strftime(col, format="%Y-%m-%dT%H:%M:%SZ")


def write_matched(path: Path, ev: Evaluation, table: pa.Table, ruleset: R.RuleSet) -> int:
    """One CSV row per (rule, transaction it matches), rule by rule, written in chunks
    of the log's rows (the log is not copied whole). Returns the rows written."""
    logged = ev.logged.decision
    after = np.array(DECISIONS, dtype=object)[ev.after]
    labels = _label_names(ev.logged.is_fraud)
    written = 0
    with pacsv.CSVWriter(path, _MATCHED_SCHEMA) as out:
        for i, r in enumerate(ruleset.rules):
            rows = np.flatnonzero(ev.masks[i])
            for at in range(0, len(rows), _CHUNK):
                idx = rows[at : at + _CHUNK]
                part = table.take(pa.array(idx))
                k = len(idx)
                batch = pa.table(
                    {
                        "rule": pa.array([r.code] * k, pa.string()),
                        "action": pa.array([r.action] * k, pa.string()),
                        "mode": pa.array([r.decl.mode] * k, pa.string()),
                        "transaction_id": part.column("transaction_id"),
                        "decided_at": _iso(part.column("decided_at")),
                        "event_time": _iso(part.column("event_time")),
                        "card_id": part.column("card_id"),
                        "amount": part.column("amount"),
                        "logged_decision": pa.array(logged[idx].tolist(), pa.string()),
                        "file_decision": pa.array(after[idx].tolist(), pa.string()),
                        "rule_decides": pa.array(ev.decides[i][idx]),
                        "label": pa.array(labels[idx].tolist(), pa.string()),
                        "past_label_delay": pa.array(ev.logged.past_delay[idx]),
                    },
                    schema=_MATCHED_SCHEMA,
                )
                out.write_table(batch)
                written += k
    return written


_MATCHED_SCHEMA = pa.schema(
    [
        ("rule", pa.string()),
        ("action", pa.string()),
        ("mode", pa.string()),
        ("transaction_id", pa.string()),
        ("decided_at", pa.string()),
        ("event_time", pa.string()),
        ("card_id", pa.string()),
        ("amount", pa.float64()),
        ("logged_decision", pa.string()),
        ("file_decision", pa.string()),
        ("rule_decides", pa.bool_()),
        ("label", pa.string()),
        ("past_label_delay", pa.bool_()),
    ]
)
_PER_DAY_FIELDS = (
    "rule",
    "day",
    "matched",
    "fraud",
    "false_positives",
    "legitimate",
    "unlabelled_past_delay",
    "unlabelled_within_delay",
    "decides",
    "decides_fraud",
    "decides_false_positives",
)


def per_day(ev: Evaluation, table: pa.Table, ruleset: R.RuleSet) -> list[dict]:
    """Per rule and UTC decision day: the transactions it matches (of them fraud, false
    positives: legitimate or unlabelled past the label delay, and unlabelled within it)
    and those it decides (fraud, false positives)."""
    day = table.column("decided_at").cast(pa.date32()).to_numpy(zero_copy_only=False)
    days, where = np.unique(day, return_inverse=True)
    label, past = ev.logged.is_fraud, ev.logged.past_delay
    fraud, legit, unl = label == 1.0, label == 0.0, np.isnan(label)
    fp = legit | (unl & past)

    def per(m: np.ndarray) -> np.ndarray:
        return np.bincount(where[m], minlength=len(days))

    out = []
    for i, r in enumerate(ruleset.rules):
        m, d = ev.masks[i], ev.decides[i]
        cols = [per(m), per(m & fraud), per(m & fp), per(m & legit)]
        cols += [per(m & unl & past), per(m & unl & ~past), per(d), per(d & fraud), per(d & fp)]
        for k, dd in enumerate(days):
            vals = [int(c[k]) for c in cols]
            out.append(dict(zip(_PER_DAY_FIELDS, [r.code, str(dd), *vals], strict=True)))
    return out


def write_per_day(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_PER_DAY_FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot_per_day(path: Path, rows: list[dict], ruleset: R.RuleSet) -> bool:
    """One PNG: per rule, its matched transactions per day: fraud (caught, for a decline
    or review rule), false positives (legitimate, or unlabelled past the label delay)
    and unlabelled within the delay (not known yet). False where matplotlib is not
    installed (the jobs image's `train` extra has it)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = ruleset.rules
    fig, axes = plt.subplots(
        len(rules), 1, figsize=(10, 2.4 * max(1, len(rules))), squeeze=False, sharex=True
    )
    for ax, r in zip(axes[:, 0], rules, strict=True):
        mine = [x for x in rows if x["rule"] == r.code]
        x = np.arange(len(mine))
        fraud = np.array([v["fraud"] for v in mine])
        fp = np.array([v["false_positives"] for v in mine])
        unl = np.array([v["unlabelled_within_delay"] for v in mine])
        ax.bar(x, fraud, color="#c0392b", label="fraud")
        ax.bar(x, fp, bottom=fraud, color="#2e86c1", label="false positives")
        ax.bar(x, unl, bottom=fraud + fp, color="#bdc3c7", label="unlabelled, within the delay")
        ax.set_title(f"{r.code} ({r.action}, {r.decl.mode}): matched per day", fontsize=9)
        ax.set_xticks(x, [v["day"] for v in mine], rotation=45, fontsize=7)
        ax.set_ylabel("transactions", fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return True


def write_outputs(out: Path, ev: Evaluation, table: pa.Table, ruleset: R.RuleSet) -> dict[str, Any]:
    """``--out``'s files; what was written (the JSON's ``files``)."""
    out.mkdir(parents=True, exist_ok=True)
    n = write_matched(out / MATCHED_CSV, ev, table, ruleset)
    rows = per_day(ev, table, ruleset)
    write_per_day(out / PER_DAY_CSV, rows)
    files: dict[str, Any] = {"matched": str(out / MATCHED_CSV), "matched_rows": n}
    files["per_day"] = str(out / PER_DAY_CSV)
    if plot_per_day(out / PER_DAY_PNG, rows, ruleset):
        files["chart"] = str(out / PER_DAY_PNG)
    else:
        files["chart"] = None
    return files


def run(args: argparse.Namespace, settings: Settings) -> None:
    _, text, doc, ev, table, ruleset = rules_report(args, settings)
    if args.out is not None:
        files = write_outputs(args.out, ev, table, ruleset)
        doc["files"] = files
        text += f"\n\nwrote {files['matched_rows']:,} matched rows to {files['matched']}"
        text += f", per-day figures to {files['per_day']}"
        text += (
            f", their chart to {files['chart']}"
            if files["chart"]
            else " (no chart: matplotlib is not installed)"
        )
    print(json.dumps(doc, indent=2) if args.json else text)


COMMAND = Command(
    "rules",
    "Test a rules file on the logged decisions before it acts (docs/rules.md).",
    run,
    configure,
    settings=Settings,
)
