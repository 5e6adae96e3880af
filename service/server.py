"""``fraud-scoring serve``: the scoring API under uvicorn."""

from __future__ import annotations

import uvicorn

from fraud_scoring.settings import Settings


def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT; in-flight requests get ``drain_seconds`` to finish."""
    uvicorn.run(
        "service.server:app_factory",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        timeout_graceful_shutdown=int(settings.drain_seconds),
        log_level="info",
        access_log=False,
    )


def app_factory():  # type: ignore[no-untyped-def]
    from service.app import create_app

    return create_app()
