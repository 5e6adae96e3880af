"""The seams where the service bypasses or reaches into its libraries, each pinned in
pyproject.toml and checked here: the middleware stack's shape (tracing on and off),
DirectDispatch past Starlette's router, the response body built without a validation
pass, the held Redis connections, hiredis's command packing and Feast's typeguard."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from fraud_scoring.redis_server import EmbeddedCluster
from service.core.decision import Reason
from service.core.scoring import ScoreResult
from service.edge.schemas import ScoreOut
from tests.conftest_streaming import stream_redis

__all__ = ["stream_redis"]


def test_the_response_body_is_a_valid_score_out() -> None:
    result = ScoreResult(
        "t1",
        "review",
        0.42,
        [Reason("VELOCITY_10M", "3 transactions on this card in the last 10 minutes.")],
        "7",
        ["merchant_fraud_rate_90d"],
        [],
        {"feature_read": 0.5, "inference": 0.1, "decision": 0.05, "batch_size": 3.0},
    )
    body = ScoreOut.wire(result, 1.25)
    assert ScoreOut.model_validate(body).model_dump() == body
    assert body["timing"]["queue_ms"] == pytest.approx(0.6)


def test_the_scoring_routes_skip_the_router_and_keep_the_apps_error_answers() -> None:
    """``DirectDispatch`` (inside admission) sends ``POST /v1/score`` straight to its
    endpoint, answers the endpoint's exceptions with the app's own handlers (here a
    415 for a body that is not JSON), and passes every other call to the router."""
    import asyncio

    from service.edge.app import create_app
    from service.edge.routes import DirectDispatch

    app = create_app()
    passed: list[str] = []

    async def rest(scope: dict, receive: object, send: object) -> None:
        passed.append(f"{scope['method']} {scope['path']}")

    direct = DirectDispatch(app, rest)  # type: ignore[arg-type]
    assert set(direct.endpoints) == {"/v1/score", "/v1/score/batch"}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"x", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    def scope(method: str, path: str, **extra: object) -> dict:
        return {
            "type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
            "state": {}, **extra,
        }  # fmt: skip

    async def calls() -> None:
        await direct(scope("POST", "/v1/score"), receive, send)
        await direct(scope("GET", "/v1/score"), receive, send)
        await direct(scope("POST", "/healthz"), receive, send)
        await direct(scope("POST", "/v1/score", root_path="/fraud"), receive, send)

    asyncio.run(calls())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 415
    assert b"Content-Type must be application/json" in sent[1]["body"]
    assert passed == ["GET /v1/score", "POST /healthz", "POST /v1/score"]


def test_held_connections_keep_replies_in_order_and_never_reuse_a_broken_one(
    stream_redis: str,
) -> None:
    """The scorer's round trips on held connections (``HeldConnections``): error replies
    in place, one connection held across calls, a connection killed while idle replaced
    at once, a cancelled call's connection dropped (its late reply never answers the next
    call), and the held connections closed with their client."""
    import asyncio

    import redis
    import redis.asyncio as aioredis
    from redis.exceptions import NoScriptError

    from fraud_scoring.redis_clients import HeldConnections, packed_by_hiredis
    from tests.conftest import wait_until
    from tests.test_batching import eventually

    def blocked() -> bool:
        return any(c.get("cmd") == "blpop" for c in admin.client_list())

    async def scenario() -> None:
        pool = aioredis.BlockingConnectionPool.from_url(stream_redis, max_connections=4)
        client = aioredis.Redis.from_pool(packed_by_hiredis(pool))
        held = HeldConnections(client)
        got = await held.round_trip([("SET", "k", "v"), ("EVALSHA", "0" * 40, 0), ("GET", "k")])
        assert got[0] == b"OK" and got[2] == b"v"
        assert isinstance(got[1], NoScriptError)  # in place; the rest still read

        first = (await held.round_trip([("CLIENT", "ID")]))[0]
        assert (await held.round_trip([("CLIENT", "ID")]))[0] == first  # held

        # Killed while idle (a server restart, an idle timeout): replaced, no error.
        admin.execute_command("CLIENT", "KILL", "ID", first)
        again = await held.round_trip([("CLIENT", "ID")])
        assert again[0] != first

        # Cancelled while its reply is pending: the connection is dropped, so the late
        # reply cannot answer the next call.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await held.round_trip([("BLPOP", "nothing", 1)])
        await eventually(lambda: not blocked(), timeout=10)  # the server dropped it
        admin.lpush("nothing", "late")
        assert await held.round_trip([("GET", "k")]) == [b"v"]
        assert await held.round_trip([("LPOP", "nothing")]) == [b"late"]

        # In two parts on one connection: the rest is sent once the first replies are in
        # (through the connection's stream writer, a redis-py seam pinned here).
        head, then = await held.round_trip_then([("SET", "k2", "a"), ("GET", "k2")])
        assert head == [b"OK", b"a"]
        assert await then.send([("APPEND", "k2", "b"), ("GET", "k2")]).replies() == [2, b"ab"]
        head, then = await held.round_trip_then([("CLIENT", "ID")])
        assert await then.send([]).replies() == []  # nothing more: held again
        assert (await held.round_trip([("CLIENT", "ID")]))[0] == head[0]
        # A rest nobody reads is read in the background, and its connection held again.
        head, then = await held.round_trip_then([("CLIENT", "ID")])
        drained = asyncio.get_running_loop().create_future()
        then.send([("GET", "k")]).abandon(5.0, lambda: drained.set_result(None))
        await drained
        assert (await held.round_trip([("CLIENT", "ID")]))[0] == head[0]
        # A rest whose reading is cancelled (its deadline passed) drops its connection.
        head, then = await held.round_trip_then([("GET", "k")])
        rest = then.send([("BLPOP", "nothing", 1)])
        assert head == [b"v"]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await rest.replies()
        await eventually(lambda: not blocked(), timeout=10)
        admin.lpush("nothing", "late")
        assert await held.round_trip([("GET", "k")]) == [b"v"]
        assert await held.round_trip([("LPOP", "nothing")]) == [b"late"]
        await client.aclose()

    with redis.Redis.from_url(stream_redis) as admin:
        asyncio.run(scenario())
        # Closed with the client: only the admin's own connection is left.
        wait_until(lambda: len(admin.client_list()) == 1, timeout=10, what="connections closed")


def test_a_round_trip_follows_the_writes_ahead_of_it_on_their_connection(
    stream_redis: str,
) -> None:
    """``Rest.follow``: the next micro-batch's commands go out behind the previous one's
    writes on the same connection, before those writes' replies are read: the server runs
    them after the writes (they see them), each side gets its own replies whoever reads
    first, and the connection ends held once, by the last of the chain. A rest already
    read cannot be followed; a failure ahead fails the follower and drops the connection."""
    import asyncio

    import redis
    import redis.asyncio as aioredis

    from fraud_scoring.redis_clients import HeldConnections, packed_by_hiredis

    async def scenario() -> None:
        pool = aioredis.BlockingConnectionPool.from_url(stream_redis, max_connections=2)
        client = aioredis.Redis.from_pool(packed_by_hiredis(pool))
        held = HeldConnections(client)
        await held.round_trip([("DEL", "f")])
        head, then = await held.round_trip_then([("CLIENT", "ID")])
        rest = then.send([("INCR", "f"), ("INCR", "f")])
        followed = rest.follow([("GET", "f"), ("CLIENT", "ID")])
        assert followed is not None and rest.follow([("GET", "f")]) is None  # once
        got, then2 = await followed.replies_then()  # reads the writes' replies first
        assert got == [b"2", head[0]]  # after the writes, on their connection
        assert await rest.replies() == [1, 2]  # kept for their owner
        rest2 = then2.send([("INCR", "f")])
        # Followed while its owner waits for its replies (the owner asked first).
        owner = asyncio.ensure_future(rest2.replies())
        await asyncio.sleep(0)
        followed2 = rest2.follow([("GET", "f")])
        assert followed2 is not None
        got2, then3 = await followed2.replies_then()
        assert got2 == [b"3"] and await owner == [3]
        assert await then3.send([]).replies() == []  # the chain's end: held again
        assert (await held.round_trip([("CLIENT", "ID")]))[0] == head[0]  # one connection
        # Read already: not followed (the connection went back).
        _, then4 = await held.round_trip_then([("GET", "f")])
        rest4 = then4.send([("GET", "f")])
        assert await rest4.replies() == [b"3"]
        assert rest4.follow([("GET", "f")]) is None
        # A failure ahead (its reading cancelled) fails the follower, never hangs it.
        _, then5 = await held.round_trip_then([("GET", "f")])
        rest5 = then5.send([("BLPOP", "follow-nothing", 2)])
        followed5 = rest5.follow([("GET", "f")])
        assert followed5 is not None
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await rest5.replies()
        with pytest.raises(redis.exceptions.ConnectionError):
            await followed5.replies_then()
        assert await held.round_trip([("GET", "f")]) == [b"3"]  # a fresh connection
        await client.aclose()

    asyncio.run(scenario())


def test_held_connections_use_the_urls_password_and_database() -> None:
    """Held connections come from the client's pool, so REDIS_URL's options apply: a
    password-protected server answers them, and writes land in the URL's database."""
    import asyncio

    import redis
    import redis.asyncio as aioredis

    from fraud_scoring.redis_clients import HeldConnections, packed_by_hiredis
    from fraud_scoring.redis_server import embedded_redis

    with embedded_redis(password="held-pw") as url:
        db3 = url.rsplit("/", 1)[0] + "/3"

        async def scenario() -> None:
            pool = aioredis.BlockingConnectionPool.from_url(db3, max_connections=2)
            client = aioredis.Redis.from_pool(packed_by_hiredis(pool))
            try:
                held = HeldConnections(client)
                assert await held.round_trip([("SET", "where", "db3")]) == [b"OK"]
            finally:
                await client.aclose()

        asyncio.run(scenario())
        with redis.Redis.from_url(db3) as r3, redis.Redis.from_url(url) as r0:
            assert r3.get("where") == b"db3"
            assert r0.get("where") is None  # not in database 0


