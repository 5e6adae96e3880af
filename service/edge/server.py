"""``fraud-scoring serve``: the scoring API under uvicorn."""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import uvicorn

from fraud_scoring.redis_server import free_port, require_redis
from service.errors import ServiceConfigError, ServiceStartError
from service.settings import ServiceSettings
from service.telemetry import MULTIPROC_ENV

__all__ = [
    "ServiceConfigError",
    "ServiceProcess",
    "ServiceStartError",
    "app_factory",
    "check_listening",
    "serve",
    "spawn",
]


def serve(settings: ServiceSettings) -> None:
    """Run until SIGTERM/SIGINT; in-flight requests get ``drain_seconds`` to finish.

    Raises ``RedisNotConfigured`` before anything starts when REDIS_URL is unset and
    ``embedded_redis`` is not (the lifespan checks the same, for other ways in), and
    ServiceConfigError when a port is taken or a TLS file unusable (:func:`check_listening`)."""
    require_redis(settings.redis_url, settings.embedded_redis)
    check_listening(settings)
    if settings.workers > 1:
        _share_metrics()
    uvicorn.run(
        "service.edge.server:app_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        # httptools plus a header size limit (431), a header read timeout (408) and a
        # drain that answers 503 on open keep-alive connections (service/edge/connection.py).
        # A string: workers import it themselves, and this module stays light to import.
        http="service.edge.connection:GuardedHttpTools",
        # In-flight requests get this long after SIGTERM; so do idle keep-alive
        # connections, to receive their 503 "draining" instead of a closed socket.
        timeout_graceful_shutdown=int(settings.drain_seconds),
        # Connections plus running requests per worker: past it uvicorn answers 503.
        limit_concurrency=settings.max_connections,
        # Idle keep-alive connections are closed after 5 s (uvicorn's default, stated).
        timeout_keep_alive=5,
        log_level="info",
        access_log=False,
    )


def check_listening(settings: ServiceSettings) -> None:
    """Raise ServiceConfigError, naming the setting, when the HTTP port (or the gRPC port,
    when set) cannot be bound on ``settings.host`` or the gRPC TLS files cannot be read.

    Checked before uvicorn starts: uvicorn ends a failed bind, and a lifespan that raises
    (the gRPC server's), with exit status 3 and a traceback; this is one line and status 2.
    A port taken in the moment between this check and the bind still fails uvicorn's way."""
    _check_port(settings.host, settings.port, "FRAUD_PORT (--port)")
    if settings.grpc_port is None:
        return
    _check_port(settings.host, settings.grpc_port, "FRAUD_GRPC_PORT (--grpc-port)")
    from service.edge.oip_grpc import tls_credentials  # grpc: only when a port is set

    tls_credentials(settings)


def _check_port(host: str, port: int, setting: str) -> None:
    # Bound as uvicorn binds (its Config.bind_socket): the family by the host's form,
    # SO_REUSEADDR, so a port held only by closed connections (TIME_WAIT) passes.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror as exc:
        raise ServiceConfigError(
            f"cannot listen on {host}:{port}: FRAUD_HOST (--host) {host!r} is not an "
            f"address here ({exc.strerror})"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            at_fault = f"FRAUD_HOST (--host) {host!r} is not an address of this machine"
        elif exc.errno == errno.EADDRINUSE:
            at_fault = f"{setting} {port} is taken by another process"
        else:
            at_fault = f"{setting} {port}: {exc.strerror}"
        raise ServiceConfigError(f"cannot listen on {host}:{port}: {at_fault}") from None


def _share_metrics() -> None:
    """Put the workers' Prometheus metrics in one directory (``PROMETHEUS_MULTIPROC_DIR``,
    a fresh temporary one unless set) so that any worker's ``/metrics`` answers for all:
    set here, before uvicorn spawns the workers, because prometheus_client reads it on
    import. A directory given by the user is emptied of a previous run's files first."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        for stale in Path(given).glob("*.db"):
            stale.unlink()
    else:
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="fraud-metrics-")
        atexit.register(shutil.rmtree, os.environ[MULTIPROC_ENV], ignore_errors=True)


def app_factory():  # type: ignore[no-untyped-def]
    from service.edge.app import create_app

    return create_app()


@dataclass
class ServiceProcess:
    """``fraud-scoring serve`` running as a child process (demo, benchmarks, tests)."""

    proc: subprocess.Popen[bytes]
    url: str

    def stop(self, timeout_s: float = 30.0) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def spawn(
    env: Mapping[str, str],
    *,
    wait_for: str = "/readyz",
    timeout_s: float = 60.0,
    output: int | IO[bytes] | None = None,
    command: Sequence[str] = ("-m", "cli", "serve"),
    cpus: str | None = None,
    cwd: str | None = None,
) -> ServiceProcess:
    """Start ``fraud-scoring serve`` (or ``python *command``, which must listen on
    FRAUD_HOST:FRAUD_PORT) on a free loopback port with ``env`` added to this process's
    environment; return once ``wait_for`` answers 200. ``cpus`` (a ``taskset`` CPU list
    such as ``"0"``) pins the process and all its threads to those cores; ``cwd`` is its
    working directory (default this process's).

    Raises ServiceStartError at once if the process exits, or after ``timeout_s``.
    """
    port = free_port()
    # Not the caller's metrics directory unless asked: importing Feast sets
    # PROMETHEUS_MULTIPROC_DIR in the caller, and inherited it would put the child's
    # prometheus_client in multiprocess mode over Feast's directory.
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    full_env = {**inherited, **env, "FRAUD_HOST": "127.0.0.1", "FRAUD_PORT": str(port)}
    argv = [sys.executable, *command]
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]  # taskset execs: proc.pid is the service
    proc = subprocess.Popen(
        argv,
        env=full_env,
        cwd=cwd,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
    )
    service = ServiceProcess(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServiceStartError(f"the scoring service exited with {proc.returncode}")
        try:
            if httpx.get(service.url + wait_for, timeout=1).status_code == 200:
                return service
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            service.stop()
            raise ServiceStartError(f"{wait_for} did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.05)
