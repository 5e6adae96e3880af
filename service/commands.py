"""The service's subcommand: ``serve``."""

from __future__ import annotations

import argparse

from fraud_scoring.commands import Command, add_embedded_redis
from fraud_scoring.redis_server import require_redis
from fraud_scoring.settings import Settings


def run_serve(args: argparse.Namespace, settings: Settings) -> None:
    # Refuse here, before uvicorn starts, so a missing REDIS_URL is one clear line and
    # exit status 2 rather than a failed startup. The entry point has already turned
    # --embedded-redis into FRAUD_EMBEDDED_REDIS, which the app's workers read.
    require_redis(settings.redis_url, settings.embedded_redis)
    from service.server import serve  # uvicorn and the app: only for this command

    serve(settings)


COMMANDS: list[Command] = [
    Command("serve", "run the scoring API (FastAPI + uvicorn)", run_serve, add_embedded_redis),
]
