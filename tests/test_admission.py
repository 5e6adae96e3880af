"""Admission by work, per key: a batch call weighs its transactions, and one key's batch
calls cannot starve another key's single calls. The rules on their own, then over real
HTTP against a served model with two API keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
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
