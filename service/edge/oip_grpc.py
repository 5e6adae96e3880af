"""The Open Inference Protocol v2 over gRPC: KServe's ``inference.GRPCInferenceService``
(``service/edge/proto/grpc_predict_v2.proto``), for ``tritonclient.grpc`` and KServe's
clients, on the same model path as the REST protocol (``service.edge.oip``).

It runs in the service's own process and event loop (``grpc.aio``), started by the app's
lifespan when ``FRAUD_GRPC_PORT`` is set (:func:`serving`) and stopped before the
resources close, in-flight calls given ``drain_seconds``. A call is the REST call's
twin: the ``score`` scope (``authorization: Bearer <key>`` or ``x-api-key`` metadata,
when auth is on), checked before the request's bytes are parsed → admission (the
in-flight bound, ``FRAUD_MAX_INFLIGHT``, and the per-key shares: the process's one
:class:`~service.edge.admission.WorkShares`, which REST's admission layer draws on too,
each call weighing as a REST inference call), before any other work, as REST's admission
comes before the body is parsed → the protobuf message parsed (the handlers take raw
bytes: a message that does not parse is ``INVALID_ARGUMENT``, timed and counted like
any call, and logged as one WARNING line at most per :data:`LOG_EVERY_S`, no traceback)
→ the same decode and checks (``service.edge.oip_model``: the model's input, FP32
``[n, n_features]``, at most the batch limit of rows, every element finite) → the model
on the scoring thread pool under the call's deadline: ``x-request-timeout-ms`` metadata
as on REST, else ``FRAUD_REQUEST_TIMEOUT_MS``, and never past the client's own gRPC
deadline.

Input data may be ``raw_input_contents`` (what tritonclient sends) or
``contents.fp32_contents``; the output is ``raw_output_contents`` (little-endian FP32).

Refusals are ``service.errors``' types, as on REST, answered with a status code and
the REST message (naming the field or element at fault; short whatever the client
sent, :func:`service.errors.bounded`, so it fits the status's metadata): 400 → ``INVALID_ARGUMENT``,
401 → ``UNAUTHENTICATED``, 403 → ``PERMISSION_DENIED``, 404 → ``NOT_FOUND``, 503 →
``UNAVAILABLE`` (``DEADLINE_EXCEEDED`` when the call's deadline passed), with
``retry-after`` (seconds) and ``fraud-reason`` trailing metadata; a 503 is counted in
``fraud_rejections_total`` under its reason, as on REST. Every call is timed in
``rpc_server_call_duration_seconds`` and, with tracing on, is a server span continuing
the caller's ``traceparent`` metadata (``service.telemetry.RpcCalls``). ``ModelReady`` answers
``ready: false`` (status OK) while no model is loaded; ``ServerLive``, ``ServerReady``
and ``ServerMetadata`` are open, like their REST twins.

One connection holds at most ``FRAUD_GRPC_MAX_CONCURRENT_STREAMS`` calls at once
(HTTP/2's ``SETTINGS_MAX_CONCURRENT_STREAMS``: the client holds the rest back; one kept
at the limit may see some refused, ``REFUSED_STREAM``, before any handler).

The port is plaintext unless ``FRAUD_GRPC_TLS_CERT`` and ``FRAUD_GRPC_TLS_KEY`` name a
PEM certificate chain and its key: then it speaks TLS only (no client certificates).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc import aio

from service import telemetry
from service.core.model import LoadedModel
from service.edge import auth
from service.edge.admission import CALL_WEIGHT, WorkShares
from service.edge.oip_model import (
    FP32,
    PLATFORM,
    WIRE_FP32,
    check_input,
    check_outputs,
    deadline,
    from_bytes,
    from_floats,
    predict,
    served,
)
from service.edge.proto import grpc_predict_v2_pb2 as pb
from service.errors import (
    ApiError,
    BadRequest,
    Forbidden,
    NotFound,
    Rejected,
    RejectReason,
    ServiceConfigError,
    Unauthenticated,
)
from service.resources import Resources
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
# Requests that do not parse are logged at most once per this many seconds (with how
# many were not logged); each is timed and counted in rpc_server_call_duration_seconds.
LOG_EVERY_S = 60.0
SERVER_NAME = "fraud-scoring"
TIMEOUT_METADATA = "x-request-timeout-ms"

_CODES: dict[type[ApiError], grpc.StatusCode] = {
    BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Rejected: grpc.StatusCode.UNAVAILABLE,
}
_PAST_DEADLINE = (RejectReason.TIMEOUT, RejectReason.DEADLINE)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
# A call's method: (request, context, the caller: None for the open calls).
Method = Callable[[Req, aio.ServicerContext, auth.Principal | None], Awaitable[Resp]]


def status_of(exc: ApiError) -> grpc.StatusCode:
    """The gRPC status code of a refusal (its REST status's meaning)."""
    if isinstance(exc, Rejected) and exc.reason in _PAST_DEADLINE:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    for kind in type(exc).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INVALID_ARGUMENT  # another 4xx: the request is at fault


class InferenceService:
    """The six calls, each an ``async`` handler of (request, context, caller): the caller
    (:meth:`principal`) is checked before the request is parsed, by :func:`_handler`."""

    def __init__(
        self,
        res: Resources,
        keyring: auth.KeyRing | None,
        version: str,
        shares: WorkShares,
    ) -> None:
        # ``shares``: the admission state REST's calls draw on too (one bound for both).
        self.res, self.keyring, self.version, self.shares = res, keyring, version, shares

    # --- the protocol --------------------------------------------------------------
    async def server_live(self, _: pb.ServerLiveRequest, *__: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest, *__: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.res.models.readiness() is None)

    async def server_metadata(
        self, _: pb.ServerMetadataRequest, *__: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.version, extensions=[])

    async def model_ready(self, request: pb.ModelReadyRequest, *_: Any) -> pb.ModelReadyResponse:
        try:
            served(self.res, request.name, request.version or None)
        except Rejected:  # no model loaded: not ready (a probe: not counted)
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, *_: Any
    ) -> pb.ModelMetadataResponse:
        meta = served(self.res, request.name, request.version or None).meta
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta.name,
            versions=[meta.version],
            platform=PLATFORM,
            inputs=[tensor(name=meta.input_name, datatype=FP32, shape=[-1, len(meta.features)])],
            outputs=[tensor(name=meta.output_name, datatype=FP32, shape=[-1])],
        )

    async def model_infer(
        self, request: pb.ModelInferRequest, context: aio.ServicerContext, *_: Any
    ) -> pb.ModelInferResponse:
        # Admitted already (:meth:`admitted`, before the request was parsed).
        model = served(self.res, request.model_name, request.model_version or None)
        until = deadline(_metadata(context).get(TIMEOUT_METADATA), self.res, TIMEOUT_METADATA)
        left = context.time_remaining()
        if left is not None:  # the client's own deadline: nobody reads an answer after it
            until = min(until, time.monotonic() + left)
        scores = await predict(self.res, model, self.decode(request, model), until)
        out = pb.ModelInferResponse.InferOutputTensor(
            name=model.meta.output_name, datatype=FP32, shape=[len(scores)]
        )
        return pb.ModelInferResponse(
            model_name=request.model_name,
            model_version=model.version,
            id=request.id,
            outputs=[out],
            raw_output_contents=[scores.astype(WIRE_FP32).tobytes()],
        )

    # --- the parts -----------------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self, who: auth.Principal) -> Iterator[None]:
        """The block holds a call's weight of the admission capacity for ``who``, as
        REST's admission does (the same bound and per-key shares): refused at once
        (:class:`~service.errors.Rejected`, ``inflight`` or ``client_share``) when it
        does not fit."""
        refused = self.shares.refusal(who.key_id, CALL_WEIGHT, time.monotonic(), who.share)
        if refused is not None:
            raise refused
        self.shares.take(who.key_id, CALL_WEIGHT)
        try:
            yield
        finally:
            self.shares.release(who.key_id, CALL_WEIGHT)

    def principal(self, context: aio.ServicerContext, call: str) -> auth.Principal:
        """The caller if it holds the ``score`` scope (anyone with auth off); else
        :class:`~service.errors.Unauthenticated` or :class:`~service.errors.Forbidden`."""
        if self.keyring is None:
            return auth.ANONYMOUS
        try:
            who = self.keyring.authenticate(auth.presented_key(_metadata(context)))
        except auth.AuthError as exc:
            detail = exc.detail.replace("'Authorization: Bearer <key>'", _HOW)
            raise Unauthenticated(detail) from None
        if auth.Scope.SCORE not in who.scopes:
            raise Forbidden(f"key {who.key_id!r} lacks scope 'score' needed for {SERVICE}/{call}")
        return who

    def decode(self, request: pb.ModelInferRequest, model: LoadedModel) -> Any:
        """The request's one input as float32 ``[n, n_features]``, checked as on REST."""
        if len(request.inputs) != 1:
            raise BadRequest(f"inputs: exactly one input tensor, got {len(request.inputs)}")
        tensor = request.inputs[0]
        limit = self.res.settings.batch_request_limit
        shape = check_input(model, tensor.name, tensor.datatype, list(tensor.shape), limit)
        check_outputs(model, [o.name for o in request.outputs])
        raw = request.raw_input_contents
        if raw:
            if len(raw) != 1:
                raise BadRequest(f"raw_input_contents: {len(raw)} entries for 1 input")
            if tensor.HasField("contents"):
                raise BadRequest(
                    f"inputs.0.contents: input {tensor.name!r} has raw_input_contents; "
                    "send one or the other"
                )
            return from_bytes(model, tensor.name, raw[0], shape)
        contents = tensor.contents
        others = [f.name for f, _ in contents.ListFields() if f.name != "fp32_contents"]
        if others:
            raise BadRequest(
                f"inputs.0.contents.{others[0]}: an FP32 input's data is fp32_contents "
                "(or raw_input_contents)"
            )
        return from_floats(model, tensor.name, contents.fp32_contents, shape)


