"""``fraud-scoring replay``: a past day's exact vectors, scores and decisions through the
training join (batch_jobs/replay.py), and its refusals of bad input."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from datetime import date, datetime
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pyarrow.parquet as pq
import pytest

from batch_jobs.declared_sql import labels_for
from batch_jobs.evaluate import HOLDOUT_FILE, Holdout
from batch_jobs.feature_plan import history_days
from batch_jobs.replay import METADATA_KEY
from batch_jobs.train import _available_join, _midnight, feature_columns, load_transactions
from cli.main import main
from fraud_scoring import features as F
from fraud_scoring.feast_store import open_store
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.settings import read_settings
from fraud_scoring.storage import partition_file
from tests.conftest import World


@pytest.fixture
def jobs_env(world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CLI's settings pointing at the world (its data, models and Redis) and nothing
    else of this process's environment."""
    for k in [k for k in os.environ if k.startswith(("FRAUD_", "REDIS_"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("FRAUD_DATA_DIR", str(world.data_dir))
    monkeypatch.setenv("FRAUD_MODEL_REPO", str(world.model_repo))
    monkeypatch.setenv("REDIS_URL", world.redis_url)
    read_settings.cache_clear()
    try:
        yield
    finally:
        read_settings.cache_clear()


def _training_join(world: World, day: date, names: list[str], as_of: datetime) -> pd.DataFrame:
    """Training's own functions, called here: the day's transactions (in shuffled order,
    so rows are matched by id, not by position), Feast's join as of availability, every
    feature column, the model's matrix; indexed by transaction id."""
    raw = world.data_dir / "raw"
    specs = list(F.declarations().specs)
    history = load_transactions(raw, day - history_days(specs), day, as_of)
    labels = labels_for(specs, raw, 0.0, arrived_before=as_of)
    t = history["event_time"]
    start = pd.Timestamp(_midnight(day))
    rows = history[(t >= start) & (t < start + pd.Timedelta(days=1))]
    sample = rows.sample(frac=1.0, random_state=3).rename(columns={"event_time": "event_timestamp"})
    store = open_store(world.data_dir, world.redis_url)
    joined = _available_join(sample.reset_index(drop=True), 0.0, store, None)
    x = F.assemble(names, feature_columns(joined, history, None, labels))
    return pd.DataFrame(x, columns=names, index=joined["transaction_id"].to_numpy())


def test_replay_of_a_past_day_equals_the_training_join(
    world: World, jobs_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The held-out day replayed: each row's vector equals the training join's (computed
    here by training's functions) and the vector training itself stored for the model's
    holdout; each score is the ONNX model on that vector; each decision the thresholds'."""
    day = world.last_day
    out = tmp_path / "replay.parquet"
    assert main(["replay", "--day", day.isoformat(), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]

    version = resolve(world.model_repo, "fraud")
    meta = load_metadata(version)
    names = meta.feature_names
    table = pq.read_table(out)
    info = json.loads(table.schema.metadata[METADATA_KEY])
    assert info["model_version"] == meta.version and info["day"] == day.isoformat()
    assert table.column_names == ["transaction_id", "event_time", *names, "score", "decision"]
    got = table.to_pandas()
    raw_rows = pq.read_table(partition_file(world.data_dir / "raw", "transactions", day))
    assert len(got) == raw_rows.num_rows > 1000
    assert set(got["transaction_id"]) == set(raw_rows.column("transaction_id").to_pylist())
    assert (got["event_time"].dt.date == day).all()
    assert got["event_time"].is_monotonic_increasing

    # Row for row: the training join's vector for the same transaction.
    x = got[names].to_numpy(np.float64)
    expected = _training_join(world, day, names, datetime.fromisoformat(info["labels_as_of"]))
    want = expected.loc[got["transaction_id"]].to_numpy(np.float64)
    np.testing.assert_allclose(x, want, rtol=1e-9, atol=0)
    # And the vectors training stored with the model for its holdout (this day is in it).
    hold = Holdout.read(version / HOLDOUT_FILE)
    assert hold.names == names
    stored = pd.DataFrame(hold.x, columns=names, index=hold.transaction_id)
    ids = got["transaction_id"][got["transaction_id"].isin(stored.index)]
    assert len(ids) > 0.9 * len(got)
    np.testing.assert_allclose(
        got.set_index("transaction_id").loc[ids, names].to_numpy(np.float64),
        stored.loc[ids].to_numpy(np.float64),
        rtol=1e-9,
        atol=0,
    )

    # Scores: the model in ONNX Runtime on those vectors.
    sess = ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    probs = sess.run([meta.output_name], {meta.input_name: want.astype(np.float32)})[0][:, 1]
    np.testing.assert_allclose(got["score"].to_numpy(), probs.astype(np.float64), rtol=1e-9)

    # Decisions: the model's thresholds, then the amount rule (default limit 5000).
    s, th = got["score"].to_numpy(), meta.thresholds
    decision = np.where(s >= th.decline, "decline", np.where(s >= th.review, "review", "approve"))
    amount = raw_rows.to_pandas().set_index("transaction_id").loc[got["transaction_id"], "amount"]
    over = amount.to_numpy(np.float32).astype(np.float64) > 5000.0  # as the service compares
    decision[(decision == "approve") & over] = "review"
    assert got["decision"].tolist() == decision.tolist()
    counts = got["decision"].value_counts()
    assert counts.get("decline", 0) > 0, counts  # the day holds frauds the model catches
    assert printed.startswith(f"replay {day}: {len(got):,} transactions, model fraud v")
    for kind in ("approve", "review", "decline"):
        assert f"{kind} {counts.get(kind, 0):,}" in printed
    assert str(out) in printed


def test_replay_refuses_a_day_without_data_and_an_unknown_version(
    world: World, jobs_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Exit 2 naming the day, or the version; nothing is written."""
    caplog.set_level(logging.ERROR)
    empty = world.start.replace(year=world.start.year - 1)
    assert main(["replay", "--day", empty.isoformat()]) == 2
    assert f"--day {empty}" in caplog.text and "no raw transactions partition" in caplog.text
    caplog.clear()
    day = world.last_day.isoformat()
    assert main(["replay", "--day", day, "--model-version", "999"]) == 2
    assert "--model-version 999" in caplog.text
    assert not list((world.data_dir / "replay").glob(f"**/day={empty}.parquet"))
    assert not list((world.data_dir / "replay").glob("**/v999/*"))
