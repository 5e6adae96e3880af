"""``fraud-scoring rules test``: what a rules file would have done to the decisions the
service logged (docs/rules.md#testing-a-rules-file).

Reads the compacted decision log (``raw/decisions``, ``fraud-scoring decisions compact``)
of the UTC decision days asked, with the labels known now joined by arrival time
(:func:`batch_jobs.decisions.decisions_with_labels`), each row's logged feature vector,
score and the thresholds of the model version that decided it (the model repository's
metadata, with the settings' overrides for the champion, as the service decides), and the
lists' items as they are now in the online store (``REDIS_URL``; unset: the lists read
as empty, and the report says so). The rules are evaluated by
:func:`service.core.rule_impact.impact`: the service's own expressions and order.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cli.settings import Settings
from fraud_scoring import rules as R
from fraud_scoring.commands import Command, UsageError, aware_time, iso_date
from fraud_scoring.model_repo import ModelNotFound, load_metadata, resolve
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.storage import partition_days, partition_file
from service.core import lists
from service.core.rule_impact import FileImpact, InputNotLogged, Logged, impact
from service.core.rules import known_features, rules_path

DEFAULT_DAYS = 7
RULES_ONLY = "rules-only"  # the model_version of a degraded (rules-only) decision


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
        "--as-of", type=aware_time, help="labels that had arrived before (RFC 3339; default now)"
    )
    t.add_argument("--json", action="store_true", help="the report as one JSON document")


def day_range(raw: Path, since: date | None, until: date | None, days: int | None) -> list[date]:
    """The decision days on file within the range asked; UsageError when none."""
    held = partition_days(raw, "decisions")
    if not held:
        raise UsageError(
            f"no decision log under {raw / 'decisions'} "
            "(the service's log is compacted there by `fraud-scoring decisions compact`)"
        )
    if since is not None and days is not None:
        raise UsageError("--since and --days: give one of them")
    last = until or held[-1]
    first = since or last - timedelta(days=(days or DEFAULT_DAYS) - 1)
    if first > last:
        raise UsageError(f"--since {first} is after --until {last}")
    chosen = [d for d in held if first <= d <= last]
    if not chosen:
        raise UsageError(
            f"no decisions logged {first}..{last} (the log holds {held[0]}..{held[-1]})"
        )
    return chosen


def _thresholds(table: pa.Table, settings: Settings) -> tuple[np.ndarray, np.ndarray]:
    """Each row's review and decline thresholds: its model version's (the metadata's
    default variant), with the settings' overrides where the champion decided. A
    rules-only row has no score, so its thresholds never decide (1.0)."""
    version = table.column("model_version").to_pylist()
    routed = table.column("routed_to").to_pylist()
    review, decline = np.ones(len(version)), np.ones(len(version))
    found: dict[str, tuple[float, float]] = {}
    for v in sorted({v for v in version if v not in (None, RULES_ONLY)}):
        try:
            th = load_metadata(resolve(settings.model_repo, settings.model_name, v))
        except ModelNotFound as exc:
            raise UsageError(
                f"decisions of model {settings.model_name} version {v} are in the range, "
                f"and its thresholds are not on file: {exc}"
            ) from None
        t = th.thresholds_for("default")
        found[v] = (t.review, t.decline)
    for i, (v, r) in enumerate(zip(version, routed, strict=True)):
        if v not in found:
            continue
        rv, dv = found[v]
        if r != "challenger":
            rv = settings.review_threshold if settings.review_threshold is not None else rv
            dv = settings.decline_threshold if settings.decline_threshold is not None else dv
        review[i], decline[i] = rv, dv
    return review, decline


def logged_columns(table: pa.Table, ruleset: R.RuleSet, settings: Settings) -> Logged:
    """The rows of :func:`decisions_with_labels` as :class:`Logged` columns: the numbers
    the rules read from each row's logged vector (float32, as the model and the rules
    saw them), ``amount`` from the vector or else the transaction, and ``score``."""
    numbers: dict[str, np.ndarray] = {}
    present: dict[str, np.ndarray] = {}
    feats = table.column("features")
    for name in sorted(ruleset.features | {"amount"}):
        got = pc.map_lookup(feats, pa.scalar(name, pa.string()), "first")
        present[name] = np.asarray(pc.is_valid(got).to_numpy(zero_copy_only=False), bool)
        numbers[name] = np.asarray(
            pc.fill_null(got.cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False),
            np.float32,
        )
    amount = np.asarray(
        pc.fill_null(table.column("amount"), np.nan).to_numpy(zero_copy_only=False), np.float64
    )
    fallback = ~present["amount"] & ~np.isnan(amount)
    numbers["amount"][fallback] = amount[fallback]
    present["amount"] |= fallback
    score = table.column("score")
    present["score"] = np.asarray(pc.is_valid(score).to_numpy(zero_copy_only=False), bool)
    numbers["score"] = np.asarray(
        pc.fill_null(score, np.nan).to_numpy(zero_copy_only=False), np.float64
    )
    strings = {
        f: np.array(["" if v is None else str(v) for v in table.column(f).to_pylist()], object)
        for f in ruleset.string_fields
    }
    label = table.column("is_fraud").to_pylist()
    review, decline = _thresholds(table, settings)
    return Logged(
        numbers=numbers,
        present=present,
        strings=strings,
        decision=np.array(table.column("decision").to_pylist(), object),
        is_fraud=np.array([np.nan if v is None else float(v) for v in label]),
        amount=amount,
        review_th=review,
        decline_th=decline,
    )


def list_members(
    ruleset: R.RuleSet, strings: dict[str, np.ndarray], url: str | None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Which rows are on each list the rules look up, by its items now in the online
    store (the service's expiry rule: :func:`service.core.lists.members`), and what was
    read per list (``{name: items on it among the rows}``, or why nothing was)."""
    if not ruleset.list_reads:
        return {}, {}
    if url is None:
        note = "not read (REDIS_URL unset): matches no row"
        return {}, {name: note for name, _ in ruleset.list_reads}
    client = sync_client(url)
    replies = []
    try:
        for name, fld in ruleset.list_reads:
            values = strings[fld]
            uniq, where = np.unique(values.astype(str), return_inverse=True)
            got = client.hmget(lists.items_key(name), uniq.tolist()) if len(uniq) else []
            replies.append(np.array(got, dtype=object)[where].tolist())
    finally:
        client.close()
    members = lists.members(lists.ListReads(ruleset.list_reads), replies)
    read = {
        name: f"read now: {int(members[R.member_column(name, fld)].sum()):,} rows on it"
        for name, fld in ruleset.list_reads
    }
    return members, read