_HOW = "'authorization: Bearer <key>' metadata"


def _metadata(context: aio.ServicerContext) -> dict[str, str]:
    """The call's metadata (names lower-case, as gRPC sends them; text values only)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class Throttled:
    """A warning logged at most once per ``every_s`` seconds, saying how many were not
    logged since the last one (each is counted elsewhere: the metric is the count)."""

    def __init__(
        self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s, self.clock = every_s, clock
        self.last: float | None = None
        self.unlogged = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` (a WARNING, no traceback) unless one was logged within
        ``every_s``; whether it was."""
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            self.unlogged += 1
            return False
        if self.unlogged:
            message += " (%d more since the last such line, not logged)"
            args = (*args, self.unlogged)
        log.warning(message, *args)
        self.last, self.unlogged = now, 0
        return True


def _parse(request_type: type[Req], raw: bytes, call: str, undecodable: Throttled) -> Req:
    """``raw`` as a ``request_type`` message; else :class:`~service.errors.BadRequest`
    (``INVALID_ARGUMENT``), noted in ``undecodable``'s log."""
    try:
        return request_type.FromString(raw)
    except DecodeError:
        kind = request_type.DESCRIPTOR.full_name
        undecodable.warning(
            "gRPC %s: a request of %d bytes does not parse as %s: answered "
            "INVALID_ARGUMENT (logged at most once per %g s; every one is counted in "
            "rpc_server_call_duration_seconds)",
            call,
            len(raw),
            kind,
            undecodable.every_s,
        )
        raise BadRequest(f"the request does not parse as {kind} (protobuf)") from None


