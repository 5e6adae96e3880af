"""The updater's ``/readyz`` means "consuming": 503 before its loop runs and while Redis
is down, 200 while it consumes (the chart's readinessProbe points at it)."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request
from pathlib import Path

from fraud_scoring.redis_server import embedded_redis, free_port
from tests.conftest_streaming import start_updater, wait_for


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def test_readyz_follows_the_loop_and_redis(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "updater.log"
    with embedded_redis() as url:
        proc = start_updater(url, log, "--metrics-port", str(port))
        try:
            wait_for(lambda: _get(base + "/readyz") == (200, "consuming\n"), 60, "ready")
            status, metrics = _get(base + "/metrics")
            assert status == 200 and "fraud_stream_last_step_time_seconds" in metrics
        except BaseException:
            proc.kill()
            raise
    try:
        # Redis is gone: the loop stalls in its retries and PING fails.
        wait_for(lambda: _get(base + "/readyz")[0] == 503, 30, "not ready")
        assert "Redis" in _get(base + "/readyz")[1]
        assert proc.poll() is None, "the updater keeps retrying, it does not exit"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
