"""The review page's layout with long values, in a real browser (Debian's ``chromium``
driven by Playwright; skipped with a message without it, failed under ``CI=true``).

The page's own files (``service/edge/static``) are served as the service serves them,
and its API calls are answered with items whose values are as long as the API lets
them be (ids of 128 characters with no space): no column is pushed past the page, a
value cut short shows the whole of it on hover (``title``), and the open item's values
wrap. Everything goes in as text: no value is markup (tests/test_review.py runs the page
against a real service).

"Add card to blocked_cards" runs against a real service over HTTP (auth on, the world's
online store): a key with ``lists`` puts a confirmed fraud's card on the list, a ``label``
key alone is shown the 403."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fraud_scoring.redis_server import embedded_redis
from service.edge.auth import KeyEntry, Scope, append_key, new_key
from tests.conftest import World, chromium, start_server, stop_server, wait_until
from tests.test_review import LIMIT, Reviewing, card_txns, queued_ids, score

STATIC = Path(__file__).resolve().parents[1] / "service" / "edge" / "static"
ORIGIN = "http://review.test"
LONG = {
    "transaction_id": "t" + "0123456789" * 12 + "-txn-id",
    "card_id": "c" + "abcdefghij" * 12 + "-card-i",
    "merchant_id": "m" + "klmnopqrst" * 12 + "-mercha",
    "device_id": "d" + "uvwxyz" * 21 + "-",
}
SHORT = {"transaction_id": "t-1", "card_id": "c0000001", "merchant_id": "m00001", "device_id": "d"}
FEATURES = {"amount": 5000.0, "card_txn_count_1h": 3.0, "merchant_fraud_rate_lag7d_7d": 0.25}


def _item(ids: dict[str, str]) -> dict[str, Any]:
    return {
        **{k: v for k, v in ids.items() if k != "device_id"},
        "decided_at": "2026-03-01T12:00:00+00:00",
        "event_time": "2026-03-01T12:00:00+00:00",
        "amount": 5000.0,
        "currency": "EUR",
        "country": "DE",
        "channel": "ecom",
        "mcc": "5732",
        "score": 0.8123,
        "model_version": "7",
        "reasons": [{"code": "RULE_AMOUNT_OVER_LIMIT", "message": "over the review limit"}],
        "key_features": [{"name": k, "value": v, "flag": None} for k, v in FEATURES.items()],
    }


def _detail(ids: dict[str, str]) -> dict[str, Any]:
    return {
        **_item(ids),
        "queued": True,
        "label": None,
        "device_id": ids["device_id"],
        "features": FEATURES,
        "missing": [],
        "stale": [],
        "card_history": [
            {
                "transaction_id": ids["transaction_id"],
                "event_time": "2026-03-01T12:00:00+00:00",
                "amount": 5000.0,
                "merchant_id": ids["merchant_id"],
                "country": "DE",
            }
        ],
    }


_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _answer(static: Path, ids: dict[str, str]) -> Callable[[Any], None]:
    """The page's files from ``static`` and its API calls answered as the service would,
    with one item of ``ids``."""

    def answer(route: Any) -> None:
        path = route.request.url.removeprefix(ORIGIN).split("?")[0]
        if path == "/review":
            path = "/review/review.html"
        if path.startswith("/review/"):
            file = static / path.removeprefix("/review/")
            route.fulfill(status=200, body=file.read_bytes(), content_type=_TYPES[file.suffix])
        elif path == "/v1/review/items":
            page = {"total": 1, "offset": 0, "items": [_item(ids)]}
            route.fulfill(status=200, body=json.dumps(page), content_type="application/json")
        elif path == "/v1/review/item":
            body = json.dumps(_detail(ids))
            route.fulfill(status=200, body=body, content_type="application/json")
        else:
            route.fulfill(status=404, body="{}", content_type="application/json")

    return answer


# The layout, measured in the page: how far each section's content reaches past its box
# (0: it fits), and the list's id cells and the open item's values.
_MEASURE = """() => {
  const over = (e) => e.scrollWidth - e.clientWidth;
  const cell = document.querySelector('#items tbody td.id');
  const clips = [...cell.children].map((c) => ({
    text: c.textContent, title: c.title, cut: c.scrollHeight > c.clientHeight,
    lines: Math.round(c.clientHeight / parseFloat(getComputedStyle(c).lineHeight)),
    clamp: getComputedStyle(c).webkitLineClamp,
  }));
  const dd = [...document.querySelectorAll('#d-txn dd')].find(
    (d) => d.previousElementSibling.textContent === 'transaction');
  const line = parseFloat(getComputedStyle(dd).lineHeight);
  return {
    queue: over(document.querySelector('#queue')),
    detail: over(document.querySelector('#detail')),
    main: over(document.querySelector('main')),
    page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
    tableRight: document.querySelector('#items').getBoundingClientRect().right,
    queueRight: document.querySelector('#queue').getBoundingClientRect().right,
    clips, dd: dd.textContent, ddLines: Math.round(dd.getBoundingClientRect().height / line),
    title: over(document.querySelector('#d-title')),
  };
}"""


def layout(static: Path, width: int, ids: dict[str, str] = LONG) -> dict[str, Any]:
    """The page from ``static`` with one item of ``ids`` listed and opened, measured."""
    browser_path = chromium()
    from playwright import sync_api

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 760})
            page.route(f"{ORIGIN}/**", _answer(static, ids))
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{ORIGIN}/review")
            row = page.locator("#items tbody tr")
            sync_api.expect(row).to_have_count(1)
            row.click()
            sync_api.expect(page.locator("#d-title")).to_contain_text("card c")
            sync_api.expect(page.locator("#d-history tbody tr")).to_have_count(1)
            measured: dict[str, Any] = page.evaluate(_MEASURE)
            assert not errors, errors
            return measured
        finally:
            browser.close()


@pytest.mark.parametrize("width", [1280, 1920])
def test_long_values_keep_the_review_table_inside_the_page(width: int) -> None:
    m = layout(STATIC, width)
    # Nothing reaches past its section, the page or the window: no column is cut off.
    assert (m["queue"], m["detail"], m["main"], m["page"], m["title"]) == (0, 0, 0, 0, 0), m
    assert m["tableRight"] <= m["queueRight"], m
    # The list's card and merchant ids: two lines each at most, cut (with an ellipsis),
    # the whole id on hover.
    assert [c["text"] for c in m["clips"]] == [LONG["card_id"], LONG["merchant_id"]], m
    for clip in m["clips"]:
        assert clip["title"] == clip["text"] and clip["cut"], clip
        assert clip["clamp"] == "2" and clip["lines"] == 2, clip
    # The open item shows the whole id, wrapped.
    assert m["dd"] == LONG["transaction_id"] and m["ddLines"] >= 2, m


def test_long_values_take_no_more_room_than_short_ones() -> None:
    """Narrower, where the list already scrolls sideways with short ids (its columns'
    own widths), the longest ids widen nothing: the layout is the short ids' one."""
    long, short = layout(STATIC, 1100, LONG), layout(STATIC, 1100, SHORT)
    assert (long["queue"], long["tableRight"]) == (short["queue"], short["tableRight"]), (
        long,
        short,
    )
    assert (long["detail"], long["page"]) == (0, 0), long
    assert not any(c["cut"] for c in short["clips"]), short  # short ids whole