def _handler(
    service: InferenceService,
    calls: telemetry.RpcCalls,
    undecodable: Throttled,
    name: str,
    method: Method[Req, Resp],
    request_type: type[Req],
    response_type: type[Resp],
    keyed: bool,
    admitted: bool,
) -> grpc.RpcMethodHandler:
    """``method`` (the call ``name``) as a unary call whose refusals are answered as
    status codes (and counted, as on REST), timed and traced (:class:`telemetry.RpcCalls`).
    The handler takes the request's bytes: the caller's key is checked first (``keyed``:
    the ``score`` scope), then the call is admitted (``admitted``: it holds capacity
    until answered), and only then are the bytes parsed (a message that does not parse
    is a refusal like any other, not grpc's UNKNOWN and traceback)."""
    full_name = f"{SERVICE}/{name}"
    res = service.res

    async def call(raw: bytes, context: aio.ServicerContext) -> Resp:
        with calls.call(full_name, _metadata(context)) as outcome:
            try:
                who = service.principal(context, name) if keyed else None
                holding: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
                if admitted:
                    holding = service.admitted(who or auth.ANONYMOUS)
                with holding:
                    request = _parse(request_type, raw, full_name, undecodable)
                    return await method(request, context, who)
            except ApiError as exc:
                code = status_of(exc)
                outcome.code = code.name
                trailing: list[tuple[str, str]] = []
                if isinstance(exc, Rejected):
                    if exc.counted:
                        res.count_rejection(exc.reason)
                    trailing = [
                        ("retry-after", str(exc.retry_after_s)),
                        ("fraud-reason", exc.reason),
                    ]
                await context.abort(code, exc.message, tuple(trailing))
                raise  # abort raises; unreachable
            except asyncio.CancelledError:  # the client went away or its deadline passed
                outcome.code = grpc.StatusCode.CANCELLED.name
                raise
            except Exception:  # grpc answers UNKNOWN (and logs it)
                outcome.code = grpc.StatusCode.UNKNOWN.name
                raise

    # No request_deserializer: the handler gets the bytes (a deserializer that raises
    # makes grpc answer UNKNOWN and log a traceback, before the key is checked).
    return grpc.unary_unary_rpc_method_handler(
        call, response_serializer=response_type.SerializeToString
    )


