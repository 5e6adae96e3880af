"""The HTTP connection: uvicorn's httptools protocol plus what uvicorn leaves out.

``fraud-scoring serve`` runs uvicorn with :class:`GuardedHttpTools` (``http=`` in
``service.edge.server``). Per connection it adds:

* **A header size limit.** uvicorn's ``h11_max_incomplete_event_size`` applies to its
  h11 implementation only; with httptools (the default when installed, and the faster
  one) headers are unbounded. Here a request line plus headers over
  :data:`MAX_HEADER_BYTES` get ``431`` and the connection is closed.
* **A header read timeout.** uvicorn has none: ``timeout_keep_alive`` runs only between
  requests, so a connection that never finishes its headers (or never sends any) is held
  until ``limit_concurrency`` is used up. Here the headers must be complete within
  ``FRAUD_HEADER_TIMEOUT_S`` of the connection opening or of a request's first byte on a
  kept-alive connection, else ``408`` (or, for a connection that sent nothing, a plain
  close). The body has its own bound (``FRAUD_BODY_TIMEOUT_S``, ``service.edge.admission``).
* **The request's arrival.** The time its first byte was parsed (``time.monotonic()``)
  goes into the ASGI scope (:data:`ARRIVED`): a request's deadline counts from there, not
  from when its handler first runs, which under load is a loop iteration or more later
  (service/edge/routes.py ``arrived``).
* **A drain that answers.** On SIGTERM uvicorn closes idle keep-alive connections at
  once, so a request a client sends on one at that moment meets a closed socket. Here an
  idle connection stays open while uvicorn waits for connections to finish (at most
  ``timeout_graceful_shutdown``, i.e. ``FRAUD_DRAIN_SECONDS``): a request arriving on it
  is answered ``503`` (reason ``draining``, ``Retry-After: 0``) with ``Connection:
  close``; a request in flight completes and its answer closes the connection; an idle
  connection still closes at the keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.edge import errors_http
from service.errors import Rejected, RejectReason
from service.settings import get_settings

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
# Scope key: when the request's first byte was parsed (time.monotonic()).
ARRIVED = "fraud_scoring.arrived"

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


async def answer_draining(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request that arrives on an open connection after SIGTERM: 503
    ``draining`` (counted), ``Connection: close``; ``{"error"}`` on the ``/v2`` paths."""
    exc = Rejected(RejectReason.DRAINING, "shutting down: send this request to another instance", 0)
    reply = errors_http.answer(scope, exc)
    reply.headers["Connection"] = "close"
    await reply(scope, receive, send)


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header size limit, a header read timeout and
    an answering drain (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = get_settings().header_timeout_s
        self._in_headers = True  # waiting for (the rest of) a request line and headers
        self._raw = 0  # bytes received for them so far
        self._timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    # -- the header read timeout -----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(self._header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if not self._in_headers or self.transport.is_closing():
            return
        if self._raw == 0:  # opened and never used: nothing to answer
            self.transport.close()
            return
        self._refuse(408, f"request headers not received within {self._header_timeout_s:g} s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- the header size limit -------------------------------------------------------
    # Checked per read and once per request, not per header: a request that arrives whole
    # in one read (the usual case) costs no timer and no callback of its own.
    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._raw += len(data)
        super().data_received(data)
        if not self._in_headers or self.transport.is_closing():
            return
        # Headers still incomplete after this read: everything read so far is headers,
        # and the rest must arrive in time (from this request's first read).
        if self._raw > MAX_HEADER_BYTES:
            self._refuse(431, f"request headers larger than {MAX_HEADER_BYTES} bytes")
        elif self._raw:
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ARRIVED] = time.monotonic()  # type: ignore[literal-required]

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        # Complete headers that arrived in one read: the request line and the fields.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > MAX_HEADER_BYTES:
            self._refusal = (431, f"request headers larger than {MAX_HEADER_BYTES} bytes")
            raise _Refused  # uvicorn stops parsing and answers through send_400_response
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers, self._raw = True, 0

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(*self._refusal)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` in plain text, close the connection; the app never sees it."""
        log.warning("refused a request with %d: %s", status, message)
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()

    # -- the drain -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Called by uvicorn on SIGTERM: from now on every request on this connection is
        answered :func:`answer_draining`; an idle connection stays open for it (until the
        client closes it or the keep-alive timeout does)."""
        self.app = answer_draining
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # the answer in flight closes the connection
