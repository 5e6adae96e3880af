"""API keys and scopes, and the event-time bound, over real HTTP (FRAUD_AUTH=required)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_protocols import check_against_openapi

ROOT = Path(__file__).resolve().parents[1]


def live_txn(i: int = 0, **patch: object) -> dict[str, object]:
    return {
        "transaction_id": f"auth-{i}",
        "card_id": "c0000001",
        "merchant_id": "m00001",
        "amount": 42.5,
        "currency": "USD",
        "event_time": datetime.now(UTC).isoformat(),
        "country": "US",
        "channel": "pos",
        "mcc": "5411",
        **patch,
    }


def create_key(keys_file: Path, key_id: str, scopes: str) -> str:
    """``fraud-scoring keys create``, as an operator runs it: the key on stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "cli", "keys", "create", "--id", key_id, "--scopes", scopes],
        env={**os.environ, "FRAUD_API_KEYS_FILE": str(keys_file), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


JSON_TYPE = {"Content-Type": "application/json"}  # what state-changing admin routes need


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class AuthServer:
    srv: Server
    keys_file: Path
    scorer: str  # scope score
    ops: str  # scopes score, admin
    scraper: str  # scope metrics


@pytest.fixture(scope="module")
def authed(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    tmp = tmp_path_factory.mktemp("auth")
    keys_file = tmp / "keys.jsonl"
    scorer = create_key(keys_file, "checkout", "score")
    ops = create_key(keys_file, "ops", "score,admin")
    scraper = create_key(keys_file, "prometheus", "metrics")
    srv = start_server(
        world,
        tmp,
        FRAUD_AUTH="required",
        FRAUD_API_KEYS_FILE=str(keys_file),
        FRAUD_MAX_EVENT_SKEW_S="600",
        FRAUD_MODEL_POLL_S="600",
    )
    yield AuthServer(srv, keys_file, scorer, ops, scraper)
    stop_server(srv)


def test_keys_file_holds_hashes_not_keys(authed: AuthServer) -> None:
    text = authed.keys_file.read_text()
    assert authed.scorer not in text and authed.scorer.split(".")[1] not in text
    assert authed.scorer.startswith("checkout.")
    assert oct(authed.keys_file.stat().st_mode & 0o777) == "0o600"


def test_probes_are_open(authed: AuthServer) -> None:
    with authed.srv.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 200
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 200


def test_auth_answers_match_the_published_schema(authed: AuthServer) -> None:
    with authed.srv.client() as c:
        spec = c.get("/openapi.json").json()
        unauthenticated = c.post("/v1/score", json=live_txn())
        forbidden = c.post("/v1/score", json=live_txn(), headers=bearer(authed.scraper))
        reload = c.post("/v1/models/reload", headers=bearer(authed.scorer))
        assert [r.status_code for r in (unauthenticated, forbidden, reload)] == [401, 403, 403]
        check_against_openapi(spec, "POST", "/v1/score", unauthenticated)
        check_against_openapi(spec, "POST", "/v1/score", forbidden)
        check_against_openapi(spec, "POST", "/v1/models/reload", reload)
        assert unauthenticated.json()["detail"][0]["code"] == "unauthenticated"
        assert forbidden.json()["detail"][0]["code"] == "forbidden"


def test_inference_protocol_needs_the_score_scope(authed: AuthServer) -> None:
    """Metadata and inference need 'score'; answers keep the protocol's error shape."""
    infer = "/v2/models/fraud/infer"
    with authed.srv.client() as c:
        for r in (c.get("/v2/models/fraud"), c.post(infer, json={})):
            assert r.status_code == 401 and set(r.json()) == {"error"}
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        r = c.get("/v2/models/fraud", headers=bearer(authed.scraper))
        assert r.status_code == 403 and "lacks scope 'score'" in r.json()["error"]
        assert c.get("/v2/models/fraud", headers=bearer(authed.scorer)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/score", "/v1/score/batch"])
def test_scoring_needs_a_valid_key(authed: AuthServer, path: str) -> None:
    # Stamped now, not when the module was collected: a live transaction older than the
    # event-time bound is refused 422, and the suite may reach this test minutes later.
    body = live_txn() if path == "/v1/score" else {"transactions": [live_txn()]}
    with authed.srv.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == 401
        assert r.headers["WWW-Authenticate"] == 'Bearer realm="fraud-scoring"'
        assert "missing API key" in r.json()["detail"][0]["message"]
        for wrong in (authed.scorer + "x", "checkout.nope", "nobody.x", "garbage"):
            r = c.post(path, json=body, headers=bearer(wrong))
            assert r.status_code == 401, wrong
            assert 'error="invalid_token"' in r.headers["WWW-Authenticate"]
        r = c.post(path, json=body, headers={"Authorization": f"Basic {authed.scorer}"})
        assert r.status_code == 401
        assert c.post(path, json=body, headers=bearer(authed.scorer)).status_code == 200
        assert c.post(path, json=body, headers={"X-API-Key": authed.scorer}).status_code == 200


def test_scopes_are_enforced_with_403(authed: AuthServer) -> None:
    with authed.srv.client() as c:
        r = c.post("/v1/score", json=live_txn(), headers=bearer(authed.scraper))
        assert r.status_code == 403
        assert r.json()["detail"][0]["message"] == (
            "key 'prometheus' lacks scope 'score' needed for POST /v1/score"
        )
        r = c.post("/v1/models/reload", headers=bearer(authed.scorer))
        assert r.status_code == 403 and "'admin'" in r.json()["detail"][0]["message"]
        assert c.post("/v1/models/reload").status_code == 401
        r = c.post("/v1/models/reload", headers=bearer(authed.ops) | JSON_TYPE)
        assert r.status_code == 200 and r.json()["serving_version"] == "1"
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers=bearer(authed.scorer)).status_code == 403
        r = c.get("/metrics", headers=bearer(authed.scraper))
        assert r.status_code == 200 and "fraud_decisions_total" in r.text


def test_event_time_bound_and_admin_replay_mode(authed: AuthServer) -> None:
    old = {"event_time": "2026-01-16T12:00:00+00:00"}
    future = {"event_time": (datetime.now(UTC) + timedelta(hours=1)).isoformat()}
    replay = {"X-Fraud-Record": "false"}
    with authed.srv.client() as c:
        for i, patch in enumerate((old, future)):
            r = c.post("/v1/score", json=live_txn(i, **patch), headers=bearer(authed.scorer))
            assert r.status_code == 422, r.text
            [problem] = r.json()["detail"]
            assert problem["field"] == "event_time" and "600 s" in problem["message"]
        batch = {"transactions": [live_txn(1), live_txn(2, **old)]}
        r = c.post("/v1/score/batch", json=batch, headers=bearer(authed.scorer))
        assert r.status_code == 422
        assert r.json()["detail"][0]["field"] == "transactions.1.event_time"
        # Replay mode: admin only; it scores old transactions (and records nothing).
        as_scorer, as_ops = {**replay, **bearer(authed.scorer)}, {**replay, **bearer(authed.ops)}
        r = c.post("/v1/score", json=live_txn(3, **old), headers=as_scorer)
        assert r.status_code == 403 and "replay mode" in r.json()["detail"][0]["message"]
        r = c.post("/v1/score", json=live_txn(3, **old), headers=as_ops)
        assert r.status_code == 200, r.text
        r = c.post("/v1/score/batch", json=batch, headers=as_ops)
        assert r.status_code == 200 and len(r.json()["results"]) == 2


def test_keys_rotate_without_restart(authed: AuthServer) -> None:
    """A new key works as soon as its line is in the file, the old one keeps working
    until its line is removed: two keys valid at once, no restart."""
    with authed.srv.client() as c:

        def status(key: str) -> int:
            return c.post("/v1/score", json=live_txn(9), headers=bearer(key)).status_code

        new = create_key(authed.keys_file, "checkout-next", "score")
        wait_until(lambda: status(new) == 200, timeout=10, what="the new key to be valid")
        assert status(authed.scorer) == 200
        lines = authed.keys_file.read_text().splitlines(keepends=True)
        kept = [line for line in lines if '"id": "checkout"' not in line]
        staged = authed.keys_file.with_suffix(".new")
        staged.write_text("".join(kept))
        staged.replace(authed.keys_file)  # atomic, as a Secret volume update is
        wait_until(lambda: status(authed.scorer) == 401, timeout=10, what="the old key to end")
        assert status(new) == 200
        # A broken file keeps the last good keys (and says so in the log).
        authed.keys_file.write_text("{not json\n")
        # The file is looked at when a request comes: each poll sends one.
        wait_until(
            lambda: status(new) == 200 and "keeping the" in authed.srv.log.read_text(),
            timeout=10,
            what="the broken file to be refused in the log",
        )
        staged.write_text("".join(kept))
        staged.replace(authed.keys_file)


def test_serve_refuses_a_missing_keys_file(world: World, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cli", "serve"],
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "REDIS_URL": world.redis_url,
            "FRAUD_AUTH": "required",
            "FRAUD_API_KEYS_FILE": str(tmp_path / "absent.jsonl"),
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "absent.jsonl" in out.stderr and "No such file" in out.stderr


def test_a_keys_file_caught_mid_write_keeps_the_keys_read_before(tmp_path: Path) -> None:
    """An editor truncates, then writes: the empty file in between is not "no keys"; a
    half-written line is not either. A file left with only a comment revokes them all."""
    from service.edge.auth import AuthError, KeyEntry, KeyRing, Scope, append_key, new_key

    path = tmp_path / "keys.jsonl"
    key, digest = new_key("ops")
    append_key(path, KeyEntry(id="ops", sha256=digest, scopes=frozenset({Scope.SCORE})))
    import prometheus_client

    def refused() -> float | None:
        name = "fraud_keys_file_rejected_reads_total"
        return prometheus_client.REGISTRY.get_sample_value(name)

    ring = KeyRing(path)
    before = refused()
    assert before is not None  # exported (at 0 in a fresh process) before any refusal
    full = path.read_text()
    for caught in ("", full[: len(full) // 2]):
        path.write_text(caught)
        ring._next_check = 0.0  # the next call re-reads (normally once a second)
        assert ring.authenticate(key).key_id == "ops"
    assert refused() == before + 2
    path.write_text("# every key revoked\n")
    ring._next_check = 0.0
    with pytest.raises(AuthError):
        ring.authenticate(key)
