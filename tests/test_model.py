"""The ONNX executor's CUDA-shaped code paths, run on CPU, and the runtime packaging."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import ModelError
from service.core.model import BUCKETS, LoadedModel, bucket_for, choose_providers, load_model
from tests.conftest import World

ROOT = Path(__file__).resolve().parent.parent


def test_bucketed_iobinding_path_equals_the_plain_path(world: World) -> None:
    """The GPU path (pad to a bucket, bind with IOBinding, cut the padding off) gives the
    plain path's scores, row for row, for sizes inside, on and past the buckets."""
    plain = load_model(world.model_repo, "fraud", "latest", producible_features())
    for variant in ("default", "tensor"):
        file = plain.path / ("model.onnx" if variant == "default" else plain.meta.variants[variant])
        sess = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        both = [
            LoadedModel(plain.meta, plain.path, [sess], ["CPUExecutionProvider"], variant, b)
            for b in (False, True)
        ]
        rng = np.random.default_rng(0)
        for n in (1, 3, 17, 64, 65, BUCKETS[-1] + 5):
            x = rng.normal(size=(n, len(plain.meta.features))).astype(np.float32)
            a, b = (m.predict(x) for m in both)
            assert a.shape == b.shape == (n,)
            np.testing.assert_array_equal(a, b, err_msg=f"{variant}, n={n}")
    assert [bucket_for(n) for n in (1, 3, 64, 65, 300)] == [1, 4, 64, 128, 300]