def test_the_page_wraps_or_cuts_long_values_in_its_style() -> None:
    """Without a browser: the rules the layout rests on are in the page's files."""
    css = (STATIC / "review.css").read_text()
    js = (STATIC / "review.js").read_text()
    assert re.search(r"(^|[\s,])td\b[^{]*\{[^}]*overflow-wrap:\s*anywhere", css, re.M), css
    assert re.search(r"\.clip\s*\{[^}]*line-clamp:\s*2", css), css
    assert not re.search(r"td\.id\b[^{]*\{[^}]*nowrap", css), "ids kept on one unbounded line"
    assert re.search(r"\.title\s*=\s*String\(text\)", js), "a cut value has no title"
    assert "innerHTML" not in js  # values go in as text


@pytest.fixture(scope="module")
def blocking(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reviewing]:
    """The service with auth on, the shipped rules (``blocked_cards``), the review queue
    on a Redis server of its own; ``analyst`` has ``label`` and ``lists``, ``feed``
    ``label`` alone."""
    tmp = tmp_path_factory.mktemp("review-block")
    keys = tmp / "keys.jsonl"
    made = {}
    for key_id, scopes in (
        ("checkout", {Scope.SCORE}),
        ("analyst", {Scope.LABEL, Scope.LISTS}),
        ("feed", {Scope.LABEL}),
        ("prometheus", {Scope.METRICS}),
    ):
        key, digest = new_key(key_id)
        append_key(keys, KeyEntry(id=key_id, sha256=digest, scopes=frozenset(scopes)))
        made[key_id] = key
    with embedded_redis() as log_url:
        srv = start_server(
            world,
            tmp,
            FRAUD_AUTH="required",
            FRAUD_API_KEYS_FILE=str(keys),
            FRAUD_DECISION_LOG_URL=log_url,
            # The model alone never decides review or decline here: the amount rule does.
            FRAUD_REVIEW_THRESHOLD="1",
            FRAUD_DECLINE_THRESHOLD="1",
            FRAUD_REVIEW_AMOUNT_LIMIT=str(LIMIT),
            FRAUD_MODEL_POLL_S="600",
        )
        try:
            yield Reviewing(
                srv,
                log_url,
                world.redis_url,
                made["checkout"],
                made["analyst"],
                made["feed"],
                made["prometheus"],
            )
        finally:
            stop_server(srv)


