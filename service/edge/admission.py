"""Admission: a scoring request's body is read whole, bounded in size and time; then the
request is weighed in transactions and admitted against the process's capacity and its
caller's fair share, before any other work.

Why by work and not by request: a batch-endpoint call of 32 transactions costs the model
32 times what a single call does. Counted as one request, a few batch callers fill the
queue while the in-flight bound still looks half empty, and every call then waits past
its deadline. Weighed in transactions, the process holds at most ``capacity``
transactions of work (two full micro-batches per model instance by default), so what is
admitted finishes in time and the rest is refused at once.

Why by cost too: a transaction's cost is not fixed. When the feature read or the model
slows down (a 32-transaction call took 52-80 ms of feature reads in issue 38), a key's
share of 128 transactions is more work than a 100 ms deadline allows: every call queued
behind it then times out in the batcher instead of being refused. So each call is also
priced in time, its transactions x its key's measured time per transaction
(:class:`WorkShares` measures it per key, from the time the process held the key's work),
against the deadline: admitted only when the work already admitted plus its own ends
within ``FRAUD_ADMISSION_DEADLINE_FRACTION`` (0.8) of its deadline, and a key's fair share
is a share of that time under the default deadline, so the share of a key sending large
calls cannot push the other keys' calls past their deadlines.

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
from service.resources import STATE_KEY

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
# The measured time per transaction (admission by cost): a sample each time a key's
# work (or all work) has held the process this long, folded into a moving average with
# this weight for the new sample. A key's own measure prices its calls for KEY_FRESH_S
# after it was taken; then (and for a key not yet measured) the measure of all calls
# does, trusted only while taken within FRESH_S (as the batcher's measured batch time):
# otherwise one slow spell could refuse everything, nothing would then run, and the
# measure would never recover. A key refused for its cost is measured afresh when its
# own measure has aged out and all calls' measure lets one of its calls in.
SAMPLE_S = 0.05
SAMPLE_WEIGHT = 0.3
FRESH_S = 1.0
KEY_FRESH_S = 10.0
_TIMEOUT_KEY = b"x-request-timeout-ms"  # service.edge.routes.TIMEOUT_HEADER
_MAX_TIMEOUT_MS = 60_000.0


class _Account:
    """One key's work priced in time: what its calls in process were priced at on
    admission, and the measure of its calls' time per transaction (see
    :class:`WorkShares`). The markers are the shares' clocks when its held work last
    changed; the sums run since its last sample."""

    __slots__ = (
        "b",
        "cost_s",
        "done",
        "g",
        "held_s",
        "load",
        "measured_at",
        "per_txn_s",
        "v",
        "work_s",
    )

    def __init__(self, v: float, g: float, b: float) -> None:
        self.cost_s = 0.0  # its calls in process, as priced when admitted
        self.v, self.g, self.b = v, g, b
        self.work_s = 0.0  # time attributed to it
        self.held_s = 0.0  # time it held work
        self.load = 0.0  # transactions in process x time, while it held work
        self.done = 0  # transactions answered
        self.per_txn_s = 0.0
        self.measured_at = float("-inf")

    def settle(self, held: int, v: float, g: float, b: float) -> None:
        """Add the time since the last change, in which it held ``held`` transactions."""
        if held:
            self.work_s += held * (v - self.v)
            self.load += g - self.g
            self.held_s += b - self.b
        self.v, self.g, self.b = v, g, b


class WorkShares:
    """Transactions admitted and not yet answered, in all and per client, against
    ``capacity``, and the same work priced in time against a deadline. Not thread-safe:
    one per event loop (per uvicorn worker).

    A call weighing ``w`` transactions is admitted when

    * the process then holds at most ``capacity`` (no call is heavier: the batch
      endpoint refuses more than ``max_batch_request``, at most the capacity, with 413),
      and
    * its client, if it already holds work, stays within its fair share (``capacity``
      split between the clients seen in the last ``window_s`` seconds or holding work,
      in proportion to their ``share``: the key's weight from the keys file, 1 by
      default), or, over it, leaves a reserve of ``capacity / 8`` free for each other
      client;
    * and, priced in time (``budget_s`` set: the default deadline times
      ``FRAUD_ADMISSION_DEADLINE_FRACTION``; and a measure, :meth:`price`), the same two
      rules hold with the call's cost (``w`` x its key's time per transaction) for its
      weight, the priced work in process (:attr:`cost_s`) for the transactions and the
      budget for the capacity: the work already admitted plus the call's own ends within
      the call's own budget (``budget_s`` of :meth:`refusal`, its deadline times the
      fraction; by default the default budget), and a key holding work keeps to its share
      of the default budget or leaves an eighth of it free for each other key. A call
      that finds nothing in process is not refused for the time it would take (so the
      measure goes on), but may be for its share: a key whose one call costs more than
      its share and the others' reserves leave is refused while another key calls,
      since its call would push the other keys' calls past their deadlines.

    A client alone may use the whole capacity. When a second one calls, the first may go
    over its half only as far as the reserve allows, so the second's calls are admitted
    as soon as the first one's work in process drains (a fraction of a deadline), and
    capacity the second does not use is not wasted.

    The time per transaction is measured here, per key, not in the batcher (whose
    measure is a whole micro-batch's time, whatever its size or whose transactions,
    misses each call's HTTP, parse and validation, and the calls that never reach it:
    ``/v2`` inference, gRPC, the naive path): the time during which the process held
    work, each interval split between the keys holding work in proportion to their
    transactions (one virtual clock, so O(1) per call), per transaction answered. Per key,
    since a transaction's cost depends on the call it comes in: a 32-transaction call's
    feature read costs more per transaction than a single call's whole round trip may,
    and a measure of all calls together would price a batch key's calls at the single
    calls' rate while those dominate. A sample is kept only when the process held on
    average at least ``capacity / 8`` transactions meanwhile: a lone call's time is its
    latency (round trips, a micro-batch of one), not what its transactions cost when
    calls share micro-batches, and pricing a burst of single calls at their lone latency
    each would refuse the burst. So at light load nothing is priced (nothing is measured,
    the measures age out) and admission counts transactions, as before.
    """

    def __init__(
        self, capacity: int, window_s: float = SHARE_WINDOW_S, budget_s: float | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity, self.window_s = capacity, window_s
        self.reserve = max(1, capacity // 8)
        # The default budget in seconds; None: not configured yet (AdmissionLimit sets it
        # from the settings), 0: admission by count alone.
        self.budget_s = budget_s
        self.total = 0
        self.held: dict[str, int] = {}
        self.cost_s = 0.0  # the work in process, each call priced when admitted
        self._seen: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._accounts: dict[str, _Account] = {}
        # The clocks, moved at each take and release while work is held: ``_v``, the
        # virtual clock, sums time / transactions in process (a key holding h
        # transactions from v0 to v1 is attributed h x (v1 - v0)); ``_g`` sums time x
        # transactions in process; ``_b`` the time with work held.
        self._v = self._g = self._b = 0.0
        self._mark = 0.0  # when they last moved
        # All calls' measure (for keys without a fresh one of their own), and the clocks
        # and transactions answered at its last sample.
        self.per_txn_s = 0.0
        self.measured_at = float("-inf")
        self._g0 = self._b0 = 0.0
        self._done = 0

    def price(self, client: str, now: float) -> float:
        """The seconds per transaction a call of ``client`` is priced at: its key's own
        measure (taken within :data:`KEY_FRESH_S`), else all calls' (within
        :data:`FRESH_S`), else 0: no budget or no measure, admission by count alone."""
        if not self.budget_s:
            return 0.0
        account = self._accounts.get(client)
        if account is not None and now - account.measured_at < KEY_FRESH_S:
            return account.per_txn_s
        return self.per_txn_s if now - self.measured_at < FRESH_S else 0.0

    def refusal(
        self,
        client: str,
        weight: int,
        now: float,
        client_share: float = 1.0,
        budget_s: float | None = None,
    ) -> Rejected | None:
        """Why a call of ``weight`` transactions from ``client`` cannot be admitted now,
        or None: ``client_share`` when the client is over its share (the caller that
        should back off), else ``inflight`` when the capacity is full or the call would
        end past ``budget_s`` (its deadline times the fraction; None: the default
        budget). Records that ``client`` called, with its weight ``client_share`` (it
        then counts for the shares)."""
        self._seen[client] = now
        self._weights[client] = client_share
        held = self.held.get(client, 0)
        # Every key that called lately counts, also for a key holding nothing: else one
        # heavy call from an idle key takes the whole capacity and refuses the others.
        active = self._active(now)
        part = 1.0
        if active > 1:
            part = client_share / sum(self._weights[c] for c in self._seen)
            share = self.capacity * part
            # Over its share, a key may still use room nobody else uses, but leaves a
            # reserve free for each other key that calls.
            reserve = self.reserve * (active - 1)
            if held + weight > share and self.total + weight + reserve > self.capacity:
                return Rejected(
                    RejectReason.CLIENT_SHARE,
                    f"overloaded: key {client!r} holds {held} transactions in process, its "
                    f"share is {share:.0f} of {self.capacity} while other keys are calling",
                )
        per = self.price(client, now)
        if per:
            refused = self._priced_refusal(client, weight * per, per, active, part, budget_s)
            if refused is not None:
                return refused
        if self.total and self.total + weight > self.capacity:
            return Rejected(
                RejectReason.INFLIGHT,
                f"overloaded: {self.total} of {self.capacity} transactions in process",
            )
        return None

    def _priced_refusal(
        self,
        client: str,
        cost: float,
        per: float,
        active: int,
        part: float,
        budget_s: float | None,
    ) -> Rejected | None:
        """The share and capacity rules in time: ``cost`` the call's, ``per`` its key's
        seconds per transaction, ``part`` its key's part of the shares."""
        default = self.budget_s or 0.0
        priced = f"{cost * 1e3:.0f} ms ({per * 1e3:.2f} ms per transaction)"
        if active > 1:
            account = self._accounts.get(client)
            held_s = account.cost_s if account is not None else 0.0
            share = default * part
            if held_s + cost > share and self.cost_s + cost + default / 8 * (active - 1) > default:
                return Rejected(
                    RejectReason.CLIENT_SHARE,
                    f"overloaded: key {client!r} holds {held_s * 1e3:.0f} ms of work in "
                    f"process and this call costs {priced}; its share is {share * 1e3:.0f} "
                    f"of {default * 1e3:.0f} ms while other keys are calling",
                )
        budget = default if budget_s is None else budget_s
        if self.total and self.cost_s + cost > budget:
            return Rejected(
                RejectReason.INFLIGHT,
                f"overloaded: {self.cost_s * 1e3:.0f} ms of work in process and this call "
                f"costs {priced}: it would end past {budget * 1e3:.0f} ms, its part of "
                "its deadline",
            )
        return None

    def take(self, client: str, weight: int, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        self._tick(now)
        account = self._accounts.get(client)
        if account is None:
            account = self._accounts[client] = _Account(self._v, self._g, self._b)
        held = self.held.get(client, 0)
        account.settle(held, self._v, self._g, self._b)
        cost = weight * self.price(client, now)
        account.cost_s += cost
        self.cost_s += cost
        self.total += weight
        self.held[client] = held + weight

    def release(self, client: str, weight: int, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        self._tick(now)
        account = self._accounts[client]
        held = self.held[client]
        account.settle(held, self._v, self._g, self._b)
        account.done += weight
        self._done += weight
        self.total -= weight
        left = held - weight
        if left:
            self.held[client] = left
            cost = account.cost_s * weight / held
        else:
            del self.held[client]
            cost = account.cost_s
        account.cost_s -= cost
        self.cost_s = self.cost_s - cost if self.total else 0.0
        if account.held_s >= SAMPLE_S:
            if account.load >= self.reserve * account.held_s:
                account.per_txn_s, account.measured_at = _folded(
                    account.per_txn_s, account.measured_at, account.work_s / account.done, now
                )
            account.work_s = account.held_s = account.load = 0.0
            account.done = 0
        busy = self._b - self._b0
        if busy >= SAMPLE_S:
            if self._g - self._g0 >= self.reserve * busy:
                self.per_txn_s, self.measured_at = _folded(
                    self.per_txn_s, self.measured_at, busy / self._done, now
                )
            self._g0, self._b0, self._done = self._g, self._b, 0

    def _tick(self, now: float) -> None:
        """Move the clocks to ``now``."""
        if self.total:
            elapsed = now - self._mark
            self._v += elapsed / self.total
            self._g += elapsed * self.total
            self._b += elapsed
        self._mark = now

    def _active(self, now: float) -> int:
        """Clients seen within the window or holding work (forgetting the others)."""
        cutoff = now - self.window_s
        for client in [c for c, t in self._seen.items() if t < cutoff and c not in self.held]:
            del self._seen[client], self._weights[client]
            self._accounts.pop(client, None)
        return len(self._seen)


def _folded(per: float, measured_at: float, sample: float, now: float) -> tuple[float, float]:
    """A measure with ``sample`` folded in (afresh when the last one is stale), and now."""
    if now - measured_at < FRESH_S:
        sample = (1 - SAMPLE_WEIGHT) * per + SAMPLE_WEIGHT * sample
    return sample, now


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
       :data:`CALL_WEIGHT`) and admitted by :class:`WorkShares` against ``capacity``
       and, priced in time, against its deadline (``X-Request-Timeout-Ms``, else
       ``FRAUD_REQUEST_TIMEOUT_MS``) times ``FRAUD_ADMISSION_DEADLINE_FRACTION``.
       Refused: 503 + Retry-After at once (reason ``inflight`` or ``client_share``),
       without parsing the body when even the least weight would be refused. Reading a
       body does not count, so slow senders cannot hold the capacity that requests
       ready to score need.

    The default budget and the fraction come from the service's settings (the
    lifespan's resources) the first time a scoring call arrives; without them (an app
    without the service's lifespan) admission counts transactions only.

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
        # FRAUD_ADMISSION_DEADLINE_FRACTION, from the settings on the first call
        # (:meth:`_configure`); 0: no pricing in time.
        self.fraction = 0.0
        self._configured = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        oip = path.startswith("/v2/models/") and path.endswith("/infer")
        if not (oip or path.startswith(("/v1/score", "/v1/feedback"))):
            await self.app(scope, receive, send)
            return
        scope[RECEIVED_NS] = time.time_ns()
        shares = self.shares
        if not self._configured:
            self._configure(scope)
        who = client_of(scope)
        client, now = (who.key_id, time.monotonic()) if who is not None else ("", 0.0)
        budget = self._budget(scope) if self.fraction else None
        # A call that would be refused at its least weight is refused before its body is
        # read: the refusal costs no body, and a slow sender is not waited for.
        if who is not None and (
            refused := shares.refusal(client, CALL_WEIGHT, now, who.share, budget)
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
        now = time.monotonic()
        refused = shares.refusal(client, weight, now, who.share, budget)
        if refused is not None:
            await self._refuse(scope, receive, send, refused)
            return
        shares.take(client, weight, now)
        try:
            await self.app(scope, replayed, send)
        finally:
            shares.release(client, weight)

    def _configure(self, scope: Scope) -> None:
        """The default budget (``FRAUD_REQUEST_TIMEOUT_MS`` x the fraction) and the
        fraction, from the settings of the resources the lifespan made (once)."""
        res = scope.get("state", {}).get(STATE_KEY)
        if res is None:
            return
        settings = res.settings
        self.fraction = settings.admission_deadline_fraction
        self.shares.budget_s = settings.request_timeout_ms / 1e3 * self.fraction
        self._configured = True

    def _budget(self, scope: Scope) -> float | None:
        """This call's budget: its ``X-Request-Timeout-Ms`` times the fraction; None
        without the header, or with one the route will refuse (422): then the default."""
        for name, value in scope["headers"]:
            if name == _TIMEOUT_KEY:
                try:
                    ms = float(value)
                except ValueError:
                    return None
                return ms / 1e3 * self.fraction if 0 < ms <= _MAX_TIMEOUT_MS else None
        return None

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
