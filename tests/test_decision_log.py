"""The decision loop: every decision in the log (with the vector the model saw), a log
outage that scoring does not feel, feedback labels, and the daily compaction into the
offline store with labels joined by arrival time. Real service over HTTP, real
Redis-protocol servers (the log on its own server, so a test can kill it)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

from fraud_scoring.redis_server import embedded_redis
from fraud_scoring.settings import Settings
from service.model import load_configured
from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_service import TXN, held_out_day


@pytest.fixture(scope="module")
def log_url() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


@pytest.fixture(scope="module")
def logged(
    world: World, log_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(world, tmp_path_factory.mktemp("logged"), FRAUD_DECISION_LOG_URL=log_url)
    yield srv
    stop_server(srv)


def entries(url: str, stream: str = "decisions") -> list[dict]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(f[b"d"]) for _, f in client.xrange(stream)]
    finally:
        client.close()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_every_decision_is_logged_with_the_vector_the_model_saw(
    logged: Server, world: World, log_url: str
) -> None:
    rows = [{**r, "transaction_id": f"log-{r['transaction_id']}"} for r in held_out_day(world)]
    sent = rows[:60]
    with logged.client() as c:
        answers = {}
        for i in range(0, 50, 10):
            r = c.post("/v1/score/batch", json={"transactions": sent[i : i + 10]})
            assert r.status_code == 200, r.text
            answers.update({a["transaction_id"]: a for a in r.json()["results"]})
        for t in sent[50:]:
            r = c.post("/v1/score", json=t)
            assert r.status_code == 200, r.text
            answers[t["transaction_id"]] = r.json()
    ids = {t["transaction_id"] for t in sent}
    got = wait_until(
        lambda: (
            (e := [x for x in entries(log_url) if x["transaction_id"] in ids])
            and len(e) >= 60
            and e
        ),
        what="60 log entries",
    )
    assert len(got) == 60
    model = load_configured(Settings(model_repo=world.model_repo, execution_provider="cpu"))
    names = model.meta.feature_names
    x = np.array([[e["features"][n] for n in names] for e in got], dtype=np.float32)
    assert all(list(e["features"]) == names for e in got)  # the model's order
    # The logged vector is the one scored: the model gives the logged score back.
    np.testing.assert_allclose(model.predict(x), [e["score"] for e in got], rtol=1e-6)
    for e in got:
        a = answers[e["transaction_id"]]
        assert (e["score"], e["decision"], e["model_version"]) == (
            a["score"],
            a["decision"],
            a["model_version"],
        )
        assert e["reasons"] == [r["code"] for r in a["reasons"]]
        assert e["missing"] == a["features"]["missing"] and e["stale"] == a["features"]["stale"]
        assert e["transaction"]["card_id"] == next(
            t["card_id"] for t in sent if t["transaction_id"] == e["transaction_id"]
        )
        assert e["timing_ms"]["inference"] >= 0 and e["decided_at"] > 0
        assert e["challenger_score"] is None


def test_a_retried_transaction_id_is_one_entry(logged: Server, log_url: str) -> None:
    txn = {**TXN, "transaction_id": "retried-1"}
    with logged.client() as c:
        for _ in range(3):
            assert c.post("/v1/score", json=txn).status_code == 200
        # A marker after it: once it is in, the retries before it were handled too.
        assert (
            c.post("/v1/score", json={**TXN, "transaction_id": "retried-after"}).status_code == 200
        )
    wait_until(lambda: any(e["transaction_id"] == "retried-after" for e in entries(log_url)))
    assert sum(e["transaction_id"] == "retried-1" for e in entries(log_url)) == 1


def test_a_log_outage_does_not_fail_scoring(world: World, tmp_path: Path) -> None:
    rows = held_out_day(world)[:400]
    log_server = embedded_redis()  # entered by hand: the test stops it under load
    url = log_server.__enter__()
    srv = start_server(world, tmp_path, FRAUD_DECISION_LOG_URL=url, FRAUD_DECISION_LOG_BUFFER="100")
    try:
        with srv.client() as c, ThreadPoolExecutor(8) as pool:

            def score(t: dict) -> int:
                tid = f"out-{t['transaction_id']}"
                return c.post("/v1/score", json={**t, "transaction_id": tid}).status_code

            assert set(pool.map(score, rows[:100])) == {200}
            wait_until(lambda: len(entries(url)) >= 100, what="first 100 logged")
            during = pool.map(score, rows[100:250])  # requests keep coming ...
            log_server.__exit__(None, None, None)  # ... while the log's server dies
            # 150 more than the buffer's 100 after it died: some must be dropped.
            assert set(during) | set(pool.map(score, rows[250:400])) == {200}
            m = wait_until(
                lambda: (
                    (t := c.get("/metrics").text) and metric(t, "fraud_decision_log_up") == 0 and t
                ),
                what="the log marked down",
            )
            # Scoring went on: what the buffer could not hold was dropped and counted.
            assert metric(m, "fraud_decision_log_dropped_total") > 0
            assert metric(m, "fraud_decision_log_buffered") <= 100
            assert c.get("/readyz").status_code == 200  # still serving
            after = {**TXN, "transaction_id": "after-outage"}
            assert c.post("/v1/score", json=after).status_code == 200
    finally:
        stop_server(srv)
        log_server.__exit__(None, None, None)
