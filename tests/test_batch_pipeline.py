"""Simulator, daily batch job, Feast materialization, training set and model file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pyarrow.parquet as pq
import pytest

from batch_jobs.batch import labels_line, run_batch
from batch_jobs.daily_features import compute_day, expected_columns, snapshot_time
from batch_jobs.simulate import SimConfig, generate, simulate
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import default_model_features, view_features, views
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.storage import DataError, partition_dir
from tests.conftest import World


def test_the_labels_line_says_what_was_recorded_and_why_nothing() -> None:
    """Nothing recorded because the backfill already did is not a failure: it says so."""
    d1, d2 = date(2026, 1, 1), date(2026, 1, 30)
    assert labels_line(434, 0, d1, d2) == (
        "declared labels: the 434 arrival(s) of 2026-01-01..2026-01-30 were recorded already "
        "(by the backfill or an earlier run): nothing new to record"
    )
    assert (
        labels_line(0, 0, d1, d1) == "declared labels: no label or decision arrived on 2026-01-01"
    )
    assert labels_line(1200, 2400, d1, d2).endswith(
        "1,200 arrival(s) of 2026-01-01..2026-01-30, 2,400 new record(s)"
    )


def test_simulator_is_deterministic_and_has_fraud_patterns() -> None:
    cfg = SimConfig(cards=300, merchants=40, days=10, seed=3)
    a, b = generate(cfg), generate(cfg)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert set(a["fraud_pattern"]) >= {
        "",
        "card_testing",
        "account_takeover",
        "compromised_merchant",
    }
    assert np.all(np.diff(a["event_time"]) >= 0)
    assert np.all(a["amount"] > 0)
    fraud = a["is_fraud"]
    assert np.all(a["label_time"][fraud] > a["event_time"][fraud])  # labels arrive later
    ct = a["fraud_pattern"] == "card_testing"
    assert np.median(a["amount"][ct]) < 10  # bursts of small amounts


def test_simulator_writes_one_partition_a_day(tmp_path: Path) -> None:
    cfg = SimConfig(cards=200, merchants=30, days=4, seed=5)
    simulate(cfg, tmp_path)
    days = sorted(p.name for p in (tmp_path / "transactions").iterdir())
    assert days == [f"date={cfg.start + timedelta(days=i)}" for i in range(4)]
    t = pq.read_table(partition_dir(tmp_path, "transactions", cfg.start) / "part-0.parquet")
    for col in (
        "transaction_id",
        "card_id",
        "merchant_id",
        "amount",
        "currency",
        "event_time",
        "utc_offset_min",
        "country",
        "channel",
        "mcc",
        "device_id",
    ):
        assert col in t.column_names
    assert (tmp_path / "labels").is_dir()
    # A shorter run into the same folder replaces it: no partition of the first survives.
    simulate(SimConfig(cards=cfg.cards, merchants=cfg.merchants, days=2, seed=3), tmp_path)
    days = sorted(p.name for p in (tmp_path / "transactions").iterdir())
    assert days == [f"date={cfg.start + timedelta(days=i)}" for i in range(2)]
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_batch_columns_match_declared_features(world: World) -> None:
    tables = compute_day(world.data_dir / "raw", world.start + timedelta(days=3))
    for view in views():
        assert tables[view.name].column_names == expected_columns(view)


def test_online_features_equal_job_output(world: World) -> None:
    """simulate → batch → materialize → get_online_features returns the job's values."""
    store = open_store(world.data_dir, world.redis_url)
    day = world.last_day - timedelta(days=1)  # the newest materialized snapshot
    card = pq.read_table(
        partition_dir(world.data_dir / "features", "card_30d", day) / "part-0.parquet"
    ).to_pandas()
    sample = card.sample(25, random_state=1)
    online = store.get_online_features(
        features=[
            f"card_30d:{c}" for c in card.columns if c.startswith("card_") and c != "card_id"
        ],
        entity_rows=[{"card_id": c} for c in sample["card_id"]],
    ).to_df()
    for col in online.columns:
        if col == "card_id":
            continue
        if online[col].dtype == object:
            assert list(online[col]) == list(sample[col]), col
        else:
            np.testing.assert_allclose(
                online[col].to_numpy(float), sample[col].to_numpy(float), rtol=1e-6, err_msg=col
            )


