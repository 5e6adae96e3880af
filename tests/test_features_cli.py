"""``fraud-scoring features plan`` and ``features backfill``, as a user runs them after
declaring features: a new transactions state and a state over the service's own
decisions (the decision log as ``decisions compact`` writes it) are listed with the days
they need, recorded by ``backfill`` into a store of their own, and read back equal to
what training computes; the plan then lists nothing new, and a published model that
reads a feature no longer declared is named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from fraud_scoring import declared as D
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import embedded_redis
from tests.conftest import World

NEW = """
- entity: merchant_id
  filter: {channel: [ecom]}
  windows: [1h, 1d]
  features: {count: merchant_ecom_count}
- source: decisions
  entity: card_id
  filter: {decision: [decline, review]}
  windows: [1d, 7d]
  features: {count: card_flagged_count}
"""


def _cli(data: Path, env: dict[str, str], *args: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=base | env | {"FRAUD_DATA_DIR": str(data)},
        text=True,
        capture_output=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _decisions(raw: Path, tx: pd.DataFrame) -> None:
    """The service's log entries for a third of ``tx``, compacted per day."""
    from batch_jobs.decisions import compact_day

    rng = np.random.default_rng(4)
    by_day: dict[object, list[bytes]] = {}
    for r in tx.sample(frac=0.3, random_state=4).to_dict("records"):
        score = float(rng.random())
        at = r["event_time"] + pd.Timedelta(milliseconds=30)
        cols = ("card_id", "merchant_id", "amount", "currency", "country", "channel", "mcc")
        entry = {
            "transaction_id": r["transaction_id"],
            "decided_at": at.isoformat(),
            "transaction": {
                "event_time": r["event_time"].isoformat(),
                "device_id": r["device_id"] if isinstance(r["device_id"], str) else None,
                **{k: r.get(k) for k in cols},
            },
            "score": score,
            "decision": "decline" if score > 0.9 else "review" if score > 0.7 else "approve",
            "model_version": "1",
            **{k: [] for k in ("reasons", "missing", "stale")},
            "features": {},
            "timing_ms": {},
        }
        by_day.setdefault(at.date(), []).append(json.dumps(entry, default=str).encode())
    for day in sorted(by_day):
        compact_day(raw, day, by_day[day], [])


def test_plan_and_backfill_a_declared_transactions_and_decisions_state(
    world: World, tmp_path: Path
) -> None:
    from batch_jobs.declared_sql import labels_for, training_columns
    from batch_jobs.train import load_transactions

    data = tmp_path / "data"
    shutil.copytree(world.data_dir / "raw", data / "raw")
    tx = load_transactions(data / "raw", world.last_day - pd.Timedelta(days=7), world.last_day)
    _decisions(data / "raw", tx)
    shipped = Path(__file__).parents[1] / "feature_repo" / "features.yaml"
    doc = yaml.safe_load(shipped.read_text())
    doc["aggregations"] += yaml.safe_load(NEW)
    declared = tmp_path / "features.yaml"
    declared.write_text(yaml.safe_dump(doc, sort_keys=False))

    with embedded_redis() as url:
        env = {
            "REDIS_URL": url,
            "FRAUD_MODEL_REPO": str(world.model_repo),
            "FRAUD_FEATURES_FILE": str(declared),
        }
        # A deployment: the daily batch with the shipped declarations (it backfills
        # their states and compacts the day's decisions from the log, which no longer
        # holds them: what the day's partition holds stays).
        shipped_env = {k: v for k, v in env.items() if k != "FRAUD_FEATURES_FILE"}
        day = world.last_day.isoformat()
        held = pq.read_table(data / "raw" / "decisions" / f"date={day}").num_rows
        _cli(data, shipped_env, "batch", "--from", day, "--to", day)
        assert pq.read_table(data / "raw" / "decisions" / f"date={day}").num_rows == held > 0
        # The deployment's first batch is recorded as applied: nothing to add.
        shipped_plan = _cli(data, shipped_env, "features", "plan")
        assert "+ add: nothing" in shipped_plan and "backfill:" not in shipped_plan
        # Then the declarations change: only the two new states need a backfill.
        first = _cli(data, env, "features", "plan")
        added = first.split("+ add: ")[1].splitlines()[0].split(", ")
        assert set(added) == {
            f"{name}_{w}"
            for name, wins in (
                ("merchant_ecom_count", ("1h", "1d")),
                ("card_flagged_count", ("1d", "7d")),
            )
            for w in wins
        }, added
        assert "card_flagged_count_7d" in first and "merchant_ecom_count_1d" in first
        assert first.count("backfill: state") == 2, first
        assert "needs the last 7 day(s) of history" in first  # the decisions state
        assert "source decisions, entity card_id, value -, filter decision in" in first
        assert "reason VELOCITY_1H when card_txn_count_1h >= 8" in first
        out = _cli(data, env, "features", "backfill")
        assert "events recorded into 2 state(s)" in out
        assert (data / "features" / "applied.json").exists()
        again = _cli(data, env, "features", "plan")
        assert "+ add: nothing" in again and "backfill: state" not in again

        # What the backfill recorded reads as training computes it.
        from fraud_scoring.features import load_declarations

        decl = load_declarations(declared)
        wanted = {"card_flagged_count_7d", "merchant_ecom_count_1d"}
        new = [s for s in decl.specs if wanted & set(s.feature_names())]
        assert {s.source for s in new} == {"transactions", "decisions"}
        # Keys of the last day, read just after the history ends (a read far behind a
        # busy key's newest events may be inexact: docs/features.md).
        q = (
            tx[tx["event_time"].dt.date == world.last_day]
            .sample(300, random_state=6)
            .assign(event_timestamp=tx["event_time"].max() + pd.Timedelta(minutes=1))
            .reset_index(drop=True)
        )
        only = D.Declarations(tuple(new), (), decl.source)
        trained = training_columns(only, q, tx, labels=labels_for(new, data / "raw", 0.0))
        client = sync_client(url)
        rows = q.to_dict("records")
        ts = [int(pd.Timestamp(r["event_timestamp"]).value // 1000) for r in rows]
        for spec in new:
            pipe = client.pipeline(transaction=False)
            for r, t in zip(rows, ts, strict=True):
                D.queue_read(pipe, spec, spec.key_value(r), t)
            for i, state in enumerate(D.parse_reads(spec, pipe.execute(), ts)):
                got, exact = D.online_row(spec, state, ts[i])
                assert exact
                for name, v in got.items():
                    assert v == pytest.approx(trained[name][i]), (name, rows[i])
        assert (trained["card_flagged_count_7d"] > 0).sum() > 50
        assert (trained["merchant_ecom_count_1d"] > 0).sum() > 50

        # Dropping the shipped features: the published model still reads them.
        doc["aggregations"] = yaml.safe_load(NEW)
        doc["derived"] = []
        doc["reasons"] = []  # the velocity reasons read the dropped aggregations
        declared.write_text(yaml.safe_dump(doc, sort_keys=False))
        removed = _cli(data, env, "features", "plan")
        assert "card_txn_count_1h" in removed.split("- remove:")[1]
        assert "is read by published model version(s) 1" in removed
