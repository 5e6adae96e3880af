"""The decision log read for a rules test (``fraud-scoring rules test``, ``POST
/v1/rules/test``; docs/rules.md#testing-a-rules-file): the days asked, each row's logged
numbers, its model's thresholds, whether it is past the label delay, the lists' rows, as
:class:`~service.core.rule_impact.Logged` columns, and the report as text and as one JSON
document.

The label delay is the one training takes (``label_delay_days``, ``fraud-scoring train``:
chargebacks arrive up to that many days after the transaction), as the model versions
that made the range's decisions recorded it in their metadata (the longest of them), else
:data:`DEFAULT_LABEL_DELAY_DAYS`. A decision whose transaction is older than the test's
as-of time minus the delay and has no label counts as legitimate.

The log itself is read by the function :func:`log_reader` answers: the compacted log
with the labels known now (:func:`fraud_scoring.labels.decisions_with_labels`, DuckDB:
the jobs image's). The serving image has no DuckDB, so ``log_reader`` imports that module
only when a test is asked, and answers :class:`ReaderUnavailable` where it cannot be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fraud_scoring import rules as R
from fraud_scoring.commands import UsageError
from fraud_scoring.model_repo import ModelMetadata, ModelNotFound, load_metadata, resolve
from fraud_scoring.storage import partition_days
from service.core import lists
from service.core.rule_impact import FileImpact, Logged
from service.settings import ServiceSettings

DEFAULT_DAYS = 7
RULES_ONLY = "rules-only"  # the model_version of a degraded (rules-only) decision
# The label delay where no model of the range recorded one (a range of rules-only
# decisions, metadata from before label coverage): training's default (TrainConfig).
DEFAULT_LABEL_DELAY_DAYS = 20


class ReaderUnavailable(RuntimeError):
    """The decision log reader cannot be loaded here (the serving image: no DuckDB)."""


def log_reader() -> Callable[[Path, date, date, datetime], pa.Table]:
    """The reader of the compacted log with labels (see the module's docstring),
    imported now. Raises ReaderUnavailable naming the missing module."""
    try:
        from fraud_scoring.labels import decisions_with_labels
    except ImportError as exc:
        raise ReaderUnavailable(
            f"the decision log reader needs {exc.name or 'fraud_scoring.labels'} (the jobs "
            "image's `train` extra); run `fraud-scoring rules test` on the jobs image"
        ) from None
    return decisions_with_labels


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


def _models(table: pa.Table, settings: ServiceSettings) -> dict[str, ModelMetadata]:
    """The metadata of each model version that made a decision of ``table``; UsageError
    naming a version the repository does not hold."""
    found: dict[str, ModelMetadata] = {}
    for v in sorted(set(table.column("model_version").to_pylist()) - {None, RULES_ONLY}):
        try:
            found[v] = load_metadata(resolve(settings.model_repo, settings.model_name, v))
        except ModelNotFound as exc:
            raise UsageError(
                f"decisions of model {settings.model_name} version {v} are in the range, "
                f"and its thresholds are not on file: {exc}"
            ) from None
    return found


def _thresholds(
    table: pa.Table, models: dict[str, ModelMetadata], settings: ServiceSettings
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's review and decline thresholds: its model version's (the metadata's
    default variant), with the settings' overrides where the champion decided. A
    rules-only row has no score, so its thresholds never decide (1.0)."""
    version = table.column("model_version").to_pylist()
    routed = table.column("routed_to").to_pylist()
    review, decline = np.ones(len(version)), np.ones(len(version))
    found = {v: m.thresholds_for("default") for v, m in models.items()}
    for i, (v, r) in enumerate(zip(version, routed, strict=True)):
        if v not in found:
            continue
        rv, dv = found[v].review, found[v].decline
        if r != "challenger":
            rv = settings.review_threshold if settings.review_threshold is not None else rv
            dv = settings.decline_threshold if settings.decline_threshold is not None else dv
        review[i], decline[i] = rv, dv
    return review, decline


def label_delay_days(models: dict[str, ModelMetadata]) -> int:
    """The label delay of the test (see the module's docstring)."""
    recorded = [
        m.label_coverage.label_delay_days
        if m.label_coverage is not None
        else m.training_config.get("label_delay_days")
        for m in models.values()
    ]
    known = [int(d) for d in recorded if d is not None]
    return max(known) if known else DEFAULT_LABEL_DELAY_DAYS


def _past_delay(table: pa.Table, as_of: datetime, days: int) -> np.ndarray:
    """Rows whose transaction (its event time, else the decision's) is older than
    ``as_of`` minus ``days``."""
    cutoff = pa.scalar(as_of - timedelta(days=days), pa.timestamp("us", tz="UTC"))
    when = pc.coalesce(table.column("event_time"), table.column("decided_at"))
    return np.asarray(pc.fill_null(pc.less(when, cutoff), False).to_numpy(zero_copy_only=False))


def logged_columns(
    table: pa.Table, ruleset: R.RuleSet, settings: ServiceSettings, as_of: datetime
) -> Logged:
    """The rows of :func:`decisions_with_labels` (labels as of ``as_of``) as
    :class:`Logged` columns: the numbers the rules read from each row's logged vector
    (float32, as the model and the rules saw them), ``amount`` from the vector or else
    the transaction, ``score``, and whether the row is past the label delay."""
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
    models = _models(table, settings)
    review, decline = _thresholds(table, models, settings)
    delay = label_delay_days(models)
    return Logged(
        numbers=numbers,
        present=present,
        strings=strings,
        decision=np.array(table.column("decision").to_pylist(), object),
        is_fraud=np.array([np.nan if v is None else float(v) for v in label]),
        past_delay=_past_delay(table, as_of, delay),
        label_delay_days=delay,
        amount=amount,
        review_th=review,
        decline_th=decline,
    )


def list_lookups(
    ruleset: R.RuleSet, strings: dict[str, np.ndarray]
) -> list[tuple[str, list[str], np.ndarray]]:
    """Per list read of the rules (in ``ruleset.list_reads``' order): the list, the
    distinct values of its field among the rows, and each row's index into them."""
    out = []
    for name, fld in ruleset.list_reads:
        uniq, where = np.unique(strings[fld].astype(str), return_inverse=True)
        out.append((name, uniq.tolist(), where))
    return out


def list_members_from(
    ruleset: R.RuleSet,
    lookups: Sequence[tuple[str, list[str], np.ndarray]],
    got: Sequence[Sequence[Any]],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The rows on each list from the store's replies (``got``: per lookup, HMGET's
    answer for its values), by the service's expiry rule
    (:func:`service.core.lists.members`), and what was read per list."""
    replies = [
        np.array(g, dtype=object)[where].tolist() if len(v) else []
        for (_, v, where), g in zip(lookups, got, strict=True)
    ]
    members = lists.members(lists.ListReads(ruleset.list_reads), replies)
    read = {
        name: f"read now: {int(members[R.member_column(name, fld)].sum()):,} rows on it"
        for name, fld in ruleset.list_reads
    }
    return members, read


def lists_not_read(ruleset: R.RuleSet) -> dict[str, Any]:
    note = "not read (REDIS_URL unset): matches no row"
    return {name: note for name, _ in ruleset.list_reads}


def report_doc(
    rep: FileImpact,
    ruleset: R.RuleSet,
    days: list[date],
    as_of: datetime,
    lists_read: dict[str, Any],
) -> dict[str, Any]:
    """The report as one JSON document (``rules test --json``, ``POST /v1/rules/test``)."""
    return {
        "rules": ruleset.source,
        "rules_version": ruleset.version,
        "days": [days[0].isoformat(), days[-1].isoformat()],
        "labels_as_of": as_of.isoformat(),
        "lists": lists_read,
        **rep.as_dict(),
    }


def report_text(
    rep: FileImpact, ruleset: R.RuleSet, days: list[date], as_of: datetime, lists_read: dict
) -> str:
    cutoff = as_of - timedelta(days=rep.label_delay_days)
    lines = [
        f"rules test: {ruleset.source} (version {ruleset.version}) over "
        f"{rep.decisions:,} decisions of {days[0]}..{days[-1]}, labels as of "
        f"{as_of.isoformat(timespec='seconds')}; label delay {rep.label_delay_days} days: "
        f"unlabelled before {cutoff.isoformat(timespec='seconds')} counts as legitimate",
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
