"""Admission by work, per key: a batch call weighs its transactions, and one key's batch
calls cannot starve another key's single calls. The rules on their own, then over real
HTTP against a served model with two API keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.edge import auth
from service.edge.admission import WorkShares
from service.edge.auth import KeyEntry, Scope, append_key, new_key
from service.errors import RejectReason
from tests.conftest import Server, World, start_server, stop_server
from tests.test_service import TXN

CAPACITY = 64
BATCH = 32
ROOT = Path(__file__).resolve().parents[1]


def test_a_call_weighs_its_transactions_against_the_capacity() -> None:
    shares = WorkShares(capacity=64)
    assert shares.refusal("a", 40, now=0.0) is None
    shares.take("a", 40)
    refused = shares.refusal("a", 32, now=0.0)  # 72 transactions > 64
    assert refused is not None and refused.reason == RejectReason.INFLIGHT
    assert shares.refusal("a", 24, now=0.0) is None  # exactly the capacity
    shares.release("a", 40)
    assert shares.total == 0 and shares.held == {}
    # Alone, a key may fill the whole capacity at once (the edge refuses a call heavier
    # than the capacity with 413 before it is weighed here).
    assert shares.refusal("a", 64, now=0.0) is None


def test_an_idle_keys_heavy_call_leaves_the_others_their_reserve() -> None:
    """A key holding nothing is weighed like any other while others call: its one heavy
    call may not take the reserve of the key that called a moment ago."""
    shares = WorkShares(capacity=64, window_s=1.0)
    assert shares.refusal("light", 2, now=0.0) is None  # took and gave back at once
    refused = shares.refusal("heavy", 64, now=0.1)
    assert refused is not None and refused.reason == RejectReason.CLIENT_SHARE
    assert shares.refusal("heavy", 56, now=0.1) is None  # 64 - the light key's 8
    shares.take("heavy", 56)
    assert shares.refusal("light", 2, now=0.1) is None


def test_a_call_that_cannot_fit_is_refused_before_its_body_is_read() -> None:
    """With the capacity full, a call is answered 503 at once: its body (here never sent,
    as from a slow sender) is not waited for, and the call in process is untouched."""
    import asyncio

    from starlette.types import Message, Receive, Send
    from starlette.types import Scope as AsgiScope

    from service.edge.admission import AdmissionLimit

    async def run() -> tuple[list[Message], int]:
        holding, finish = asyncio.Event(), asyncio.Event()

        async def app(scope: AsgiScope, receive: Receive, send: Send) -> None:
            holding.set()
            await finish.wait()

        limit = AdmissionLimit(
            app, capacity=2, max_body_bytes=1000, body_timeout_s=30, max_batch_request=2
        )
        body_reads = 0

        async def sent_body() -> Message:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def never_sent() -> Message:
            nonlocal body_reads
            body_reads += 1
            await asyncio.Event().wait()  # the body never arrives
            return {}

        def scope() -> AsgiScope:
            return {"type": "http", "path": "/v1/score", "headers": [], "state": {}}

        async def drop(message: Message) -> None:
            pass

        first = asyncio.create_task(limit(scope(), sent_body, drop))
        await holding.wait()
        answers: list[Message] = []

        async def keep(message: Message) -> None:
            answers.append(message)

        await asyncio.wait_for(limit(scope(), never_sent, keep), timeout=5)
        finish.set()
        await first
        return answers, body_reads

    answers, body_reads = asyncio.run(run())
    assert answers[0]["status"] == 503 and body_reads == 0
    assert b"inflight" in answers[1]["body"]


def test_a_batch_call_may_not_be_heavier_than_the_capacity() -> None:
    from cli.settings import Settings

    assert Settings().admission_capacity == 128
    assert Settings().batch_request_limit == 64  # half: it fits a share beside one other key
    assert Settings(max_inflight=300).batch_request_limit == 150
    assert Settings(max_inflight=1).batch_request_limit == 1
    assert Settings(max_batch_request=32).batch_request_limit == 32
    with pytest.raises(ValueError, match=r"FRAUD_MAX_BATCH_REQUEST \(256\) is above"):
        Settings(max_batch_request=256)


def test_a_second_key_halves_the_first_keys_share() -> None:
    shares = WorkShares(capacity=64, window_s=1.0)
    for _ in range(2):  # alone, a key may use everything
        assert shares.refusal("heavy", 32, now=0.0) is None
        shares.take("heavy", 32)
    # The other key's first call finds the capacity full ...
    first = shares.refusal("light", 1, now=0.1)
    assert first is not None and first.reason == RejectReason.INFLIGHT
    shares.release("heavy", 32)
    # ... and from then on the heavy key is held to its half plus what leaves the
    # reserve (64 / 8) free: its next batch is refused, the light key's calls admitted.
    over = shares.refusal("heavy", 32, now=0.2)
    assert over is not None and over.reason == RejectReason.CLIENT_SHARE
    assert "holds 32 transactions" in over.detail and "share is 32 of 64" in over.detail
    assert shares.refusal("light", 1, now=0.2) is None
    # Over its share, a key may use what the others leave: 32 + 16 + 8 reserved <= 64.
    assert shares.refusal("heavy", 16, now=0.2) is None
    shares.take("heavy", 16)
    assert shares.refusal("heavy", 16, now=0.2) is not None  # would eat the reserve
    assert shares.refusal("light", 1, now=0.2) is None
    shares.release("heavy", 16)
    # The light key gone quiet for longer than the window: the heavy one has it all.
    assert shares.refusal("heavy", 32, now=1.5) is None


def test_a_keys_share_weighs_its_part_of_the_capacity() -> None:
    """A key with share 3 (keys file ``"share": 3``) gets 3/4 of the capacity against a
    key of share 1, the other 1/4."""
    shares = WorkShares(capacity=64, window_s=1.0)
    assert shares.refusal("light", 1, now=0.0, client_share=1.0) is None
    shares.take("light", 1)
    assert shares.refusal("gold", 32, now=0.0, client_share=3.0) is None
    shares.take("gold", 32)
    # gold holds 32 of its 48 (64 * 3/4): 16 more fit in its share.
    assert shares.refusal("gold", 16, now=0.1, client_share=3.0) is None
    shares.take("gold", 16)
    over = shares.refusal("gold", 8, now=0.1, client_share=3.0)
    assert over is not None and over.reason == RejectReason.CLIENT_SHARE
    assert "share is 48 of 64" in over.detail
    # The light key holding work is held to its quarter (16).
    shares.take("light", 15)
    refused = shares.refusal("light", 8, now=0.1, client_share=1.0)
    assert refused is not None and "share is 16 of 64" in refused.detail


def test_every_key_may_hold_one_call_whatever_its_share() -> None:
    shares = WorkShares(capacity=64, window_s=1.0)
    for key in ("a", "b", "c"):  # three keys: shares of 21
        shares.refusal(key, 1, now=0.0)
    assert shares.refusal("a", 32, now=0.0) is None  # more than 21, but a holds nothing
    shares.take("a", 32)
    assert shares.refusal("a", 32, now=0.0) is not None  # 64 leaves no reserve for b, c


# Admission by cost (issue 38, item 3): the measure is driven with explicit clocks.
BUDGET_S = 0.08  # the default 100 ms deadline x FRAUD_ADMISSION_DEADLINE_FRACTION (0.8)


def measured(per_txn_s: dict[str, float], at: float = 1.0) -> WorkShares:
    """Shares with each key's calls measured at ``per_txn_s[key]`` seconds per
    transaction by ``at`` (one call of 64 transactions each, alone in process)."""
    shares = WorkShares(capacity=128, window_s=1.0, budget_s=BUDGET_S)
    start = at - 1.0
    for key, per in per_txn_s.items():
        shares.take(key, 64, now=start)
        start += 64 * per
        shares.release(key, 64, now=start)
        assert shares.price(key, at) == pytest.approx(per)
    return shares


def test_each_keys_time_per_transaction_is_measured_from_the_time_its_work_held() -> None:
    """Each interval with work held is split between the keys in proportion to the
    transactions they hold (overlapping calls share the time: under load the measure is
    the process's time per transaction, not one call's latency); time with nothing held
    does not count; a sample is taken after SAMPLE_S, folded into a moving average."""
    from service.edge.admission import SAMPLE_S, SAMPLE_WEIGHT

    shares = WorkShares(capacity=128, budget_s=BUDGET_S)
    assert shares.price("a", 0.0) == 0.0  # nothing measured: by count alone
    shares.take("a", 32, now=0.0)
    shares.take("b", 32, now=0.05)
    shares.release("a", 32, now=0.1)  # a: 50 ms alone + half of 50 ms = 75 ms for 32
    assert shares.price("a", 0.1) == pytest.approx(0.075 / 32)
    assert shares.price("c", 0.1) == pytest.approx(0.1 / 32)  # all calls: 100 ms, 32 done
    shares.release("b", 32, now=0.16)  # b: 25 ms + 60 ms alone
    assert shares.price("b", 0.16) == pytest.approx(0.085 / 32)
    all_calls = (1 - SAMPLE_WEIGHT) * 0.1 / 32 + SAMPLE_WEIGHT * 0.06 / 32
    assert shares.price("c", 0.16) == pytest.approx(all_calls)
    assert SAMPLE_S <= 0.06
    # The 0.84 s with nothing held are not counted; b's next call is folded in.
    shares.take("b", 32, now=1.0)
    shares.release("b", 32, now=1.064)
    folded = (1 - SAMPLE_WEIGHT) * 0.085 / 32 + SAMPLE_WEIGHT * 0.002
    assert shares.price("b", 1.064) == pytest.approx(folded)
    # A key's own measure prices its calls for KEY_FRESH_S; all calls' for FRESH_S;
    # none without a budget (FRAUD_ADMISSION_DEADLINE_FRACTION=0).
    assert shares.price("b", 10.0) == pytest.approx(folded)
    assert shares.price("b", 11.1) == 0.0
    shares.budget_s = 0.0
    assert shares.price("b", 1.064) == 0.0


def test_lone_calls_are_not_measured_their_time_is_latency() -> None:
    """Single calls one at a time (1 ms each, 2 transactions in process) are not
    measured: the process held less than capacity / 8 transactions on average, so their
    time is their latency, not their cost. Nothing is priced, admission counts
    transactions; a burst of 10 concurrent single calls is admitted whole."""
    shares = WorkShares(capacity=128, budget_s=BUDGET_S)
    t = 0.0
    for _ in range(200):
        assert shares.refusal("light", 2, now=t) is None
        shares.take("light", 2, now=t)
        shares.release("light", 2, now=t + 0.001)
        t += 0.002
    assert shares.price("light", t) == 0.0 and shares.price("anyone", t) == 0.0
    for _ in range(10):
        assert shares.refusal("light", 2, now=t) is None
        shares.take("light", 2, now=t)


def test_a_key_over_its_cost_share_is_refused_another_keys_single_call_admitted() -> None:
    """The heavy key's calls cost 2 ms per transaction, 64 ms for 32: its share of the
    default budget (80 ms) beside the light key is 40 ms, and a reserve of 10 ms stays
    free for the light key. Counted in transactions (capacity 128) its second call would
    fit; priced in time it would push the light key's calls past their deadline: refused
    ``client_share`` at once, while the light key's single calls are admitted. With no
    fresh measure the same state admits it (by count alone)."""
    shares = measured({"heavy": 0.002, "light": 0.001})
    assert shares.refusal("light", 2, now=1.0) is None
    shares.take("light", 2, now=1.0)
    assert shares.refusal("heavy", BATCH, now=1.0) is None  # 2 + 64 + 10 <= 80 ms
    shares.take("heavy", BATCH, now=1.0)
    over = shares.refusal("heavy", BATCH, now=1.0)
    assert over is not None and over.reason == RejectReason.CLIENT_SHARE
    assert over.detail == (
        "overloaded: key 'heavy' holds 64 ms of work in process and this call costs 64 ms "
        "(2.00 ms per transaction); its share is 40 of 80 ms while other keys are calling"
    )
    assert over.retry_after_s == 1
    assert shares.refusal("light", 2, now=1.0) is None  # 66 + 2 <= 80 ms
    # By count alone (both measures aged out) the heavy call would be admitted.
    assert shares.refusal("light", 2, now=11.5) is None
    assert shares.refusal("heavy", BATCH, now=11.5) is None


def test_a_call_costing_more_than_its_keys_share_is_refused_while_others_call() -> None:
    """At 3 ms per transaction one call of 32 (96 ms) costs more than the whole budget:
    refused while another key calls (it would time out every call queued behind it);
    the key alone is admitted one call at a time (so its measure goes on)."""
    shares = measured({"heavy": 0.003, "light": 0.001})
    assert shares.refusal("light", 2, now=1.0) is None
    refused = shares.refusal("heavy", BATCH, now=1.0)
    assert refused is not None and refused.reason == RejectReason.CLIENT_SHARE
    assert shares.refusal("light", 2, now=1.0) is None
    alone = measured({"heavy": 0.003})
    assert alone.refusal("heavy", BATCH, now=1.0) is None
    alone.take("heavy", BATCH, now=1.0)
    second = alone.refusal("heavy", BATCH, now=1.0)
    assert second is not None and second.reason == RejectReason.INFLIGHT


def test_a_batch_key_is_priced_at_its_own_cost_while_single_calls_dominate() -> None:
    """Single calls answered fast bring all calls' measure down; the batch key's calls
    are still priced at its own measure (2.5 ms per transaction: 80 ms, the whole
    budget) and refused while the light key calls. All calls' measure (0.5 ms) would
    have let them in, and does once the batch key's own measure has aged out (it is then
    measured afresh)."""
    from service.edge.admission import KEY_FRESH_S

    shares = measured({"heavy": 0.0025})
    t = 1.0
    for _ in range(200):  # the light key's single calls, bursts of 10 answered in 10 ms
        for _ in range(10):
            assert shares.refusal("light", 2, now=t) is None
            shares.take("light", 2, now=t)
        for _ in range(10):
            shares.release("light", 2, now=t + 0.01)
        t += 0.02
    assert shares.price("light", t) == pytest.approx(0.0005, rel=1e-4)
    assert shares.price("anyone", t) == pytest.approx(0.0005, rel=0.01)
    refused = shares.refusal("heavy", BATCH, now=t)
    assert refused is not None and refused.reason == RejectReason.CLIENT_SHARE
    assert "this call costs 80 ms (2.50 ms per transaction)" in refused.detail
    later = 1.0 + KEY_FRESH_S + 0.1  # the heavy key's measure aged out
    # All calls' measure fresh again: another key's 120 transactions in 60 ms.
    assert shares.refusal("other", 120, now=later - 0.06) is None
    shares.take("other", 120, now=later - 0.06)
    shares.release("other", 120, now=later)
    assert shares.price("heavy", later) < 0.001  # all calls' measure
    assert shares.refusal("heavy", BATCH, now=later) is None


def test_a_call_whose_expected_finish_is_past_its_deadline_is_refused() -> None:
    """The work already admitted plus the call's own, priced in time, must end within
    the call's budget (its deadline x the fraction): a call with a short deadline behind
    32 transactions (64 ms) is refused ``inflight`` at once; with the default budget it
    is admitted; a long deadline lets a key alone hold more than the default budget."""
    shares = measured({"heavy": 0.002, "light": 0.001})
    shares.take("heavy", BATCH, now=1.0)
    short = shares.refusal("light", 2, now=1.0, budget_s=0.05)
    assert short is not None and short.reason == RejectReason.INFLIGHT
    assert short.detail == (
        "overloaded: 64 ms of work in process and this call costs 2 ms (1.00 ms per "
        "transaction): it would end past 50 ms, its part of its deadline"
    )
    assert shares.refusal("light", 2, now=1.0) is None  # 66 <= 80 ms
    alone = measured({"heavy": 0.002})
    alone.take("heavy", BATCH, now=1.0)
    assert alone.refusal("heavy", BATCH, now=1.0) is not None  # 128 > 80 ms
    assert alone.refusal("heavy", BATCH, now=1.0, budget_s=0.8) is None
    # Never past the capacity in transactions, whatever the deadline.
    for _ in range(3):
        alone.take("heavy", BATCH, now=1.0)
    assert alone.refusal("heavy", 2, now=1.0, budget_s=48.0) is not None


def test_admission_prices_a_call_by_its_deadline_header() -> None:
    """Through the ASGI layer: the fraction and the default deadline come from the
    service's settings (the lifespan's resources); a call's ``X-Request-Timeout-Ms``
    sets its own budget. Behind the heavy key's 32 transactions at 2 ms each, a single
    call with a 25 ms deadline is answered 503 ``inflight`` with Retry-After at once,
    before its body is read; one with the default deadline is admitted."""
    import asyncio
    from types import SimpleNamespace

    from starlette.types import Message, Receive, Send
    from starlette.types import Scope as AsgiScope

    from service.edge.admission import AdmissionLimit
    from service.resources import STATE_KEY

    settings = SimpleNamespace(admission_deadline_fraction=0.8, request_timeout_ms=100.0)
    counted: list[RejectReason] = []
    res = SimpleNamespace(settings=settings, count_rejection=counted.append)
    state = {STATE_KEY: res}

    async def run() -> tuple[list[Message], int, list[str]]:
        shares = WorkShares(capacity=128)
        admitted: list[str] = []

        async def app(scope: AsgiScope, receive: Receive, send: Send) -> None:
            admitted.append(scope["path"])

        limit = AdmissionLimit(
            app, 128, max_body_bytes=1000, body_timeout_s=30, max_batch_request=64, shares=shares
        )
        reads = 0

        async def body() -> Message:
            nonlocal reads
            reads += 1
            return {"type": "http.request", "body": b"{}", "more_body": False}

        answers: list[Message] = []

        async def keep(message: Message) -> None:
            answers.append(message)

        def scope(headers: list[tuple[bytes, bytes]]) -> AsgiScope:
            return {"type": "http", "path": "/v1/score", "headers": headers, "state": state}

        await limit(scope([]), body, keep)  # the first call reads the settings
        assert shares.budget_s == pytest.approx(BUDGET_S) and admitted == ["/v1/score"]
        now = time.monotonic()
        # All calls measured at 2 ms per transaction (one call of 32 held for 64 ms),
        # then 32 of the heavy key's transactions held: 64 ms of work in process.
        shares.take("probe", BATCH, now=now - 0.064)
        shares.release("probe", BATCH, now=now)
        shares.take("heavy", BATCH, now=now)
        answers.clear()
        await limit(scope([(b"x-request-timeout-ms", b"25")]), body, keep)
        assert reads == 1 and len(admitted) == 1  # refused before the body was read
        await limit(scope([(b"x-request-timeout-ms", b"100")]), body, keep)
        return answers, reads, admitted

    answers, reads, admitted = asyncio.run(run())
    assert answers[0]["status"] == 503
    assert (b"retry-after", b"1") in answers[0]["headers"]
    assert b'"code":"inflight"' in answers[1]["body"].replace(b" ", b"")
    assert b"it would end past 20 ms" in answers[1]["body"]
    assert reads == 2 and admitted == ["/v1/score", "/v1/score"]
    assert counted == [RejectReason.INFLIGHT]


@dataclass
class TwoKeys:
    srv: Server
    heavy: str
    light: str


@pytest.fixture(scope="module")
def two_keys(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoKeys]:
    tmp = tmp_path_factory.mktemp("admission")
    keys_file = tmp / "keys.jsonl"
    keys = {}
    for key_id in ("heavy", "light"):
        key, digest = new_key(key_id)
        append_key(keys_file, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({Scope.SCORE})))
        keys[key_id] = key
    srv = start_server(
        world,
        tmp,
        FRAUD_AUTH="required",
        FRAUD_API_KEYS_FILE=str(keys_file),
        FRAUD_MAX_INFLIGHT=str(CAPACITY),
        FRAUD_MODEL_POLL_S="600",
    )
    yield TwoKeys(srv, keys["heavy"], keys["light"])
    stop_server(srv)


def test_a_heavy_key_is_shed_while_another_keys_single_calls_are_admitted(
    two_keys: TwoKeys,
) -> None:
    """Eight connections of the heavy key send 32-transaction batches without pause
    while the light key sends single calls one after the other. Counted per request the
    heavy key's 8 calls would fit in 64 and never be refused; counted in transactions it
    holds at most its half (one call of 32), its other calls get 503 ``client_share``, and
    every single call of the light key is scored."""
    batch = {"transactions": [{**TXN, "transaction_id": f"hv-{i}"} for i in range(BATCH)]}
    heavy_answers: list[httpx.Response] = []
    stop = threading.Event()
    light = httpx.Client(
        base_url=two_keys.srv.url, timeout=10, headers={"X-API-Key": two_keys.light}
    )
    # The light key calls first, so it counts for the shares before the flood starts.
    assert light.post("/v1/score", json={**TXN, "transaction_id": "lt-first"}).status_code == 200

    def flood() -> None:
        auth = {"Authorization": f"Bearer {two_keys.heavy}"}
        with httpx.Client(base_url=two_keys.srv.url, timeout=10, headers=auth) as c:
            while not stop.is_set():
                heavy_answers.append(c.post("/v1/score/batch", json=batch))

    floods = [threading.Thread(target=flood) for _ in range(8)]
    for t in floods:
        t.start()
    try:
        singles = [
            light.post("/v1/score", json={**TXN, "transaction_id": f"lt-{i}"}) for i in range(30)
        ]
    finally:
        stop.set()
        for t in floods:
            t.join()
        light.close()
    assert [r.status_code for r in singles] == [200] * 30, [r.text for r in singles[:3]]
    served = [r for r in heavy_answers if r.status_code == 200]
    shed = [r for r in heavy_answers if r.status_code == 503]
    assert served and len(served) + len(shed) == len(heavy_answers)
    assert all(len(r.json()["results"]) == BATCH for r in served)
    problems = [r.json()["detail"][0] for r in shed]
    assert {p["code"] for p in problems} == {"client_share"}, problems[:3]
    assert all(r.headers["Retry-After"] == "1" for r in shed)
    # The weight held is the batch's transaction count, not one per request.
    held = {int(re.search(r"holds (\d+) transactions", p["message"])[1]) for p in problems}  # type: ignore[index]
    assert held == {BATCH}, held


def test_a_keys_share_comes_from_the_keys_file(tmp_path: Path) -> None:
    """``keys create --share 3`` writes the weight; the verified principal carries it;
    an out-of-range share in the file is refused naming the line and field."""
    keys = tmp_path / "keys.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "keys",
            "create",
            "--id",
            "gold",
            "--scopes",
            "score",
            "--share",
            "3",
            "--file",
            str(keys),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"share": 3.0' in keys.read_text()
    who = auth.KeyRing(keys).authenticate(out.stdout.strip())
    assert (who.key_id, who.share) == ("gold", 3.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "sha256": "' + "0" * 64 + '", "scopes": ["score"], "share": 0}\n')
    with pytest.raises(auth.KeysFileError, match=r"line 1: share"):
        auth.read_keys(bad)
