"""Admission: a bound on scoring requests in the process, enforced before any work."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import Rejected, RejectReason
from service.resources import resources

# Scope key: when the request was admitted (time.time_ns()), the start of its trace.
RECEIVED_NS = "fraud_scoring.received_ns"


class AdmissionLimit:
    """Pure ASGI middleware: at most ``limit`` scoring requests in the process at once.

    Past that, 503 + Retry-After at once (reason ``inflight``), before the body is read or
    validated: under overload the time goes to the requests that can still meet their
    deadlines. Other paths (health, metrics) are never limited."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit, self.inflight = app, limit, 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/score"):
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.limit:
            more = True  # drain the unread body so the keep-alive connection stays usable
            while more:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
            overloaded = Rejected(RejectReason.INFLIGHT, "overloaded: too many requests in flight")
            await resources(scope).answer(overloaded)(scope, receive, send)
            return
        self.inflight += 1
        scope[RECEIVED_NS] = time.time_ns()
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