def test_training_join_never_uses_a_later_snapshot(world: World) -> None:
    """A card whose features change on a known day: just before the snapshot instant the
    old values are joined, at and after it the new ones."""
    feats = world.data_dir / "features"
    d1 = world.start + timedelta(days=8)
    d2 = d1 + timedelta(days=1)
    a = pq.read_table(partition_dir(feats, "card_30d", d1) / "part-0.parquet").to_pandas()
    b = pq.read_table(partition_dir(feats, "card_30d", d2) / "part-0.parquet").to_pandas()
    m = a.merge(b, on="card_id", suffixes=("_a", "_b"))
    changed = m[m.card_txn_count_30d_a != m.card_txn_count_30d_b].iloc[0]
    snap2 = pd.Timestamp(snapshot_time(d2))
    ts = [snap2 - pd.Timedelta(microseconds=1), snap2, snap2 + pd.Timedelta(hours=1)]
    entity = pd.DataFrame(
        {"card_id": [changed.card_id] * 3, "merchant_id": ["m00001"] * 3, "event_timestamp": ts}
    )
    store = open_store(world.data_dir, world.redis_url)
    out = (
        store.get_historical_features(
            entity_df=entity, features=store.get_feature_service("fraud_model")
        )
        .to_df()
        .sort_values("event_timestamp")
    )
    got = out["card_txn_count_30d"].tolist()
    assert got == [
        changed.card_txn_count_30d_a,
        changed.card_txn_count_30d_b,
        changed.card_txn_count_30d_b,
    ]


def test_training_join_keeps_transactions_before_a_cards_first_snapshot(world: World) -> None:
    """A card's first transactions come before its first snapshot: no usable batch
    features (the service uses defaults), but the row stays in the training set, and it
    keeps its merchant's features (each view is joined on its own, as the service reads)."""
    from batch_jobs.training_set import point_in_time_join

    feats = world.data_dir / "features"
    day = world.start + timedelta(days=8)
    before = set(
        pq.read_table(partition_dir(feats, "card_30d", day - timedelta(days=1)))
        .column("card_id")
        .to_pylist()
    )
    after = pq.read_table(partition_dir(feats, "card_30d", day)).to_pandas()
    new_card = sorted(set(after["card_id"]) - before)[0]  # first seen on ``day``
    snap = pd.Timestamp(snapshot_time(day))
    entity = pd.DataFrame(
        {
            "transaction_id": ["first", "next"],
            "card_id": [new_card] * 2,
            "merchant_id": ["m00001"] * 2,
            "event_timestamp": [snap - pd.Timedelta(hours=1), snap + pd.Timedelta(hours=1)],
        }
    )
    store = open_store(world.data_dir, world.redis_url)
    out = point_in_time_join(store, entity).set_index("transaction_id")
    assert list(out.index) == ["first", "next"]
    assert pd.isna(out.loc["first", "card_txn_count_30d"])
    assert not pd.isna(out.loc["first", "merchant_txn_count_30d"])
    assert out.loc["next", "card_txn_count_30d"] >= 1


def test_rerunning_a_day_is_idempotent(world: World, redis_server: str) -> None:
    day = world.start + timedelta(days=6)
    path = partition_dir(world.data_dir / "features", "card_30d", day) / "part-0.parquet"
    before = pq.read_table(path)
    store = open_store(world.data_dir, redis_server)
    probe = [{"card_id": c} for c in before.column("card_id").to_pylist()[:10]]
    online_before = store.get_online_features(
        features=["card_30d:card_txn_count_30d"], entity_rows=probe
    ).to_dict()
    run_batch(world.data_dir, [day], redis_server)
    after = pq.read_table(path)
    assert after.equals(before)
    assert len(list(path.parent.parent.glob(f"date={day}*"))) == 1  # no duplicates
    assert not list(path.parent.parent.glob(".tmp-*"))
    # Backfilling an old day never overwrites the newer online snapshot.
    assert (
        store.get_online_features(
            features=["card_30d:card_txn_count_30d"], entity_rows=probe
        ).to_dict()
        == online_before
    )