def test_the_stack_puts_metrics_then_admission_in_front_of_starlettes_layers() -> None:
    """``service.edge.app._outermost`` wraps Starlette's ``build_middleware_stack``: with
    tracing off a scoring request meets the HTTP metrics' layer, then admission, then
    ``DirectDispatch``, before any of Starlette's layers. Fails when a Starlette release
    changes how the stack is built (pyproject.toml pins its minor version)."""
    from starlette.middleware.errors import ServerErrorMiddleware

    from service.edge.admission import AdmissionLimit
    from service.edge.app import create_app
    from service.edge.routes import DirectDispatch
    from service.telemetry import HttpMetrics

    stack = create_app().build_middleware_stack()
    assert isinstance(stack, HttpMetrics)
    assert isinstance(stack.app, AdmissionLimit)
    assert isinstance(stack.app.app, DirectDispatch)
    assert isinstance(stack.app.app.rest, ServerErrorMiddleware)


def test_hiredis_packing_sends_the_bytes_redis_py_would() -> None:
    """``packed_by_hiredis`` swaps redis-py's command packer for its hiredis serializer
    (a redis-py internal: pyproject.toml pins its minor version); the bytes must be what
    redis-py's own packer sends."""
    import redis.asyncio as aioredis

    from fraud_scoring.redis_clients import packed_by_hiredis

    plain = aioredis.Redis().connection_pool
    packed = packed_by_hiredis(aioredis.Redis().connection_pool)
    args = ("EVALSHA", "ab" * 20, 2, "k:1", b"\x00\xff", 1.5, -7, "é")
    assert b"".join(packed.make_connection().pack_command(*args)) == b"".join(
        plain.make_connection().pack_command(*args)
    )


