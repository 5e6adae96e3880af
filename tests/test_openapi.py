"""OpenAPI = wire: ``/openapi.json`` against a live ``fraud-scoring serve`` over real HTTP.

The service runs as deployed: the live event-time bound on (FRAUD_MAX_EVENT_SKEW_S=600)
and transaction ids remembered (FRAUD_IDEMPOTENCY_TTL_S=3600). Every documented example
is sent and answered as documented; schemathesis then sends generated requests to every
operation and fails on any status, content type, header or body the document does not
list; /readyz's 503 and a not-ready service's answers are checked against the document;
/docs and /redoc ask no other host for anything (they render without internet: the
browser test needs Debian's chromium, scripts/install-chromium.sh).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from fraud_scoring.events import Transaction, country_codes, currency_codes
from fraud_scoring.model_repo import resolve
from service.edge.app import REDOC_CSP, REDOC_JS_PATH
from service.edge.schemas import TXN_EXAMPLE, transaction_schema
from tests.conftest import Server, World, chromium, start_server, stop_server
from tests.test_protocols import check_against_openapi

METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture(scope="module")
def live(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        world,
        tmp_path_factory.mktemp("openapi"),
        FRAUD_MAX_EVENT_SKEW_S="600",
        FRAUD_IDEMPOTENCY_TTL_S="3600",
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def spec(live: Server) -> dict[str, Any]:
    with live.client() as c:
        body: dict[str, Any] = c.get("/openapi.json").json()
    return body


def _operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                yield method.upper(), path, op


def _problems(spec: dict[str, Any], schema: dict[str, Any], value: Any) -> list[str]:
    validator = Draft202012Validator({**schema, "components": spec["components"]})
    return [e.message for e in validator.iter_errors(value)]


# --- the documented examples ---------------------------------------------------------


def test_every_documented_example_is_answered_as_documented(
    live: Server, spec: dict[str, Any]
) -> None:
    """Each operation's documented request (its body's example, with its parameters'
    examples) is valid by its own schema and, sent to the live service, answered with a
    documented status and body: scored (200) for the scoring examples, a reload of the
    configured version for the reload's `{}`. Every documented answer example is valid
    by its schema too."""
    answered = {}
    with live.client() as c:
        for method, path, op in _operations(spec):
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            if "example" not in body:
                continue
            assert not _problems(spec, body["schema"], body["example"]), path
            headers = {
                p["name"]: p["example"]
                for p in op.get("parameters", [])
                if p["in"] == "header" and "example" in p
            }
            r = c.request(method, path, json=body["example"], headers=headers)
            check_against_openapi(spec, method, path, r)
            answered[path] = r.status_code
    assert answered == {"/v1/score": 200, "/v1/score/batch": 200, "/v1/models/reload": 200}
    examples = [
        (schema, example)
        for schema in spec["components"]["schemas"].values()
        for example in schema.get("examples", [])
    ]
    for _, _, op in _operations(spec):
        for answer in op["responses"].values():
            for media in answer.get("content", {}).values():
                if "example" in media:
                    examples.append((media["schema"], media["example"]))
    assert examples  # ScoreOut's at least
    for schema, example in examples:
        assert not _problems(spec, schema, example), example


def test_the_example_is_a_replay_and_a_live_call_needs_the_time_of_now(
    live: Server, spec: dict[str, Any]
) -> None:
    """What docs/api.md says of the example: as a live call its event time is refused
    (422 naming event_time); with an event time of now the live call is scored."""
    op = spec["paths"]["/v1/score"]["post"]
    example = op["requestBody"]["content"]["application/json"]["example"]
    assert example == TXN_EXAMPLE
    record = next(p for p in op["parameters"] if p["name"] == "X-Fraud-Record")
    assert record["example"] == "false"
    with live.client() as c:
        stale = c.post("/v1/score", json={**example, "transaction_id": "t-openapi-stale"})
        assert stale.status_code == 422, stale.text
        assert stale.json()["detail"][0]["field"] == "event_time"
        check_against_openapi(spec, "POST", "/v1/score", stale)
        now = datetime.now(UTC).isoformat()
        fresh = c.post(
            "/v1/score", json={**example, "transaction_id": "t-openapi-now", "event_time": now}
        )
        assert fresh.status_code == 200, fresh.text
        check_against_openapi(spec, "POST", "/v1/score", fresh)


# --- currency and country: the validator's lists -------------------------------------


def test_currency_and_country_enums_are_the_validators_lists(
    live: Server, spec: dict[str, Any]
) -> None:
    body = spec["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]
    props = body["schema"]["properties"]
    assert props["currency"]["enum"] == sorted(currency_codes())
    assert props["country"]["enum"] == sorted(country_codes())
    batch = spec["paths"]["/v1/score/batch"]["post"]["requestBody"]["content"]
    items = batch["application/json"]["schema"]["properties"]["transactions"]["items"]
    assert items == body["schema"]
    # The wire agrees at the edges: a code outside the list is refused naming the field.
    assert "XTS" in props["currency"]["enum"] and "QQ" not in props["country"]["enum"]
    headers = {"X-Fraud-Record": "false"}
    with live.client() as c:
        for field, value in (("currency", "ABC"), ("country", "QQ")):
            assert value not in props[field]["enum"]
            r = c.post("/v1/score", json={**TXN_EXAMPLE, field: value}, headers=headers)
            assert r.status_code == 422 and r.json()["detail"][0]["field"] == field, r.text
        r = c.post("/v1/score", json={**TXN_EXAMPLE, "currency": "XTS"}, headers=headers)
        assert r.status_code == 200, r.text


def test_v2_lists_no_422_and_the_key_schemes_follow_auth(
    spec: dict[str, Any], tmp_path: Path
) -> None:
    """The ``/v2`` operations list no 422 (never answered); the key's two schemes are in
    the document; with auth off no operation requires them (none is asked for), with
    auth on exactly the operations that answer 401 do (either scheme)."""
    from cli.settings import Settings
    from service.edge.app import SECURITY_SCHEMES, create_app

    v2 = [(m, p) for m, p, op in _operations(spec) if p.startswith("/v2")]
    assert v2 and not [
        (m, p) for m, p, op in _operations(spec) if p.startswith("/v2") and "422" in op["responses"]
    ]
    assert spec["components"]["securitySchemes"] == SECURITY_SCHEMES
    assert not [p for _, p, op in _operations(spec) if "security" in op]
    assert "HTTPValidationError" not in spec["components"]["schemas"]

    keys = tmp_path / "keys.jsonl"
    on = create_app(Settings(auth="required", api_keys_file=keys)).openapi()
    either = [{"bearerAuth": []}, {"apiKeyHeader": []}]
    keyed = {(m, p) for m, p, op in _operations(on) if "401" in op["responses"]}
    assert {
        ("POST", "/v1/score"),
        ("GET", "/metrics"),
        ("POST", "/v2/models/{name}/infer"),
    } <= keyed
    for method, path, op in _operations(on):
        assert op.get("security") == (either if (method, path) in keyed else None), path
    assert ("GET", "/readyz") not in keyed and ("GET", "/v2/health/ready") not in keyed


def test_the_documented_id_pattern_is_the_validators() -> None:
    """An id's documented pattern accepts exactly what the validator does with the
    JSON: whitespace around it stripped first, then 1 to 128 characters, no control
    character."""
    spec_ids = transaction_schema()["properties"]
    accepts = Draft202012Validator(spec_ids["card_id"]).is_valid
    odd = [chr(c) for c in (*range(0x20), 0x7F, 0x85, 0xA0, 0x180E, 0x200B, 0x2028, 0xFEFF)]
    odd += [chr(c) for c in range(0x2000, 0x200B)] + ["\u3000", " ", "a", "é", "🂡"]
    samples = ["", "a" * 128, "a" * 129, " " + "a" * 128 + "\u3000", "a b", " a" * 64]
    for c in odd:
        samples += [c, c + "a", "a" + c, "a" + c + "a", c + "a" * 127 + c, c * 3 + "b" * 128]
    for value in samples:
        try:
            Transaction.model_validate_json(json.dumps({**TXN_EXAMPLE, "card_id": value}))
            wire = True
        except ValidationError:
            wire = False
        assert accepts(value) == wire, (value, wire)


# --- statuses: /readyz's 503 and a service with no model ----------------------------


def test_a_service_with_no_model_answers_as_documented(
    world: World, spec: dict[str, Any], tmp_path: Path
) -> None:
    """/readyz's 503 (its own body), the scoring and inference 503s and the protocol's
    "not ready" 400: each status documented for its route, each body its schema."""
    srv = start_server(
        world, tmp_path, wait_for="/healthz", FRAUD_MODEL_REPO=str(tmp_path / "no-models")
    )
    try:
        with srv.client() as c:
            headers = {"X-Fraud-Record": "false"}
            calls = [
                ("GET", "/readyz", c.get("/readyz")),
                ("POST", "/v1/score", c.post("/v1/score", json=TXN_EXAMPLE, headers=headers)),
                ("GET", "/v2/health/ready", c.get("/v2/health/ready")),
                ("GET", "/v2/models/{name}", c.get("/v2/models/fraud")),
                ("GET", "/v2/models/{name}/ready", c.get("/v2/models/fraud/ready")),
            ]
    finally:
        stop_server(srv)
    assert [r.status_code for _, _, r in calls] == [503, 503, 400, 503, 400]
    for method, path, r in calls:
        check_against_openapi(spec, method, path, r)
    ready = calls[0][2]
    assert ready.headers["Retry-After"] == "5" and ready.json()["status"] == "not ready"
    assert "model" in ready.json(), ready.json()
    ok = spec["paths"]["/readyz"]["get"]["responses"]
    assert ok["503"]["content"]["application/json"]["schema"]["anyOf"][0] == {
        "$ref": "#/components/schemas/ReadyzProblemsOut"
    }


# --- the docs pages: nothing from another host ---------------------------------------

# What a script or style would load from another host: an element's src (ReDoc's logo
# was an <img src> on its CDN), a url(), a fetch, an @import; links (<a href>) and
# schema ids are not loads.
_REMOTE_LOAD = re.compile(
    r"""src\s*[:=]\s*["'`](?:https?:)?//|url\(\s*["']?(?:https?:)?//|"""
    r"""fetch\(\s*["'`]https?://|@import\s+["'](?:https?:)?//"""
)


