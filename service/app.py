"""The scoring API: POST /v1/score, /v1/score/batch, model reload, health and metrics.

Resources (Redis pool, Feast store, model sessions, the batcher) are created in the
lifespan and kept on ``app.state``; nothing connects at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import prometheus_client
import redis.asyncio as aioredis
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from pydantic import BaseModel, Field, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import open_store
from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import ModelError, ModelNotFound, versions
from fraud_scoring.redis_server import redis_url
from fraud_scoring.settings import Settings, get_settings
from service import telemetry
from service.batching import Batcher, BatchStats, DeadlineExceeded, QueueFull
from service.features import OnlineFeatureReader
from service.model import LoadedModel, ModelHolder, load_model
from service.scoring import FeatureStoreUnavailable, Scorer, ScoreResult

log = logging.getLogger(__name__)


# --- response schema -------------------------------------------------------------------
class ReasonOut(BaseModel):
    code: str
    message: str


class FeatureStatus(BaseModel):
    missing: list[str] = Field(description="features with no value; defaults were used")
    stale: list[str] = Field(
        description="features older than their TTL (or newer than the "
        "transaction); defaults were used"
    )


class Timing(BaseModel):
    queue_ms: float
    feature_read_ms: float
    inference_ms: float
    decision_ms: float
    total_ms: float
    batch_size: int


class ScoreOut(BaseModel):
    transaction_id: str
    decision: str
    score: float
    reasons: list[ReasonOut]
    model_version: str
    features: FeatureStatus
    timing: Timing


class BatchIn(BaseModel):
    transactions: list[Transaction]


class BatchOut(BaseModel):
    results: list[ScoreOut]


class ServiceUnavailable(Exception):
    def __init__(self, reason: str, retry_after_s: int = 1) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class PayloadTooLarge(Exception):
    pass


# --- app -------------------------------------------------------------------------------
def _load(settings: Settings) -> LoadedModel:
    return load_model(
        settings.model_repo,
        settings.model_name,
        settings.model_version,
        producible=producible_features(),
        provider_setting=settings.execution_provider,
        instances=settings.model_instances,
        intra_op_threads=settings.intra_op_threads,
    )


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    instruments = telemetry.setup()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_url(settings.redis_url))
        store = open_store(settings.data_dir, url, settings.feature_store_yaml)
        models = ModelHolder()
        try:
            models.current = _load(settings)  # refuses a model it cannot feed: no start
        except ModelNotFound as exc:
            log.warning("%s; not ready until a model appears", exc)
        stack.callback(_watch_models(models, settings).cancel)
        # A blocking pool: past 64 connections a read waits (up to the Redis timeout) for
        # a free one instead of failing, e.g. a large batch call on the naive path.
        client = aioredis.Redis.from_pool(  # the client owns (and closes) the pool
            aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=64,
                timeout=settings.redis_timeout_s,
                socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s,
            )
        )
        pool = ThreadPoolExecutor(max_workers=settings.model_instances, thread_name_prefix="onnx")
        reader = OnlineFeatureReader(store.project, store.config.entity_key_serialization_version)
        scorer = Scorer(client, reader, models, settings, pool)

        def version() -> str:
            return models.current.version if models.current else "none"

        def on_batch(size: int, compute_s: float, waits: list[float]) -> None:
            attrs = {"model_version": version()}
            instruments.batch_size.record(size, attrs)
            instruments.compute_time.record(compute_s, attrs)
            for w in waits:
                instruments.queue_time.record(w, attrs)

        def on_reject(reason: str) -> None:
            instruments.rejections.add(1, {"reason": reason, "model_version": version()})

        batcher: Batcher[Transaction, ScoreResult] | None = None
        if settings.batching:
            batcher = Batcher(
                scorer.score_batch,
                max_batch_size=settings.max_batch_size,
                max_queue_delay_s=settings.max_queue_delay_ms / 1e3,
                max_queue_size=settings.max_queue_size,
                preferred_batch_sizes=settings.preferred_batch_sizes,
                concurrency=settings.model_instances,
                stats=BatchStats(on_batch=on_batch, on_reject=on_reject),
            )
            batcher.start()
            queued = batcher
            telemetry.observe_queue_depth(lambda: queued.depth)
            stack.callback(telemetry.observe_queue_depth, None)
        app.state.redis = client
        app.state.models = models
        app.state.scorer = scorer
        app.state.batcher = batcher
        app.state.instruments = instruments
        app.state.on_reject = on_reject
        # Start-up objects (Feast, pandas, the model) never die: move them out of the
        # collector's reach so full collections stay short on the request path.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if batcher:
                await batcher.stop(drain_s=settings.drain_seconds)
            await client.aclose()
            pool.shutdown(wait=True)


def _watch_models(models: ModelHolder, settings: Settings) -> asyncio.Task[None]:
    """Look for a model every ``model_poll_s``: until the first one exists (the training
    job has not run yet) and, with version 'latest', for newer versions, which are
    swapped in atomically. While a model serves, a newer version that fails to load or
    validate is logged once and skipped; the serving model stays. Until the first model
    loads, every poll tries again."""

    async def watch() -> None:
        failed: set[int] = set()
        while True:
            await asyncio.sleep(settings.model_poll_s)
            try:
                await look(failed)
            except Exception:  # e.g. the repository changing under the scan: try again
                log.exception("model watch failed; keeping the current model")

    async def look(failed: set[int]) -> None:
        found = versions(settings.model_repo, settings.model_name)
        current = models.current
        if current is not None and (
            settings.model_version != "latest"
            or not found
            or found[-1] <= int(current.version)
            or found[-1] in failed
        ):
            return
        if current is None and settings.model_version == "latest" and not found:
            return
        try:
            new = await asyncio.to_thread(models.swap, lambda: _load(settings))
            log.info("now serving model %s v%s", new.meta.name, new.version)
        except ModelNotFound:
            return
        except ModelError:
            log.exception("cannot serve the new model; keeping the current one")
            if found:
                failed.add(found[-1])

    return asyncio.get_running_loop().create_task(watch(), name="model-watch")


RECEIVED_NS = "fraud_scoring.received_ns"


class AdmissionLimit:
    """Pure ASGI middleware: at most ``limit`` scoring requests in the process at once.

    Past that, 503 + Retry-After at once, before the body is read or validated: under
    overload the time goes to the requests that can still meet their deadlines."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit, self.inflight = app, limit, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/score"):
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.limit:
            on_reject = getattr(scope["app"].state, "on_reject", None)
            if on_reject:
                on_reject("inflight")
            more = True  # drain the unread body so the keep-alive connection stays usable
            while more:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
            overloaded = JSONResponse(
                {"detail": "overloaded: too many requests in flight"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
            await overloaded(scope, receive, send)
            return
        self.inflight += 1
        scope[RECEIVED_NS] = time.time_ns()  # start of the request's trace
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1


def create_app(settings: Settings | None = None) -> FastAPI:
    app = FastAPI(title="fraud-scoring", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings or get_settings()
    app.add_middleware(AdmissionLimit, limit=app.state.settings.max_inflight)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            loc = [str(p) for p in e["loc"] if p != "body"]
            problem = e["msg"]
            if e["type"] == "json_invalid":
                problem = f"body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
            errors.append({"field": ".".join(loc) or "body", "problem": problem})
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(ServiceUnavailable)
    async def _unavailable(request: Request, exc: ServiceUnavailable) -> JSONResponse:
        return JSONResponse(
            status_code=503,
            content={"detail": str(exc)},
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    @app.exception_handler(PayloadTooLarge)
    async def _too_large(request: Request, exc: PayloadTooLarge) -> JSONResponse:
        return JSONResponse(
            status_code=413, content={"detail": [{"field": "transactions", "problem": str(exc)}]}
        )

    app.post(
        "/v1/score",
        response_model=ScoreOut,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": Transaction.model_json_schema()}},
            }
        },
    )(score)
    app.post("/v1/score/batch", response_model=BatchOut)(score_batch)
    app.post("/v1/models/reload")(reload_model)
    app.get("/healthz")(healthz)
    app.get("/readyz")(readyz)
    app.get("/metrics")(metrics)
    return app


def _deadline(request: Request, timeout_ms: float | None) -> float:
    settings: Settings = request.app.state.settings
    ms = settings.request_timeout_ms if timeout_ms is None else timeout_ms
    return time.monotonic() + ms / 1e3


TimeoutHeader = Annotated[float | None, Header(alias="X-Request-Timeout-Ms", gt=0, le=60_000)]


async def _score_one(request: Request, txn: Transaction, deadline: float) -> ScoreOut:
    state = request.app.state
    if state.models.current is None:
        raise ServiceUnavailable("no model loaded yet", retry_after_s=5)
    start = time.perf_counter()
    tracer = telemetry.tracer()
    received = request.scope.get(RECEIVED_NS, time.time_ns())
    with tracer.start_as_current_span(
        "score", start_time=received, attributes={"transaction_id": txn.transaction_id}
    ):
        # Body parsing and validation ran before this handler, since ``received``.
        tracer.start_span("validation", start_time=received).end()
        try:
            if state.batcher is not None:
                # asyncio.timeout cancels the await (and so the queued item) at the
                # deadline without wrapping it in a task as wait_for would.
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    res = await state.batcher.submit(txn, deadline)
            else:
                if deadline <= time.monotonic():
                    state.on_reject("deadline")
                    raise DeadlineExceeded("deadline passed")
                res = (await state.scorer.score_batch([txn]))[0]
        except QueueFull as exc:
            raise ServiceUnavailable(f"overloaded: {exc}") from exc
        except FeatureStoreUnavailable as exc:
            state.on_reject("feature_store")
            raise ServiceUnavailable(str(exc)) from exc
        except (DeadlineExceeded, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                state.on_reject("timeout")
            raise ServiceUnavailable(f"deadline exceeded: {exc or 'timed out'}") from exc
        for name, (s, e) in res.spans_ns.items():
            tracer.start_span(name, start_time=s).end(end_time=e)
        total_ms = (time.perf_counter() - start) * 1e3
        tm = res.timing_ms
        queue_ms = max(total_ms - tm["feature_read"] - tm["inference"] - tm["decision"], 0.0)
        trace.get_current_span().set_attribute("decision", res.decision)
    state.instruments.decisions.add(
        1, {"decision": res.decision, "model_version": res.model_version}
    )
    state.instruments.request_duration.record(total_ms / 1e3, {"model_version": res.model_version})
    return ScoreOut(
        transaction_id=res.transaction_id,
        decision=res.decision,
        score=res.score,
        reasons=[ReasonOut(code=r.code, message=r.message) for r in res.reasons],
        model_version=res.model_version,
        features=FeatureStatus(missing=res.missing, stale=res.stale),
        timing=Timing(
            queue_ms=queue_ms,
            feature_read_ms=tm["feature_read"],
            inference_ms=tm["inference"],
            decision_ms=tm["decision"],
            total_ms=total_ms,
            batch_size=int(tm["batch_size"]),
        ),
    )


async def score(request: Request) -> Response:
    """Score one transaction: approve, review or decline, with reasons.

    The hot path parses the body with pydantic-core straight from bytes (one pass, no
    ``json.loads`` and no dependency solving); errors take the same 422 route as
    everywhere else.
    """
    try:
        txn = Transaction.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None
    raw = request.headers.get("x-request-timeout-ms")
    timeout_ms = None
    if raw is not None:
        try:
            timeout_ms = float(raw)
        except ValueError:
            timeout_ms = -1.0
        if not 0 < timeout_ms <= 60_000:
            raise RequestValidationError(
                [
                    {
                        "loc": ("header", "X-Request-Timeout-Ms"),
                        "type": "value_error",
                        "msg": f"must be a number of milliseconds in (0, 60000], got {raw!r}",
                    }
                ]
            )
    deadline = _deadline(request, timeout_ms)
    return await _unless_client_leaves(request, _score_one(request, txn, deadline))


def _json(body: BaseModel) -> Response:
    # Serialized once here; returning a Response skips FastAPI's second validation pass
    # (the route's response_model still documents the schema).
    return Response(body.model_dump_json(), media_type="application/json")


async def score_batch(
    request: Request, body: BatchIn, x_request_timeout_ms: TimeoutHeader = None
) -> Response:
    """Score up to ``FRAUD_MAX_BATCH_REQUEST`` transactions; results keep the input order."""
    limit = request.app.state.settings.max_batch_request
    if len(body.transactions) > limit:
        raise PayloadTooLarge(f"{len(body.transactions)} transactions; at most {limit} per call")
    if not body.transactions:
        raise RequestValidationError(
            [
                {
                    "loc": ("body", "transactions"),
                    "type": "too_short",
                    "msg": "at least one transaction is required",
                }
            ]
        )
    deadline = _deadline(request, x_request_timeout_ms)

    async def all_of_them() -> BatchOut:
        # The call fails as a whole (e.g. 503 on a full queue): then cancel the rest, so
        # no work is done for answers nobody will receive.
        tasks = [asyncio.ensure_future(_score_one(request, t, deadline)) for t in body.transactions]
        try:
            return BatchOut(results=list(await asyncio.gather(*tasks)))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    return await _unless_client_leaves(request, all_of_them())


async def _unless_client_leaves(request: Request, work: Awaitable[BaseModel]) -> Response:
    """Run ``work`` unless the client disconnects first.

    The body has been read, so the next ASGI message is ``http.disconnect``: a watcher
    waits for it and cancels this handler, which cancels its queued batch items; the
    batcher drops them before their batch runs (they never reach the model).
    """
    handler = asyncio.current_task()
    assert handler is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        handler.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return _json(await work)
    except asyncio.CancelledError:
        if not gone:
            raise
        handler.uncancel()
        request.app.state.on_reject("disconnected")
        return Response(status_code=499)  # nobody is listening; for the access log only
    finally:
        watcher.cancel()


async def reload_model(request: Request) -> JSONResponse:
    """Load the configured version (e.g. 'latest') and swap it in; keep the old on failure."""
    state = request.app.state
    old = state.models.current.version if state.models.current else None
    try:
        new = await asyncio.get_running_loop().run_in_executor(
            None, state.models.swap, lambda: _load(state.settings)
        )
    except ModelError as exc:
        return JSONResponse(status_code=409, content={"detail": str(exc), "serving_version": old})
    return JSONResponse({"previous_version": old, "serving_version": new.version})


async def healthz() -> dict[str, str]:
    return {"status": "alive"}


async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    problems: dict[str, Any] = {}
    if state.models.current is None:
        problems["model"] = "not loaded"
    try:
        await asyncio.wait_for(state.redis.ping(), timeout=1.0)
    except Exception as exc:  # any failure to reach Redis means not ready
        problems["redis"] = f"unreachable: {exc!r}"
    if problems:
        return JSONResponse(status_code=503, content={"status": "not ready", **problems})
    return JSONResponse(
        {
            "status": "ready",
            "model_version": state.models.current.version,
            "providers": state.models.current.providers,
        }
    )


async def metrics() -> Response:
    return Response(
        prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )
