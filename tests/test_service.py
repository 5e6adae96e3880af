"""The scoring service over real HTTP (uvicorn subprocess), real Redis and a real model."""

from __future__ import annotations

import contextlib
import json
import shutil
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fraud_scoring.events import raw_row_to_event
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.storage import partition_dir
from tests.conftest import Server, World, rejections, start_server, stop_server

TXN = {
    "transaction_id": "t-1",
    "card_id": "c0000001",
    "merchant_id": "m00001",
    "amount": 42.5,
    "currency": "USD",
    "event_time": "2026-01-16T12:00:00+00:00",
    "country": "US",
    "channel": "pos",
    "mcc": "5411",
}


def held_out_day(world: World) -> list[dict]:
    t = pq.read_table(
        partition_dir(world.data_dir / "raw", "transactions", world.last_day) / "part-0.parquet"
    ).to_pylist()
    # Label columns ride along (the service ignores unknown fields).
    labels = ("is_fraud", "fraud_pattern")
    return [{**raw_row_to_event(r), **{k: r[k] for k in labels}} for r in t]


def test_score_answers_with_decision_reasons_timing(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/score", json=TXN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["transaction_id"] == "t-1"
    assert body["decision"] in ("approve", "review", "decline")
    assert 0 <= body["score"] <= 1
    assert body["model_version"] == "1"
    assert set(body["features"]) == {"missing", "stale", "inexact"}
    for k in ("feature_read_ms", "inference_ms", "total_ms", "queue_ms"):
        assert body["timing"][k] >= 0
    assert isinstance(body["reasons"], list)


def test_fraud_scores_higher_than_normal_on_held_out_day(server: Server, world: World) -> None:
    rows = held_out_day(world)
    rng = np.random.default_rng(0)
    fraud = [r for r in rows if r["is_fraud"]]
    normal = [rows[i] for i in rng.choice(len(rows), 400, replace=False) if not rows[i]["is_fraud"]]
    assert {r["fraud_pattern"] for r in fraud} >= {
        "card_testing",
        "account_takeover",
        "compromised_merchant",
    }
    scored: list[tuple[dict, dict]] = []
    with server.client() as c:
        group = fraud + normal
        for i in range(0, len(group), 64):
            r = c.post("/v1/score/batch", json={"transactions": group[i : i + 64]})
            assert r.status_code == 200, r.text
            for res, sent in zip(r.json()["results"], group[i : i + 64], strict=True):
                assert res["transaction_id"] == sent["transaction_id"]  # order kept
                scored.append((sent, res))
    normal_scores = np.array([res["score"] for s, res in scored if not s["is_fraud"]])
    for pattern in ("card_testing", "account_takeover", "compromised_merchant"):
        scores = [res["score"] for s, res in scored if s["fraud_pattern"] == pattern]
        assert np.median(scores) > np.quantile(normal_scores, 0.9), pattern
    flagged_fraud = np.mean([res["decision"] != "approve" for s, res in scored if s["is_fraud"]])
    flagged_normal = np.mean(
        [res["decision"] != "approve" for s, res in scored if not s["is_fraud"]]
    )
    assert flagged_fraud > 0.5 > 0.05 > flagged_normal, (flagged_fraud, flagged_normal)


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        ({"amount": None}, "amount", "number"),
        ({"amount": "abc"}, "amount", "number"),
        ({"amount": -5}, "amount", "greater than 0"),
        ({"currency": "XYZ"}, "currency", "ISO 4217"),
        ({"country": "ZZ"}, "country", "ISO 3166"),
        ({"event_time": "2026-01-16T12:00:00"}, "event_time", "timezone"),
        ({"channel": "fax"}, "channel", "pos"),
        ({"mcc": "54"}, "mcc", "pattern"),
        ({"transaction_id": ""}, "transaction_id", "at least 1"),
    ],
)
def test_bad_fields_get_422_naming_the_field(
    server: Server, patch: dict, field: str, fragment: str
) -> None:
    body = {**TXN, **patch}
    with server.client() as c:
        r = c.post("/v1/score", json=body)
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert any(e["field"] == field and fragment in e["message"] for e in errors), errors