@pytest.mark.parametrize("page", ["/redoc", "/docs"])
def test_the_docs_pages_load_nothing_from_another_host(live: Server, page: str) -> None:
    """The page and every script and style it loads name no other host to load from
    (ReDoc's bundle drew Redocly's logo from its CDN); /redoc also forbids it (CSP)."""
    with live.client() as c:
        r = c.get(page)
        assert r.status_code == 200
        urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
        assert urls and not [u for u in urls if re.match(r"(https?:)?//", u)], urls
        assert re.search(r"https?://", r.text) is None, "a remote URL in the page"
        for u in urls:
            asset = c.get(u)
            assert asset.status_code == 200, u
            if u.endswith((".js", ".css")):
                found = _REMOTE_LOAD.findall(asset.text)
                assert not found, (u, found[:5])
                assert "cdn." not in asset.text, u
    if page == "/redoc":
        assert r.headers["Content-Security-Policy"] == REDOC_CSP
        assert REDOC_JS_PATH in urls
    else:
        assert '"validatorUrl": null' in r.text  # no badge from validator.swagger.io


def test_the_docs_pages_render_in_a_browser_asking_only_the_service(live: Server) -> None:
    """In a real browser (Debian's chromium, driven by Playwright): ReDoc and Swagger UI
    render the operations; every request goes to the service (ReDoc's search worker is
    a blob of the page's own origin), none is refused by /redoc's CSP, and ReDoc's
    sidebar footer shows no logo (it was an image from Redocly's CDN)."""
    browser_path = chromium()
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            for path, rendered in (
                ("/redoc", "text=API docs by Redocly"),
                ("/docs", '.opblock-summary-path[data-path="/v1/score"]'),
            ):
                page = browser.new_page()
                asked: list[str] = []
                console: list[str] = []
                page.on("request", lambda req, asked=asked: asked.append(req.url))
                page.on("console", lambda msg, console=console: console.append(msg.text))
                page.goto(f"{live.url}{path}")
                sync_api.expect(page.locator(rendered).first).to_be_visible(timeout=30_000)
                page.wait_for_timeout(300)  # ReDoc draws the footer's logo after mounting
                ours = (f"{live.url}/", f"blob:{live.url}/")
                assert asked and all(u.startswith(ours) for u in asked), (path, asked)
                assert not console, (path, console)  # no CSP refusal, no failed load
                assert page.locator("img").count() == 0, path
                page.close()
        finally:
            browser.close()


