"""The scoring API, composed: resources made in the lifespan, admission, routes, errors.

* ``service.resources``: everything the service holds, created and closed in one place;
* ``service.edge.admission``: admission by work (transactions) and per key, before any work
  (one state for REST and gRPC calls);
* ``service.edge.auth``: API keys and scopes (``FRAUD_AUTH``), checked before a body is read;
* ``service.edge.routes``: the endpoints and the error answers (one for every 503);
* ``service.edge.oip``: the Open Inference Protocol v2 (``/v2``) on the raw model;
  ``service.edge.oip_grpc`` the same over gRPC (``FRAUD_GRPC_PORT``);
* ``service.edge.schemas``: the response bodies; ``service.core.model``: the model and its watcher;
* ``service.telemetry``: metrics (HTTP ones included, in front of everything), and
  traces when ``OTEL_TRACES_EXPORTER`` is set.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import iter_route_contexts
from fastapi_offline import FastAPIOffline
from starlette.routing import Match
from starlette.types import ASGIApp, Scope

from fraud_scoring import fields
from service import telemetry
from service.edge import auth, feedback, lists_api, oip, oip_grpc, review, rules_api
from service.edge.admission import AdmissionLimit, WorkShares
from service.edge.errors_http import EXCEPTION_HANDLERS
from service.edge.feedback import router as feedback_router
from service.edge.routes import DirectDispatch, DirectRoute, router
from service.edge.schemas import document_declared_fields
from service.resources import STATE_KEY, open_resources
from service.settings import ServiceSettings, get_settings


def create_app(settings: ServiceSettings | None = None) -> FastAPI:
    """The app for ``settings`` (default: from the environment). Nothing connects until
    the lifespan starts; without REDIS_URL it refuses to start (RedisNotConfigured) unless
    ``embedded_redis`` is set, and with ``auth`` 'required' it refuses a keys file it
    cannot read (KeysFileError)."""
    settings = settings or get_settings()
    # The request bodies' model (the declared fields; refused here, naming the field, when
    # a PII field has no hash key): validated by the routes, documented in /openapi.json.
    door = fields.door_for(settings)
    # One admission state for both transports: REST's admission layer and the gRPC
    # server's calls are bounded together (one per process: both run on its event loop).
    shares = WorkShares(settings.admission_capacity)

    @contextlib.asynccontextmanager
    async def lifespan(started: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # The keys first: a bad keys file stops the start before anything connects.
        keyring = auth.keyring_for(settings)
        async with (
            open_resources(settings, door) as res,
            # The OIP gRPC server (FRAUD_GRPC_PORT; none unless set), stopped first.
            oip_grpc.serving(settings, res, keyring, started.version, shares),
        ):
            # Start-up objects (Feast, pandas, the model) never die: move them out of the
            # collector's reach so full collections stay short on the request path.
            gc.collect()
            gc.freeze()
            # fraud_decisions_total at 0 for the serving version from the start.
            if res.models.current is not None:
                res.instruments.zero_decisions(res.models.current.version)
            yield {STATE_KEY: res, auth.STATE_KEY: keyring}

    # /docs and /redoc serve Swagger UI's and ReDoc's assets from the installed
    # fastapi-offline package, not a CDN: they render on a cluster without internet.
    # /redoc is the app's own (_offline_redoc); Swagger UI's online validator is off.
    app = FastAPIOffline(
        title="fraud-scoring",
        version="0.1.0",
        redoc_url=None,
        swagger_ui_parameters={"validatorUrl": None},
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        # FastAPI's own OpenTelemetry layer off: service.telemetry owns traces and
        # metrics (below). On, it asks the global providers (environment reads) on every
        # request, ~5 % of the event loop under load, even when nothing is configured.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    _offline_redoc(app)
    _openapi_as_answered(app, auth_on=settings.auth == "required", door=door)
    app.include_router(router)
    app.include_router(oip.router)
    # Labels steer training and the review queue: their own `label` scope (admin implies
    # it), for feedback and the analysts' queue, reads included; the page is open.
    labelling = [Depends(auth.require_scope(auth.Scope.LABEL))]
    app.include_router(feedback_router, dependencies=labelling)
    feedback.zero_counters()
    app.include_router(review.router, dependencies=labelling)
    app.include_router(review.page_router)
    # Block and allow lists decide: their own `lists` scope (admin implies it).
    app.include_router(
        lists_api.router, dependencies=[Depends(auth.require_scope(auth.Scope.LISTS))]
    )
    # Testing a rules document reads the whole decision log: `admin` only.
    app.include_router(
        rules_api.router, dependencies=[Depends(auth.require_scope(auth.Scope.ADMIN))]
    )
    admission = functools.partial(
        AdmissionLimit,
        capacity=settings.admission_capacity,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        max_batch_request=settings.batch_request_limit,
        shares=shares,
        # The scoring routes straight from admission, past Starlette's routing layers.
        inner=lambda rest: DirectDispatch(app, rest),
    )
    # One stack whether tracing is on or off: HTTP metrics → [server spans] → admission →
    # DirectDispatch → Starlette's own layers. The server spans (OpenTelemetry's ASGI
    # middleware, only with OTEL_TRACES_EXPORTER) and the metrics see refusals too.
    _outermost(app, admission)
    traced = telemetry.tracing_layer(_span_details)
    if traced is not None:
        _outermost(app, traced)
    _outermost(app, functools.partial(telemetry.HttpMetrics, route_of=_route_of))
    return app


# The scoring routes DirectDispatch answers before any router (no path parameters).
_DIRECT_PATHS = frozenset(r.path for r in router.routes if isinstance(r, DirectRoute))


def _span_details(scope: Scope) -> tuple[str, dict[str, str]]:
    """A server span's name and attributes before the request runs: ``METHOD route``
    and ``http.route`` (the template of the route that will answer), or the method
    alone when none matches (a 404)."""
    method = scope.get("method", "")
    method = method if method in telemetry.HTTP_METHODS else "HTTP"
    route: str | None = scope["path"] if scope["path"] in _DIRECT_PATHS else None
    if route is None:
        # FastAPI nests included routers: its own iterator yields each route with its
        # whole path. A path whose method does not match (a 405) still names its route.
        partial = None
        for candidate in iter_route_contexts(scope["app"].routes):
            match = candidate.matches(scope)[0]
            if match is Match.FULL:
                route = candidate.path
                break
            if match is Match.PARTIAL and partial is None:
                partial = candidate.path
        route = route or partial
    if route is None:
        return method, {}
    return f"{method} {route}", {"http.route": route}


def _route_of(scope: Scope) -> str | None:
    """A request's ``http.route``: the template of the route Starlette's router matched
    (it leaves the route in the scope), or the path of a scoring route that
    ``DirectDispatch`` (or admission, refusing it) answered before any router. None when
    no route matched (a 404)."""
    route = scope.get("route")
    if route is not None:
        path: str | None = getattr(route, "path", None)
        return path
    return scope["path"] if scope["path"] in _DIRECT_PATHS else None


# ReDoc's bundle draws Redocly's logo from its CDN in the sidebar (no option turns it
# off): /redoc loads the bundle with that address emptied (the image then removes
# itself; tests/test_openapi.py checks no other host is left in it), and the page's
# Content-Security-Policy refuses other hosts' images, fonts and fetches.
_REDOC_JS = Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"
_REDOC_LOGO = b'"https://cdn.redoc.ly/redoc/logo-mini.svg"'
REDOC_JS_PATH = "/redoc/redoc.standalone.js"
REDOC_CSP = "img-src 'self' data:; font-src 'self' data:; connect-src 'self'"


@functools.cache
def _redoc_bundle() -> bytes:
    return _REDOC_JS.read_bytes().replace(_REDOC_LOGO, b'""')


def _offline_redoc(app: FastAPI) -> None:
    """``GET /redoc`` and its script, with nothing from another host (above)."""

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path") or ""
        page = get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{REDOC_JS_PATH}",
            redoc_favicon_url=f"{root}/static-offline-docs/favicon.png",
            with_google_fonts=False,
        )
        page.headers["Content-Security-Policy"] = REDOC_CSP
        return page

    @app.get(REDOC_JS_PATH, include_in_schema=False)
    async def redoc_js() -> Response:
        return Response(
            _redoc_bundle(),
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=3600"},
        )


# How a caller presents its key (service.edge.auth.presented_key), as OpenAPI schemes.
SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    "bearerAuth": {
        "type": "http",
        "scheme": "bearer",
        "description": "`Authorization: Bearer <key>` (FRAUD_AUTH=required; docs/api.md, Security)",
    },
    "apiKeyHeader": {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": "`X-API-Key: <key>`, the same key another way",
    },
}


def _openapi_as_answered(app: FastAPI, auth_on: bool, door: fields.Door) -> None:
    """``/openapi.json`` as the wire answers, after FastAPI builds it (once):

    * the ``/v2`` operations list no 422: their path parameters are plain strings and
      the protocol's errors are 400/404 (FastAPI adds a 422 to every route with
      parameters; ``service.edge.oip`` lists one in its own shape so that none of
      FastAPI's is added, and it is taken out here);
    * the key schemes (:data:`SECURITY_SCHEMES`) in ``components.securitySchemes``; with
      auth on (``FRAUD_AUTH=required``) every operation that answers 401 requires one of
      them (the others are open). With auth off no operation requires a key, as none is
      asked for (a client, or schemathesis, would otherwise expect a 401);
    * the scoring routes' bodies with the declared fields of ``door``, when there are."""
    standard = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = standard()
        for path, item in doc["paths"].items():
            for op in item.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                if path.startswith("/v2"):
                    op["responses"].pop("422", None)
                if auth_on and "401" in op["responses"]:
                    op["security"] = [{name: []} for name in SECURITY_SCHEMES]
        doc.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
        if door.fields:
            document_declared_fields(doc, door.model)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _outermost(app: FastAPI, layer: Callable[[ASGIApp], ASGIApp]) -> None:
    """Put ``layer`` in front of the app's whole middleware stack, outside Starlette's
    ``ServerErrorMiddleware`` and FastAPI's exception-telemetry and body-limit layers:
    with admission there, a scoring request runs admission → ``DirectDispatch`` →
    endpoint and nothing else (each layer is a coroutine call per request and the error
    layer a wrapped ``send`` per message). An exception nothing handles then reaches
    uvicorn, which answers the same plain 500 the error layer would (and logs it). The
    HTTP metrics' layer goes in front of it the same way (:func:`create_app`)."""
    standard = app.build_middleware_stack

    def build() -> ASGIApp:
        return layer(standard())

    app.build_middleware_stack = build  # type: ignore[method-assign]