def test_missing_field_and_non_json_body(server: Server) -> None:
    with server.client() as c:
        body = {k: v for k, v in TXN.items() if k != "card_id"}
        r = c.post("/v1/score", json=body)
        assert r.status_code == 422
        assert r.json()["detail"][0]["field"] == "card_id"
        r = c.post("/v1/score", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422
        assert "JSON" in r.json()["detail"][0]["message"]
        r = c.post("/v1/score", headers={"X-Request-Timeout-Ms": "-3"}, json=TXN)
        assert r.status_code == 422
        assert r.json()["detail"][0]["field"] == "header.X-Request-Timeout-Ms"


def test_batch_limits(server: Server) -> None:
    """A call may carry at most half the admission capacity (64 by default): a call
    that large fits a key's fair share beside another key's calls."""
    with server.client() as c:
        many = [{**TXN, "transaction_id": f"t-{i}"} for i in range(65)]
        r = c.post("/v1/score/batch", json={"transactions": many})
        assert r.status_code == 413
        assert r.json()["detail"][0]["field"] == "transactions"
        assert "at most 64 per call" in r.json()["detail"][0]["message"]
        r = c.post("/v1/score/batch", json={"transactions": []})
        assert r.status_code == 422
        bad = [TXN, {**TXN, "amount": -1}]
        r = c.post("/v1/score/batch", json={"transactions": bad})
        assert r.status_code == 422
        assert r.json()["detail"][0]["field"] == "transactions.1.amount"


def test_unknown_card_and_merchant_are_not_errors(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/score", json={**TXN, "card_id": "never-seen", "merchant_id": "nope"})
    assert r.status_code == 200
    body = r.json()
    assert "card_txn_count_30d" in body["features"]["missing"]
    assert "merchant_fraud_rate_90d" in body["features"]["missing"]
    assert any(x["code"] == "NO_CARD_HISTORY" for x in body["reasons"])
    assert not any(x["code"] == "STALE_CARD_HISTORY" for x in body["reasons"])


def test_stale_snapshot_is_flagged_not_used(server: Server, world: World) -> None:
    card = held_out_day(world)[0]["card_id"]
    late = (world.last_day + timedelta(days=5)).isoformat() + "T12:00:00+00:00"
    early = world.start.isoformat() + "T12:00:00+00:00"  # snapshot newer than the txn
    with server.client() as c:
        for when in (late, early):
            r = c.post("/v1/score", json={**TXN, "card_id": card, "event_time": when})
            assert r.status_code == 200
            assert "card_txn_count_30d" in r.json()["features"]["stale"], when
            codes = {x["code"] for x in r.json()["reasons"]}  # stale is not absent
            assert "STALE_CARD_HISTORY" in codes and "NO_CARD_HISTORY" not in codes, when
        fresh = held_out_day(world)[0]
        r = c.post("/v1/score", json=fresh)
        assert r.json()["features"]["stale"] == []
        assert "card_txn_count_30d" not in r.json()["features"]["missing"]


def test_health_ready_and_metrics(server: Server) -> None:
    with server.client() as c:
        assert c.get("/healthz").status_code == 200
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["model_version"] == "1"
        c.post("/v1/score", json=TXN)
        text = c.get("/metrics").text
    for name in (
        "fraud_batch_size_bucket",
        "fraud_batch_queue_time_seconds_bucket",
        "fraud_batch_compute_time_seconds_bucket",
        "fraud_decisions_total",
        "fraud_request_duration_seconds_bucket",
        "fraud_batch_queue_depth",
        "fraud_score_bucket",  # the score distribution (service/loop/drift.py)
        "fraud_drift_reference",
    ):
        assert name in text, name
    assert 'model_version="1"' in text


def _copy_model(world: World, dest: Path, edit) -> Path:
    src = resolve(world.model_repo, "fraud")
    target = dest / "fraud" / "1"
    shutil.copytree(src, target)
    meta = json.loads((target / "metadata.json").read_text())
    edit(meta, target)
    (target / "metadata.json").write_text(json.dumps(meta))
    return dest


def _unknown_feature(meta: dict, _: Path) -> None:
    meta["features"][-1]["name"] = "card_shoe_size"


def _corrupt_onnx(_: dict, target: Path) -> None:
    (target / "model.onnx").write_bytes(b"garbage")


@pytest.mark.parametrize(
    ("edit", "problem"), [(_unknown_feature, "card_shoe_size"), (_corrupt_onnx, "model.onnx")]
)
def test_only_model_that_cannot_load_is_not_ready_until_a_good_one_appears(
    world: World, tmp_path: Path, edit, problem: str
) -> None:
    """The only published version is unfeedable or corrupt: the service stays up, says
    why it is not ready, answers scoring with 503, and keeps looking for a model."""
    from tests.conftest import wait_until

    repo = _copy_model(world, tmp_path / "models", edit)
    srv = start_server(
        World(world.data_dir, repo, world.redis_url, world.start, world.days),
        tmp_path,
        wait_for="/healthz",
        FRAUD_MODEL_POLL_S="0.2",
    )
    try:
        with srv.client() as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503 and problem in ready.json()["model"], ready.text
            r = c.post("/v1/score", json=TXN)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5"
            assert problem in r.json()["detail"][0]["message"]
            assert rejections(c.get("/metrics").text, "no_model") >= 1
            incoming = repo / "fraud" / ".incoming"
            shutil.copytree(resolve(world.model_repo, "fraud"), incoming)
            meta = load_metadata(incoming)
            (incoming / "metadata.json").write_text(
                meta.model_copy(update={"version": "2"}).model_dump_json()
            )
            incoming.rename(repo / "fraud" / "2")
            wait_until(
                lambda: c.get("/readyz").status_code == 200,
                timeout=20,
                what="the good version to be served",
                proc=srv.process.proc,
            )
            assert c.post("/v1/score", json=TXN).json()["model_version"] == "2"
        assert srv.log.read_text().count(problem) >= 1  # the problem is logged
    finally:
        stop_server(srv)


async def test_embedded_redis_is_started_only_when_asked(world: World) -> None:
    from cli.settings import Settings
    from fraud_scoring.redis_server import RedisNotConfigured
    from service.resources import open_resources

    settings = Settings(redis_url=None, data_dir=world.data_dir, model_repo=world.model_repo)
    assert settings.redis_url is None
    with pytest.raises(RedisNotConfigured, match="REDIS_URL"):
        async with open_resources(settings):
            pass
    asked = settings.model_copy(update={"embedded_redis": True})
    async with open_resources(asked) as res:
        assert await res.redis.execute_command("PING")
        assert res.models.current is not None


def test_reload_keeps_old_model_when_new_one_is_broken(world: World, tmp_path: Path) -> None:
    repo = _copy_model(world, tmp_path / "models", lambda m, p: None)
    srv = start_server(
        World(world.data_dir, repo, world.redis_url, world.start, world.days),
        tmp_path,
        FRAUD_MODEL_POLL_S="600",
    )
    try:
        broken = repo / "fraud" / "2"
        shutil.copytree(repo / "fraud" / "1", broken)
        (broken / "model.onnx").write_bytes(b"garbage")
        with srv.client() as c:
            r = c.post("/v1/models/reload", headers={"Content-Type": "application/json"})
            assert r.status_code == 409 and "model.onnx" in r.json()["detail"][0]["message"]
            assert c.post("/v1/score", json=TXN).json()["model_version"] == "1"
            shutil.rmtree(broken)
            good = repo / "fraud" / "3"
            shutil.copytree(repo / "fraud" / "1", good)
            meta = load_metadata(good)
            (good / "metadata.json").write_text(
                meta.model_copy(update={"version": "3"}).model_dump_json()
            )
            r = c.post("/v1/models/reload", headers={"Content-Type": "application/json"})
            assert r.status_code == 200 and r.json()["serving_version"] == "3"
            assert c.post("/v1/score", json=TXN).json()["model_version"] == "3"
    finally:
        stop_server(srv)


def test_not_ready_until_a_model_exists(world: World, tmp_path: Path) -> None:
    empty = World(world.data_dir, tmp_path / "none", world.redis_url, world.start, world.days)
    srv = start_server(empty, tmp_path, wait_for="/healthz")
    try:
        with srv.client() as c:
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["model"] == "not loaded"
            r = c.post("/v1/score", json=TXN)
            assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    finally:
        stop_server(srv)


def test_new_versions_are_picked_up_while_serving(world: World, tmp_path: Path) -> None:
    from tests.conftest import wait_until

    repo = _copy_model(world, tmp_path / "models", lambda m, p: None)
    srv = start_server(
        World(world.data_dir, repo, world.redis_url, world.start, world.days),
        tmp_path,
        FRAUD_MODEL_POLL_S="0.2",
    )
    try:
        tmp = repo / "fraud" / ".incoming"
        shutil.copytree(repo / "fraud" / "1", tmp)
        meta = load_metadata(tmp)
        (tmp / "metadata.json").write_text(
            meta.model_copy(update={"version": "2"}).model_dump_json()
        )
        tmp.rename(repo / "fraud" / "2")  # published atomically, as the training job does
        with srv.client() as c:
            wait_until(
                lambda: c.get("/readyz").json()["model_version"] == "2",
                timeout=20,
                what="model v2 to be served",
            )
            assert c.post("/v1/score", json=TXN).json()["model_version"] == "2"
    finally:
        stop_server(srv)


def test_one_trace_per_request_with_its_stages(world: World, tmp_path: Path) -> None:
    from tests.conftest import wait_until

    srv = start_server(
        world, tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_BSP_SCHEDULE_DELAY="50"
    )
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json={**TXN, "transaction_id": "traced"}).status_code == 200

        def spans() -> list[dict]:
            # The console exporter prints one JSON object per span, between log lines.
            text, decoder, found, at = srv.log.read_text(), json.JSONDecoder(), [], 0
            while (at := text.find("{", at)) != -1:
                try:
                    obj, at = decoder.raw_decode(text, at)
                    found.append(obj)
                except json.JSONDecodeError:
                    at += 1
            return [s for s in found if "context" in s]

        def stages_of_scored_trace() -> set[str] | None:
            # Children end (and may be exported) before their root: wait for the whole trace.
            got = spans()
            roots = [s for s in got if s["name"] == "score"]
            if not roots:
                return None
            trace_id = roots[0]["context"]["trace_id"]
            names = {s["name"] for s in got if s["context"]["trace_id"] == trace_id}
            return names if names >= wanted else None

        wanted = {"score", "validation", "feature_read", "inference", "decision"}
        names = wait_until(stages_of_scored_trace, timeout=20, what="the whole exported trace")
        assert names >= wanted
    finally:
        stop_server(srv)


def test_redis_outage_answers_503_never_500(world: World, tmp_path: Path) -> None:
    """No decision on made-up features: a failed feature read is a 503 the caller can
    retry or route to its fallback, for the batched and the naive path alike."""
    from batch_jobs.batch import mark_materialized
    from fraud_scoring.redis_server import embedded_redis
    from tests.conftest import mark_declared

    for batching in ("true", "false"):
        with contextlib.ExitStack() as own_redis:
            url = own_redis.enter_context(embedded_redis())  # a server this test may stop
            mark_materialized(url, "fraud_scoring")  # not empty: this test is the outage
            mark_declared(url)
            srv = start_server(
                world, tmp_path, REDIS_URL=url, FRAUD_BATCHING=batching, FRAUD_REDIS_TIMEOUT_S="0.5"
            )
            try:
                with srv.client() as c:
                    assert c.post("/v1/score", json=TXN).status_code == 200
                    own_redis.close()  # Redis goes away
                    r = c.post("/v1/score", json=TXN)
                    assert r.status_code == 503, (batching, r.text)
                    assert r.json()["detail"][0]["message"].startswith("feature store unavailable")
                    assert r.headers["Retry-After"] == "1"
                    ready = c.get("/readyz")
                    assert ready.status_code == 503
                    assert ready.json()["redis"].startswith("feature store unreachable")
                    for answer in (r.text, ready.text):  # no internals in answers
                        assert "127.0.0.1" not in answer and "Connection" not in answer
                    assert "feature_store" in c.get("/metrics").text
            finally:
                stop_server(srv)


def test_naive_path_serves_a_batch_larger_than_the_redis_pool(world: World, tmp_path: Path) -> None:
    """Without batching each transaction reads on its own connection: past the pool's 64
    they wait for a free one instead of failing as "feature store unavailable"."""
    srv = start_server(
        world,
        tmp_path,
        FRAUD_BATCHING="false",
        FRAUD_MAX_INFLIGHT="256",
        FRAUD_MAX_BATCH_REQUEST="150",
    )
    try:
        txns = [{**TXN, "transaction_id": f"n{i}"} for i in range(150)]
        with srv.client() as c:
            r = c.post("/v1/score/batch", json={"transactions": txns})
        assert r.status_code == 200, r.text
        assert [x["transaction_id"] for x in r.json()["results"]] == [
            t["transaction_id"] for t in txns
        ]
    finally:
        stop_server(srv)


def _sample_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_aggregate_across_workers(world: World, tmp_path: Path) -> None:
    """With FRAUD_WORKERS=2 any worker's /metrics counts every worker's requests."""
    import concurrent.futures

    import httpx

    from tests.conftest import wait_until

    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    srv = start_server(
        world, tmp_path, FRAUD_WORKERS="2", PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)
    )
    sent = 0

    def one(i: int) -> int:
        # A fresh connection each time, so the kernel hands requests to both workers.
        with httpx.Client(base_url=srv.url, headers={"Connection": "close"}) as c:
            return c.post("/v1/score", json={**TXN, "transaction_id": f"w-{i}"}).status_code

    def both_workers_served() -> bool:
        nonlocal sent
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(sent, sent + 16)))
        assert codes == [200] * 16
        sent += 16
        return len(list(metrics_dir.glob("counter_*.db"))) >= 2  # a decision in each

    try:
        wait_until(both_workers_served, timeout=60, what="both workers to serve requests")
        for _ in range(4):  # whichever worker answers the scrape, it reports all of them
            with httpx.Client(base_url=srv.url, headers={"Connection": "close"}) as c:
                text = c.get("/metrics").text
            assert _sample_sum(text, "fraud_decisions_total") == sent
            assert _sample_sum(text, "fraud_request_duration_seconds_count") == sent
            assert _sample_sum(text, "fraud_score_count") == sent  # bulk-observed per batch
            assert "fraud_batch_queue_depth" in text
    finally:
        stop_server(srv)


def test_metrics_ignore_a_multiprocess_dir_set_after_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing Feast sets PROMETHEUS_MULTIPROC_DIR to a directory of its own after our
    metrics already live in memory; /metrics must still answer them (it was empty)."""
    from service import telemetry

    if telemetry._multiprocess():
        pytest.skip("this test process keeps prometheus_client values in files")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert b"python_gc_objects_collected_total" in telemetry.exposition()
