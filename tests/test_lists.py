"""Lists and rules over real HTTP and the world's real Redis-protocol server
(service/core/lists.py, service/edge/lists_api.py, service/core/rules.py): a card put on
``blocked_cards`` is declined on its next transaction, read in the micro-batch's one
round trip; expiry; the ``lists`` scope; values checked against their column; the limit;
the audit trail; the rules version on /readyz and in answers; a bad rules file keeps the
old rules."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from fraud_scoring import rules as R
from tests.conftest import Server, World, start_server, stop_server, wait_until
from tests.test_auth import bearer, create_key
from tests.test_service import TXN

MAX_ITEMS = 20


@dataclass
class ListsServer:
    srv: Server
    rules_file: Path
    scorer: str  # scope score
    analyst: str  # scope lists
    labeller: str  # scope label
    ops: str  # scope admin (implies lists)

    def call(self, method: str, path: str, key: str, **kw: Any) -> httpx.Response:
        with self.srv.client() as c:
            return c.request(method, path, headers=bearer(key), **kw)

    def score(self, **over: Any) -> httpx.Response:
        body = TXN | {"transaction_id": f"lists-{time.monotonic_ns()}"} | over
        return self.call("POST", "/v1/score", self.scorer, json=body)


@pytest.fixture(scope="module")
def served(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ListsServer]:
    tmp = tmp_path_factory.mktemp("lists")
    keys = tmp / "keys.jsonl"
    rules_file = tmp / "rules.yaml"
    shutil.copy(R.DEFAULT_PATH, rules_file)
    scopes = {"checkout": "score", "analyst": "lists", "labels": "label", "ops": "admin"}
    made = {k: create_key(keys, k, s) for k, s in scopes.items()}
    srv = start_server(
        world,
        tmp,
        FRAUD_AUTH="required",
        FRAUD_API_KEYS_FILE=str(keys),
        FRAUD_RULES_FILE=str(rules_file),
        FRAUD_RULES_POLL_S="0.1",
        FRAUD_LIST_MAX_ITEMS=str(MAX_ITEMS),
    )
    yield ListsServer(
        srv, rules_file, made["checkout"], made["analyst"], made["labels"], made["ops"]
    )
    stop_server(srv)


def _card() -> str:
    return f"c-lists-{time.monotonic_ns()}"


def _pages(served: ListsServer, path: str, rows: str, **params: Any) -> list[list[dict]]:
    """Every page of a list GET, following ``next_cursor``."""
    out, cursor = [], None
    while True:
        query = params | ({"cursor": cursor} if cursor else {})
        got = served.call("GET", path, served.analyst, params=query)
        assert got.status_code == 200, got.text
        out.append(got.json()[rows])
        if (cursor := got.json()["next_cursor"]) is None:
            return out


def test_a_card_put_on_the_block_list_is_declined_on_its_next_transaction(
    served: ListsServer,
) -> None:
    card = _card()
    before = served.score(card_id=card).json()
    assert before["decided_by"] != "list"
    put = served.call(
        "PUT",
        "/v1/lists/blocked_cards/items",
        served.analyst,
        json={"items": [{"value": card, "reason": "confirmed compromised (case 17)"}]},
    )
    assert put.status_code == 200, put.text
    assert put.json() == {"name": "blocked_cards", "changed": 1, "by": "analyst"}
    after = served.score(card_id=card).json()
    assert after["decision"] == "decline" and after["decided_by"] == "list"
    assert after["reasons"][0]["code"] == "RULE_BLOCKED_CARD"
    assert after["rules_version"] == before["rules_version"]
    shown = served.call("GET", "/v1/lists/blocked_cards/items", served.ops).json()
    item = next(i for i in shown["items"] if i["value"] == card)
    assert (item["added_by"], item["reason"], item["expires_at"], item["expired"]) == (
        "analyst",
        "confirmed compromised (case 17)",
        None,
        False,
    )
    gone = served.call(
        "DELETE",
        "/v1/lists/blocked_cards/items",
        served.ops,
        json={"values": [card], "reason": "false positive"},
    )
    assert gone.json()["changed"] == 1
    assert served.score(card_id=card).json()["decided_by"] != "list"
    audit = [e for p in _pages(served, "/v1/lists/blocked_cards/audit", "entries") for e in p]
    mine = [(e["op"], e["key_id"], e["reason"]) for e in audit if e["value"] == card]
    assert mine == [
        ("add", "analyst", "confirmed compromised (case 17)"),
        ("remove", "ops", "false positive"),
    ]


def test_list_gets_answer_pages_a_cursor_follows(served: ListsServer) -> None:
    """``limit`` rows a page (default and most in the OpenAPI document) and the cursor of
    the next; every item once, by value; the audit oldest first; a bad limit or cursor is
    a 422 naming it."""
    tag = time.monotonic_ns()
    merchants = [f"m-page-{tag}-{i}" for i in range(7)]
    items = [{"value": m, "reason": "page"} for m in merchants]
    put = served.call(
        "PUT", "/v1/lists/trusted_merchants/items", served.analyst, json={"items": items}
    )
    assert put.status_code == 200, put.text
    pages = _pages(served, "/v1/lists/trusted_merchants/items", "items", limit=3)
    assert all(len(p) == 3 for p in pages[:-1]) and 1 <= len(pages[-1]) <= 3
    values = [i["value"] for p in pages for i in p]
    assert values == sorted(set(values)) and set(merchants) <= set(values)
    whole = served.call("GET", "/v1/lists/trusted_merchants/items", served.analyst).json()
    assert [i["value"] for i in whole["items"]] == values  # default 100: one page here
    assert whole["next_cursor"] is None

    audit = _pages(served, "/v1/lists/trusted_merchants/audit", "entries", limit=2)
    entries = [e for p in audit for e in p]
    assert [e["value"] for e in entries if e["value"] in merchants] == merchants
    ids = [tuple(map(int, e["id"].split("-"))) for e in entries]
    assert ids == sorted(set(ids))  # oldest first, none twice

    first = served.call(
        "GET", "/v1/lists/trusted_merchants/audit", served.analyst, params={"limit": 1}
    ).json()
    bad = {
        "limit": [{"limit": 0}, {"limit": 1001}, {"limit": "x"}],
        "cursor": [{"cursor": "nope"}, {"cursor": first["next_cursor"]}],  # an audit cursor
    }
    for field, tries in bad.items():
        for params in tries:
            got = served.call(
                "GET", "/v1/lists/trusted_merchants/items", served.analyst, params=params
            )
            assert got.status_code == 422, (params, got.text)
            assert got.json()["detail"][0]["field"] == f"query.{field}", got.text
    wrong = served.call(
        "GET",
        "/v1/lists/trusted_merchants/audit",
        served.analyst,
        params={"cursor": "YXVkaXQ6bm90LWFuLWlk"},
    )  # "audit:not-an-id"
    assert wrong.status_code == 422 and wrong.json()["detail"][0]["field"] == "query.cursor"

    with served.srv.client() as c:
        doc = c.get("/openapi.json").json()
    for path in ("/v1/lists/{name}/items", "/v1/lists/{name}/audit"):
        op = doc["paths"][path]["get"]
        params = {p["name"]: p for p in op["parameters"]}
        assert params["limit"]["schema"]["default"] == 100
        assert params["limit"]["schema"]["maximum"] == 1000
        assert "next_cursor" in params["cursor"]["description"]
        ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        out = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert "next_cursor" in out["properties"]
    served.call(
        "DELETE",
        "/v1/lists/trusted_merchants/items",
        served.analyst,
        json={"values": merchants, "reason": "test done"},
    )


def test_an_item_past_its_expiry_no_longer_decides(served: ListsServer) -> None:
    card = _card()
    until = datetime.now(UTC) + timedelta(seconds=1.5)
    put = served.call(
        "PUT",
        "/v1/lists/blocked_cards/items",
        served.analyst,
        json={"items": [{"value": card, "reason": "hold", "expires_at": until.isoformat()}]},
    )
    assert put.status_code == 200, put.text
    assert served.score(card_id=card).json()["decided_by"] == "list"
    wait_until(lambda: served.score(card_id=card).json()["decided_by"] != "list", 10)
    shown = served.call("GET", "/v1/lists/blocked_cards/items", served.analyst).json()
    assert next(i for i in shown["items"] if i["value"] == card)["expired"] is True


def test_only_a_lists_key_changes_a_list_and_it_cannot_score(served: ListsServer) -> None:
    body = {"items": [{"value": _card(), "reason": "r"}]}
    for key in (served.scorer, served.labeller):
        refused = served.call("PUT", "/v1/lists/blocked_cards/items", key, json=body)
        assert refused.status_code == 403 and "lists" in refused.text, refused.text
    assert served.score().status_code == 200
    scoring = served.call("POST", "/v1/score", served.analyst, json=TXN)
    assert scoring.status_code == 403 and "score" in scoring.text


def test_a_bad_change_is_refused_naming_the_item_and_changes_nothing(
    served: ListsServer,
) -> None:
    def put(name: str, items: list[dict[str, Any]]) -> httpx.Response:
        return served.call("PUT", f"/v1/lists/{name}/items", served.analyst, json={"items": items})

    good = {"value": _card(), "reason": "r"}
    bad = put("blocked_cards", [good, {"value": "bad\u0001id", "reason": "r"}])
    assert bad.status_code == 422 and "items.1.value" in bad.text, bad.text
    past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    late = put("blocked_cards", [{**good, "expires_at": past}])
    assert late.status_code == 422 and "items.0.expires_at" in late.text
    unknown = put("stolen_cards", [good])
    assert unknown.status_code == 404 and "stolen_cards" in unknown.text
    shown = served.call("GET", "/v1/lists/blocked_cards/items", served.analyst).json()
    assert good["value"] not in [i["value"] for i in shown["items"]]
    devices = [{"value": f"d-{time.monotonic_ns()}-{i}", "reason": "r"} for i in range(25)]
    over = put("blocked_devices", devices)
    assert over.status_code == 422 and f"limit of {MAX_ITEMS}" in over.text, over.text
    held = served.call("GET", "/v1/lists/blocked_devices/items", served.analyst).json()
    assert held["items"] == []


def test_a_bad_rules_file_keeps_the_old_rules_and_a_good_one_serves(
    served: ListsServer,
) -> None:
    def ready() -> dict[str, Any]:
        with served.srv.client() as c:
            return c.get("/readyz").json()

    first = ready()["rules_version"]
    assert served.score().json()["rules_version"] == first
    shipped = R.DEFAULT_PATH.read_text()
    served.rules_file.write_text(shipped.replace("amount > review_amount_limit", "amount > x"))
    wait_until(lambda: "rules" in ready(), 10)
    assert "rules.2.when: unknown name 'x'" in ready()["rules"]
    assert ready()["rules_version"] == first
    big = served.score(amount=6000.0).json()
    assert "RULE_AMOUNT_OVER_LIMIT" in [r["code"] for r in big["reasons"]]
    served.rules_file.write_text(shipped.replace("amount > review_amount_limit", "amount > 5500"))
    wait_until(lambda: ready()["rules_version"] != first and "rules" not in ready(), 10)
    assert served.score(amount=6000.0).json()["rules_version"] == ready()["rules_version"]
    served.rules_file.write_text(shipped)  # the module's other tests read the shipped rules
    wait_until(lambda: ready()["rules_version"] == first, 10)


async def test_list_lookups_ride_the_micro_batch_s_one_round_trip(world: World) -> None:
    from cli.settings import Settings
    from fraud_scoring.events import Transaction
    from fraud_scoring.feast_store import open_store
    from fraud_scoring.features import producible_features
    from service.core import lists
    from service.core.model import ModelHolder, load_model
    from service.core.online_features import OnlineFeatureReader
    from service.core.scoring import Scorer

    class Counting(Scorer):
        round_trips = 0

        async def _execute(self, pipe: Any) -> list[Any]:
            Counting.round_trips += 1
            return await super()._execute(pipe)

        async def _execute_then(self, pipe: Any, *rest: Any) -> tuple[list[Any], Any]:
            Counting.round_trips += 1  # the reads (and claims); the writes follow on it
            return await super()._execute_then(pipe, *rest)

    settings = Settings(
        redis_url=world.redis_url,
        data_dir=world.data_dir,
        model_repo=world.model_repo,
        idempotency_ttl_s=0,
        max_event_skew_s=0,
    )
    store = open_store(world.data_dir, world.redis_url)
    model = load_model(world.model_repo, "fraud", "latest", producible_features())
    client = aioredis.Redis.from_url(world.redis_url)
    pool = ThreadPoolExecutor(1)
    scorer = Counting(
        client, OnlineFeatureReader(store.project), ModelHolder(model), settings, pool
    )
    cards = [_card() for _ in range(4)]
    await lists.add(
        client, scorer.rules.current, "blocked_cards", [lists.Item(cards[2], "test")], "t", 100
    )
    txns = [
        Transaction.model_validate(TXN | {"transaction_id": f"rt-{c}", "card_id": c}) for c in cards
    ]
    await scorer.score_batch(txns[:1])  # loads the scripts the first time
    Counting.round_trips = 0
    out = await scorer.score_batch(txns)
    assert Counting.round_trips == 1
    assert [r.decided_by == "list" for r in out] == [False, False, True, False]
    assert out[2].decision == "decline" and out[2].fired_rules[0] == "BLOCKED_CARD"
    await client.aclose()
    pool.shutdown()
    await asyncio.sleep(0)