def test_provider_choice_falls_back_to_cpu_and_refuses_a_missing_gpu() -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA: the fallback is not observable here")
    assert choose_providers("auto") == ["CPUExecutionProvider"]
    assert choose_providers("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(ModelError, match="install onnxruntime-gpu"):
        choose_providers("cuda")
    with pytest.raises(ModelError, match="auto, cuda or cpu"):
        choose_providers("tpu")


def test_cpu_and_gpu_runtimes_are_never_installed_together() -> None:
    """Both wheels own the module ``onnxruntime``: no dependency list may hold both."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def runtimes(deps: list[str]) -> set[str]:
        names = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].strip() for d in deps}
        return names & {"onnxruntime", "onnxruntime-gpu"}

    assert runtimes(project["dependencies"]) == set()
    extras = project["optional-dependencies"]
    assert runtimes(extras["cpu"]) == {"onnxruntime"}
    assert runtimes(extras["gpu"]) == {"onnxruntime-gpu"}
    for name, deps in extras.items():
        assert len(runtimes(deps)) <= 1, name


def test_a_model_the_service_cannot_feed_is_refused(world: World, tmp_path: Path) -> None:
    """A string feature (the card's top country) or a non-float input would fail every
    batch after a swap; the load refuses it instead, so the old model keeps serving."""
    import json
    import shutil

    from fraud_scoring.model_repo import resolve

    for field, value, expected in (
        ("name", "card_top_country_30d", "card_top_country_30d"),
        ("dtype", "int64", "float32"),
    ):
        repo = tmp_path / field
        target = repo / "fraud" / "1"
        shutil.copytree(resolve(world.model_repo, "fraud"), target)
        meta = json.loads((target / "metadata.json").read_text())
        meta["features"][-1][field] = value
        (target / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(ModelError, match=expected):
            load_model(repo, "fraud", "latest", producible_features())


def test_each_variant_decides_with_its_own_thresholds(world: World) -> None:
    from cli.settings import Settings
    from service.core.scoring import policy_for

    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    meta = model.meta
    assert "tensor" in meta.variant_thresholds  # chosen from the MLP's own holdout scores
    tensor = LoadedModel(meta, model.path, model.sessions, model.providers, "tensor")
    settings = Settings(redis_url=world.redis_url)
    assert policy_for(model, settings).decline_threshold == meta.thresholds.decline
    assert policy_for(tensor, settings).decline_threshold == (
        meta.variant_thresholds["tensor"].decline
    )


def test_a_hole_in_a_usable_snapshot_is_defaulted_and_flagged() -> None:
    """A snapshot inside its TTL whose field is absent: the default is used, and the
    response lists the feature as missing (never a silent stand-in)."""
    from feast.protos.feast.types.Value_pb2 import Value
    from google.protobuf.timestamp_pb2 import Timestamp

    from fraud_scoring.events import Transaction
    from fraud_scoring.features import view_features, views
    from service.core.online_features import OnlineFeatureReader

    txn = Transaction.model_validate(
        {
            "transaction_id": "t1",
            "card_id": "c1",
            "merchant_id": "m1",
            "amount": 10.0,
            "currency": "USD",
            "event_time": "2026-01-16T12:00:00Z",
            "country": "US",
            "channel": "pos",
            "mcc": "5411",
        }
    )
    snap = Timestamp(seconds=int(txn.event_ts) - 3600).SerializeToString()
    replies: list[object] = []
    for view in views():
        fields = []
        for f in view_features(view):
            if f.name == "card_amount_mean_30d":
                fields.append(None)  # the hole
            elif f.dtype == "string":
                fields.append(Value(string_val="US").SerializeToString())
            elif f.dtype == "int64":
                fields.append(Value(int64_val=3).SerializeToString())
            else:
                fields.append(Value(float_val=1.5).SerializeToString())
        replies.append([*fields, snap])
    replies.append([[[], 0]])  # the session read script: no recent events, nothing older
    rows = OnlineFeatureReader("p").parse(replies, [txn])
    assert rows.missing == [["card_amount_mean_30d"]] and rows.stale == [[]]
    assert rows.columns["card_amount_mean_30d"][0] == 0.0  # its declared default
    assert rows.columns["card_txn_count_30d"][0] == 3


async def test_a_failed_version_is_tried_again_when_its_files_change(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new version seen half-copied (truncated ONNX file) is refused and the old one
    keeps serving; once its copy completes (the file's size and mtime change) the
    watcher tries it again and swaps it in. Unchanged, it is not tried again."""
    import asyncio
    import json
    import logging
    import shutil

    from cli.settings import Settings
    from fraud_scoring.model_repo import resolve
    from service.core.model import ModelHolder, watch_models

    src = resolve(world.model_repo, "fraud")
    repo = tmp_path / "repo"
    shutil.copytree(src, repo / "fraud" / "1")
    models = ModelHolder()
    models.swap(lambda: load_model(repo, "fraud", "1", producible_features()))
    onnx = (src / "model.onnx").read_bytes()
    v2 = repo / "fraud" / "2"
    shutil.copytree(src, v2)
    meta = json.loads((v2 / "metadata.json").read_text())
    (v2 / "metadata.json").write_text(json.dumps({**meta, "version": "2"}))
    (v2 / "model.onnx").write_bytes(onnx[: len(onnx) // 2])  # the copy is half done

    async def until(cond: Callable[[], bool]) -> None:
        async with asyncio.timeout(30):
            while not cond():
                await asyncio.sleep(0.02)

    def failures() -> int:
        return sum("cannot serve the new model" in r.getMessage() for r in caplog.records)

    settings = Settings(model_repo=repo, model_poll_s=0.05, execution_provider="cpu")
    caplog.set_level(logging.ERROR, logger="service.core.model")
    task = watch_models(models, settings)
    try:
        await until(lambda: failures() == 1)  # the half-copied version refused
        assert models.current is not None and models.current.version == "1"
        (v2 / "model.onnx").write_bytes(onnx)  # the copy completes
        await until(lambda: models.current is not None and models.current.version == "2")
    finally:
        task.cancel()
    assert failures() == 1  # refused once, never retried while its files were unchanged


def test_a_model_trained_for_another_snapshot_schedule_is_named_at_load(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """The world's model was trained with snapshots available at midnight (0 s, the
    batch before serving); a service whose batch lands 7,200 s later (the chart's
    CronJob) says so at load, naming the setting to train with."""
    from cli.settings import Settings
    from service.core.model import load_configured, snapshot_schedule_skew

    meta = load_model(world.model_repo, "fraud", "latest", producible_features()).meta
    assert meta.training_config["batch_available_after_s"] == 0
    assert snapshot_schedule_skew(meta, 0.0) is None
    settings = Settings(model_repo=world.model_repo, batch_available_after_s=7200)
    with caplog.at_level("WARNING", logger="service.core.model"):
        load_configured(settings)
    assert "from 0 to 7200 s after every midnight" in caplog.text
    assert "FRAUD_BATCH_AVAILABLE_AFTER_S=7200" in caplog.text
