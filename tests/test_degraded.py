"""The declared degraded mode and the Redis circuit breaker, over real HTTP against the
test's own real Redis-protocol server (never the shared world's, which stays intact).

* The store loses its batch features (FLUSHALL, as after a restart without persistence):
  /readyz and ``fraud_batch_features_present`` say so, and FRAUD_DEGRADED_POLICY decides
  the answer: ``refuse`` 503, ``rules`` a rules-only decision marked ``degraded``.
* The server hangs (SIGSTOP of the test's own server): after FRAUD_BREAKER_FAILURES
  timeouts the breaker opens and requests are answered at once; /readyz agrees; the
  service recovers once the server answers again, within a few seconds even when every
  request's deadline is shorter than the Redis timeout (the probe is not a request's).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from batch_jobs.batch import mark_materialized
from cli.settings import Settings
from fraud_scoring import features as F
from fraud_scoring.features import views
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.redis_server import embedded_redis
from tests.conftest import (
    World,
    mark_declared,
    paused,
    rejections,
    start_server,
    stop_server,
    wait_until,
)
from tests.test_service import TXN

PROJECT = "fraud_scoring"  # feature_repo/feature_store.yaml
MODEL = Settings().model_name
FAST_CHECKS = {"FRAUD_BATCH_MARKER_CHECK_S": "0.1"}


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A server this test may flush or stop, holding the batch job's markers."""
    with embedded_redis() as url:
        mark_materialized(url, PROJECT)
        mark_declared(url)
        yield url


def txn(i: int, **over: object) -> dict[str, object]:
    return TXN | {"transaction_id": f"degraded-{i}-{time.monotonic_ns()}"} | over


def present(c: httpx.Client) -> dict[str, str]:
    """``fraud_batch_features_present`` per view, from /metrics."""
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("fraud_batch_features_present{"):
            view = line.split('view="')[1].split('"')[0]
            out[view] = line.rsplit(" ", 1)[1]
    return out


@pytest.mark.parametrize("policy", ["refuse", "rules"])
def test_flushed_store_is_declared_and_the_policy_applies(
    world: World, tmp_path: Path, own_redis: str, policy: str
) -> None:
    srv = start_server(
        world, tmp_path, REDIS_URL=own_redis, FRAUD_DEGRADED_POLICY=policy, **FAST_CHECKS
    )
    try:
        with srv.client() as c:
            ok = c.post("/v1/score", json=txn(0))
            assert ok.status_code == 200 and ok.json()["degraded"] is False
            assert set(present(c).values()) == {"1.0"}
            redis.Redis.from_url(own_redis).flushall()  # a restart without persistence

            wait_until(lambda: set(present(c).values()) == {"0.0"}, what="gauge at 0")
            assert set(present(c)) == {v.name for v in views()}
            ready = c.get("/readyz")
            big = c.post("/v1/score", json=txn(1, amount=9999.0))
            if policy == "refuse":
                assert ready.status_code == 503
                assert ready.json()["batch_features"].startswith("none in the store for")
                assert big.status_code == 503, big.text
                assert big.json()["detail"][0]["code"] == "no_batch_features"
                assert big.json()["detail"][0]["message"].startswith("no batch features")
                assert rejections(c.get("/metrics").text, "no_batch_features") >= 1
            else:
                assert ready.status_code == 200
                assert "batch_features" in ready.json()["degraded"]
                assert big.status_code == 200, big.text
                body = big.json()
                assert body["degraded"] is True and body["score"] is None
                assert body["model_version"] == "rules-only"
                assert body["decision"] == "review"  # the amount rule still holds
                codes = [r["code"] for r in body["reasons"]]
                assert codes[:2] == ["DEGRADED_RULES_ONLY", "RULE_AMOUNT_OVER_LIMIT"]
                assert c.post("/v1/score", json=txn(2)).json()["decision"] == "approve"
                assert 'fraud_degraded_decisions_total{cause="no_batch_features"} 2.0' in (
                    c.get("/metrics").text
                )
                # Every answered decision is logged, the rules-only ones too.
                log = redis.Redis.from_url(own_redis)

                def rules_logged() -> list[dict]:
                    entries = [json.loads(f[b"d"]) for _, f in log.xrange("decisions")]
                    return [e for e in entries if e["model_version"] == "rules-only"]

                wait_until(lambda: len(rules_logged()) == 2, what="rules-only decisions logged")
                first = rules_logged()[0]
                assert first["score"] is None and first["degraded"] == "no_batch_features"
                assert first["decision"] == "review" and "card_txn_count_10m" in first["features"]

            mark_materialized(own_redis, PROJECT)  # the batch job runs again
            mark_declared(own_redis)  # and backfills the declared states
            wait_until(
                lambda: (r := c.get("/readyz")).status_code == 200 and "degraded" not in r.json(),
                what="ready, not degraded",
            )
            assert c.post("/v1/score", json=txn(3)).json()["degraded"] is False
    finally:
        stop_server(srv)


def test_an_emptied_store_is_refused_from_its_first_read(
    world: World, tmp_path: Path, own_redis: str
) -> None:
    """The markers travel with every micro-batch's read: the first request after a
    flush is refused, whatever the watcher's period (here a minute); so is a declared
    state the batch job has not backfilled, by name."""
    srv = start_server(world, tmp_path, REDIS_URL=own_redis, FRAUD_BATCH_MARKER_CHECK_S="60")
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json=txn(0)).status_code == 200
            redis.Redis.from_url(own_redis).flushall()
            first = c.post("/v1/score", json=txn(1))
            assert first.status_code == 503, first.text
            assert first.json()["detail"][0]["code"] == "no_batch_features"
            mark_materialized(own_redis, PROJECT)
            names = set(load_metadata(resolve(world.model_repo, MODEL)).feature_names)
            read = [s for s in F.declarations().specs if set(s.feature_names()) & names]
            assert read, "the test model reads declared features"
            refused = c.post("/v1/score", json=txn(2))
            assert refused.status_code == 503, refused.text
            message = refused.json()["detail"][0]["message"]
            assert f"declared state {read[0].id}" in message, message
            assert c.get("/readyz").status_code == 503
            mark_declared(own_redis)
            assert c.post("/v1/score", json=txn(3)).status_code == 200
    finally:
        stop_server(srv)


