"""Redis clients for the online store: one Redis, or a Redis Cluster, from one URL.

Every part (the scoring service, the updater, the batch job, Feast) reaches the online
store through ``REDIS_URL``. A Redis Cluster is named by the URL of any one of its
nodes plus the query option ``cluster=true`` (``FRAUD_REDIS_CLUSTER=true`` adds it, see
``fraud_scoring/settings.py``); the client finds the other nodes itself. The clients
made here are ``redis.Redis`` / ``redis.asyncio.Redis`` for one server and redis-py's
``RedisCluster`` (sync and asyncio) for a cluster; both offer the same commands and
pipelines, so the code above them does not branch.

On a cluster a pipeline is split by node: redis-py's cluster pipelines group the queued
commands by the node owning each key's slot and send one pipeline per node (the asyncio
one with ``asyncio.gather``, all at once; the sync one writes every node's commands
before reading any reply), so a batch still costs one round trip in time. A command
whose keys span slots fails (CROSSSLOT): the project's own multi-key commands keep their
keys under one hash tag (``{card:<id>}``, ``{<stream>}``); Feast's keys are read one
per command.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import hiredis
import redis
import redis.asyncio as aioredis
from redis._parsers.commands import CommandPolicies, RequestPolicy, ResponsePolicy
from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterPipeline, RedisCluster
from redis.commands.policies import BasePolicyResolver, PolicyResolver, StaticPolicyResolver
from redis.connection import HiredisRespSerializer

CLUSTER_PARAM = "cluster"  # the URL query option that marks a Redis Cluster
_TRUE = ("1", "true", "yes", "on")

# Redis Cluster errors a retry can mend: a slot in migration or failover (TRYAGAIN,
# CLUSTERDOWN, MASTERDOWN), a slot no node serves until the topology is read again.
CLUSTER_RETRYABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)

# A command as a queueing helper gives it: its arguments, or bytes already in the protocol.
Command = tuple[Any, ...] | bytes


# What a failed store command raises: redis-py's errors, and its cluster client's own
# (RedisClusterException: e.g. no node serves a slot while the topology is re-read).
STORE_ERRORS: tuple[type[Exception], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
)


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (its query has ``cluster=true``). Raises
    ValueError naming REDIS_URL for a value that is not a boolean."""
    for key, value in parse_qsl(urlsplit(url).query):
        if key == CLUSTER_PARAM:
            if value.lower() not in (*_TRUE, "0", "false", "no", "off"):
                raise ValueError(f"REDIS_URL: {CLUSTER_PARAM} must be true or false, got {value!r}")
            return value.lower() in _TRUE
    return False


def client_url(url: str) -> str:
    """``url`` without the ``cluster`` option, as redis-py's ``from_url`` takes it."""
    u = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(u.query) if k != CLUSTER_PARAM]
    return u._replace(query=urlencode(query)).geturl()


def check_cluster_url(url: str) -> None:
    """Raise ValueError (naming REDIS_URL) when a cluster URL selects a database other
    than 0: Redis Cluster has only database 0."""
    db = (urlsplit(url).path or "/0").lstrip("/") or "0"
    if db != "0":
        raise ValueError(f"REDIS_URL: a Redis Cluster has only database 0, got /{db}")


_KEYED = CommandPolicies(
    request_policy=RequestPolicy.DEFAULT_KEYED, response_policy=ResponsePolicy.DEFAULT_KEYED
)


class ScriptsAreKeyed(BasePolicyResolver):
    """redis-py's policies, plus: EVAL and EVALSHA go to the node of their keys' slot.
    Without it the sync cluster pipeline (redis-py 7.4) asks the server ``COMMAND
    GETKEYS`` for every script call it routes (a script's keys are "movable"), one
    round trip each before the pipeline is sent: the updater's recording paid one per
    key (``tests/test_seams.py`` counts them)."""

    def __init__(self, fallback: PolicyResolver | None = None) -> None:
        scripts = {"eval": _KEYED, "evalsha": _KEYED}
        super().__init__({"core": scripts}, fallback or StaticPolicyResolver())

    def with_fallback(self, fallback: PolicyResolver) -> PolicyResolver:
        return ScriptsAreKeyed(fallback)


