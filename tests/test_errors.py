"""service/errors.py's failure types and service/edge/errors_http.py's answers: each type
renders its documented status, code and shape (``/v1`` problems, ``/v2`` ``{"error"}``),
every counted 503 is counted under its reason, and the table agrees with docs/api.md."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fraud_scoring.redis_server import embedded_redis
from service.edge import errors_http
from service.errors import (
    ERRORS,
    MAX_PROBLEMS,
    SERVING_REASONS,
    ApiError,
    BadRequest,
    BodyTimeout,
    ErrorCode,
    Forbidden,
    Invalid,
    MethodNotAllowed,
    ModelRejected,
    NotAvailable,
    NotFound,
    NotReady,
    Rejected,
    RejectReason,
    TooLarge,
    TransactionIdReused,
    Unauthenticated,
    UnsupportedMediaType,
)
from service.resources import STATE_KEY
from tests.conftest import World, rejections, start_server, stop_server

# (the error, its status, its code, counted); one of each type of the table.
CASES: list[tuple[ApiError, int, str, bool]] = [
    (BadRequest("shape must be [n, 42]"), 400, "invalid", False),
    (
        Unauthenticated("missing API key", headers={"WWW-Authenticate": "Bearer"}),
        401,
        "unauthenticated",
        False,
    ),
    (Forbidden("key 'x' lacks scope 'admin'"), 403, "forbidden", False),
    (NotFound("no review item for 't1'", "transaction_id"), 404, "not_found", False),
    (MethodNotAllowed("GET /v1/score: Method Not Allowed"), 405, "method_not_allowed", False),
    (BodyTimeout("request body not received within 5 s"), 408, "body_timeout", False),
    (ModelRejected("no such version", serving_version="3"), 409, "model_rejected", False),
    (TransactionIdReused("used for another", "transaction_id"), 409, "id_reused", False),
    (TooLarge("40 transactions; at most 32 per call", "transactions"), 413, "too_large", False),
    (
        UnsupportedMediaType("Content-Type must be JSON", "header.Content-Type"),
        415,
        "unsupported_media_type",
        False,
    ),
    (Invalid("must be 'true' or 'false'", "header.X-Fraud-Record"), 422, "invalid", False),
    (NotAvailable("the decision log reader needs duckdb"), 501, "not_available", False),
    (Rejected(RejectReason.QUEUE_FULL, "overloaded: queue full", 2), 503, "queue_full", True),
    (NotReady({"model": "not loaded"}), 503, "not_ready", False),
]


IDS = [type(e).__name__ for e, *_ in CASES]


class Counting:
    """What errors_http.answer needs of the resources: a count per reason."""

    def __init__(self) -> None:
        self.counted: list[str] = []

    def count_rejection(self, reason: RejectReason) -> None:
        self.counted.append(reason.value)


def scope(path: str, res: Counting | None = None) -> dict[str, Any]:
    return {"type": "http", "path": path, "state": {STATE_KEY: res} if res else {}}


def test_every_type_of_the_table_has_a_case() -> None:
    assert {type(e) for e, *_ in CASES} == set(ERRORS)


@pytest.mark.parametrize(("exc", "status", "code", "counted"), CASES, ids=IDS)
def test_each_type_renders_its_status_code_and_v1_shape(
    exc: ApiError, status: int, code: str, counted: bool
) -> None:
    res = Counting()
    reply = errors_http.answer(scope("/v1/score", res), exc)
    body = json.loads(bytes(reply.body))
    assert (reply.status_code, exc.status, exc.code, exc.counted) == (
        status,
        status,
        code,
        counted,
    )
    assert res.counted == ([code] if counted else [])
    for name, value in exc.headers.items():
        assert reply.headers[name] == value
    if isinstance(exc, Rejected):
        assert reply.headers["Retry-After"] == str(exc.retry_after_s)
    if isinstance(exc, NotReady):  # the probe's own body
        assert body == {"status": "not ready", "model": "not loaded"}
        return
    [problem] = body.pop("detail")
    assert problem["code"] == code and problem["message"] == exc.message
    assert problem.get("field") == exc.field
    assert body == ({"serving_version": "3"} if isinstance(exc, ModelRejected) else {})


@pytest.mark.parametrize(("exc", "status", "code", "counted"), CASES, ids=IDS)
def test_each_type_renders_the_oip_shape_under_v2(
    exc: ApiError, status: int, code: str, counted: bool
) -> None:
    res = Counting()
    reply = errors_http.answer(scope("/v2/models/fraud/infer", res), exc)
    body = json.loads(bytes(reply.body))
    assert reply.status_code == status
    assert body.pop("error") == exc.message
    assert body == exc.extra
    assert res.counted == ([code] if counted else [])


def test_a_rejection_before_the_lifespan_is_answered_uncounted() -> None:
    reply = errors_http.answer(scope("/v1/score"), Rejected(RejectReason.DRAINING, "bye", 0))
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "0"


def test_pydantic_errors_are_one_problem_per_field_then_a_count() -> None:
    errors = [
        {"loc": ("body", "transactions", i, "amount"), "type": "float_parsing", "msg": "bad"}
        for i in range(MAX_PROBLEMS + 5)
    ]
    body = Invalid.from_errors(errors).content()
    assert len(body["detail"]) == MAX_PROBLEMS and body["problems_total"] == MAX_PROBLEMS + 5
    assert body["detail"][3] == {
        "field": "transactions.3.amount",
        "code": "invalid",
        "message": "bad",
    }
    missing = Invalid.from_errors([{"loc": ("card_id",), "type": "missing", "msg": "required"}])
    assert missing.content() == {
        "detail": [{"field": "card_id", "code": "missing", "message": "required"}]
    }
    not_json = Invalid.from_errors(
        [{"loc": (), "type": "json_invalid", "msg": "x", "ctx": {"error": "EOF at 3"}}]
    )
    assert not_json.problems() == [
        {"field": "body", "code": "invalid_json", "message": "body is not valid JSON (EOF at 3)"}
    ]


def _documented() -> set[tuple[int, str]]:
    """(status, code) of each row of docs/api.md's error table."""
    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    table = text.split("## Error answers", 1)[1].split("\n\n| status |", 1)[1]
    rows = set()
    for line in table.split("\n\n", 1)[0].splitlines()[2:]:
        status, codes = line.split("|")[1:3]
        for code in re.findall(r"`([a-z_]+)`", codes):
            rows.add((int(status.split()[0]), code))
    return rows


