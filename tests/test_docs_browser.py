"""/docs renders offline in a real browser (Debian's ``chromium``, headless): Swagger UI's
assets come from the installed package, so the operations appear without internet."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import Server, chromium


def test_swagger_ui_renders_the_operations(server: Server, tmp_path: Path) -> None:
    shot = tmp_path / "docs.png"
    common = [
        chromium(),
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        # Swagger UI renders after its scripts run: give them time (virtual, not wall).
        "--virtual-time-budget=10000",
    ]
    dom = subprocess.run(
        [*common, "--dump-dom", f"{server.url}/docs"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    # Rendered operations, not just the page's shell (which names no route).
    assert 'class="swagger-ui' in dom
    assert "opblock" in dom and "/v1/score" in dom, dom[:2000]
    subprocess.run(
        [*common, f"--screenshot={shot}", "--window-size=1280,1600", f"{server.url}/docs"],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.stat().st_size > 0
