"""Admission: a scoring request's body is read whole, bounded in size and time, and only
then does the request count against the in-flight bound, before any other work."""

from __future__ import annotations

import asyncio
import contextlib
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ErrorCode, Rejected, RejectReason, error_body
from service.resources import resources

# Scope key: when the request arrived (time.time_ns()), the start of its trace.
RECEIVED_NS = "fraud_scoring.received_ns"


class BodyProblem(Exception):
    """The body could not be read whole: too large (413) or too slow (408)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class AdmissionLimit:
    """Pure ASGI middleware for the scoring, feedback and inference paths (``/v1/score*``,
    ``/v1/feedback``, ``/v2/models/.../infer``; the last answer in the inference
    protocol's ``{"error": ...}`` shape):

    1. a declared ``Content-Length`` over ``max_body_bytes`` is answered 413 before
       anything is read; a chunked body is cut (413) as soon as it passes the limit;
    2. the body must arrive whole within ``body_timeout_s`` of the request, else 408
       (``Connection: close``): a slow sender is cut, never waited for;
    3. then at most ``limit`` requests are in the process at once. Past that, 503 +
       Retry-After at once (reason ``inflight``). Reading a body does not count, so slow
       senders cannot fill the slots of requests that are ready to score.

    Other paths (health, metrics, reload) pass straight through."""

    def __init__(
        self, app: ASGIApp, limit: int, max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.app, self.limit, self.inflight = app, limit, 0
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        oip = path.startswith("/v2/models/") and path.endswith("/infer")
        if not (oip or path.startswith(("/v1/score", "/v1/feedback"))):
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_NS] = time.time_ns()
        try:
            body = await self._read(scope, receive)
        except BodyProblem as exc:
            # Closing the connection: the rest of the body is not worth reading.
            headers = {"Connection": "close"}
            code = ErrorCode.TOO_LARGE if exc.status == 413 else ErrorCode.BODY_TIMEOUT
            content = {"error": exc.detail} if oip else error_body(code, exc.detail)
            answer = JSONResponse(content, exc.status, headers=headers)
            await answer(scope, receive, send)
            return
        if self.inflight >= self.limit:
            overloaded = Rejected(RejectReason.INFLIGHT, "overloaded: too many requests in flight")
            res = resources(scope)
            reply = res.answer(overloaded, {"error": overloaded.detail} if oip else None)
            await reply(scope, receive, send)
            return
        self.inflight += 1
        try:
            await self.app(scope, _Replayed(body, receive).receive, send)
        finally:
            self.inflight -= 1

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise BodyProblem(413, f"body of {int(value)} bytes; at most {limit}")
        chunks: list[bytes] = []
        size = 0
        # uvicorn usually holds the whole body before the app starts: then receiving
        # cannot wait, and the timer (~2 % of a scoring request's CPU) is not needed.
        arrived = getattr(getattr(receive, "__self__", None), "more_body", True) is False
        timer = contextlib.nullcontext() if arrived else asyncio.timeout(self.body_timeout_s)
        try:
            async with timer:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        break  # the client left; the route sees an empty body and fails
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyProblem(413, f"body larger than {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise BodyProblem(
                408, f"request body not received within {self.body_timeout_s:g} s"
            ) from None
        return b"".join(chunks)


class _Replayed:
    """What the app receives: the body already read, then the real ``receive`` (so a
    disconnect is still seen). ``disconnected`` passes on uvicorn's flag, which the
    batcher's "client gone" check reads (``service.routes.client_gone``)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._real = receive
        self._cycle = getattr(receive, "__self__", None)

    @property
    def disconnected(self) -> bool | None:
        flag = getattr(self._cycle, "disconnected", None)
        return flag if isinstance(flag, bool) else None

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._real()
