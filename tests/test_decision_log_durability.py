"""Every answered decision is in the log and no refused one is, through a crash and a log
outage: the real service (killed with SIGKILL, stopped with SIGTERM), the log on a real
Redis-protocol server of its own (paused with SIGSTOP), the spool on disk shipped by the
next process (service/loop/spool.py)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fraud_scoring.redis_server import embedded_redis
from tests.conftest import Server, World, paused, start_server, stop_server, wait_until
from tests.test_decision_log import entries
from tests.test_degraded import own_redis  # noqa: F401 (fixture)
from tests.test_service import TXN


@pytest.fixture
def log_url() -> Iterator[str]:
    with embedded_redis() as url:
        yield url


class Load:
    """``threads`` callers sending /v1/score, each time a new transaction_id, until the
    block ends; ``status`` maps each id sent to its answer's status (0: no answer)."""

    def __init__(self, srv: Server, prefix: str, threads: int = 8, **headers: str) -> None:
        self.srv, self.prefix, self.headers = srv, prefix, headers
        self.status: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._send, args=(i,)) for i in range(threads)]

    def _send(self, worker: int) -> None:
        with httpx.Client(base_url=self.srv.url, timeout=10) as c:
            n = 0
            while not self.stop.is_set():
                tid = f"{self.prefix}-{worker}-{n}"
                n += 1
                try:
                    code = c.post(
                        "/v1/score", json={**TXN, "transaction_id": tid}, headers=self.headers
                    ).status_code
                except httpx.TransportError:
                    code = 0
                with self.lock:
                    self.status[tid] = code

    def answered(self, code: int = 200) -> set[str]:
        with self.lock:
            return {t for t, s in self.status.items() if s == code}

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def logged(url: str) -> Counter[str]:
    return Counter(e["transaction_id"] for e in entries(url))


def test_sigkill_under_load_loses_no_answered_decision(
    world: World, tmp_path: Path, log_url: str
) -> None:
    env = {"FRAUD_DECISION_LOG_URL": log_url, "FRAUD_DECISION_SPOOL_DIR": str(tmp_path / "s")}
    srv = start_server(world, tmp_path, **env)
    with Load(srv, "kill") as load:
        wait_until(lambda: len(load.answered()) >= 300, what="300 answers")
        srv.process.proc.kill()  # mid-load: the last answers are not in the log yet
        srv.process.proc.wait()
    answered = load.answered()
    again = start_server(world, tmp_path, **env)  # ships what the killed one spooled
    try:
        wait_until(lambda: answered <= set(logged(log_url)), what="every answer in the log")
        assert max(logged(log_url).values()) == 1
    finally:
        stop_server(again)


def test_sigterm_while_the_log_hangs_loses_no_answered_decision(
    world: World, tmp_path: Path, log_url: str
) -> None:
    env = {"FRAUD_DECISION_LOG_URL": log_url, "FRAUD_DECISION_SPOOL_DIR": str(tmp_path / "s")}
    # A small buffer: most of the outage's decisions wait in the spool's files only.
    srv = start_server(world, tmp_path, FRAUD_DECISION_LOG_BUFFER="50", **env)
    with Load(srv, "term") as load:
        wait_until(lambda: len(load.answered()) >= 100, what="100 answers")
        with paused(log_url):
            before = len(load.answered())
            wait_until(lambda: len(load.answered()) >= before + 300, what="300 more answers")
            srv.process.proc.terminate()  # under load, the log hanging
            srv.process.proc.wait(timeout=30)
            load.stop.set()
    answered = load.answered()
    assert answered - set(logged(log_url))  # some were only in the spool
    again = start_server(world, tmp_path, **env)
    try:
        wait_until(lambda: answered <= set(logged(log_url)), what="every answer in the log")
        assert max(logged(log_url).values()) == 1
    finally:
        stop_server(again)
    assert "left in" in srv.log.read_text()  # the stop said where they wait