_STREAM_READS = {"XREADGROUP", "XREAD"}


class _Cluster(RedisCluster):  # type: ignore[misc]
    """``RedisCluster`` whose pipelines keep its policy resolver (redis-py 7.4's
    ``pipeline()`` leaves them on the default one), and which finds the slot of a
    stream read itself: its keys are "movable", so redis-py asks the server ``COMMAND
    GETKEYS`` before each one (the updater's every poll)."""

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe._policy_resolver = self._policy_resolver
        return pipe

    def determine_slot(self, *args: Any) -> int | None:
        if args and str(args[0]).upper() in _STREAM_READS:
            # ... STREAMS key [key ...] id [id ...]: the first half after STREAMS
            words = [a.upper() if isinstance(a, str | bytes) else a for a in args]
            at = next((i for i, w in enumerate(words) if w in ("STREAMS", b"STREAMS")), None)
            if at is not None:
                rest = args[at + 1 :]
                slots = {self.keyslot(k) for k in rest[: len(rest) // 2]}
                if len(slots) == 1:
                    return slots.pop()
        return super().determine_slot(*args)


def sync_client(url: str, **kwargs: Any) -> Any:
    """A blocking client for ``url``: ``RedisCluster`` when it names a cluster, else
    ``redis.Redis``. ``kwargs`` (timeouts, ...) go to every connection. Typed Any: the
    two classes share their commands but not redis-py's annotations."""
    if is_cluster(url):
        check_cluster_url(url)
        return _Cluster.from_url(client_url(url), policy_resolver=ScriptsAreKeyed(), **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def async_client(url: str, **kwargs: Any) -> Any:
    """An asyncio client for ``url``: ``redis.asyncio.RedisCluster`` when it names a
    cluster, else ``redis.asyncio.Redis``. ``max_connections`` is per node on a cluster
    (past it a command fails at once rather than waiting)."""
    if is_cluster(url):
        check_cluster_url(url)
        return AsyncRedisCluster.from_url(client_url(url), **kwargs)
    return aioredis.Redis.from_url(url, **kwargs)


def is_cluster_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` (sync or asyncio) sends to a Redis Cluster, where one command's
    keys must share a slot. Answered once per type: redis-py's pipelines are typing
    protocols, whose ``isinstance`` costs microseconds on every micro-batch."""
    kind = type(pipe)
    got = _CLUSTER_PIPELINE.get(kind)
    if got is None:
        got = _CLUSTER_PIPELINE[kind] = issubclass(kind, (ClusterPipeline, AsyncClusterPipeline))
    return got


_CLUSTER_PIPELINE: dict[type, bool] = {}


def drop_connections(client: Any) -> None:
    """Close a sync client's connections so that the next command connects afresh: to
    the new primary after a failover (one server behind a moving address), or, on a
    cluster, after the slot map is read again from the nodes still up."""
    if isinstance(client, RedisCluster):
        client.nodes_manager.initialize()
    else:
        client.connection_pool.disconnect()


class _HiredisPacked:
    """Connection mixin: commands packed by hiredis's C packer, through the serializer
    redis-py's sync connections use (the same bytes as the asyncio connection's Python
    ``pack_command``, ~4x cheaper per argument; a micro-batch's pipeline carries one
    argument per key and field)."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args)


def packed_by_hiredis(pool: Any) -> Any:
    """``pool`` (a redis-py asyncio connection pool, before its first connection) with
    its connections packing commands in C (:class:`_HiredisPacked`)."""
    cls = pool.connection_class
    if not issubclass(cls, _HiredisPacked):
        pool.connection_class = type(f"HiredisPacked{cls.__name__}", (_HiredisPacked, cls), {})
    return pool


class HeldConnections:
    """Pipelined round trips on connections taken from an asyncio client's pool once and
    then held, for the scorer's one round trip per micro-batch (one server only).

    redis-py's pipeline checks a connection out of the pool for every call (a lock, a
    fork check, a probe read of the socket), then builds, sends and parses through
    several layers; on a machine where each call starts with cold caches that is about
    half a millisecond more than sending the packed commands on a connection at hand
    (``bench/README.md``). Here a connection comes from the pool the first time, so the
    URL's options (password, database, TLS, timeouts) and the pool's size bound apply as
    for any command, and stays out of it until it fails: it is then disconnected and
    handed back. Closing the client closes held connections too (the pool closes those
    in use). At most one round trip runs on a connection at a time, and at most the
    pool's size at once.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        if not isinstance(client, aioredis.Redis):
            raise TypeError(f"HeldConnections needs one server's client, got {type(client)}")
        self.pool = client.connection_pool
        self._idle: list[Any] = []
        # Round trips at once, at most the pool's size: a connection never goes back to
        # the pool while it works, so the pool's own wait would never end; here a call
        # past the bound waits for a free connection (bounded by the caller's timeout).
        self._slots = asyncio.Semaphore(self.pool.max_connections)

    async def round_trip(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` at once and return their replies in order, a Redis error
        reply in place as its ``ResponseError``. A held connection that turns out broken
        (the server restarted or closed it while idle) is replaced once, sending the
        commands again (they must be safe to run twice, as the scorer's reads and
        idempotent writes are); any other
        failure, a cancellation (e.g. the caller's timeout) included, drops the
        connection (its replies may be unread) and propagates."""
        async with self._slots:
            if self._idle:
                conn = self._idle.pop()
                try:
                    return await self._exchange(conn, commands)
                except redis.exceptions.ConnectionError:
                    pass  # gone while idle: once more on a connection the pool checks
            return await self._exchange(await self.pool.get_connection(), commands)

    async def round_trip_then(self, commands: Sequence[Command]) -> tuple[list[Any], Then]:
        """:meth:`round_trip`, keeping the connection for more: returns the replies and a
        :class:`Then`, whose ``send`` (called once, on every path) sends more commands on
        the same connection, after these, and gives back their :class:`Rest`.
        A server answers a pipeline only once it has run all of it: the scorer sends a
        micro-batch's writes after its reads' replies (and its claims') are in, and parses
        the reads while the server runs the writes."""
        await self._slots.acquire()
        try:
            conn, replies = None, None
            if self._idle:
                conn = self._idle.pop()
                try:
                    replies = await self._send(conn, commands, len(commands))
                except redis.exceptions.ConnectionError:
                    conn = None  # gone while idle: once more on a connection the pool checks
            if conn is None:
                conn = await self.pool.get_connection()
                replies = await self._send(conn, commands, len(commands))
        except BaseException:
            self._slots.release()
            raise
        assert replies is not None
        return replies, Then(self, conn)

    async def _exchange(self, conn: Any, commands: Sequence[Command]) -> list[Any]:
        replies = await self._send(conn, commands, len(commands))
        self._idle.append(conn)
        return replies

    async def _send(self, conn: Any, commands: Sequence[Command], n: int) -> list[Any]:
        """Send ``commands`` on ``conn`` and read the first ``n`` replies; any failure
        drops the connection."""
        try:
            await conn.send_packed_command(_pack(commands), check_health=False)
            return await _read(conn, n)
        except BaseException:
            await self._drop(conn)
            raise

    async def _drop(self, conn: Any) -> None:
        await conn.disconnect(nowait=True)
        await self.pool.release(conn)


class Then:
    """The rest of a :meth:`HeldConnections.round_trip_then` (see there)."""

    def __init__(self, held: HeldConnections, conn: Any) -> None:
        self._held, self._conn = held, conn

    def send(self, commands: Sequence[Command]) -> Rest:
        """Send ``commands`` now (none: nothing more) and return their :class:`Rest`."""
        conn, self._conn = self._conn, None
        if conn is None:
            raise RuntimeError("Then.send is called once")
        error = None
        if commands:
            try:  # the transport takes the bytes now; a broken one fails the rest
                conn._writer.writelines(_pack(commands))
            except Exception as exc:
                error = redis.exceptions.ConnectionError(str(exc))
        return Rest(self._held, conn, len(commands), error)


class Rest:
    """Replies still to come on a held connection, read by :meth:`replies` once (no task
    of their own: by the time the caller asks, they are usually in the socket's buffer),
    or, by nobody, drained in the background by :meth:`abandon`. The connection is held
    again once they are read, or dropped if that failed or was cancelled.

    Before they are read, :meth:`follow` may send the next round trip's commands on the
    same connection, behind these: the server runs them after these (one connection is
    one ordered stream), so a micro-batch's reads can go out as soon as the previous
    batch's writes are sent instead of once their replies are in. The connection (and its
    place among the held ones) then passes to the follower; these replies are read by
    whichever asks first, :meth:`replies` or the follower."""

    def __init__(self, held: HeldConnections, conn: Any, n: int, error: Exception | None) -> None:
        self._held, self._conn, self._n, self._error = held, conn, n, error
        self._result: asyncio.Future[list[Any]] | None = None  # the replies, once read
        self._passed = False  # the connection went on to a follower
        self._asked = False
        self._finished = False  # replies() is over: the connection held again or dropped

    async def _ensure(self) -> list[Any]:
        """These replies, read once: by the first caller; later ones get the same. A
        failed or interrupted read breaks the connection (its stream is out of step)."""
        if self._result is not None:
            return await asyncio.shield(self._result)
        fut = self._result = asyncio.get_running_loop().create_future()
        try:
            if self._error is not None:
                raise self._error
            out = await _read(self._conn, self._n) if self._n else []
        except BaseException as exc:
            await self._conn.disconnect(nowait=True)
            fut.set_exception(
                exc if isinstance(exc, Exception) else redis.exceptions.ConnectionError("cancelled")
            )
            fut.exception()  # retrieved: a follower may never ask
            raise
        fut.set_result(out)
        return out

    async def replies(self) -> list[Any]:
        if self._asked:
            raise RuntimeError("Rest.replies is called once")
        self._asked = True
        held = self._held
        try:
            out = await self._ensure()
        except BaseException:
            self._finished = True
            if not self._passed:  # still ours: dropped
                try:
                    await held._drop(self._conn)
                finally:
                    held._slots.release()
            raise
        self._finished = True
        if not self._passed:  # still ours: held again
            held._idle.append(self._conn)
            held._slots.release()
        return out

    def follow(self, commands: Sequence[Command]) -> Followed | None:
        """Send ``commands`` now on this connection, behind these replies' commands, and
        pass the connection on to them (:class:`Followed`); None: it cannot be (these
        replies were read already, the send failed, or it was followed before). While
        :meth:`replies` waits for them it may still be followed."""
        if self._finished or self._passed or self._error is not None:
            return None
        if self._result is not None and self._result.done() and self._result.exception():
            return None
        try:
            self._conn._writer.writelines(_pack(commands))
        except Exception:
            return None
        self._passed = True
        return Followed(self, len(commands))

    def abandon(self, timeout_s: float, then: Callable[[], None]) -> None:
        """Read the replies in the background (nobody will), for at most ``timeout_s``,
        and call ``then`` once they are read or given up."""
        if self._asked:
            then()
            return
        drain_in_background(self.replies, timeout_s, then)


class Followed:
    """A round trip sent behind a :class:`Rest` (:meth:`Rest.follow`): its replies come
    after that one's, and the connection is its own from now on."""

    def __init__(self, before: Rest, n: int) -> None:
        self._before, self._n = before, n

    async def replies_then(self) -> tuple[list[Any], Then]:
        """The earlier replies read first (kept for their owner), then these; with a
        :class:`Then` for more, as :meth:`HeldConnections.round_trip_then`. A failure
        (of either read) drops the connection."""
        before = self._before
        held, conn = before._held, before._conn
        try:
            try:
                await before._ensure()
            except BaseException as exc:
                raise redis.exceptions.ConnectionError(
                    f"the round trip ahead on this connection failed: {exc!r}"
                ) from None
            replies = await _read(conn, self._n)
        except BaseException:
            await held._drop(conn)
            held._slots.release()
            raise
        return replies, Then(held, conn)


_DRAINING: set[asyncio.Future[None]] = set()  # replies read in the background, nobody waiting


def drain_in_background(
    replies: Callable[[], Awaitable[list[Any]]], timeout_s: float, then: Callable[[], None]
) -> None:
    """Read ``replies()`` in a task of its own (nobody waits for them), for at most
    ``timeout_s``, and call ``then`` once they are read or given up."""

    async def drain() -> None:
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await replies()
        except Exception:  # the batch has failed already: nothing to tell
            pass
        finally:
            then()

    task = asyncio.ensure_future(drain())
    _DRAINING.add(task)
    task.add_done_callback(_DRAINING.discard)


async def _read(conn: Any, n: int) -> list[Any]:
    """``n`` replies from ``conn``, a Redis error reply in place as its exception."""
    parser = conn._parser
    if isinstance(parser, _AsyncHiredisParser):
        return await _replies(parser, n)
    replies: list[Any] = []  # redis-py's pure-Python parser: one reply at a time
    for _ in range(n):
        try:
            replies.append(await conn.read_response())
        except redis.exceptions.ResponseError as exc:
            replies.append(exc)
    return replies


def hmget_parts(fields: Sequence[bytes]) -> tuple[bytes, bytes]:
    """An ``HMGET`` of ``fields`` in the protocol as hiredis packs it, less its key: the
    command's head (the array's length and name) and the fields' bulk strings; put
    around a key by :func:`hmget_packed`. For callers that send one command many times,
    key by key, packed once (``Commands.packed`` on a held connection)."""
    head = b"*%d\r\n$5\r\nHMGET\r\n" % (2 + len(fields))
    return head, b"".join(b"$%d\r\n%b\r\n" % (len(f), f) for f in fields)


def hmget_packed(parts: tuple[bytes, bytes], key: bytes) -> bytes:
    """The ``HMGET`` of :func:`hmget_parts` for ``key``, as hiredis packs it."""
    return b"%b$%d\r\n%b\r\n%b" % (parts[0], len(key), key, parts[1])


def _pack(commands: Sequence[Command]) -> list[bytes]:
    """The commands in the protocol, packed by hiredis in C (a command name holding a
    space, as "SCRIPT LOAD", split as redis-py splits it); bytes: one command packed
    already."""
    out = []
    for c in commands:
        if isinstance(c, bytes):
            out.append(c)
            continue
        name = c[0]
        if isinstance(name, str) and " " in name:
            c = (*name.split(), *c[1:])
        out.append(hiredis.pack_command(c))
    return out


async def _replies(parser: Any, n: int) -> list[Any]:
    """``n`` replies straight from the connection's hiredis reader (the one redis-py
    configured: an error reply comes back as redis-py's exception for it, in place),
    without redis-py's per-reply coroutine (~2 us each; a micro-batch's round trip
    carries one command per declared key). redis is pinned to 7.4.x: the reader and
    ``read_from_socket`` are its parser's, checked by tests/test_seams.py."""
    reader, out = parser._reader, list[Any]()
    while len(out) < n:
        reply = reader.gets()
        if reply is NOT_ENOUGH_DATA:
            await parser.read_from_socket()
            continue
        if isinstance(reply, redis.exceptions.ConnectionError):
            raise reply
        out.append(reply)
    return out
