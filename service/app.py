"""The scoring API, composed: resources made in the lifespan, admission, routes, errors.

* ``service.resources``: everything the service holds, created and closed in one place;
* ``service.admission``: admission by work (transactions) and per key, before any work;
* ``service.auth``: API keys and scopes (``FRAUD_AUTH``), checked before a body is read;
* ``service.routes``: the endpoints and the error answers (one for every 503);
* ``service.oip``: the Open Inference Protocol v2 (``/v2``) on the raw model;
* ``service.schemas``: the response bodies; ``service.model``: the model and its watcher;
* ``service.telemetry``: metrics, and traces when ``OTEL_TRACES_EXPORTER`` is set.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline

from fraud_scoring.settings import Settings, get_settings
from service import auth, oip, review, telemetry
from service.admission import AdmissionLimit
from service.feedback import router as feedback_router
from service.resources import STATE_KEY, open_resources
from service.routes import EXCEPTION_HANDLERS, DirectDispatch, router


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app for ``settings`` (default: from the environment). Nothing connects until
    the lifespan starts; without REDIS_URL it refuses to start (RedisNotConfigured) unless
    ``embedded_redis`` is set, and with ``auth`` 'required' it refuses a keys file it
    cannot read (KeysFileError)."""
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # The keys first: a bad keys file stops the start before anything connects.
        keyring = auth.keyring_for(settings)
        async with open_resources(settings) as res:
            # Start-up objects (Feast, pandas, the model) never die: move them out of the
            # collector's reach so full collections stay short on the request path.
            gc.collect()
            gc.freeze()
            yield {STATE_KEY: res, auth.STATE_KEY: keyring}

    # /docs and /redoc serve Swagger UI's and ReDoc's assets from the installed
    # fastapi-offline package, not a CDN: they render on a cluster without internet.
    app = FastAPIOffline(
        title="fraud-scoring",
        version="0.1.0",
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.add_middleware(
        AdmissionLimit,
        capacity=settings.admission_capacity,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        max_batch_request=settings.max_batch_request,
        # The scoring routes straight from admission, past Starlette's routing layers.
        inner=lambda rest: DirectDispatch(app, rest),
    )
    app.include_router(router)
    app.include_router(oip.router)
    # Feedback is scored traffic's other half: the same `score` scope.
    app.include_router(
        feedback_router, dependencies=[Depends(auth.require_scope(auth.Scope.SCORE))]
    )
    # The analysts' review queue: its API reads and writes need `admin`; the page is open.
    app.include_router(review.router, dependencies=[Depends(auth.require_scope(auth.Scope.ADMIN))])
    app.include_router(review.page_router)
    # Server spans and HTTP metrics from OpenTelemetry's instrumentation, only when
    # tracing is on (OTEL_TRACES_EXPORTER): off, requests pass through no extra layer.
    telemetry.instrument_app(app)
    return app