def test_rerunning_the_online_day_with_corrected_data_updates_redis(tmp_path: Path) -> None:
    """Feast skips a row not newer than the stored one, so a re-run day whose snapshot
    is the one online must still replace it when its raw data changed."""
    from fraud_scoring.redis_server import embedded_redis

    cfg = SimConfig(cards=200, merchants=30, days=3, seed=11)
    simulate(cfg, tmp_path / "raw")
    last = cfg.start + timedelta(days=2)
    with embedded_redis() as url:  # its own server: the world's keys are not touched
        run_batch(tmp_path, [cfg.start, cfg.start + timedelta(days=1), last], url)
        raw_path = partition_dir(tmp_path / "raw", "transactions", last) / "part-0.parquet"
        raw = pq.read_table(raw_path)
        earlier = pq.read_table(partition_dir(tmp_path / "features", "card_30d", cfg.start))
        seen = set(earlier.column("card_id").to_pylist())
        card = next(c for c in raw.column("card_id").to_pylist() if c in seen)
        keep = np.array(raw.column("card_id").to_pylist()) != card
        pq.write_table(raw.filter(keep), raw_path)  # a correction: that card's day is void
        run_batch(tmp_path, [last], url)
        snap = pq.read_table(partition_dir(tmp_path / "features", "card_30d", last)).to_pandas()
        expected = int(snap.set_index("card_id").loc[card, "card_txn_count_30d"])
        store = open_store(tmp_path, url)
        online = store.get_online_features(
            features=["card_30d:card_txn_count_30d"], entity_rows=[{"card_id": card}]
        ).to_dict()
        assert online["card_txn_count_30d"] == [expected]


def test_model_loads_and_metadata_lists_features_in_order(world: World) -> None:
    path = resolve(world.model_repo, "fraud")
    meta = load_metadata(path)
    assert meta.feature_names == default_model_features()
    assert 0 <= meta.thresholds.review <= meta.thresholds.decline <= 1
    assert {"holdout_pr_auc", "holdout_roc_auc"} <= set(meta.metrics)
    sess = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.zeros((3, len(meta.features)), np.float32)
    probs = sess.run([meta.output_name], {meta.input_name: x})[0]
    assert probs.shape == (3, 2)
    assert meta.holdout_window[0] >= meta.training_window[1]


def test_missing_and_corrupt_partitions_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"date=2026-03-01"):
        compute_day(tmp_path, date(2026, 3, 1))
    bad = partition_dir(tmp_path, "transactions", date(2026, 3, 2))
    bad.mkdir(parents=True)
    (bad / "part-0.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match="date=2026-03-02"):
        compute_day(tmp_path, date(2026, 3, 2))


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        text=True,
        capture_output=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_cli_reports_bad_input_clearly(tmp_path: Path, redis_server: str) -> None:
    env = {"FRAUD_DATA_DIR": str(tmp_path), "REDIS_URL": redis_server}
    r = _cli(["batch", "--date", "2026-02-01"], env)
    assert r.returncode == 2 and "missing partition" in r.stderr
    assert "date=2026-02-01" in r.stderr
    r = _cli(["batch", "--date", "yesterday"], env)
    assert r.returncode == 2 and "not a date" in r.stderr
    r = _cli(["batch", "--from", "2026-02-03", "--to", "2026-02-01"], env)
    assert r.returncode == 2 and "before" in r.stderr
    r = _cli(["simulate", "--cards", "0"], env)
    assert r.returncode == 2 and "--cards must be positive" in r.stderr
    # Each command reads its own app's settings, named by their variable.
    r = _cli(["serve"], {**env, "FRAUD_PORT": "not-a-port"})
    assert r.returncode == 2 and "FRAUD_PORT" in r.stderr
    r = _cli(["batch", "--date", "2026-02-01"], {**env, "FRAUD_BATCH_ENGINE": "pandas"})
    assert r.returncode == 2 and "FRAUD_BATCH_ENGINE" in r.stderr
    r = _cli(["batch", "--date", "2026-02-01"], {**env, "REDIS_URL": "http://nope"})
    assert r.returncode != 0 and "REDIS_URL" in r.stderr


def test_feast_apply_cli_works_on_the_repo(tmp_path: Path, redis_server: str) -> None:
    from fraud_scoring.feast_store import REPO_DIR
    from fraud_scoring.redis_server import feast_connection_string

    env = {
        **os.environ,
        "FRAUD_DATA_DIR": str(tmp_path),
        "FRAUD_FEAST_REDIS": feast_connection_string(redis_server),
    }
    (tmp_path / "feast").mkdir()
    feast = Path(sys.executable).parent / "feast"
    r = subprocess.run(
        [str(feast), "-c", str(REPO_DIR), "apply"],
        env=env,
        text=True,
        capture_output=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "feast" / "registry.db").exists()


def test_metadata_is_plain_json(world: World) -> None:
    raw = json.loads((resolve(world.model_repo, "fraud") / "metadata.json").read_text())
    assert raw["features"][0]["name"] == default_model_features()[0]
    assert datetime.fromisoformat(raw["created_at"]) <= datetime.now(UTC)
    assert datetime.fromisoformat(raw["labels_as_of"]) <= datetime.fromisoformat(raw["created_at"])


def test_hour_of_day_is_local_to_the_event() -> None:
    from fraud_scoring.events import Transaction, raw_row_to_event
    from fraud_scoring.features import request_features

    base = {
        "transaction_id": "t1",
        "card_id": "c1",
        "merchant_id": "m1",
        "amount": 10.0,
        "currency": "USD",
        "country": "US",
        "channel": "pos",
        "mcc": "5411",
    }
    late_evening = Transaction.model_validate({**base, "event_time": "2026-01-16T23:30:00-05:00"})
    epoch = Transaction.model_validate({**base, "event_time": late_evening.event_ts})
    assert (late_evening.utc_offset_s, epoch.utc_offset_s) == (-5 * 3600, 0)
    txns = [late_evening, epoch]
    cols = request_features(
        [t.amount for t in txns],
        [t.event_ts for t in txns],
        [t.utc_offset_s for t in txns],
        [t.country for t in txns],
        [t.channel for t in txns],
        [False, False],
        {
            "card_amount_mean_30d": [0, 0],
            "card_amount_std_30d": [0, 0],
            "card_top_country_30d": ["", ""],
        },
    )
    assert list(cols["hour_of_day_local"]) == [23, 4]  # 23:30 in New York is 04:30 UTC

    # Simulated rows keep their offset: as events they come back in local time.
    cfg = SimConfig(cards=300, merchants=50, days=2, seed=5)
    cols_sim = generate(cfg)
    i = int(np.flatnonzero(cols_sim["utc_offset_min"] != 0)[0])
    row = {k: v[i] for k, v in cols_sim.items()}
    row["event_time"] = datetime.fromtimestamp(int(row["event_time"]) / 1e6, UTC)
    t = Transaction.model_validate(raw_row_to_event(row))
    assert t.utc_offset_s == int(row["utc_offset_min"]) * 60
    assert t.event_ts == row["event_time"].timestamp()
    # Normal spending follows the day/night curve in local time: few purchases at 2-5 am.
    normal = ~cols_sim["is_fraud"]
    local_h = ((cols_sim["event_time"] // 1_000_000 + cols_sim["utc_offset_min"] * 60) // 3600) % 24
    assert np.mean((local_h[normal] >= 2) & (local_h[normal] < 5)) < 0.04


def test_training_joins_the_snapshot_serving_has_at_the_transactions_time(
    world: World,
) -> None:
    """With the nightly batch landing at 01:30, a 00:30 transaction is served with the
    day before's snapshot: training (``batch_available_after_s``) joins that one too,
    while a 02:00 transaction gets the new one; each row keeps its own event time."""
    from batch_jobs.train import _available_join

    feats = world.data_dir / "features"
    day = world.start + timedelta(days=10)
    cards = pq.read_table(partition_dir(feats, "card_30d", day)).to_pandas()
    older = pq.read_table(partition_dir(feats, "card_30d", day - timedelta(days=1))).to_pandas()
    both = cards.merge(older, on="card_id", suffixes=("", "_before"))
    card = both[both["card_txn_count_30d"] != both["card_txn_count_30d_before"]].iloc[0]
    snap = pd.Timestamp(snapshot_time(day))
    entity = pd.DataFrame(
        {
            "transaction_id": ["early", "late"],
            "card_id": [card["card_id"]] * 2,
            "merchant_id": ["m00001"] * 2,
            "event_timestamp": [snap + pd.Timedelta(minutes=30), snap + pd.Timedelta(hours=2)],
        }
    )
    store = open_store(world.data_dir, world.redis_url)
    out = _available_join(entity, 5400, store, None).set_index("transaction_id")
    assert out.loc["early", "card_txn_count_30d"] == card["card_txn_count_30d_before"]
    assert out.loc["late", "card_txn_count_30d"] == card["card_txn_count_30d"]
    assert list(out["event_timestamp"]) == list(entity["event_timestamp"])
    now = _available_join(entity, 0, store, None).set_index("transaction_id")
    assert now.loc["early", "card_txn_count_30d"] == card["card_txn_count_30d"]


def test_training_join_gives_each_row_sharing_an_entity_and_time_its_snapshot(
    world: World,
) -> None:
    """Two transactions of one card at one instant, and two of one merchant (other cards)
    at another: each row gets the snapshot serving reads at that time (the newest one
    online), none comes back null (Feast's join kept one row per entity and time)."""
    from batch_jobs.training_set import point_in_time_join

    day = world.last_day - timedelta(days=1)  # the newest snapshot online
    snap = pd.Timestamp(snapshot_time(day))
    feats = world.data_dir / "features"
    cards = pq.read_table(partition_dir(feats, "card_30d", day)).to_pandas()["card_id"]
    merchants = pq.read_table(partition_dir(feats, "merchant_90d", day)).to_pandas()
    card, other, third = cards.iloc[0], cards.iloc[1], cards.iloc[2]
    merchant, m2 = merchants["merchant_id"].iloc[0], merchants["merchant_id"].iloc[1]
    t1, t2 = snap + pd.Timedelta(hours=1), snap + pd.Timedelta(hours=2)
    entity = pd.DataFrame(
        {
            "transaction_id": ["card-a", "card-b", "merchant-a", "merchant-b", "alone"],
            "card_id": [card, card, other, third, card],
            "merchant_id": [m2, merchant, merchant, merchant, m2],
            "event_timestamp": [t1, t1, t2, t2, t2],
        }
    )
    store = open_store(world.data_dir, world.redis_url)
    out = point_in_time_join(store, entity)
    assert list(out["transaction_id"]) == list(entity["transaction_id"])  # sample's order
    names = [f"{v.name}:{f.name}" for v in views() for f in view_features(v)]
    online = store.get_online_features(
        features=names,
        entity_rows=[
            {"card_id": c, "merchant_id": m}
            for c, m in zip(entity["card_id"], entity["merchant_id"], strict=True)
        ],
    ).to_df()
    for name in (n.split(":")[1] for n in names):
        assert out[name].notna().all(), name
        if online[name].dtype == object:
            assert list(out[name]) == list(online[name]), name
        else:
            np.testing.assert_allclose(
                out[name].to_numpy(float), online[name].to_numpy(float), rtol=1e-6, err_msg=name
            )
