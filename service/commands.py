"""The service's subcommands: ``serve`` and ``keys create``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fraud_scoring.commands import Command, UsageError, add_embedded_redis
from fraud_scoring.redis_server import require_redis
from fraud_scoring.settings import read_settings
from service.edge.auth import KeyEntry, Scope, append_key, keyring_for, new_key
from service.settings import ServiceSettings, get_settings


def run_serve(args: argparse.Namespace, settings: ServiceSettings) -> None:
    settings = serve_settings(args, settings)
    # Refuse here, before uvicorn starts, so a missing REDIS_URL (or an unusable keys
    # file) is one clear line and exit status 2 rather than a failed startup. The entry
    # point has already turned --embedded-redis into FRAUD_EMBEDDED_REDIS, which the
    # app's workers read.
    require_redis(settings.redis_url, settings.embedded_redis)
    keyring_for(settings)
    from service.edge.server import serve  # uvicorn and the app: only for this command

    # uvicorn stops gracefully on SIGTERM (drains, runs the lifespan's shutdown), then
    # raises the signal again under the handler it found: with the default one the
    # process dies of it (exit status 143) after a clean stop. Found: this one, which
    # ends with status 0 (also for a SIGTERM before uvicorn takes the signal over).
    signal.signal(signal.SIGTERM, _stopped)
    serve(settings)


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)


# The serve flags and the settings they override, by environment variable.
SERVE_FLAGS = {
    "host": "FRAUD_HOST",
    "port": "FRAUD_PORT",
    "workers": "FRAUD_WORKERS",
    "grpc_port": "FRAUD_GRPC_PORT",
}


def serve_settings(args: argparse.Namespace, settings: ServiceSettings) -> ServiceSettings:
    """``settings`` with the ``--host``/``--port``/``--workers``/``--grpc-port`` flags
    that were given.

    The flags are exported to the environment (``FRAUD_HOST`` ...) and the settings
    cache cleared, so every reader sees the same values: uvicorn here, the app factory
    and its gRPC server (``get_settings()``, in this process with one worker) and
    uvicorn's worker processes, which read the environment they inherit."""
    given = {var: getattr(args, flag, None) for flag, var in SERVE_FLAGS.items()}
    given = {var: v for var, v in given.items() if v is not None}
    if given:
        os.environ.update({var: str(v) for var, v in given.items()})
        read_settings.cache_clear()
        settings = get_settings()
    if settings.grpc_port == settings.port:
        raise UsageError(
            f"--grpc-port (FRAUD_GRPC_PORT) {settings.grpc_port} is the HTTP port "
            "(--port, FRAUD_PORT) too: give the gRPC server a port of its own"
        )
    return settings


def _int_in(low: int, high: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < low or (high is not None and v > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}")
        return v

    return parse


def _configure_serve(parser: argparse.ArgumentParser) -> None:
    add_embedded_redis(parser)
    parser.add_argument(
        "--host", help="address to listen on, 0.0.0.0 for other hosts (default FRAUD_HOST)"
    )
    parser.add_argument(
        "--port", type=_int_in(1, 65535), help="port to listen on (default FRAUD_PORT)"
    )
    parser.add_argument(
        "--workers", type=_int_in(1, None), help="uvicorn worker processes (default FRAUD_WORKERS)"
    )
    parser.add_argument(
        "--grpc-port",
        type=_int_in(1, 65535),
        help="also serve the Open Inference Protocol v2 over gRPC on this port, on the "
        "same host (default FRAUD_GRPC_PORT; unset: no gRPC server)",
    )


def _configure_keys(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    create = sub.add_parser(
        "create",
        help="make a key: print it once (stdout), append its hash to the keys file",
        description="Make an API key, print it once on stdout and append its SHA-256 "
        "(never the key) to the keys file. A running service picks it up within a second.",
    )
    create.add_argument("--id", required=True, help="the key's name, e.g. checkout-2026-11")
    create.add_argument(
        "--scopes",
        required=True,
        help=f"comma-separated, from: {', '.join(s.value for s in Scope)}",
    )
    create.add_argument(
        "--share",
        type=float,
        default=1.0,
        help="the key's weight in admission's fair shares under overload (default 1)",
    )
    create.add_argument(
        "--file",
        type=Path,
        default=None,
        help="the keys file (default: FRAUD_API_KEYS_FILE)",
    )


def run_keys(args: argparse.Namespace, settings: ServiceSettings) -> None:
    path = args.file or settings.api_keys_file
    if path is None:
        raise UsageError("keys create: give --file or set FRAUD_API_KEYS_FILE")
    try:
        scopes = frozenset(Scope(s.strip()) for s in args.scopes.split(",") if s.strip())
    except ValueError:
        raise UsageError(
            f"--scopes: {args.scopes!r}; choose from {', '.join(s.value for s in Scope)}"
        ) from None
    if not scopes:
        raise UsageError("--scopes: at least one scope")
    if not 0 < args.share <= 1000:
        raise UsageError(f"--share: must be in (0, 1000], got {args.share:g}")
    key, digest = new_key(args.id)
    append_key(path, KeyEntry(id=args.id, sha256=digest, scopes=scopes, share=args.share))
    # The key itself goes to stdout only (not the log), so it can be piped into a Secret.
    sys.stdout.write(key + "\n")


COMMANDS: list[Command[Any]] = [
    Command(
        "serve",
        "run the scoring API (FastAPI + uvicorn)",
        run_serve,
        _configure_serve,
        settings=ServiceSettings,
    ),
    Command(
        "keys",
        "manage the scoring API's keys (see docs/api.md, Security)",
        run_keys,
        _configure_keys,
        settings=ServiceSettings,
    ),
]
