"""The HTTP connection (service/edge/connection.py) over real sockets against a real server
process: the header size limit and read timeout uvicorn lacks with httptools, and a
drain that answers open keep-alive connections with 503 instead of closing them."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_service import TXN

HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def guarded(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        world,
        tmp_path_factory.mktemp("connection"),
        FRAUD_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        FRAUD_MODEL_POLL_S="600",
    )
    yield srv
    stop_server(srv)


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port))
    s.settimeout(HEADER_TIMEOUT_S + 10)
    return s


def _read_to_close(s: socket.socket) -> bytes:
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer


@pytest.mark.parametrize("complete", [True, False])
def test_headers_over_16_kib_get_431(guarded: Server, complete: bool) -> None:
    """Whether the 20 KB of headers end (parsed field by field) or not (counted as they
    arrive), the answer is 431 and the connection is closed."""
    head = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 20_000
    with _connect(guarded.url) as s:
        s.sendall(head + (b"\r\nContent-Length: 0\r\n\r\n" if complete else b""))
        answer = _read_to_close(s)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert b"larger than 16384 bytes" in answer


def test_headers_must_arrive_in_time(guarded: Server) -> None:
    """A request whose headers stall gets 408; a connection that never sends anything is
    closed. Both within the header timeout, not held until the connection limit."""
    with _connect(guarded.url) as started, _connect(guarded.url) as silent:
        started.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")
        answer = _read_to_close(started)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert b"not received within 1 s" in answer
        assert _read_to_close(silent) == b""
    with guarded.client() as c:  # and the service goes on answering
        assert c.post("/v1/score", json={**TXN, "transaction_id": "conn-1"}).status_code == 200


def _score_slowly(url: str, txn_id: str, timeout_ms: int, pause_s: float) -> bytes:
    """POST /v1/score with ``X-Request-Timeout-Ms``: the headers and half the body, a
    pause, then the rest; the answer's status line and body."""
    body = json.dumps({**TXN, "transaction_id": txn_id}).encode()
    head = (
        f"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"X-Request-Timeout-Ms: {timeout_ms}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with _connect(url) as s:
        s.sendall(head + body[: len(body) // 2])
        time.sleep(pause_s)
        s.sendall(body[len(body) // 2 :])
        return _read_to_close(s)


def test_a_deadline_counts_from_the_requests_first_byte(guarded: Server) -> None:
    """X-Request-Timeout-Ms is the client's budget from when its request arrived: time
    spent before the handler runs (here a body sent slowly; under load, the event loop's
    backlog) counts. 400 ms past arrival the request is refused at once (503), not
    scored as if it had just come; with the budget left, the same upload is scored."""
    late = _score_slowly(guarded.url, "conn-late", 300, 0.6)
    assert late.startswith(b"HTTP/1.1 503"), late[:300]
    on_time = _score_slowly(guarded.url, "conn-on-time", 5000, 0.6)
    assert on_time.startswith(b"HTTP/1.1 200"), on_time[:300]


def _refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_answers_open_keep_alive_connections_with_503(world: World, tmp_path: Path) -> None:
    """On SIGTERM the listener closes; requests then sent on connections the clients
    already hold get 503 ``draining`` with ``Connection: close`` (not a closed socket),
    a request in flight completes, and the process exits once the connections are gone."""
    srv = start_server(world, tmp_path, FRAUD_DRAIN_SECONDS="10", FRAUD_MODEL_POLL_S="600")
    clients = [httpx.Client(base_url=srv.url, timeout=10) for _ in range(4)]
    try:
        for i, c in enumerate(clients):  # each holds one open keep-alive connection
            assert c.post("/v1/score", json={**TXN, "transaction_id": f"d-{i}"}).status_code == 200
        # In flight at SIGTERM: headers and the start of the body sent, the rest later.
        body = json.dumps({**TXN, "transaction_id": "d-inflight"}).encode()
        inflight = _connect(srv.url)
        inflight.sendall(
            b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10])
        )
        srv.process.proc.terminate()
        wait_until(lambda: _refuses_connections(srv.url), what="the listener to close")
        for i, c in enumerate(clients):
            r = c.post("/v1/score", json={**TXN, "transaction_id": f"d-late-{i}"})
            assert r.status_code == 503, r.text
            assert r.headers["connection"] == "close" and r.headers["retry-after"] == "0"
            assert r.json()["detail"][0]["code"] == "draining"
        inflight.sendall(body[10:])
        answer = _read_to_close(inflight)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        assert b"connection: close" in answer.lower()
        # uvicorn re-raises SIGTERM once its graceful shutdown is done.
        assert srv.process.proc.wait(timeout=30) in (0, -15)
        assert "Application shutdown complete" in srv.log.read_text()
    finally:
        for c in clients:
            c.close()
        stop_server(srv)