def test_the_stack_keeps_its_shape_with_tracing_on() -> None:
    """With ``OTEL_TRACES_EXPORTER`` set, OpenTelemetry's ASGI middleware is one more
    layer between the HTTP metrics and admission; the rest of the stack is the same
    (in a subprocess: the tracer provider is process-global)."""
    import os
    import subprocess
    import sys

    code = (
        "from service.edge.app import create_app\n"
        "s = create_app().build_middleware_stack()\n"
        "names = []\n"
        "while s is not None and len(names) < 5:\n"
        "    names.append(type(s).__name__)\n"
        "    s = getattr(s, 'app', None) or getattr(s, 'rest', None)\n"
        "print(' '.join(names))\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [
        "HttpMetrics",
        "OpenTelemetryMiddleware",
        "AdmissionLimit",
        "DirectDispatch",
        "ServerErrorMiddleware",
    ]


def test_server_spans_are_named_by_the_route_that_will_answer() -> None:
    """With tracing on, a server span's name and ``http.route`` come from the route
    before the request runs: the scoring routes DirectDispatch answers, routes of
    included routers (FastAPI nests them), templates with parameters, a path whose
    method does not match (405); a path no route matches gets the method alone."""
    from service.edge.app import _span_details, create_app

    app = create_app()
    cases = {
        ("POST", "/v1/score"): "/v1/score",
        ("GET", "/healthz"): "/healthz",
        ("GET", "/v2/models/fraud/versions/1/ready"): "/v2/models/{name}/versions/{version}/ready",
        ("DELETE", "/healthz"): "/healthz",
        ("GET", "/docs"): "/docs",
    }
    for (method, path), route in cases.items():
        scope = {"type": "http", "method": method, "path": path, "app": app, "root_path": ""}
        assert _span_details(scope) == (f"{method} {route}", {"http.route": route}), path
    lost = {"type": "http", "method": "GET", "path": "/no-such-page", "app": app, "root_path": ""}
    assert _span_details(lost) == ("GET", {})
    odd = {**lost, "method": "BREW", "path": "/healthz"}
    assert _span_details(odd)[0] == "HTTP /healthz"


