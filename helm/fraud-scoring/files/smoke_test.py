"""`helm test` check: POST one sample transaction to the scoring Service and verify the answer.

Standard library only, so it runs in the application image unchanged. Waits for
/readyz (a fresh install may still be loading its first model) up to
SMOKE_TIMEOUT_S, then exits 0 when the response carries a valid decision, 1 otherwise.
With auth required, sends the key in the file SCORING_API_KEY_FILE names (a key with the
score scope, mounted from the Secret named in SCORING_API_KEY_SECRET, which the installer
creates), or SCORING_API_KEY when set (a run outside the cluster).
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime

BASE = os.environ["SCORING_URL"].rstrip("/")
TIMEOUT_S = float(os.environ.get("SMOKE_TIMEOUT_S", "120"))
KEY_FILE = os.environ.get("SCORING_API_KEY_FILE", "")


def _key() -> str:
    """The API key: SCORING_API_KEY, else the file's content ("" without a file, or when
    the optional Secret is missing: the 401 then names it)."""
    if os.environ.get("SCORING_API_KEY"):
        return os.environ["SCORING_API_KEY"]
    if not KEY_FILE:
        return ""
    try:
        with open(KEY_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


API_KEY = _key()
KEY_SECRET = os.environ.get("SCORING_API_KEY_SECRET", "")


def wait_ready() -> None:
    deadline = time.monotonic() + TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(BASE + "/readyz", timeout=5) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(2)
    sys.exit(f"FAIL: {BASE}/readyz not ready after {TIMEOUT_S:.0f}s ({last})")


def score() -> dict:
    txn = {
        "transaction_id": f"helm-test-{int(time.time())}",
        "card_id": "helm-test-card",
        "merchant_id": "helm-test-merchant",
        "amount": 42.5,
        "currency": "USD",
        "event_time": datetime.now(UTC).isoformat(),
        "country": "US",
        "channel": "pos",
        "mcc": "5411",
    }
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": "2000"}
    if API_KEY:
        headers["Authorization"] = f"Bearer {API_KEY}"
    req = urllib.request.Request(
        BASE + "/v1/score", data=json.dumps(txn).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        hint = ""
        if exc.code in (401, 403) and KEY_SECRET:
            hint = (
                f" (the test sends the key in Secret {KEY_SECRET!r}, key 'api-key': create "
                "it with a key holding the score scope)"
            )
        sys.exit(f"FAIL: POST /v1/score answered HTTP {exc.code}{hint}: {exc.read()[:500]!r}")


def check(body: dict) -> list[str]:
    problems = []
    if body.get("decision") not in ("approve", "review", "decline"):
        problems.append(f"decision is {body.get('decision')!r}")
    s = body.get("score")
    if not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0:
        problems.append(f"score is {s!r}, expected a number in [0, 1]")
    for key in ("reasons", "model_version", "features", "timing"):
        if key not in body:
            problems.append(f"{key!r} missing")
    return problems


if __name__ == "__main__":
    wait_ready()
    answer = score()
    failed = check(answer)
    if failed:
        sys.exit("FAIL: " + "; ".join(failed) + f"\n{json.dumps(answer)[:1000]}")
    print(
        f"OK: decision={answer['decision']} score={answer['score']} "
        f"model_version={answer['model_version']}"
    )