def test_a_request_answered_503_is_not_logged_and_its_retry_is_once(
    world: World,
    tmp_path: Path,
    log_url: str,
    own_redis: str,  # noqa: F811
) -> None:
    # The online store hangs for longer than the requests' deadline and less than its
    # timeout: the batch in flight finishes after its callers were answered 503.
    srv = start_server(
        world,
        tmp_path,
        REDIS_URL=own_redis,
        FRAUD_DECISION_LOG_URL=log_url,
        FRAUD_REDIS_TIMEOUT_S="3",
        FRAUD_IDEMPOTENCY_TTL_S="3600",  # as deployed: a retry gets the first answer
    )
    try:
        with Load(srv, "late", **{"X-Request-Timeout-Ms": "100"}) as load:
            wait_until(lambda: len(load.answered()) >= 50, what="50 answers")
            with paused(own_redis):
                wait_until(lambda: len(load.answered(503)) >= 20, what="20 answered 503")
            after = len(load.answered())
            wait_until(lambda: len(load.answered()) >= after + 50, what="answers again")
        refused = load.answered(503)
        answered = load.answered()
        wait_until(lambda: answered <= set(logged(log_url)), what="every answer in the log")
        assert not refused & set(logged(log_url))
        with srv.client() as c:  # the callers retry: each retry's answer is logged once
            for tid in refused:
                r = c.post("/v1/score", json={**TXN, "transaction_id": tid})
                assert r.status_code == 200, r.text
        wait_until(lambda: refused <= set(logged(log_url)), what="the retries in the log")
        assert max(logged(log_url).values()) == 1
    finally:
        stop_server(srv)


def test_spool_reads_up_to_a_torn_tail_and_replays_only_what_no_live_process_holds(
    tmp_path: Path,
) -> None:
    from service.loop.spool import Spool, SpoolRecord, read_segment

    live = Spool(tmp_path, fsync_s=0)
    records = [SpoolRecord(f"t-{i}", b'{"n": %d}' % i, b"x" * i) for i in range(3)]
    held = live.append(records)
    dead = Spool(tmp_path)
    left = dead.append(records[:2])
    dead.close()  # its process is gone: the kernel let go of the lock
    with open(left, "ab") as f:
        f.write(b"\x00\x00\x00\x05torn")  # a write cut short by a power loss
    assert list(read_segment(left)) == records[:2]
    assert list(read_segment(held)) == records
    other = Spool(tmp_path)
    assert other.orphans() == [left]  # not the live one's segment
    other.release(left)
    assert not left.exists() and held.exists()


def test_a_shadowed_decision_is_spooled_before_its_answer_and_shipped_with_its_score(
    tmp_path: Path, log_url: str
) -> None:
    """A challenger's shadow run scores a micro-batch after its answers: the decisions are
    in the spool when answered (a SIGKILL during the shadow run loses only the shadow
    score: the next process ships them), and without a crash the log gets each decision
    once, with its shadow score."""
    import asyncio
    import dataclasses

    import numpy as np

    from fraud_scoring.event_log import RedisStreamProducer
    from fraud_scoring.events import Transaction
    from service.core.scoring import ScoreResult
    from service.loop.decision_log import DecisionLog
    from service.loop.spool import Spool, read_segment

    def batch(prefix: str) -> tuple[list[Transaction], list[ScoreResult]]:
        ids = [f"{prefix}-{i}" for i in range(3)]
        txns = [Transaction.model_validate({**TXN, "transaction_id": t}) for t in ids]
        results = [ScoreResult(t, "approve", 0.01, [], "1", [], []) for t in ids]
        return txns, results

    def producer() -> RedisStreamProducer:
        return RedisStreamProducer(log_url, "decisions", retention_s=0, timeout_s=2)

    async def crashed() -> None:
        spool = Spool(tmp_path / "a", fsync_s=0)
        dlog = DecisionLog(producer(), buffer_size=100, spool=spool)
        txns, results = batch("killed")
        dlog.submit(txns, np.zeros((3, 2)), ["a", "b"], results, shadow=True)
        dlog.answered(results, [True] * 3)
        assert spool.current is not None
        assert [r.key for r in read_segment(spool.current)] == [r.transaction_id for r in results]
        spool.close()  # the process dies here, its shadow run unfinished

    async def restarted() -> None:
        dlog = DecisionLog(producer(), buffer_size=100, spool=Spool(tmp_path / "a", fsync_s=0))
        dlog.start()
        await asyncio.to_thread(
            wait_until, lambda: len(logged(log_url)) >= 3, what="the spooled decisions"
        )
        await dlog.stop(5)

    async def finished() -> None:
        dlog = DecisionLog(producer(), buffer_size=100, spool=Spool(tmp_path / "b", fsync_s=0))
        dlog.start()
        txns, results = batch("shadowed")
        dlog.submit(txns, np.zeros((3, 2)), ["a", "b"], results, shadow=True)
        dlog.answered(results, [True] * 3)
        assert not dlog.pending  # held for the shadow score: the writer has nothing to ship
        assert not any(e["transaction_id"].startswith("shadowed") for e in entries(log_url))
        scored = [
            dataclasses.replace(r, challenger_version="2", challenger_score=0.5) for r in results
        ]
        dlog.shadow_scored(scored)
        await dlog.stop(5)

    asyncio.run(crashed())
    asyncio.run(restarted())
    asyncio.run(finished())
    by_id = {e["transaction_id"]: e for e in entries(log_url)}
    assert max(logged(log_url).values()) == 1
    assert {t: by_id[t]["challenger_score"] for t in by_id if t.startswith("killed")} == {
        f"killed-{i}": None for i in range(3)
    }
    assert {t: by_id[t]["challenger_score"] for t in by_id if t.startswith("shadowed")} == {
        f"shadowed-{i}": 0.5 for i in range(3)
    }