def test_feast_imports_without_typeguards_instrumentation() -> None:
    """Feast binds ``typechecked`` at import (``from typeguard import typechecked``) and
    gets the no-op; with FRAUD_FEAST_TYPECHECKS=1 it keeps typeguard's."""
    code = (
        "import fraud_scoring, feast.data_source as d, fraud_scoring.feast_import as f; "
        "print(d.typechecked is f.unchecked)"
    )
    for env, want in (({}, "True"), ({"FRAUD_FEAST_TYPECHECKS": "1"}, "False")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.strip() == want, out.stderr[-2000:]


def test_cluster_pipelines_route_scripts_without_asking_the_server(
    redis_cluster: EmbeddedCluster,
) -> None:
    """redis-py 7.4's sync cluster pipeline sends ``COMMAND GETKEYS`` for each EVALSHA it
    routes unless told scripts are keyed (fraud_scoring/redis_clients.py): one round
    trip per script call; and its client one before each stream read (XREADGROUP: the
    updater's every poll). Ours sends none, and the plain client still does (when it
    stops, the workaround can go)."""
    from redis.cluster import RedisCluster

    from fraud_scoring.redis_clients import client_url, sync_client

    def getkeys(c: Any) -> int:
        info = c.info("commandstats", target_nodes=RedisCluster.ALL_NODES)
        return sum(int(v.get("cmdstat_command|getkeys", {}).get("calls", 0)) for v in info.values())

    plain = RedisCluster.from_url(client_url(redis_cluster.url))
    for client, asks in ((sync_client(redis_cluster.url), 0), (plain, 50)):
        sha = client.script_load("return KEYS[1]")
        before = getkeys(client)
        pipe = client.pipeline()
        for i in range(50):
            pipe.execute_command("EVALSHA", sha, 1, f"k{i}")
        assert pipe.execute() == [f"k{i}".encode() for i in range(50)]
        assert getkeys(client) - before == asks
        # The updater's poll: a stream read (its keys are "movable" too).
        client.xadd("{s}:events", {"d": "1"})
        client.xgroup_create("{s}:events", "g", id="0", mkstream=True)
        before = getkeys(client)
        for _ in range(20):
            client.xreadgroup("g", "c", {"{s}:events": ">"}, count=10)
        asked = getkeys(client) - before
        assert asked == 0 if asks == 0 else asked >= 20
        client.delete("{s}:events")
        client.close()
