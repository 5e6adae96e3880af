"""The HTTP surface: scoring, model reload, health and metrics.

The life of a scoring request, top to bottom: admission (``service.edge.admission``: body
read whole, bounded in size and time, then weighed in transactions against the capacity
and the key's fair share) → the key's scope
(``service.edge.auth``) → JSON content type → parse and validate (the batch endpoint counts
its items first) → the event-time bound (live mode) → deadline from
``X-Request-Timeout-Ms`` → micro-batch (or the naive path) → response. Each refusal is
raised as one of ``service.errors``' types and answered by ``service.edge.errors_http``.
Two kinds of batch meet
here: the client's batch endpoint (``score_many``), whose transactions each join the
service's micro-batches like single requests do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import prometheus_client
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from opentelemetry import trace
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json, to_json
from starlette import types as asgi

from fraud_scoring.events import Transaction
from fraud_scoring.model_repo import ModelError
from service import telemetry
from service.core import idempotency
from service.core.batching import DeadlineExceeded
from service.core.challenger import LineupChange
from service.core.scoring import ScoreRequest, ScoreResult
from service.edge.admission import PARSED_BODY, RECEIVED_NS
from service.edge.auth import Scope, check_scope, require_scope
from service.edge.connection import ARRIVED
from service.edge.schemas import (
    TXN_EXAMPLE,
    BatchOut,
    HealthzOut,
    ReadyzOut,
    ReadyzProblemsOut,
    ScoreOut,
    transaction_schema,
)
from service.errors import (
    ErrorCode,
    ErrorOut,
    Invalid,
    ModelRejected,
    NotReady,
    TooLarge,
    UnsupportedMediaType,
    error_responses,
)
from service.resources import Resources, resources
from service.settings import ServiceSettings

log = logging.getLogger(__name__)
router = APIRouter()

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
MAX_TIMEOUT_MS = 60_000
RECORD_HEADER = "X-Fraud-Record"
_TIMEOUT_KEY, _RECORD_KEY = TIMEOUT_HEADER.lower().encode(), RECORD_HEADER.lower().encode()
_RECORD_DOC: dict[str, Any] = {
    "name": RECORD_HEADER,
    "in": "header",
    "required": False,
    "description": "'false': replay mode: score without joining the card's session state "
    "and without the event-time bound (what-if, replay and backfill calls); needs the "
    "'admin' scope when auth is on. Default 'true' (unless FRAUD_RECORD_SCORED=false). "
    "The example request is a replay: its event_time is long past, which a live call "
    "refuses (422), and trying it changes no card's state.",
    "schema": {"type": "string", "enum": ["true", "false"]},
    "example": "false",
}
_TIMEOUT_DOC: dict[str, Any] = {
    "name": TIMEOUT_HEADER,
    "in": "header",
    "required": False,
    "description": "This request's deadline in milliseconds, in (0, 60000]; default: "
    "FRAUD_REQUEST_TIMEOUT_MS. Past it the answer is 503.",
    "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_MS},
}
# Any route may answer this while the process stops: a request that arrives on an open
# connection after SIGTERM (service/edge/connection.py).
_DRAINING = (
    "The process is stopping (`draining`, `Retry-After: 0`, `Connection: close`): send "
    "the request to another instance."
)
_TXN_SCHEMA = transaction_schema()


_UNPARSED = object()


def header(request: Request, name: bytes) -> str | None:
    """The request's first ``name`` header (lower-case bytes, as ASGI gives names), or
    None. One pass over the raw headers: Starlette's ``request.headers.get`` builds a
    ``Headers`` and raises and catches a KeyError for each absent header."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _json_body(request: Request) -> bytes:
    """The body of a JSON request; :class:`UnsupportedMediaType` (415) for another
    Content-Type. The body is already in memory (admission read it), so this does not
    wait."""
    ctype = header(request, b"content-type") or ""
    media = ctype.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {ctype or 'none'!r}",
            "header.Content-Type",
        )
    return await request.body()


_Model = TypeVar("_Model", bound=BaseModel)


async def json_model(request: Request, model: type[_Model]) -> _Model:
    """The request's body as ``model``: :class:`UnsupportedMediaType` (415) for another
    Content-Type, :class:`Invalid` (422) for a body that is not UTF-8 JSON
    (``invalid_json``, field ``body``) or not valid (one problem per field). Routes that
    change state read their body so: a cross-site form can only send a form or
    plain-text Content-Type."""
    try:
        return model.model_validate_json(await _json_body(request))
    except ValidationError as exc:
        raise Invalid.from_errors(exc.errors(include_url=False)) from None


