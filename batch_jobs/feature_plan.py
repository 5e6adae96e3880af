"""``fraud-scoring features plan`` and ``features backfill``: what a change of
``feature_repo/features.yaml`` does, and the one command that fills new state.

The plan compares the declarations with the last applied ones
(``<data dir>/features/applied.json``, written by backfill; the daily batch adds the
states it backfilled and their features) and with every published
model version: features added and removed, states (entity + value + filter + windows)
that are new and need a backfill of their longest window, and removed features that a
published model still reads (they stay: a model keeps serving while its features exist;
nothing here deletes state, which expires by itself once no longer written).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fraud_scoring import declared as D
from fraud_scoring.model_repo import ModelError, load_metadata, versions

log = logging.getLogger(__name__)


def applied_path(data_dir: Path) -> Path:
    return data_dir / "features" / "applied.json"


def read_applied(data_dir: Path) -> dict[str, Any]:
    p = applied_path(data_dir)
    if not p.exists():
        return {"features": [], "states": {}}
    try:
        raw: dict[str, Any] = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise D.DeclarationError(
            f"{p}: unreadable ({exc}); delete it to plan from scratch"
        ) from None
    return raw


@dataclass
class Plan:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    still_read: dict[str, list[str]] = field(default_factory=dict)  # feature -> versions
    new_states: list[D.Spec] = field(default_factory=list)
    unknown_to_models: dict[str, list[str]] = field(default_factory=dict)
    new_views: list[str] = field(default_factory=list)

    def text(self, decl: D.Declarations) -> str:
        lines = [f"declarations: {decl.source}"]
        for view in decl.views:
            lines.append(
                f"  snapshot view {view.name}: entity {view.entity} ({view.join_key}), ttl "
                f"{view.ttl}; features: {', '.join(f.name for f in view.features)}"
            )
        for s in decl.specs:
            flt = " ".join(f"{k} in {list(v)}" for k, v in s.filter.items()) or "-"
            wins = ", ".join(f"{w.label} (tiles {w.width_us // D.US} s)" for w in s.windows)
            src = "" if s.source == "transactions" else f"source {s.source}, "
            delay = f", delay {D.window_label(s.delay_us)}" if s.delay_us else ""
            lines.append(
                f"  state {s.id}: {src}entity {'+'.join(s.entity)}, value {s.value_column or '-'}, "
                f"filter {flt}{delay}; windows {wins}"
            )
            lines.append(f"    features: {', '.join(s.feature_names())}")
        for d in decl.derived:
            lines.append(f"  derived {d.name} = {d.expr}")
        for r in decl.reasons:
            lines.append(f"  reason {r.code} when {r.when}")
        lines.append(f"+ add: {', '.join(self.added) or 'nothing'}")
        lines.append(f"- remove: {', '.join(self.removed) or 'nothing'}")
        for f, vs in self.still_read.items():
            lines.append(f"! {f} is read by published model version(s) {', '.join(vs)}")
        for s in self.new_states:
            days = -(-s.longest_us // (86_400 * D.US))
            lines.append(
                f"  backfill: state {s.id} ({'+'.join(s.entity)}) needs the last {days} day(s) "
                "of history: `fraud-scoring features backfill`"
            )
        for name in self.new_views:
            lines.append(
                f"  backfill: snapshot view {name} has new features: run `fraud-scoring batch "
                "--from D1 --to D2` over the days training uses (it registers the view in Feast)"
            )
        for v, fs in self.unknown_to_models.items():
            lines.append(f"! model version {v} reads undeclared features: {', '.join(fs)}")
        return "\n".join(lines)


def plan(
    decl: D.Declarations, data_dir: Path, model_repo: Path, model_name: str, producible: set[str]
) -> Plan:
    applied = read_applied(data_dir)
    now, before = set(decl.names()), set(applied.get("features", []))
    out = Plan(added=sorted(now - before), removed=sorted(before - now))
    out.new_states = [s for s in decl.specs if s.id not in applied.get("states", {})]
    # A view with a feature not applied before needs its snapshots computed again.
    out.new_views = [w.name for w in decl.views if {f.name for f in w.features} - before]
    for v in versions(model_repo, model_name):
        try:
            names = load_metadata(model_repo / model_name / str(v)).feature_names
        except ModelError as exc:
            log.warning("model version %s: %s", v, exc)
            continue
        for f in out.removed:
            if f in names:
                out.still_read.setdefault(f, []).append(str(v))
        missing = [f for f in names if f not in producible]
        if missing:
            out.unknown_to_models[str(v)] = missing
    return out


def record_applied(data_dir: Path, decl: D.Declarations, states: list[D.Spec]) -> None:
    applied = read_applied(data_dir)
    applied["features"] = decl.names()
    at = datetime.now(UTC).isoformat()
    applied.setdefault("states", {}).update({s.id: {"backfilled_at": at} for s in states})
    _write(data_dir, applied)


def record_backfilled(data_dir: Path, decl: D.Declarations, states: list[D.Spec]) -> None:
    """Record what the daily batch made: ``states`` (every state the store holds; the
    batch backfills those it lacks) and their features. A deployment's first batch also
    records the snapshot views' and the derived features (it computed the views for the
    days it ran over); later, a view's new feature is applied only once
    ``features backfill`` (or a batch over the training days) ran."""
    applied = read_applied(data_dir)
    was = json.dumps(applied)
    features: list[str] = applied.get("features", [])
    if not applied_path(data_dir).exists():
        features = [f.name for view in decl.views for f in view.features]
        features += [d.name for d in decl.derived]
    known = applied.setdefault("states", {})
    at = datetime.now(UTC).isoformat()
    known.update({s.id: {"backfilled_at": at} for s in states if s.id not in known})
    applied["features"] = features + [
        f for s in states for f in s.feature_names() if f not in features
    ]
    if json.dumps(applied) != was:
        _write(data_dir, applied)


def _write(data_dir: Path, applied: dict[str, Any]) -> None:
    p = applied_path(data_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(applied, indent=2))
    tmp.replace(p)


def history_days(states: list[D.Spec]) -> timedelta:
    """How much raw history a backfill of ``states`` needs: the longest window behind its
    delay, a day more."""
    longest = max((s.longest_us + s.delay_us for s in states), default=0)
    return timedelta(microseconds=longest) + timedelta(days=1)