def test_an_unexpected_error_after_the_write_is_retried_not_fatal(
    tmp_path: Path, log_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's after-write step (the review queue) raising what it should not (a
    client fault, a bug: here a TypeError) does not end the writer: it is logged once
    with its traceback, the log reads as down, and the batch is retried until it goes
    through; the decisions after it are written too. (A review queue built on a plain
    client for a Redis Cluster URL once raised TypeError here, and every decision after
    the first ``review`` stayed in the spool until the next start.)"""
    import asyncio

    import numpy as np

    from fraud_scoring.event_log import RedisStreamProducer
    from fraud_scoring.events import Transaction
    from service.core.scoring import ScoreResult
    from service.loop.decision_log import DecisionLog
    from service.loop.spool import Spool

    calls = []

    async def flaky(batch: list[object]) -> None:
        calls.append(len(batch))
        if len(calls) <= 2:
            raise TypeError("unexpected keyword argument 'cluster'")

    async def run() -> tuple[str | None, str | None]:
        producer = RedisStreamProducer(log_url, "decisions", retention_s=0, timeout_s=2)
        dlog = DecisionLog(producer, 100, after_write=flaky, spool=Spool(tmp_path, fsync_s=0))
        dlog.start()
        for n in range(2):
            ids = [f"t{n}-{i}" for i in range(3)]
            txns = [Transaction.model_validate({**TXN, "transaction_id": t}) for t in ids]
            results = [ScoreResult(t, "review", 0.5, [], "1", [], []) for t in ids]
            dlog.submit(txns, np.zeros((3, 2)), ["a", "b"], results)
            dlog.answered(results, [True] * 3)
        down = await asyncio.to_thread(wait_until, lambda: dlog.readiness(), what="the error")
        await asyncio.to_thread(
            wait_until, lambda: not dlog.pending and dlog.readiness() is None, what="the retry"
        )
        up = dlog.readiness()
        await dlog.stop(5)
        return down, up

    with caplog.at_level("ERROR", logger="service.loop.decision_log"):
        down, up = asyncio.run(run())
    assert down is not None and down.startswith("unreachable") and up is None
    assert sorted(logged(log_url)) == [f"t{n}-{i}" for n in range(2) for i in range(3)]
    assert max(logged(log_url).values()) == 1
    errors = [r for r in caplog.records if "TypeError" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert sum(calls[2:]) == 6  # every decision went through after_write once it worked