def _check_clock(txn: Transaction, settings: ServiceSettings, *loc: str | int) -> None:
    """Live scoring: ``event_time`` within ``max_event_skew_s`` of this host's clock (0:
    no bound), and never further ahead than the store records (``max_future_skew_s``,
    the updater's bound too): what is answered as live is recorded, so a caller cannot
    move an attempt out of the velocity windows by stamping it ahead. Else a 422 naming
    the field."""
    field = ".".join(str(p) for p in (*loc, "event_time"))
    ahead = txn.event_ts - time.time()
    skew = settings.max_event_skew_s
    if skew and abs(ahead) > skew:
        raise Invalid(
            f"more than {skew:g} s from the server clock; score old transactions in "
            f"replay mode ({RECORD_HEADER}: false, admin scope)",
            field,
        )
    if settings.record_scored and ahead > settings.max_future_skew_s:
        raise Invalid(
            f"more than {settings.max_future_skew_s:g} s ahead of the server clock: the "
            "store records no event that far ahead (FRAUD_MAX_FUTURE_SKEW_S)",
            field,
        )


def arrived(request: Request) -> float:
    """When the request's first byte was parsed (``time.monotonic()``, the connection's
    stamp: service/edge/connection.py), else now (another ASGI server)."""
    at = request.scope.get(ARRIVED)
    return time.monotonic() if at is None else float(at)


def request_deadline(request: Request, res: Resources) -> float:
    """The request's deadline (``time.monotonic()``) from the timeout header, else the
    configured default, counted from its arrival (:func:`arrived`: the client's budget
    includes the time it waited for the event loop); a header that is not a number of ms
    in (0, 60000] is a 422."""
    raw = header(request, _TIMEOUT_KEY)
    if raw is None:
        return arrived(request) + res.settings.request_timeout_ms / 1e3
    ms = timeout_ms(raw)
    if ms is None:
        raise Invalid(TIMEOUT_PROBLEM.format(raw=raw), f"header.{TIMEOUT_HEADER}")
    return arrived(request) + ms / 1e3


TIMEOUT_PROBLEM = f"must be a number of milliseconds in (0, {MAX_TIMEOUT_MS}], got {{raw!r}}"


def timeout_ms(raw: str) -> float | None:
    """A timeout header's (or metadata's) milliseconds; None: not a number in (0,
    MAX_TIMEOUT_MS] (each protocol answers that its own way: TIMEOUT_PROBLEM)."""
    try:
        ms = float(raw)
    except ValueError:
        return None
    return ms if 0 < ms <= MAX_TIMEOUT_MS else None


def _record(request: Request) -> bool:
    """Whether to record the request's transactions in session state (read-your-writes),
    from the ``X-Fraud-Record`` header: 'true' (default, live mode) or 'false' (replay
    mode: needs the ``admin`` scope when auth is on, else 403), else a 422."""
    raw = header(request, _RECORD_KEY)
    if raw is None or raw.lower() == "true":
        return True
    if raw.lower() == "false":
        check_scope(request, Scope.ADMIN, f"replay mode ({RECORD_HEADER}: false)")
        return False
    raise Invalid(f"must be 'true' or 'false', got {raw!r}", f"header.{RECORD_HEADER}")


_Endpoint = TypeVar("_Endpoint", bound=Callable[[Request], Coroutine[Any, Any, Response]])


class DirectRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` alone and checks its own scope first:
    FastAPI's per-request dependency solving (query, header and cookie parsing, and a
    thread hop for a sync dependency) is skipped on the hot path, about a fifth of a
    scoring request's CPU. OpenAPI and the error answers are FastAPI's as usual."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return cast(Callable[[Request], Coroutine[Any, Any, Response]], self.endpoint)


class DirectDispatch:
    """Pure ASGI, inside admission: a ``POST`` to a :class:`DirectRoute`'s path goes
    straight to its endpoint; anything else to ``rest`` (Starlette's exception layer,
    FastAPI's exit-stack layer, the router, FastAPI's per-request wrapper with its two
    exit stacks), which do nothing for these endpoints (py-spy: 19 % of the event loop's
    samples at 1,600 req/s before, 6 % after; alternated runs: p99 about halved at
    1,400-2,100 req/s, CPU per request -2 to -4 % with this round's other changes).
    An exception the endpoint raises is answered by the app's own handler for it
    (``exception_handlers``, looked up along the exception's classes, as Starlette
    does); one without a handler propagates (500). Not used under a ``root_path`` (then
    the router resolves paths)."""

    def __init__(self, app: FastAPI, rest: asgi.ASGIApp) -> None:
        self.rest = rest
        # This module's router, included in ``app`` without a prefix.
        self.endpoints = {
            r.path: r.endpoint
            for r in router.routes
            if isinstance(r, DirectRoute) and r.methods == {"POST"}
        }
        self.handlers = {k: v for k, v in app.exception_handlers.items() if isinstance(k, type)}

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        endpoint = (
            self.endpoints.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST"
            else None
        )
        if endpoint is None or scope.get("root_path"):
            await self.rest(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = next(
                (self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None
            )
            if handler is None:
                raise
            answer = handler(request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)


def _direct_post(path: str, **kwargs: Any) -> Callable[[_Endpoint], _Endpoint]:
    """``@router.post(path, ...)`` as a :class:`DirectRoute`."""

    def add(endpoint: _Endpoint) -> _Endpoint:
        router.add_api_route(
            path, endpoint, methods=["POST"], route_class_override=DirectRoute, **kwargs
        )
        return endpoint

    return add


@_direct_post(
    "/v1/score",
    response_model=ScoreOut,
    responses=error_responses(401, 403, 408, 409, 413, 415, 422, 503),
    openapi_extra={
        "parameters": [_TIMEOUT_DOC, _RECORD_DOC],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": _TXN_SCHEMA,
                    "example": TXN_EXAMPLE,
                }
            },
        },
    },
)
async def score(request: Request) -> Response:
    """Score one transaction: approve, review or decline, with reasons.

    The hot path parses the body with pydantic-core straight from bytes (one pass, no
    ``json.loads`` and no dependency solving); errors take the same 422 route as
    everywhere else.
    """
    check_scope(request, Scope.SCORE)
    record = _record(request)
    body = await _json_body(request)  # a body that is not JSON: 415, before anything else
    res = resources(request)
    try:
        # The contract's fields and the declared ones (PII hashed here): res.door.
        txn = res.door.model.model_validate_json(body)
    except ValidationError as exc:
        raise Invalid.from_errors(exc.errors(include_url=False)) from None
    if record:
        _check_clock(txn, res.settings)
    deadline = request_deadline(request, res)
    item = ScoreRequest(txn, record)
    return _json(await _score_one(request, res, item, deadline, client_gone(request)))


@_direct_post(
    "/v1/score/batch",
    response_model=BatchOut,
    responses=error_responses(401, 403, 408, 409, 413, 415, 422, 503),
    openapi_extra={
        "parameters": [_TIMEOUT_DOC, _RECORD_DOC],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["transactions"],
                        "properties": {
                            "transactions": {
                                "type": "array",
                                "minItems": 1,
                                "items": _TXN_SCHEMA,
                            }
                        },
                    },
                    "example": {"transactions": [TXN_EXAMPLE]},
                }
            },
        },
    },
)
async def score_many(request: Request) -> Response:
    """The batch endpoint: score up to ``FRAUD_MAX_BATCH_REQUEST`` transactions under one
    deadline; results keep the input order. One 503 fails the whole call.

    The count is checked before any item is validated (413), so an oversized call costs
    one JSON parse, not one validation per item."""
    check_scope(request, Scope.SCORE)
    res = resources(request)
    record = _record(request)
    raw = await _json_body(request)
    # Admission parsed it already to weigh the call (counted in transactions).
    parsed = request.scope.get(PARSED_BODY, _UNPARSED)
    if parsed is _UNPARSED:
        try:
            parsed = from_json(raw)
        except ValueError as exc:
            raise Invalid(
                f"body is not valid JSON ({exc})", "body", ErrorCode.INVALID_JSON
            ) from None
    items = parsed.get("transactions") if isinstance(parsed, dict) else None
    if not isinstance(items, list):
        raise Invalid(
            "the body must be a JSON object with a 'transactions' list",
            "transactions",
            ErrorCode.MISSING,
        )
    limit = res.settings.batch_request_limit
    if len(items) > limit:
        raise TooLarge(f"{len(items)} transactions; at most {limit} per call", "transactions")
    try:
        transactions = res.door.many.validate_python(items)
    except ValidationError as exc:
        raise Invalid.from_errors(exc.errors(include_url=False), "transactions") from None
    if not transactions:
        raise Invalid("at least one transaction is required", "transactions")
    if record:
        for i, txn in enumerate(transactions):
            _check_clock(txn, res.settings, "transactions", i)
    deadline = request_deadline(request, res)
    if record and res.settings.record_scored and res.settings.idempotency_ttl_s > 0:
        # All or nothing: one reused id refuses the whole call before anything is scored.
        reused = await idempotency.reused_in(res.redis, transactions, res.settings.redis_timeout_s)
        if reused is not None:
            raise reused
    gone = client_gone(request)
    # The call fails as a whole (e.g. 503 on a full queue): then cancel the rest, so no
    # work is done for answers nobody will receive.
    tasks = [
        asyncio.ensure_future(_score_one(request, res, ScoreRequest(t, record), deadline, gone))
        for t in transactions
    ]
    try:
        return _json({"results": list(await asyncio.gather(*tasks))})
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def client_gone(request: Request) -> Callable[[], bool] | None:
    """A cheap "has the client disconnected?" for the batcher, which asks it as the
    request's micro-batch forms and drops the request if so (``ClientGone``): no watcher
    task per request. uvicorn marks its request cycle (the owner of ``receive``)
    ``disconnected`` when the connection drops; under another server this is None and a
    request whose client left still runs (its answer is discarded)."""
    cycle: Any = getattr(request.receive, "__self__", None)
    if not isinstance(getattr(cycle, "disconnected", None), bool):
        return None
    return lambda: bool(cycle.disconnected)


async def _score_one(
    request: Request,
    res: Resources,
    item: ScoreRequest,
    deadline: float,
    gone: Callable[[], bool] | None,
) -> dict[str, Any]:
    res.models.require()  # no model: 503 at once, nothing queued
    start = time.perf_counter()
    if telemetry.tracing():
        result = await _traced(request, res, item, deadline, gone)
    else:  # no spans at all: even the no-op tracer costs a context switch per request
        result = await _decide(res, item, deadline, gone)
    total_ms = (time.perf_counter() - start) * 1e3
    res.instruments.bound(result.model_version).request_duration.observe(total_ms / 1e3)
    return ScoreOut.wire(result, total_ms)


async def _decide(
    res: Resources, item: ScoreRequest, deadline: float, gone: Callable[[], bool] | None
) -> ScoreResult:
    """One decision through the micro-batcher (or, batching off, on its own)."""
    if res.batcher is not None:
        # The batcher answers TimedOut (503 ``timeout``) at the deadline itself.
        result = await res.batcher.submit(item, deadline, gone)
    else:
        if deadline <= time.monotonic():
            raise DeadlineExceeded("deadline passed")
        result = (await res.score_batch([item]))[0]
    if result.refused is not None:
        raise result.refused
    return result


async def _traced(
    request: Request,
    res: Resources,
    item: ScoreRequest,
    deadline: float,
    gone: Callable[[], bool] | None,
) -> ScoreResult:
    """:func:`_decide` inside a ``score`` span with one child span per stage, nested in
    the request's server span (OpenTelemetry's instrumentation, which continued the
    caller's ``traceparent``)."""
    tracer = telemetry.tracer()
    received = request.scope.get(RECEIVED_NS, time.time_ns())
    # A child never starts before its parent: the server span may open after admission
    # stamped ``received`` (its clock is read later in the same request).
    parent_start = getattr(trace.get_current_span(), "start_time", None) or 0
    start = max(received, parent_start)
    with tracer.start_as_current_span(
        "score", start_time=start, attributes={"transaction_id": item.txn.transaction_id}
    ) as span:
        # Body parsing and validation ran before this handler, since ``start``.
        tracer.start_span("validation", start_time=start).end()
        result = await _decide(res, item, deadline, gone)
        for name, (s, e) in result.spans_ns.items():
            tracer.start_span(name, start_time=s).end(end_time=e)
        span.set_attribute("decision", result.decision)
    return result


def _json(body: dict[str, Any]) -> Response:
    # Serialised once, by pydantic-core (the route's response_model documents the shape;
    # returning a Response skips FastAPI's validation pass).
    return Response(to_json(body), media_type="application/json")


class ReloadOut(BaseModel):
    previous_version: str | None
    serving_version: str
    challenger_version: str | None = None
    canary_percent: float = 0.0


@router.post(
    "/v1/models/reload",
    response_model=ReloadOut,
    dependencies=[Depends(require_scope(Scope.ADMIN))],
    responses=error_responses(401, 403, 409, 415, 422)
    | {503: {"model": ErrorOut, "description": _DRAINING}},
    openapi_extra={
        # Documented as required: the call needs the JSON Content-Type even with no body
        # (415 otherwise), and a request without a body has none. `{}` (or an empty body
        # with that Content-Type) reloads the configured version.
        "requestBody": {
            "required": True,
            "description": "What to change; `{}` (or no body, with `Content-Type: "
            "application/json`) reloads the configured version.",
            "content": {
                "application/json": {"schema": LineupChange.model_json_schema(), "example": {}}
            },
        }
    },
)
async def reload_model(request: Request) -> JSONResponse:
    """Load the configured version (e.g. 'latest') and swap it in; keep the old on failure.
    An optional body (:class:`~service.core.challenger.LineupChange`) changes this process's
    champion version, challenger and canary share: promotion and rollback. The request
    needs ``Content-Type: application/json`` even without a body (415 otherwise)."""
    # JSON only, body or not, auth on or off: a cross-site form post cannot send it
    # (a browser asks first, and the service answers no CORS preflight).
    raw = await _json_body(request)
    res = resources(request)
    old = res.models.current.version if res.models.current else None
    change = LineupChange()
    if raw:  # a body that is there is JSON: whitespace alone is not
        change = await json_model(request, LineupChange)
    assert res.challenger is not None  # open_resources always makes one
    try:
        new = await asyncio.to_thread(res.challenger.apply, res.models, change)
    except ModelError as exc:
        raise ModelRejected(str(exc), serving_version=old) from None
    return JSONResponse({"previous_version": old, **dataclasses.asdict(new)})