def generic_handler(service: InferenceService) -> grpc.GenericRpcHandler:
    calls, undecodable = telemetry.RpcCalls("grpc"), Throttled()
    s = service
    # name, method, request and response types, keyed (the score scope), admitted.
    methods: list[tuple[str, Method[Any, Any], type[Message], type[Message], bool, bool]] = [
        ("ServerLive", s.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse, False, False),
        (
            "ServerReady",
            s.server_ready,
            pb.ServerReadyRequest,
            pb.ServerReadyResponse,
            False,
            False,
        ),
        ("ModelReady", s.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse, True, False),
        (
            "ServerMetadata",
            s.server_metadata,
            pb.ServerMetadataRequest,
            pb.ServerMetadataResponse,
            False,
            False,
        ),
        (
            "ModelMetadata",
            s.model_metadata,
            pb.ModelMetadataRequest,
            pb.ModelMetadataResponse,
            True,
            False,
        ),
        ("ModelInfer", s.model_infer, pb.ModelInferRequest, pb.ModelInferResponse, True, True),
    ]
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            name: _handler(s, calls, undecodable, name, m, q, a, keyed, admitted)
            for name, m, q, a, keyed, admitted in methods
        },
    )


def tls_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """The server's TLS credentials from ``FRAUD_GRPC_TLS_CERT``/``FRAUD_GRPC_TLS_KEY``
    (PEM; the settings hold both or neither), None for plaintext. Raises
    ServiceConfigError naming the variable whose file cannot be read or is not PEM."""
    if settings.grpc_tls_cert is None or settings.grpc_tls_key is None:
        return None
    pem: dict[str, bytes] = {}
    for variable, path, marker in (
        ("FRAUD_GRPC_TLS_CERT", settings.grpc_tls_cert, b"-----BEGIN CERTIFICATE-----"),
        ("FRAUD_GRPC_TLS_KEY", settings.grpc_tls_key, b"PRIVATE KEY-----"),
    ):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ServiceConfigError(
                f"gRPC server: cannot read {variable} {str(path)!r}: {exc.strerror}"
            ) from None
        if marker not in data:
            what = "certificate" if variable.endswith("CERT") else "private key"
            raise ServiceConfigError(f"gRPC server: {variable} {str(path)!r} holds no PEM {what}")
        pem[variable] = data
    return grpc.ssl_server_credentials([(pem["FRAUD_GRPC_TLS_KEY"], pem["FRAUD_GRPC_TLS_CERT"])])


@contextlib.asynccontextmanager
async def serving(
    settings: ServiceSettings,
    res: Resources,
    keyring: auth.KeyRing | None,
    version: str,
    shares: WorkShares,
) -> AsyncIterator[aio.Server | None]:
    """The gRPC server on ``settings.host:settings.grpc_port`` while the context runs
    (None, and nothing started, when ``grpc_port`` is unset), TLS only when
    ``FRAUD_GRPC_TLS_CERT``/``_KEY`` are set (:func:`tls_credentials`), admitting its calls
    against ``shares`` (REST's admission state, so both transports are bounded
    together); stopped on exit, giving in-flight calls ``drain_seconds``. Raises
    ServiceConfigError when the port cannot be bound (``serve`` checks it first:
    ``service.edge.server.check_listening``)."""
    if settings.grpc_port is None:
        yield None
        return
    server = aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.so_reuseport", 1),  # uvicorn's workers each serve the one port
            # Calls one connection may have open at once (HTTP/2 SETTINGS).
            ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        ]
    )
    service = InferenceService(res, keyring, version, shares)
    server.add_generic_rpc_handlers((generic_handler(service),))
    address = f"{settings.host}:{settings.grpc_port}"
    credentials = tls_credentials(settings)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise ServiceConfigError(
            f"gRPC server: cannot listen on {address} (FRAUD_GRPC_PORT): {exc}"
        ) from None
    if not bound:
        raise ServiceConfigError(f"gRPC server: cannot listen on {address} (FRAUD_GRPC_PORT)")
    await server.start()
    log.info(
        "Open Inference Protocol gRPC server listening on %s (%s)",
        address,
        "plaintext" if credentials is None else "TLS",
    )
    try:
        yield server
    finally:
        await server.stop(grace=settings.drain_seconds)