def test_docs_list_every_status_and_code_of_the_table() -> None:
    documented = _documented()
    for exc, status, code, _ in CASES:
        if not isinstance(exc, (Rejected, BadRequest)):  # /readyz and /v2 documented apart
            assert (status, code) in documented, (type(exc).__name__, status, code)
    for code in (ErrorCode.INVALID_JSON, ErrorCode.MISSING):
        assert (422, code) in documented
    assert {(503, r.value) for r in SERVING_REASONS} <= documented
    assert {s for s, _ in documented} == {e.status for e in ERRORS} - {400}


# --- real servers: the feedback and review paths' 503s, counted ------------------------


def _rejections(c: httpx.Client, reason: str) -> float:
    return rejections(c.get("/metrics").text, reason)


LABEL = {
    "transaction_id": "t-errors-1",
    "label": "fraud",
    "source": "chargeback",
    "time": "2024-01-01T00:00:00Z",
}


@pytest.fixture(scope="module")
def log_off(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    srv = start_server(world, tmp_path_factory.mktemp("log-off"), FRAUD_DECISION_LOG="off")
    try:
        with srv.client() as c:
            yield c
    finally:
        stop_server(srv)


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("POST", "/v1/feedback", {"json": LABEL}),
        ("GET", "/v1/review/items", {}),
        ("GET", "/v1/review/item", {"params": {"transaction_id": "t1"}}),
        ("POST", "/v1/review/label", {"json": {"transaction_id": "t1", "label": "fraud"}}),
    ],
)
def test_feedback_and_review_with_the_log_off_are_a_counted_503(
    log_off: httpx.Client, method: str, path: str, kwargs: dict[str, Any]
) -> None:
    before = _rejections(log_off, "log_off")
    r = log_off.request(method, path, **kwargs)
    assert r.status_code == 503 and r.headers["Retry-After"] == "60", r.text
    assert [p["code"] for p in r.json()["detail"]] == ["log_off"]
    assert _rejections(log_off, "log_off") == before + 1


def test_v2_errors_keep_the_protocol_shape_even_without_a_route(log_off: httpx.Client) -> None:
    for method, path, status in (
        ("GET", "/v2/models/other", 404),
        ("GET", "/v2/models/fraud/nothing-here", 404),
        ("GET", "/v2/models/fraud/infer", 405),
    ):
        r = log_off.request(method, path)
        assert r.status_code == status and set(r.json()) == {"error"}, r.text
    r = log_off.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["detail"][0]["code"] == "not_found"


def test_a_log_that_stops_answering_is_a_counted_503(world: World, tmp_path: Path) -> None:
    with embedded_redis() as log_url:
        srv = start_server(world, tmp_path, FRAUD_DECISION_LOG_URL=log_url)
    # The log's server is gone now; the scoring service still runs.
    try:
        with srv.client() as c:
            before = _rejections(c, "log_unavailable")
            for method, path, kwargs in (
                ("GET", "/v1/review/items", {}),
                ("POST", "/v1/feedback", {"json": LABEL}),
            ):
                r = c.request(method, path, **kwargs)
                assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
                assert [p["code"] for p in r.json()["detail"]] == ["log_unavailable"]
            assert _rejections(c, "log_unavailable") == before + 2
    finally:
        stop_server(srv)