def report_text(
    rep: FileImpact, ruleset: R.RuleSet, days: list[date], as_of: datetime, lists_read: dict
) -> str:
    lines = [
        f"rules test: {ruleset.source} (version {ruleset.version}) over "
        f"{rep.decisions:,} decisions of {days[0]}..{days[-1]}, labels as of "
        f"{as_of.isoformat(timespec='seconds')}",
        f"  all: {rep.labels.text()}",
    ]
    lines += [f"  list {name}: {what}" for name, what in lists_read.items()]
    for r in rep.rules:
        lines.append("")
        lines.append(f"{r.code}  {r.action}, {r.mode}: {r.when}")
        lines.append(f"  matched {r.matched.text()}")
        shadow = " (were it active)" if r.mode == "shadow" else ""
        moved = sum(c.transactions for c in r.changes.values())
        lines.append(f"  decides {r.decides:,}{shadow}; changes {moved:,} logged decisions")
        lines += [f"    {k}: {c.text()}" for k, c in r.changes.items()]
        if r.overrides is not None:
            lines.append(f"  overrides (reviewed or declined without it): {r.overrides.text()}")
        for name, k in r.lacking.items():
            lines.append(f"  not evaluated on {k:,} decisions: their log holds no {name}")
    lines.append("")
    lines.append(
        "whole file, in order (allow, decline, the model's decline threshold, review, "
        "the model's review threshold):"
    )
    mix = ", ".join(f"{d} {rep.before[d]:,} -> {rep.after[d]:,}" for d in rep.before)
    lines.append(f"  decisions: {mix}")
    moved = sum(c.transactions for c in rep.changes.values())
    lines.append(f"  changes {moved:,} logged decisions")
    lines += [f"    {k}: {c.text()}" for k, c in rep.changes.items()]
    lines.append("  decided by: " + ", ".join(f"{k} {v:,}" for k, v in rep.decided_by.items()))
    return "\n".join(lines)


def rules_report(args: argparse.Namespace, settings: Settings) -> tuple[FileImpact, str, dict]:
    """The report of ``rules test`` (its data, its text, its JSON)."""
    path = args.rules if args.rules is not None else rules_path(settings)
    ruleset = R.load(path, set(known_features()))  # RulesError (exit 2) names the field
    raw = settings.data_dir / "raw"
    days = day_range(raw, args.since, args.until, args.days)
    as_of = args.as_of or datetime.now(UTC)
    # The compacted log is read with DuckDB (the training stack): imported here, so the
    # serving image's CLI starts and `rules test` alone answers its one-line pointer.
    from batch_jobs.decisions import decisions_with_labels

    table = decisions_with_labels(raw, days[0], days[-1], as_of)
    if table.num_rows == 0:
        files = ", ".join(str(partition_file(raw, "decisions", d)) for d in days)
        raise UsageError(f"no decisions logged {days[0]}..{days[-1]} ({files} hold none)")
    logged = logged_columns(table, ruleset, settings)
    members, lists_read = list_members(ruleset, dict(logged.strings), settings.redis_url)
    try:
        rep = impact(ruleset, logged, members, settings.review_amount_limit)
    except InputNotLogged as exc:
        raise UsageError(str(exc)) from None
    doc = {
        "rules": str(path),
        "rules_version": ruleset.version,
        "days": [days[0].isoformat(), days[-1].isoformat()],
        "labels_as_of": as_of.isoformat(),
        "lists": lists_read,
        **rep.as_dict(),
    }
    return rep, report_text(rep, ruleset, days, as_of, lists_read), doc


def run(args: argparse.Namespace, settings: Settings) -> None:
    _, text, doc = rules_report(args, settings)
    print(json.dumps(doc, indent=2) if args.json else text)


COMMAND = Command(
    "rules",
    "Test a rules file on the logged decisions before it acts (docs/rules.md).",
    run,
    configure,
    settings=Settings,
)
