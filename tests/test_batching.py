"""The dynamic batcher: size and time bounds, queue limit, deadlines, cancellation, and
exact equality with the unbatched path on the real model and Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from service.core.batching import Batcher, BatchStats, DeadlineExceeded, QueueFull, TimedOut
from tests.conftest import World, start_server, stop_server
from tests.test_service import TXN, held_out_day


class Recorder:
    """A batch function that records what reached 'the model'."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s
        self.gate: asyncio.Event | None = None

    async def __call__(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return [i * 10 for i in items]

    @property
    def seen(self) -> list[int]:
        return [i for b in self.batches for i in b]


def far() -> float:
    return time.monotonic() + 30


async def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the event loop until ``cond()`` holds (fail after ``timeout`` s)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)


async def test_batches_fill_to_the_size_bound_under_load() -> None:
    rec = Recorder(delay_s=0.01)
    b = Batcher(rec, max_batch_size=8, max_queue_delay_s=0.05, max_queue_size=1000)
    b.start()
    results = await asyncio.gather(*(b.submit(i, far()) for i in range(40)))
    await b.stop()
    assert results == [i * 10 for i in range(40)]
    assert max(len(x) for x in rec.batches) == 8
    assert sum(len(x) == 8 for x in rec.batches) >= 4
    assert rec.seen == list(range(40))  # FIFO


def recorded_waits(stats: BatchStats) -> list[float]:
    """Hook ``stats`` so every batch's queue waits (as the batcher measured them) land in
    the returned list."""
    waits: list[float] = []
    stats.on_batch = lambda _size, _compute_s, w: waits.extend(w)
    return waits


async def test_a_lone_request_is_not_held_when_the_executor_is_idle() -> None:
    rec = Recorder()
    stats = BatchStats()
    waits = recorded_waits(stats)
    b = Batcher(rec, max_batch_size=64, max_queue_delay_s=0.5, max_queue_size=10, stats=stats)
    b.start()
    assert await b.submit(7, far()) == 70
    await b.stop()
    assert rec.batches == [[7]]
    assert len(waits) == 1 and waits[0] < 0.05  # far under the 0.5 s delay: not held


