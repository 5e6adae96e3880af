"""No request can stall the service: body limits, the batch count before validation,
capped error lists, slow senders cut, strict content type and amount. Real HTTP."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import Server, World, start_server, stop_server
from tests.test_service import TXN

BODY_TIMEOUT_S = 3.0
INFLIGHT = 4


@pytest.fixture(scope="module")
def hardened(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        world,
        tmp_path_factory.mktemp("hardened"),
        FRAUD_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
        FRAUD_MAX_INFLIGHT=str(INFLIGHT),
        FRAUD_MAX_BATCH_REQUEST=str(INFLIGHT),
        FRAUD_MAX_BODY_BYTES="1048576",
    )
    yield srv
    stop_server(srv)


def test_huge_batch_is_refused_by_count_while_others_are_answered(hardened: Server) -> None:
    """100,000 empty items (300 KB) are refused on their count, not validated one by one,
    and single requests sent meanwhile keep being answered."""
    body = b'{"transactions": [' + b",".join([b"{}"] * 100_000) + b"]}"
    answers: list[int] = []
    texts: list[str] = []
    stop = threading.Event()

    def attack() -> None:
        with httpx.Client(base_url=hardened.url, timeout=10) as c:
            while not stop.is_set():
                r = c.post(
                    "/v1/score/batch", content=body, headers={"content-type": "application/json"}
                )
                answers.append(r.status_code)
                texts.append(r.text)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        with hardened.client() as c:
            singles = [
                c.post("/v1/score", json={**TXN, "transaction_id": f"h-{i}"}) for i in range(40)
            ]
    finally:
        stop.set()
        attacker.join()
    assert [r.status_code for r in singles] == [200] * 40
    # At most FRAUD_MAX_BATCH_REQUEST per call (here the whole capacity).
    assert texts and all(f"100000 transactions; at most {INFLIGHT}" in t for t in texts)
    assert answers and set(answers) == {413}


def test_body_over_the_byte_limit_is_413_before_reading(hardened: Server) -> None:
    big = b'{"transactions": [' + b" " * 2_000_000 + b"]}"
    with hardened.client() as c:
        r = c.post("/v1/score/batch", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most 1048576" in r.json()["detail"][0]["message"]


def test_error_list_is_capped(hardened: Server) -> None:
    with hardened.client() as c:
        r = c.post("/v1/score/batch", json={"transactions": [{}] * INFLIGHT})
    assert r.status_code == 422
    body = r.json()
    assert len(body["detail"]) == 20 and body["problems_total"] == INFLIGHT * 9


def _slow_sender(url: str) -> socket.socket:
    """A connection that sends headers and a few bytes of a 1,000-byte body, then stalls."""
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port))
    s.sendall(
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    return s


def test_slow_senders_are_cut_and_hold_no_slot(hardened: Server) -> None:
    """More slow senders than in-flight slots: requests with a body are still served, and
    every slow sender gets 408 once its body is late."""
    slow = [_slow_sender(hardened.url) for _ in range(INFLIGHT * 3)]
    try:
        with hardened.client() as c:
            for i in range(5):
                r = c.post("/v1/score", json={**TXN, "transaction_id": f"s-{i}"})
                assert r.status_code == 200, r.text
        for s in slow:  # still stalled, unanswered, while the others were served
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        for s in slow:
            s.settimeout(BODY_TIMEOUT_S + 10)
            answer = b""
            # Headers and body may come in separate segments; the 408 closes the connection.
            while chunk := s.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"not received within 3 s" in answer
    finally:
        for s in slow:
            s.close()


def test_content_type_must_be_json(hardened: Server) -> None:
    with hardened.client() as c:
        for path in ("/v1/score", "/v1/score/batch"):
            r = c.post(path, content=b"{}", headers={"content-type": "text/plain"})
            assert r.status_code == 415 and "application/json" in r.json()["detail"][0]["message"]
        utf8 = {"content-type": "application/json; charset=utf-8"}
        r = c.post("/v1/score", json=TXN, headers=utf8)
        assert r.status_code == 200


@pytest.mark.parametrize(
    "body", [b"{not json", b"[]", b'{"transactions": 3}', b'"x"', b'{"transactions": [1]}']
)
def test_malformed_batch_body_is_422(hardened: Server, body: bytes) -> None:
    with hardened.client() as c:
        r = c.post("/v1/score/batch", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["field"].startswith(("body", "transactions"))


@pytest.mark.parametrize("amount", [True, "42.5"])
def test_amount_must_be_a_number(hardened: Server, amount: object) -> None:
    with hardened.client() as c:
        r = c.post("/v1/score", json={**TXN, "amount": amount})
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "amount"


def test_reload_refuses_a_cross_site_form_post(hardened: Server) -> None:
    """Auth off, an empty HTML form posted from another site (a form or plain-text
    Content-Type, or none) reloads nothing: 415 naming the header. JSON goes through."""
    with hardened.client() as c:
        for headers in (
            {"content-type": "application/x-www-form-urlencoded"},
            {"content-type": "text/plain"},
            {"content-type": "multipart/form-data; boundary=x"},
            {},
        ):
            r = c.post("/v1/models/reload", content=b"", headers=headers)
            assert r.status_code == 415, (headers, r.text)
            [problem] = r.json()["detail"]
            assert (problem["field"], problem["code"]) == (
                "header.Content-Type",
                "unsupported_media_type",
            )
        r = c.post("/v1/models/reload", headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text


def test_routing_errors_have_the_one_error_shape(hardened: Server) -> None:
    with hardened.client() as c:
        for r, status, code in [
            (c.get("/v1/no-such-route"), 404, "not_found"),
            (c.get("/v1/models/reload"), 405, "method_not_allowed"),
        ]:
            assert r.status_code == status, r.text
            [problem] = r.json()["detail"]
            assert problem["code"] == code and problem["message"], problem