def test_hung_store_opens_the_breaker_and_recovers(
    world: World, tmp_path: Path, own_redis: str
) -> None:
    srv = start_server(
        world,
        tmp_path,
        REDIS_URL=own_redis,
        FRAUD_REDIS_TIMEOUT_S="0.3",
        FRAUD_BREAKER_FAILURES="2",
        FRAUD_BREAKER_OPEN_S="1",
        FRAUD_BATCH_MARKER_CHECK_S="0.5",
    )
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json=txn(0)).status_code == 200
            with paused(own_redis):
                # Until the breaker opens, each request waits out the Redis timeout.
                wait_until(
                    lambda: c.get("/readyz").json().get("redis", "").endswith("(circuit open)"),
                    what="breaker open",
                )
                answers = []
                for i in range(20):
                    t0 = time.perf_counter()
                    r = c.post("/v1/score", json=txn(10 + i))
                    answers.append((r.status_code, time.perf_counter() - t0))
                    assert r.json()["detail"] == [
                        {
                            "code": "feature_store",
                            "message": "feature store unavailable (circuit open)",
                        }
                    ]
                # Answered at once, not after the 0.3 s timeout each (requests never
                # probe: the background task does).
                assert sum(s for _, s in answers) < 20 * 0.3 / 2, answers
                assert {s for s, _ in answers} == {503}
            wait_until(lambda: c.get("/readyz").status_code == 200, what="ready again")
            assert c.post("/v1/score", json=txn(99)).status_code == 200
    finally:
        stop_server(srv)


def test_breaker_closes_after_a_hang_even_when_request_deadlines_are_shorter(
    world: World, tmp_path: Path, own_redis: str
) -> None:
    """Requests whose deadline (100 ms) is shorter than the Redis timeout (1 s) keep
    arriving through a hang; once the server answers again the background probe closes
    the breaker within a few seconds, and the log has no traceback per refused request."""
    srv = start_server(
        world,
        tmp_path,
        REDIS_URL=own_redis,
        FRAUD_REQUEST_TIMEOUT_MS="100",
        FRAUD_REDIS_TIMEOUT_S="1",
        FRAUD_BREAKER_FAILURES="2",
        FRAUD_BREAKER_OPEN_S="1",
    )
    stop = threading.Event()

    sent = [0]  # calls answered (or failed) so far, all threads

    def load() -> None:
        with srv.client() as c:
            i = 0
            while not stop.is_set():
                i += 1
                with contextlib.suppress(httpx.HTTPError):
                    c.post("/v1/score", json=txn(1000 + i))
                sent[0] += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json=txn(0)).status_code == 200
            for t in threads:
                t.start()
            with paused(own_redis):
                wait_until(
                    lambda: c.get("/readyz").json().get("redis", "").endswith("(circuit open)"),
                    what="breaker open",
                )
                # The outage goes on under load (this is the thing tested): 200 more calls.
                during = sent[0]
                wait_until(lambda: sent[0] - during >= 200, what="200 calls during the outage")
            resumed = time.monotonic()
            wait_until(
                lambda: c.post("/v1/score", json=txn(1)).status_code == 200,
                timeout=3,
                what="scoring answers again within 3 s of the store",
            )
            assert time.monotonic() - resumed < 3
            assert c.get("/readyz").status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join()
        stop_server(srv)
    text = srv.log.read_text()
    assert text.count("Traceback") == 0, text[-3000:]
    assert text.count("circuit open") == 1 and text.count("circuit closed") == 1, text[-3000:]


def test_a_full_store_still_decides_and_says_it_records_nothing(
    world: World, tmp_path: Path, own_redis: str
) -> None:
    """Redis at maxmemory with noeviction refuses every write (the id claims, the
    recording) but answers reads: each call is still decided (200, not 503), the
    refusals are counted, /readyz stays ready and names the store read-only, and it
    clears once the store takes writes again."""
    client = redis.Redis.from_url(own_redis)
    srv = start_server(
        world, tmp_path, REDIS_URL=own_redis, FRAUD_IDEMPOTENCY_TTL_S="3600", **FAST_CHECKS
    )
    try:
        with srv.client() as c:
            assert c.post("/v1/score", json=txn(0)).status_code == 200
            assert "store_writes" not in c.get("/readyz").json()
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)  # below what it holds: every write refused
            answers = [c.post("/v1/score", json=txn(i)) for i in range(1, 21)]
            assert [a.status_code for a in answers] == [200] * 20, answers[-1].text
            assert all(a.json()["model_version"] != "rules-only" for a in answers)
            ready = c.get("/readyz")
            assert ready.status_code == 200 and "refuses writes" in ready.json()["store_writes"]
            metrics = c.get("/metrics").text
            assert 'fraud_store_writes_refused_total{what="claim"} 20.0' in metrics
            client.config_set("maxmemory", 0)
            assert c.post("/v1/score", json=txn(21)).status_code == 200
            assert "store_writes" not in c.get("/readyz").json()
    finally:
        client.config_set("maxmemory", 0)
        client.close()
        stop_server(srv)
    log = srv.log.read_text()
    assert log.count("refuses writes") == 1, log[-3000:]