async def test_a_lone_batch_run_by_its_caller_keeps_the_deadline_and_the_drain() -> None:
    """The caller of a lone request runs its batch itself: a late one is answered
    TimedOut at the deadline (and frees the executor), a running one is waited for by
    stop's drain, and requests arriving meanwhile form the next batch."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(rec, max_batch_size=64, max_queue_delay_s=0.5, max_queue_size=10)
    b.start()
    t0 = time.monotonic()
    with pytest.raises(TimedOut):
        await b.submit(1, time.monotonic() + 0.1)
    assert 0.09 < time.monotonic() - t0 < 1.0
    rec.gate.set()
    assert await b.submit(2, far()) == 20  # the executor is free again
    rec.gate.clear()
    lone = asyncio.create_task(b.submit(3, far()))
    await eventually(lambda: rec.seen[-1:] == [3])
    later = [asyncio.create_task(b.submit(i, far())) for i in (4, 5)]
    await eventually(lambda: b.depth == 2)
    stopping = asyncio.create_task(b.stop(drain_s=5))
    done, _ = await asyncio.wait({stopping}, timeout=0.05)
    assert not done  # the drain waits for the caller's own batch
    rec.gate.set()
    await stopping
    assert await asyncio.gather(lone, *later) == [30, 40, 50]
    assert rec.batches == [[1], [2], [3], [4, 5]]


async def test_batches_form_while_the_executor_is_busy() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(rec, max_batch_size=64, max_queue_delay_s=0.5, max_queue_size=100)
    b.start()
    first = asyncio.create_task(b.submit(0, far()))
    await eventually(lambda: bool(rec.batches))  # item 0 runs alone, at once
    rest = [asyncio.create_task(b.submit(i, far())) for i in range(1, 6)]
    await eventually(lambda: b.depth == 5)
    rec.gate.set()
    assert await asyncio.gather(first, *rest) == [0, 10, 20, 30, 40, 50]
    await b.stop()
    assert rec.batches == [[0], [1, 2, 3, 4, 5]]  # queued behind the running batch


async def test_company_is_waited_for_at_most_the_delay_while_another_batch_runs() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    stats = BatchStats()
    waits = recorded_waits(stats)
    b = Batcher(
        rec,
        max_batch_size=64,
        max_queue_delay_s=0.03,
        max_queue_size=10,
        concurrency=2,
        stats=stats,
    )
    b.start()
    blocked = asyncio.create_task(b.submit(0, far()))
    await eventually(lambda: bool(rec.batches))
    second = asyncio.create_task(b.submit(1, far()))
    await eventually(lambda: len(rec.batches) == 2)  # flushed by the time bound
    rec.gate.set()
    assert await asyncio.gather(blocked, second) == [0, 10]
    await b.stop()
    assert rec.batches == [[0], [1]]
    assert max(waits) >= 0.03  # item 1 waited the delay for company, not longer than needed


async def test_preferred_size_flushes_early() -> None:
    rec = Recorder()
    b = Batcher(
        rec, max_batch_size=64, max_queue_delay_s=5.0, max_queue_size=100, preferred_batch_sizes=[4]
    )
    b.start()
    results = await asyncio.wait_for(
        asyncio.gather(*(b.submit(i, far()) for i in range(4))), timeout=2
    )
    await b.stop()
    assert results == [0, 10, 20, 30] and rec.batches == [[0, 1, 2, 3]]


async def test_batch_never_waits_past_the_earliest_deadline() -> None:
    rec = Recorder()
    b = Batcher(rec, max_batch_size=64, max_queue_delay_s=5.0, max_queue_size=100)
    b.start()
    t0 = time.monotonic()
    # Flushed just before its deadline; on a badly stalled loop it may instead be refused
    # as expired, but it never waits for the 5 s queue delay.
    with contextlib.suppress(DeadlineExceeded):
        assert await b.submit(1, time.monotonic() + 0.2) == 10
    assert time.monotonic() - t0 < 1.0
    await b.stop()


async def test_full_queue_rejects_at_once() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(rec, max_batch_size=1, max_queue_delay_s=0, max_queue_size=2)
    b.start()
    first = asyncio.create_task(b.submit(0, far()))
    await eventually(lambda: bool(rec.batches))  # item 0 is inside the (blocked) model
    queued = [asyncio.create_task(b.submit(i, far())) for i in (1, 2)]
    await eventually(lambda: b.depth == 2)
    t0 = time.monotonic()
    with pytest.raises(QueueFull):
        await b.submit(3, far())
    assert time.monotonic() - t0 < 0.05
    # A queued request whose caller went away gives its place to a live one.
    queued[1].cancel()
    await eventually(lambda: b.depth == 1)
    replacement = asyncio.create_task(b.submit(4, far()))
    await eventually(lambda: b.depth == 2)
    rec.gate.set()
    assert await asyncio.gather(first, queued[0], replacement) == [0, 10, 40]
    await b.stop()


async def test_expired_deadline_never_reaches_the_model() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(rec, max_batch_size=1, max_queue_delay_s=0, max_queue_size=10)
    b.start()
    blocker = asyncio.create_task(b.submit(0, far()))
    await eventually(lambda: bool(rec.batches))
    deadline_1 = time.monotonic() + 0.02
    doomed = asyncio.create_task(b.submit(1, deadline_1))
    with pytest.raises(DeadlineExceeded):
        await b.submit(2, time.monotonic() - 1)  # already expired
    await eventually(lambda: time.monotonic() > deadline_1)  # passes while the model is busy
    # Answered at its deadline while it still waited in the queue, not when the model
    # freed up; either way it never reaches the model.
    with pytest.raises(TimedOut):
        await doomed
    rec.gate.set()
    await blocker
    await b.stop()
    assert rec.seen == [0]


async def test_cancelled_requests_are_dropped_and_do_not_leak() -> None:
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(rec, max_batch_size=64, max_queue_delay_s=0.05, max_queue_size=3)
    b.start()
    blocker = asyncio.create_task(b.submit(-1, far()))
    await eventually(lambda: bool(rec.batches))  # the model is busy: the next ones queue
    tasks = [asyncio.create_task(b.submit(i, far())) for i in range(3)]
    await eventually(lambda: b.depth == 3)
    tasks[1].cancel()  # client went away
    rec.gate.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert done[0] == 0 and done[2] == 20 and await blocker == -10
    assert isinstance(done[1], asyncio.CancelledError)
    assert rec.seen == [-1, 0, 2]
    assert b.depth == 0
    rec.gate = None
    # the slot came back: the queue takes 3 again
    assert await asyncio.gather(*(b.submit(i, far()) for i in range(3))) == [0, 10, 20]
    # a caller timing out (wait_for) cancels the same way
    rec.gate = asyncio.Event()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(b.submit(9, far()), timeout=0.1)
    rec.gate.set()
    assert await b.submit(5, far()) == 50
    await b.stop()


async def test_a_failing_batch_fails_only_its_items() -> None:
    calls = 0

    async def flaky(items: Sequence[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("model crashed")
        return list(items)

    b = Batcher(flaky, max_batch_size=4, max_queue_delay_s=0.01, max_queue_size=10)
    b.start()
    with pytest.raises(RuntimeError):
        await b.submit(1, far())
    assert await b.submit(2, far()) == 2
    await b.stop()


def _world_scorer(world: World) -> tuple[Any, aioredis.Redis, ThreadPoolExecutor]:
    """A scorer on the world's store and model (its client and pool: the caller closes)."""
    from cli.settings import Settings
    from fraud_scoring.feast_store import open_store
    from fraud_scoring.features import producible_features
    from service.core.model import ModelHolder, load_model
    from service.core.online_features import OnlineFeatureReader
    from service.core.scoring import Scorer

    settings = Settings(
        redis_url=world.redis_url, data_dir=world.data_dir, model_repo=world.model_repo
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    client = aioredis.Redis.from_url(world.redis_url)
    pool = ThreadPoolExecutor(1)
    scorer = Scorer(client, OnlineFeatureReader(store.project), ModelHolder(model), settings, pool)
    return scorer, client, pool


async def test_batched_results_equal_unbatched_exactly(world: World) -> None:
    from fraud_scoring.events import Transaction

    scorer, client, pool = _world_scorer(world)
    txns = [Transaction.model_validate(r) for r in held_out_day(world)[:64]]
    one_by_one = [(await scorer.score_batch([t]))[0] for t in txns]
    b = Batcher(scorer.score_batch, max_batch_size=16, max_queue_delay_s=0.01, max_queue_size=100)
    b.start()
    batched = await asyncio.gather(*(b.submit(t, far()) for t in txns))
    await b.stop()
    await client.aclose()
    pool.shutdown()
    assert [r.score for r in batched] == [r.score for r in one_by_one]
    assert [r.decision for r in batched] == [r.decision for r in one_by_one]
    assert [r.missing for r in batched] == [r.missing for r in one_by_one]
    assert max(r.timing_ms["batch_size"] for r in batched) > 1


async def test_scripts_lost_before_a_batch_are_loaded_and_it_records_once(world: World) -> None:
    """A server that lost its scripts (a restart that kept the data) answers the batch's
    reads with NOSCRIPT: the scorer loads them and runs the batch again, without claiming
    its ids twice (the transaction is new, not a retry) and recording it once."""
    from datetime import timedelta

    import redis

    from fraud_scoring.events import Transaction

    scorer, client, pool = _world_scorer(world)
    base = Transaction.model_validate(held_out_day(world)[0])
    first = base.model_copy(update={"card_id": "noscript-card", "transaction_id": "noscript-1"})
    later = first.model_copy(
        update={
            "transaction_id": "noscript-2",
            "event_time": first.event_time + timedelta(seconds=1),
        }
    )
    await scorer.score_batch([base.model_copy(update={"transaction_id": "noscript-0"})])
    before = (await scorer.read_features([later], [False]))[0]["card_txn_count_1m"][0]
    redis.Redis.from_url(world.redis_url).script_flush()
    (out,) = await scorer.score_batch([first])
    assert not out.degraded and not out.repeat and out.refused is None
    after = (await scorer.read_features([later], [False]))[0]["card_txn_count_1m"][0]
    assert (before, after) == (0.0, 1.0)
    (again,) = await scorer.score_batch([first])  # a retry: answered, recorded no more
    assert again.transaction_id == "noscript-1"
    assert (await scorer.read_features([later], [False]))[0]["card_txn_count_1m"][0] == 1.0
    await client.aclose()
    pool.shutdown()


def test_http_full_queue_gives_503_with_retry_after(world: World, tmp_path) -> None:
    srv = start_server(
        world,
        tmp_path,
        FRAUD_MAX_QUEUE_SIZE="1",
        FRAUD_MAX_QUEUE_DELAY_MS="300",
        FRAUD_MAX_BATCH_SIZE="64",
    )
    try:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
                return await asyncio.gather(
                    *(
                        c.post("/v1/score", json={**TXN, "transaction_id": f"q{i}"})
                        for i in range(6)
                    )
                )

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes, codes
        shed = [r for r in responses if r.status_code == 503]
        assert all(r.headers.get("Retry-After") for r in shed)
        assert "overloaded" in shed[0].json()["detail"][0]["message"]
        with httpx.Client(base_url=srv.url) as c:  # an impossible deadline is refused
            r = c.post("/v1/score", json=TXN, headers={"X-Request-Timeout-Ms": "0.001"})
            assert r.status_code == 503 and "deadline" in r.json()["detail"][0]["message"]
    finally:
        stop_server(srv)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_that_disconnects_is_dropped_before_the_model(world: World, tmp_path) -> None:
    import json
    import socket

    from tests.conftest import wait_until

    # With a preferred size the batcher waits (500 ms) for company even when idle.
    srv = start_server(
        world,
        tmp_path,
        FRAUD_MAX_QUEUE_DELAY_MS="500",
        FRAUD_PREFERRED_BATCH_SIZES="[64]",
        FRAUD_REQUEST_TIMEOUT_MS="5000",
    )
    try:
        with httpx.Client(base_url=srv.url) as c:
            before = _metric(c.get("/metrics").text, "fraud_batch_size_sum")
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({**TXN, "transaction_id": "walks-away"}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            with httpx.Client(base_url=srv.url) as c:  # queued: a batch waits 500 ms to fill
                wait_until(
                    lambda: _metric(c.get("/metrics").text, "fraud_batch_queue_depth") >= 1,
                    timeout=10,
                    what="the request to be queued",
                )
        # the socket is closed here, long before the batch would flush
        with httpx.Client(base_url=srv.url) as c:
            wait_until(
                lambda: (
                    _metric(c.get("/metrics").text, "fraud_rejections_total", reason="disconnected")
                    >= 1
                ),
                timeout=10,
                what="the disconnect to be noticed",
            )
            # A later request is answered (the queue is fine) in a batch of its own: had
            # the walked-away request still been queued, it would have joined that batch.
            assert c.post("/v1/score", json=TXN).status_code == 200
            after = _metric(c.get("/metrics").text, "fraud_batch_size_sum")
            assert after == before + 1  # it never reached the model
    finally:
        stop_server(srv)