@router.get(
    "/healthz",
    response_model=HealthzOut,
    responses={503: {"model": ErrorOut, "description": _DRAINING}},
)
async def healthz() -> dict[str, str]:
    return {"status": "alive"}


@router.get(
    "/readyz",
    response_model=ReadyzOut,
    responses={
        503: {
            # The probe's own body; a request after SIGTERM gets the draining problem list.
            "model": ReadyzProblemsOut | ErrorOut,
            "description": "Not ready (`Retry-After: 5`): one entry per part that is not, "
            "saying why; not counted in fraud_rejections_total. Or the process is stopping "
            "(`draining`, the problem list).",
        }
    },
)
async def readyz(request: Request) -> JSONResponse:
    """200 with the serving model, or 503 naming each part that is not ready and why
    (``model``: e.g. "not loaded: <why it cannot load>"; ``redis``: unreachable or the
    circuit breaker open; ``batch_features``: the store holds none for a view;
    ``declared_features``: a declared state the models read is not backfilled). Under
    FRAUD_DEGRADED_POLICY=rules the store's problems do not make it 503: the body says
    ``degraded`` with the reasons instead."""
    res = resources(request)
    problems: dict[str, str] = {}
    store: dict[str, str] = {}
    if (why := res.models.readiness()) is not None:
        problems["model"] = why
    if res.health is not None and res.health.is_open:
        store["redis"] = "feature store unreachable (circuit open)"  # agree with the breaker
    else:
        try:
            # execute_command, not ping(): redis-py types ping() as "awaitable or bool".
            await asyncio.wait_for(res.redis.execute_command("PING"), timeout=1.0)
        except Exception as exc:  # any failure to reach Redis means not ready
            # /readyz is open: the cause (it names Redis's host:port) goes to the log only.
            log.warning("readiness: Redis unreachable: %r", exc)
            store["redis"] = "feature store unreachable"
    if res.health is not None and res.health.absent_views:
        store["batch_features"] = "none in the store for " + ", ".join(res.health.absent_views)
    if res.health is not None and res.health.absent_states:
        store["declared_features"] = "not backfilled: " + ", ".join(res.health.absent_states)
    degraded = res.settings.degraded_policy == "rules"
    if not degraded:
        problems |= store
    if problems:
        raise NotReady(problems)
    model = res.models.require()
    body: dict[str, Any] = {
        "status": "ready",
        "model_version": model.version,
        "providers": model.providers,
        "rules_version": res.scorer.rules.current.version,
    }
    if (why := res.scorer.rules.problem) is not None:
        body["rules"] = why  # information only: the rules before the refused file serve
    # Information only: scoring goes on (decisions buffered, then dropped and counted).
    if res.decision_log is not None and (why := res.decision_log.readiness()) is not None:
        body["decision_log"] = why
    if res.health is not None and res.health.read_only is not None:
        # Information only: decisions go on, not recorded (ids unclaimed) until it writes.
        body["store_writes"] = res.health.read_only + "; deciding without recording"
    if res.challenger is not None and (why := res.challenger.readiness()) is not None:
        body["challenger"] = why  # information only: the serving model decides alone
    if degraded and store:
        body["degraded"] = store  # deciding by rules only while these last
    return JSONResponse(body)


@router.get(
    "/metrics",
    dependencies=[Depends(require_scope(Scope.METRICS))],
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "Prometheus' text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **error_responses(401, 403),
        503: {"model": ErrorOut, "description": _DRAINING},
    },
)
async def metrics() -> Response:
    return Response(telemetry.exposition(), media_type=prometheus_client.CONTENT_TYPE_LATEST)
