"""Admission: a scoring request's body is read whole, bounded in size and time; then the
request is weighed in transactions and admitted against the process's capacity and its
caller's fair share, before any other work.

Why by work and not by request: a batch-endpoint call of 32 transactions costs the model
32 times what a single call does. Counted as one request, a few batch callers fill the
queue while the in-flight bound still looks half empty, and every call then waits past
its deadline. Weighed in transactions, the process holds at most ``capacity``
transactions of work (two full micro-batches per model instance by default), so what is
admitted finishes in time and the rest is refused at once.

Why per client: one caller's batch calls must not starve another caller's single calls.
A client is the API key's id (auth on); with auth off every caller is one client,
``anonymous``: the process has no identity for them it could trust (behind an ingress
every connection comes from the ingress, and ``X-Forwarded-For`` is the caller's to
write), so fairness between callers needs keys."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from pydantic_core import from_json
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.edge import auth, errors_http
from service.errors import BodyTimeout, Rejected, RejectReason, TooLarge

# Scope key: when the request arrived (time.time_ns()), the start of its trace.
RECEIVED_NS = "fraud_scoring.received_ns"
# Scope key: the batch endpoint's body as admission parsed it to count the transactions;
# the route validates it without parsing the bytes again.
PARSED_BODY = "fraud_scoring.parsed_body"
BATCH_PATH = "/v1/score/batch"
# A client that called within this many seconds counts for the fair share.
SHARE_WINDOW_S = 1.0
# The least a call weighs, in transactions: a call's own work (HTTP, parsing, its task,
# the answer) costs about what a transaction costs the model. Measured on one core, single
# calls saturate at about half the transactions/s of 32-transaction batch calls
# (bench/README.md). So the default capacity (128) holds four 32-transaction calls, enough
# to keep the model busy between them, but only 64 single calls, about one micro-batch:
# what is admitted is answered within ~20 ms at the single-call ceiling.
CALL_WEIGHT = 2


class WorkShares:
    """Transactions admitted and not yet answered, in all and per client, against
    ``capacity``. Not thread-safe: one per event loop (per uvicorn worker).

    A call weighing ``w`` transactions is admitted when

    * the process then holds at most ``capacity`` (no call is heavier: the batch
      endpoint refuses more than ``max_batch_request``, at most the capacity, with 413),
      and
    * its client, if it already holds work, stays within its fair share (``capacity``
      split between the clients seen in the last ``window_s`` seconds or holding work,
      in proportion to their ``share``: the key's weight from the keys file, 1 by
      default), or, over it, leaves a reserve of ``capacity / 8`` free for each other
      client.

    A client alone may use the whole capacity. When a second one calls, the first may go
    over its half only as far as the reserve allows, so the second's calls are admitted
    as soon as the first one's work in process drains (a fraction of a second: the
    capacity is two micro-batches), and capacity the second does not use is not wasted.
    Each client may always hold one call, whatever its share.
    """

    def __init__(self, capacity: int, window_s: float = SHARE_WINDOW_S) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity, self.window_s = capacity, window_s
        self.reserve = max(1, capacity // 8)
        self.total = 0
        self.held: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def refusal(
        self, client: str, weight: int, now: float, client_share: float = 1.0
    ) -> Rejected | None:
        """Why a call of ``weight`` transactions from ``client`` cannot be admitted now,
        or None: ``client_share`` when the client is over its share (the caller that
        should back off), else ``inflight`` when the capacity is full. Records that
        ``client`` called, with its weight ``client_share`` (it then counts for the
        shares)."""
        self._seen[client] = now
        self._weights[client] = client_share
        held = self.held.get(client, 0)
        # Every key that called lately counts, also for a key holding nothing: else one
        # heavy call from an idle key takes the whole capacity and refuses the others.
        active = self._active(now)
        if active > 1:
            total_weight = sum(self._weights[c] for c in self._seen)
            share = self.capacity * client_share / total_weight
            # Over its share, a key may still use room nobody else uses, but leaves a
            # reserve free for each other key that calls.
            reserve = self.reserve * (active - 1)
            if held + weight > share and self.total + weight + reserve > self.capacity:
                return Rejected(
                    RejectReason.CLIENT_SHARE,
                    f"overloaded: key {client!r} holds {held} transactions in process, its "
                    f"share is {share:.0f} of {self.capacity} while other keys are calling",
                )
        if self.total and self.total + weight > self.capacity:
            return Rejected(
                RejectReason.INFLIGHT,
                f"overloaded: {self.total} of {self.capacity} transactions in process",
            )
        return None

    def take(self, client: str, weight: int) -> None:
        self.total += weight
        self.held[client] = self.held.get(client, 0) + weight

    def release(self, client: str, weight: int) -> None:
        self.total -= weight
        left = self.held[client] - weight
        if left:
            self.held[client] = left
        else:
            del self.held[client]

    def _active(self, now: float) -> int:
        """Clients seen within the window or holding work (forgetting the others)."""
        cutoff = now - self.window_s
        for client in [c for c, t in self._seen.items() if t < cutoff and c not in self.held]:
            del self._seen[client], self._weights[client]
        return len(self._seen)


def client_of(scope: Scope) -> auth.Principal | None:
    """Who the request counts for: the API key's principal (the key verified, and the
    principal kept for the route's scope check), ``anonymous`` with auth off, None for a
    missing or invalid key (the route answers 401 at once; such a call weighs nothing)."""
    ring: auth.KeyRing | None = scope["state"].get(auth.STATE_KEY)
    if ring is None:
        return auth.ANONYMOUS
    try:
        who = ring.authenticate(auth.presented_key(Headers(scope=scope)))
    except auth.AuthError:
        return None
    scope[auth.PRINCIPAL_KEY] = who
    return who


class AdmissionLimit:
    """Pure ASGI middleware for the scoring, feedback and inference paths (``/v1/score*``,
    ``/v1/feedback``, ``/v2/models/.../infer``; the last answer in the inference
    protocol's ``{"error": ...}`` shape):

    1. a declared ``Content-Length`` over ``max_body_bytes`` is answered 413 before
       anything is read; a chunked body is cut (413) as soon as it passes the limit;
    2. the body must arrive whole within ``body_timeout_s`` of the request, else 408
       (``Connection: close``): a slow sender is cut, never waited for;
    3. then the call is weighed (the batch endpoint: its number of transactions, counted
       on the parsed JSON before any item is validated; any call at least
       :data:`CALL_WEIGHT`) and admitted by :class:`WorkShares` against ``capacity``.
       Refused: 503 + Retry-After at once (reason ``inflight`` or ``client_share``),
       without parsing the body when even the least weight would be refused. Reading a
       body does not count, so slow senders cannot hold the capacity that requests
       ready to score need.

    Other paths (health, metrics, reload) pass straight through."""

    def __init__(
        self,
        app: ASGIApp,
        capacity: int,
        max_body_bytes: int,
        body_timeout_s: float,
        max_batch_request: int,
        inner: Callable[[ASGIApp], ASGIApp] | None = None,
        shares: WorkShares | None = None,
    ) -> None:
        # ``inner``: what admitted calls go to, made from the next layer (the app's
        # direct dispatch of the scoring routes, ``service.edge.routes.DirectDispatch``).
        self.app = inner(app) if inner is not None else app
        # ``shares``: the process's admission state when another transport draws on it
        # too (the OIP gRPC server, ``service.edge.oip_grpc``); else one of its own.
        self.shares = shares if shares is not None else WorkShares(capacity)
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.max_batch_request = max_batch_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        oip = path.startswith("/v2/models/") and path.endswith("/infer")
        if not (oip or path.startswith(("/v1/score", "/v1/feedback"))):
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_NS] = time.time_ns()
        who = client_of(scope)
        client, now = (who.key_id, time.monotonic()) if who is not None else ("", 0.0)
        # A call that would be refused at its least weight is refused before its body is
        # read: the refusal costs no body, and a slow sender is not waited for.
        if who is not None and (
            refused := self.shares.refusal(client, CALL_WEIGHT, now, who.share)
        ):
            await self._refuse(scope, receive, send, refused)
            return
        try:
            body = await self._read(scope, receive)
        except (TooLarge, BodyTimeout) as exc:
            # Closing the connection: the rest of the body is not worth reading.
            exc.headers["Connection"] = "close"
            await errors_http.answer(scope, exc)(scope, receive, send)
            return
        replayed = _Replayed(body, receive).receive
        if who is None:  # no valid key: answered 401 before any work
            await self.app(scope, replayed, send)
            return
        weight = CALL_WEIGHT
        if path == BATCH_PATH:
            weight = max(CALL_WEIGHT, self._weigh(scope, body))
        # Again after the read (other calls may have taken capacity meanwhile), at the
        # call's weight; no await between this check and taking the capacity.
        refused = self.shares.refusal(client, weight, time.monotonic(), who.share)
        if refused is not None:
            await self._refuse(scope, receive, send, refused)
            return
        self.shares.take(client, weight)
        try:
            await self.app(scope, replayed, send)
        finally:
            self.shares.release(client, weight)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, refused: Rejected) -> None:
        await errors_http.answer(scope, refused)(scope, receive, send)

    def _weigh(self, scope: Scope, body: bytes) -> int:
        """The batch endpoint's number of transactions (one JSON parse, kept in the scope
        for the route); 1 for a body the route refuses at once (not JSON, no list, more
        than ``max_batch_request`` transactions)."""
        try:
            parsed = from_json(body)
        except ValueError:
            return 1
        scope[PARSED_BODY] = parsed
        items = parsed.get("transactions") if isinstance(parsed, dict) else None
        n = len(items) if isinstance(items, list) else 0
        return n if 1 <= n <= self.max_batch_request else 1

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise TooLarge(f"body of {int(value)} bytes; at most {limit}")
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
                        raise TooLarge(f"body larger than {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise BodyTimeout(
                f"request body not received within {self.body_timeout_s:g} s"
            ) from None
        return b"".join(chunks)


class _Replayed:
    """What the app receives: the body already read, then the real ``receive`` (so a
    disconnect is still seen). ``disconnected`` passes on uvicorn's flag, which the
    batcher's "client gone" check reads (``service.edge.routes.client_gone``)."""

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