def _on_block_list(r: Reviewing, card: str) -> dict[str, Any] | None:
    with r.client(r.analyst) as c:
        cursor = None
        while True:
            got = c.get(
                "/v1/lists/blocked_cards/items", params={"cursor": cursor} if cursor else {}
            )
            assert got.status_code == 200, got.text
            found = [i for i in got.json()["items"] if i["value"] == card]
            if found:
                return found[0]
            if (cursor := got.json()["next_cursor"]) is None:
                return None


def test_a_confirmed_fraud_s_card_is_put_on_blocked_cards_with_a_lists_key(
    blocking: Reviewing, world: World
) -> None:
    browser_path = chromium()
    from playwright import sync_api

    r = blocking
    [mine] = card_txns(world, "rv-block", [LIMIT + 500])
    [other] = card_txns(world, "rv-noscope", [LIMIT + 600])
    assert score(r, [mine, other]) == ["review", "review"]
    ids = [mine["transaction_id"], other["transaction_id"]]
    wait_until(lambda: set(ids) <= set(queued_ids(r)), what="the items queued")

    def mark_and_block(page: Any, key: str, target: str) -> None:
        page.goto(f"{r.srv.url}/review")
        page.locator("#key").fill(key)
        page.locator("#key-form button[type=submit]").click()
        page.locator(f'#items tr[data-id="{target}"]').click()
        sync_api.expect(page.locator("#d-title")).to_contain_text("card rv-")
        sync_api.expect(page.locator("#block-card")).to_be_hidden()  # not confirmed yet
        page.locator("#mark-fraud").click()
        sync_api.expect(page.locator("#d-state")).to_contain_text("Labelled fraud")
        sync_api.expect(page.locator("#block-card")).to_be_visible()
        page.locator("#block-card").click()

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            mark_and_block(page, r.analyst, ids[0])
            sync_api.expect(page.locator("#status")).to_have_text(
                "card rv-block added to blocked_cards."
            )
            # A label key alone: the list's 403, shown; the key is kept (no new prompt).
            other_tab = browser.new_page(viewport={"width": 1280, "height": 760})
            other_tab.on("pageerror", lambda e: errors.append(str(e)))
            mark_and_block(other_tab, r.feed, ids[1])
            status = other_tab.locator("#status")
            sync_api.expect(status).to_contain_text("403")
            sync_api.expect(status).to_contain_text("lists")
            sync_api.expect(status).to_have_class("error")
            assert other_tab.locator("#key-form").is_hidden()
            assert other_tab.locator("#block-card").is_enabled()  # may be tried again
            assert not errors, errors
        finally:
            browser.close()

    item = _on_block_list(r, "rv-block")
    assert item is not None
    assert (item["added_by"], item["reason"]) == ("analyst", f"confirmed fraud {ids[0]}")
    assert _on_block_list(r, "rv-noscope") is None
    # Read by the next transaction of the card, in its micro-batch.
    again = card_txns(world, "rv-block", [10.0, 12.0])[1]
    with r.client(r.scorer) as c:
        answer = c.post("/v1/score", json=again | {"transaction_id": "rv-block-again"}).json()
    assert (answer["decision"], answer["decided_by"]) == ("decline", "list"), answer
