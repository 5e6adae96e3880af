"""One id, one transaction (``service/core/idempotency.py``), over real HTTP and Redis:
a retry gets the original answer and changes no state; the same id with other content
is refused 409 ``id_reused`` naming the fields, and records nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from tests.conftest import Server, World, start_server, stop_server
from tests.test_service import TXN


@pytest.fixture(scope="module")
def server(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The service as deployed: ids kept for FRAUD_IDEMPOTENCY_TTL_S (default 3600)."""
    srv = start_server(world, tmp_path_factory.mktemp("idem"), FRAUD_IDEMPOTENCY_TTL_S="3600")
    yield srv
    stop_server(srv)


def _txn(tid: str, **over: object) -> dict[str, object]:
    return TXN | {"transaction_id": tid, "card_id": f"card-{tid}"} | over


def test_a_retry_gets_the_original_answer_and_changes_nothing(server: Server, world: World) -> None:
    tid = f"idem-{time.monotonic_ns()}"
    client = redis.Redis.from_url(world.redis_url)
    with server.client() as c:
        first = c.post("/v1/score", json=_txn(tid))
        assert first.status_code == 200, first.text
        # The same instant written with another offset is the same transaction.
        again = c.post("/v1/score", json=_txn(tid, event_time="2026-01-16T13:00:00+01:00"))
        assert again.status_code == 200, again.text
    a, b = first.json(), again.json()
    for k in ("transaction_id", "decision", "score", "reasons", "model_version"):
        assert a[k] == b[k], k
    assert client.zcard(f"{{card:card-{tid}}}:ev") == 1


def test_the_same_id_for_another_transaction_is_refused_409(server: Server, world: World) -> None:
    tid = f"idem-{time.monotonic_ns()}"
    client = redis.Redis.from_url(world.redis_url)
    with server.client() as c:
        assert c.post("/v1/score", json=_txn(tid)).status_code == 200
        answers = [
            c.post("/v1/score", json=_txn(tid, amount=1.0 + i, merchant_id="m00002"))
            for i in range(12)
        ]
        metrics = c.get("/metrics").text
    assert {r.status_code for r in answers} == {409}
    problem = answers[0].json()["detail"][0]
    assert problem["code"] == "id_reused" and problem["field"] == "transaction_id"
    assert "amount" in problem["message"] and "merchant_id" in problem["message"]
    assert client.zcard(f"{{card:card-{tid}}}:ev") == 1  # the burst recorded nothing
    assert "fraud_id_reused_total" in metrics


def test_a_batch_call_with_one_reused_id_is_refused_whole(server: Server, world: World) -> None:
    """A batch call whose one transaction reuses an id with other content is refused 409
    and has no effect: none of its other transactions is recorded (the card's history
    and the decision log do not grow); the same id twice with other content in one call
    too."""
    tid = f"idem-{time.monotonic_ns()}"
    client = redis.Redis.from_url(world.redis_url)
    others = [_txn(f"{tid}-other-{i}", card_id=f"card-{tid}-b") for i in range(3)]
    with server.client() as c:
        assert c.post("/v1/score", json=_txn(tid)).status_code == 200
        logged = client.xlen("decisions")
        call = c.post("/v1/score/batch", json={"transactions": [*others, _txn(tid, amount=2.0)]})
        twice = c.post(
            "/v1/score/batch",
            json={"transactions": [_txn(f"{tid}-2"), _txn(f"{tid}-2", amount=3.0)]},
        )
    assert call.status_code == 409, call.text
    assert call.json()["detail"][0]["code"] == "id_reused"
    assert twice.status_code == 409, twice.text
    assert client.zcard(f"{{card:card-{tid}-b}}:ev") == 0
    assert not client.exists(f"fraud:txn:{{{tid}-other-0}}", f"fraud:txn:{{{tid}-2}}")
    assert client.xlen("decisions") == logged


def test_a_retry_after_a_death_between_claim_and_recording_records_it(
    server: Server, world: World
) -> None:
    """A first attempt that died after claiming its id and before recording (the claim
    holds the content, no answer): the retry records the transaction (idempotent on the
    id), so the card's next attempt counts it; a second retry still changes nothing."""
    from fraud_scoring import declared as D
    from fraud_scoring.events import Transaction
    from fraud_scoring.features import declarations
    from service.core import idempotency

    tid = f"idem-{time.monotonic_ns()}"
    client = redis.Redis.from_url(world.redis_url)
    body = _txn(tid)
    content = idempotency.encode(idempotency.content(Transaction.model_validate(body)))
    client.set(idempotency.key(tid), content, nx=True, ex=3600)  # the dead attempt's claim
    with server.client() as c:
        retry = c.post("/v1/score", json=body)
        again = c.post("/v1/score", json=body)
    assert retry.status_code == 200 and again.status_code == 200, (retry.text, again.text)
    assert client.zcard(f"{{card:card-{tid}}}:ev") == 1  # recorded once, not twice
    marked = client.hgetall(D.marker(tid))  # and in every declared state keyed by the card
    for spec in declarations().specs:
        if spec.entity == ("card_id",) and spec.source == "transactions" and not spec.filter:
            assert marked.get(spec.id.encode()) == b"1", spec.id