# --- schemathesis: every operation, generated requests -------------------------------

# The run's settings (schemathesis.toml). Every built-in check is on. A 503 is documented
# on every operation (overload, deadline, a stopping process), so it is not a "server
# error" here; a 500 is. Checks turned off where the document cannot say what the
# service refuses: a body valid by its schema is refused for a time relative to the
# server's clock (feedback's time: at most 300 s ahead, at most 730 days back; a review
# label's time is the item's event time when later than now, and replayed items may lie
# far ahead) or for a tensor's shape (the model's feature count).
_CONFIG = """
seed = 26
workers = 1
[phases]
examples.enabled = true
coverage.enabled = true
fuzzing.enabled = true
stateful.enabled = false
[generation]
max-examples = {examples}
[parameters]
"path.name" = "fraud"
"path.version" = "{version}"
[checks]
enabled = true
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503"]
[[operations]]
include-path-regex = "^/v1/score"
headers = {{ "X-Fraud-Record" = "{record}" }}
checks.positive_data_acceptance.enabled = {live_accepts}
[[operations]]
include-path-regex = "^/v1/(feedback|review/label|rules/test)$|/infer$"
checks.positive_data_acceptance.enabled = false
"""


def _schemathesis(url: str, tmp: Path, *args: str, **config: Any) -> None:
    (tmp / "schemathesis.toml").write_text(_CONFIG.format(**config))
    cli = [sys.executable, "-m", "schemathesis.cli", "--config-file", "schemathesis.toml"]
    run = subprocess.run(
        [*cli, "run", f"{url}/openapi.json", "--no-color", *args],
        cwd=tmp,  # its caches (.hypothesis, .schemathesis) stay out of the checkout
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-30_000:] + run.stderr[-5_000:]


def test_schemathesis_finds_no_answer_the_document_does_not_list(
    live: Server, world: World, tmp_path: Path
) -> None:
    """Every operation, in schemathesis' three phases (the documented examples, the
    schema's boundaries and its negations, then random requests): every status,
    content type, header and body is documented, every schema-valid request is accepted
    (scoring in replay mode: the live event-time bound depends on the clock) and every
    invalid one refused. Then the scoring operations in live mode: answers as
    documented."""
    version = resolve(world.model_repo, "fraud").name
    replay = tmp_path / "replay"
    replay.mkdir()
    _schemathesis(
        live.url, replay, examples=10, version=version, record="false", live_accepts="true"
    )
    _schemathesis(
        live.url,
        tmp_path,
        "--include-path-regex",
        "^/v1/score",
        examples=5,
        version=version,
        record="true",
        live_accepts="false",
    )
