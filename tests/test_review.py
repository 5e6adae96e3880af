"""The review queue and the analysts' page: decisions of 'review' enter the queue (once),
leave it when a label arrives through the feedback path, and the page lists, opens and
marks them in a real browser (Debian's ``chromium`` driven by Playwright; skipped with a
message without either). A real service with auth on, the log on its own Redis server
or on a Redis Cluster.

``REVIEW_SCREENSHOT=path.png`` saves the page (an item open) for the README."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import EmbeddedCluster, embedded_redis
from service.core import idempotency
from service.edge.auth import KeyEntry, Scope, append_key, new_key
from tests.conftest import (
    Server,
    World,
    chromium,
    private_db,
    start_server,
    stop_server,
    wait_until,
)
from tests.test_protocols import check_against_openapi
from tests.test_service import held_out_day

LIMIT = 1000.0  # FRAUD_REVIEW_AMOUNT_LIMIT: amounts above it are (at least) 'review'


@dataclass
class Reviewing:
    srv: Server
    log_url: str
    store_url: str  # the online store
    scorer: str  # scope score: the payment system
    analyst: str  # scope admin (which implies label): the review page's user
    feed: str  # scope label: a chargeback feed
    scraper: str  # scope metrics

    def client(self, key: str | None = None) -> httpx.Client:
        c = self.srv.client()
        if key:
            c.headers["Authorization"] = f"Bearer {key}"
        return c


@pytest.fixture(scope="module", params=["redis", "cluster"])
def reviewing(
    world: World, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Reviewing]:
    """The service with the decision log, the review queue and the feedback log on a
    Redis server of their own, or on the test's Redis Cluster (emptied first)."""
    tmp = tmp_path_factory.mktemp("review")
    keys = tmp / "keys.jsonl"
    made = {}
    for key_id, scope in (
        ("checkout", Scope.SCORE),
        ("analyst", Scope.ADMIN),
        ("feed", Scope.LABEL),
        ("prometheus", Scope.METRICS),
    ):
        key, digest = new_key(key_id)
        append_key(keys, KeyEntry(id=key_id, sha256=digest, scopes=frozenset({scope})))
        made[key_id] = key
    # The cluster run scores the same cards again: an online store of its own.
    store = world.redis_url if request.param == "redis" else private_db(world, 5)
    with _log_store(request) as log_url:
        srv = start_server(
            world,
            tmp,
            REDIS_URL=store,
            FRAUD_AUTH="required",
            FRAUD_API_KEYS_FILE=str(keys),
            FRAUD_DECISION_LOG_URL=log_url,
            # The model alone never decides review or decline here: the amount rule does.
            FRAUD_REVIEW_THRESHOLD="1",
            FRAUD_DECLINE_THRESHOLD="1",
            FRAUD_REVIEW_AMOUNT_LIMIT=str(LIMIT),
            FRAUD_MODEL_POLL_S="600",
            # As deployed: an answered id's claim is what matches a label to an approved
            # or declined decision.
            FRAUD_IDEMPOTENCY_TTL_S="3600",
        )
        try:
            yield Reviewing(
                srv,
                log_url,
                store,
                made["checkout"],
                made["analyst"],
                made["feed"],
                made["prometheus"],
            )
        finally:
            stop_server(srv)


@contextlib.contextmanager
def _log_store(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":
        with embedded_redis() as url:
            yield url
        return
    cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
    client = sync_client(cluster.url)
    client.flushall(target_nodes=client.PRIMARIES)
    client.close()
    yield cluster.url


def card_txns(world: World, card: str, amounts: list[float]) -> list[dict[str, Any]]:
    """Transactions of ``card`` (a card of its own, so no other test's session state
    changes) at a real merchant of the held-out day, a minute apart."""
    base = held_out_day(world)[0]
    t0 = datetime.fromisoformat(base["event_time"])
    return [
        {
            **{k: base[k] for k in ("merchant_id", "currency", "country", "channel", "mcc")},
            "transaction_id": f"{card}-t{i}",
            "card_id": card,
            "amount": amount,
            "event_time": (t0 + timedelta(minutes=i)).isoformat(),
        }
        for i, amount in enumerate(amounts)
    ]


def score(r: Reviewing, txns: list[dict[str, Any]]) -> list[str]:
    with r.client(r.scorer) as c:
        out = []
        for t in txns:
            a = c.post("/v1/score", json=t)
            assert a.status_code == 200, a.text
            out.append(a.json()["decision"])
    return out


def queued_ids(r: Reviewing) -> list[str]:
    with r.client(r.analyst) as c:
        a = c.get("/v1/review/items", params={"limit": 500})
        assert a.status_code == 200, a.text
        return [i["transaction_id"] for i in a.json()["items"]]


def labels(r: Reviewing, transaction_id: str) -> list[dict[str, Any]]:
    """What the feedback log holds for ``transaction_id``."""
    client: Any = sync_client(r.log_url)
    try:
        found = [json.loads(f[b"d"]) for _, f in client.xrange("feedback")]
    finally:
        client.close()
    return [e for e in found if e["transaction_id"] == transaction_id]


def test_review_decisions_are_queued_once_and_leave_on_a_label(
    reviewing: Reviewing, world: World
) -> None:
    r = reviewing
    txns = card_txns(world, "rv-api", [LIMIT + 500, 20.0, LIMIT + 1500])
    assert score(r, [*txns, txns[0]]) == ["review", "approve", "review", "review"]  # a retry
    ids = [txns[0]["transaction_id"], txns[2]["transaction_id"]]
    wait_until(lambda: set(ids) <= set(queued_ids(r)), what="both review decisions queued")
    assert sorted(i for i in queued_ids(r) if i.startswith("rv-api")) == ids  # once each

    with r.client(r.analyst) as c:
        spec = c.get("/openapi.json").json()
        page = c.get("/v1/review/items").json()
        item = next(i for i in page["items"] if i["transaction_id"] == ids[0])
        assert (item["amount"], item["card_id"]) == (LIMIT + 500, "rv-api")
        assert item["merchant_id"] == txns[0]["merchant_id"]
        assert "RULE_AMOUNT_OVER_LIMIT" in [x["code"] for x in item["reasons"]]
        assert item["key_features"][0] == {"name": "amount", "value": LIMIT + 500, "flag": None}
        assert 0 <= item["score"] <= 1 and item["model_version"] == "1"

        detail = c.get("/v1/review/item", params={"transaction_id": ids[0]})
        check_against_openapi(spec, "GET", "/v1/review/item", detail)
        d = detail.json()
        assert d["queued"] is True and d["label"] is None
        assert d["features"]["amount"] == LIMIT + 500 and len(d["features"]) > 10
        # A new card: its 30-day features are defaults, and the key features say so.
        assert "card_txn_count_30d" in d["missing"]
        for f in d["key_features"]:
            assert (f["flag"] == "missing") == (f["name"] in d["missing"]), f
        # The card's history: its session state holds all three (scoring records them).
        history = [h["transaction_id"] for h in d["card_history"]]
        assert history == [t["transaction_id"] for t in reversed(txns)]

        # A label from any source, through POST /v1/feedback, takes it out of the queue.
        fb = {"transaction_id": ids[0], "label": "legitimate", "source": "chargeback"}
        fb["time"] = txns[0]["event_time"]
        with r.client(r.feed) as s:
            a = s.post("/v1/feedback", json=fb)
            assert a.status_code == 200 and a.json()["matched"] is True, a.text
        assert ids[0] not in queued_ids(r) and ids[1] in queued_ids(r)
        d = c.get("/v1/review/item", params={"transaction_id": ids[0]}).json()
        assert d["queued"] is False
        assert (d["label"]["label"], d["label"]["source"]) == ("legitimate", "chargeback")
        # The close is kept with the key that sent it, in the queue and in the log.
        assert d["label"]["key_id"] == "feed"
        [stored] = labels(r, ids[0])
        assert (stored["key_id"], stored["matched"]) == ("feed", True)

    # Scored again after its label (a late retry): it does not come back.
    score(r, [txns[0]])
    marker = card_txns(world, "rv-api-after", [LIMIT + 1])
    score(r, marker)
    wait_until(lambda: marker[0]["transaction_id"] in queued_ids(r), what="the marker queued")
    assert ids[0] not in queued_ids(r)


def test_review_api_validates_and_needs_the_label_scope(reviewing: Reviewing) -> None:
    r = reviewing
    with r.client() as c:
        spec = c.get("/openapi.json").json()
        assert c.get("/review").status_code == 200  # the page itself is open
        assert c.get("/v1/review/items").status_code == 401
    with r.client(r.scorer) as c:
        a = c.get("/v1/review/items")
        assert a.status_code == 403 and "'label'" in a.json()["detail"][0]["message"]
        a = c.post("/v1/review/label", json={"transaction_id": "x", "label": "fraud"})
        assert a.status_code == 403
    with r.client(r.feed) as c:  # the label scope alone reads the queue
        assert c.get("/v1/review/items").status_code == 200
    with r.client(r.analyst) as c:  # admin implies label
        for params, field in [
            ({"limit": 0}, "query.limit"),
            ({"offset": -1}, "query.offset"),
        ]:
            a = c.get("/v1/review/items", params=params)
            assert a.status_code == 422 and a.json()["detail"][0]["field"] == field
        a = c.get("/v1/review/item")
        assert a.status_code == 422
        assert a.json()["detail"][0]["field"] == "query.transaction_id"
        a = c.get("/v1/review/item", params={"transaction_id": "no-such-id"})
        assert a.status_code == 404
        assert a.json()["detail"] == [
            {
                "field": "transaction_id",
                "code": "not_found",
                "message": "no review item for 'no-such-id' (never decided 'review', or expired)",
            }
        ]
        check_against_openapi(spec, "GET", "/v1/review/item", a)
        mark = {"transaction_id": "no-such-id", "label": "fraud"}
        assert c.post("/v1/review/label", json=mark).status_code == 404
        for body, field in [
            ({**mark, "label": "maybe"}, "label"),
            ({**mark, "x": 1}, "x"),
            ({"label": "fraud"}, "transaction_id"),
        ]:
            a = c.post("/v1/review/label", json=body)
            assert a.status_code == 422 and a.json()["detail"][0]["field"] == field


def label_body(transaction_id: str, when: str | datetime, **patch: str) -> dict[str, Any]:
    at = when.isoformat() if isinstance(when, datetime) else when
    body = {"transaction_id": transaction_id, "label": "fraud", "source": "chargeback"}
    return {**body, "time": at, **patch}


def test_feedback_needs_the_label_scope(reviewing: Reviewing) -> None:
    r = reviewing
    fb = label_body("rv-scope-1", datetime.now(UTC))
    with r.client(r.scorer) as c:
        a = c.post("/v1/feedback", json=fb)
    assert a.status_code == 403
    assert a.json()["detail"] == [
        {
            "code": "forbidden",
            "message": "key 'checkout' lacks scope 'label' needed for POST /v1/feedback",
        }
    ]
    assert labels(r, "rv-scope-1") == []
    for key in (r.feed, r.analyst):  # label, and admin (which implies it)
        with r.client(key) as c:
            assert c.post("/v1/feedback", json=fb).status_code == 200


def test_only_the_review_page_or_an_admin_key_labels_as_analyst(
    reviewing: Reviewing, world: World
) -> None:
    """A label key (a chargeback feed) cannot send ``source: analyst``: 403 naming the
    field, nothing stored, the item still queued; an admin key can."""
    r = reviewing
    txns = card_txns(world, "rv-src", [LIMIT + 300])
    tid = txns[0]["transaction_id"]
    assert score(r, txns) == ["review"]
    wait_until(lambda: tid in queued_ids(r), what="the review decision queued")
    pre = label_body(tid, txns[0]["event_time"], label="legitimate", source="analyst")
    with r.client(r.feed) as c:
        spec = c.get("/openapi.json").json()
        a = c.post("/v1/feedback", json=pre)
    assert a.status_code == 403, a.text
    check_against_openapi(spec, "POST", "/v1/feedback", a)
    [problem] = a.json()["detail"]
    assert (problem["field"], problem["code"]) == ("source", "forbidden"), problem
    assert "'feed'" in problem["message"] and "'admin'" in problem["message"]
    assert labels(r, tid) == [] and tid in queued_ids(r)
    with r.client(r.analyst) as c:  # admin: an analyst's tool may send it
        a = c.post("/v1/feedback", json={**pre, "label": "fraud"})
    assert a.status_code == 200 and a.json()["duplicate"] is False, a.text
    assert [(e["source"], e["key_id"]) for e in labels(r, tid)] == [("analyst", "analyst")]


def feedback_payloads(r: Reviewing, ids: set[str]) -> list[bytes]:
    """The feedback log's entries of ``ids``, as the compaction reads them."""
    client: Any = sync_client(r.log_url)
    try:
        found = [f[b"d"] for _, f in client.xrange("feedback")]
    finally:
        client.close()
    return [d for d in found if json.loads(d)["transaction_id"] in ids]


def test_a_pre_label_never_makes_the_analysts_mark_a_duplicate_and_training_takes_it(
    reviewing: Reviewing, world: World, tmp_path: Path
) -> None:
    """Issue 38 item 5: a label key pre-labels an item, then the analyst marks it on the
    page: the mark is a new label, and the training label is the analyst's, whatever the
    pre-label said and whenever the chargeback came."""
    from batch_jobs.decisions import compact_day
    from batch_jobs.labels import known_frauds, known_labels

    r = reviewing
    txns = card_txns(world, "rv-prec", [LIMIT + 100, LIMIT + 200, LIMIT + 300])
    ids = [t["transaction_id"] for t in txns]
    assert score(r, txns) == ["review"] * 3
    wait_until(lambda: set(ids) <= set(queued_ids(r)), what="the review decisions queued")
    pre = [("legitimate", "customer"), ("fraud", "chargeback")]
    with r.client(r.feed) as c:
        for (label, source), t in zip(pre, txns, strict=False):
            body = label_body(t["transaction_id"], t["event_time"], label=label, source=source)
            a = c.post("/v1/feedback", json=body)
            assert a.status_code == 200 and a.json()["matched"] is True, a.text
        # The feed's key marks the third through the page itself (source analyst).
        a = c.post("/v1/review/label", json={"transaction_id": ids[2], "label": "legitimate"})
        assert a.status_code == 200 and a.json()["duplicate"] is False, a.text
    assert not set(ids) & set(queued_ids(r))  # each closed by the pre-label
    marks = ["fraud", "legitimate", "fraud"]
    with r.client(r.analyst) as c:
        for tid, mark in zip(ids, marks, strict=True):
            a = c.post("/v1/review/label", json={"transaction_id": tid, "label": mark})
            assert a.status_code == 200, a.text
            out = a.json()
            assert (out["source"], out["duplicate"], out["matched"]) == ("analyst", False, True)
            # A retry of the same key's mark is the duplicate.
            again = c.post("/v1/review/label", json={"transaction_id": tid, "label": mark})
            assert again.json()["duplicate"] is True, again.text
    for tid, mark in zip(ids, marks, strict=True):
        stored = [(e["source"], e["is_fraud"], e["key_id"]) for e in labels(r, tid)]
        assert stored[-1] == ("analyst", mark == "fraud", "analyst"), stored
        assert len(stored) == 2, stored

    # The labels into the offline store as the daily compaction writes them, then
    # training's label of each transaction: the analyst's.
    raw = tmp_path / "raw"
    today = datetime.now(UTC).date()
    compact_day(raw, today, [], feedback_payloads(r, set(ids)))
    as_of = datetime.now(UTC) + timedelta(seconds=1)
    standing = {
        row["transaction_id"]: (row["is_fraud"], row["source"])
        for row in known_labels(raw, as_of).to_pylist()
    }
    assert standing == {tid: (m == "fraud", "analyst") for tid, m in zip(ids, marks, strict=True)}
    assert known_frauds(raw, as_of) == {ids[0], ids[2]}


def test_a_label_for_an_unscored_id_is_unmatched_and_hides_nothing(
    reviewing: Reviewing, world: World
) -> None:
    r = reviewing
    txns = card_txns(world, "rv-early", [LIMIT + 700])
    tid = txns[0]["transaction_id"]
    early = label_body(tid, txns[0]["event_time"], label="legitimate", source="customer")
    with r.client(r.feed) as c:
        a = c.post("/v1/feedback", json=early)
    assert a.status_code == 200, a.text
    # Scored after the label: its review decision still reaches the queue.
    assert score(r, txns) == ["review"]
    wait_until(lambda: tid in queued_ids(r), what="the review decision queued")
    assert a.json()["matched"] is False
    [stored] = labels(r, tid)  # kept, marked
    assert (stored["matched"], stored["key_id"]) == (False, "feed")
    with r.client(r.scraper) as c:
        metrics = c.get("/metrics").text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("fraud_feedback_labels_total{")
        and 'matched="false"' in line
        and 'source="customer"' in line
    ]
    assert counted and float(counted[0].split()[-1]) >= 1, counted


def test_a_label_for_an_approved_decision_is_matched_by_its_claim(
    reviewing: Reviewing, world: World
) -> None:
    r = reviewing
    txns = card_txns(world, "rv-approved", [25.0])
    assert score(r, txns) == ["approve"]
    tid = txns[0]["transaction_id"]
    # The claim keeps the answer just after answering (off the answer's path).
    store: Any = sync_client(r.store_url)
    try:
        wait_until(
            lambda: idempotency.SEP.encode() in (store.get(idempotency.key(tid)) or b""),
            what="the answer kept in the claim",
        )
    finally:
        store.close()
    with r.client(r.feed) as c:
        a = c.post("/v1/feedback", json=label_body(tid, txns[0]["event_time"]))
    assert a.status_code == 200 and a.json()["matched"] is True, a.text
    assert labels(r, tid)[0]["matched"] is True


def test_label_times_outside_event_time_and_now_are_422(reviewing: Reviewing, world: World) -> None:
    r = reviewing
    txns = card_txns(world, "rv-time", [LIMIT + 900])
    tid = txns[0]["transaction_id"]
    assert score(r, txns) == ["review"]
    wait_until(lambda: tid in queued_ids(r), what="the review decision queued")
    event = datetime.fromisoformat(txns[0]["event_time"])
    now = datetime.now(UTC)
    with r.client(r.feed) as c:
        for transaction_id, when, why in [
            (tid, event - timedelta(seconds=1), "is before the transaction's event_time"),
            (tid, datetime(1, 1, 1, tzinfo=UTC), "is before the transaction's event_time"),
            (tid, now + timedelta(hours=1), "is after the server clock"),
            (tid, datetime(9999, 12, 31, tzinfo=UTC), "is after the server clock"),
            ("rv-time-never-scored", datetime(1, 1, 1, tzinfo=UTC), "days ago"),
        ]:
            a = c.post("/v1/feedback", json=label_body(transaction_id, when))
            assert a.status_code == 422, (when, a.text)
            [problem] = a.json()["detail"]
            assert (problem["field"], problem["code"]) == ("time", "invalid")
            assert why in problem["message"], problem
        assert c.post("/v1/feedback", json=label_body(tid, event)).status_code == 200
    assert len(labels(r, tid)) == 1 and tid not in queued_ids(r)


def test_a_label_at_a_future_event_time_the_service_scored_is_accepted() -> None:
    """The service scores an event_time up to FRAUD_MAX_EVENT_SKEW_S (600 s) ahead and the
    review page labels an item at its event time, beyond now + LABEL_SKEW_S: accepted;
    a second later is not."""
    from service.edge.feedback import LABEL_SKEW_S, FeedbackIn, check_time
    from service.errors import Invalid

    now = datetime.now(UTC)
    event = now + timedelta(seconds=LABEL_SKEW_S + 150)

    def body(at: datetime) -> FeedbackIn:
        return FeedbackIn(transaction_id="t-ahead", label="fraud", source="analyst", time=at)

    check_time(body(event), event.timestamp(), now.timestamp())
    with pytest.raises(Invalid, match="after the server clock"):
        check_time(body(event + timedelta(seconds=1)), event.timestamp(), now.timestamp())


def test_ids_with_slashes_and_dots_are_listed_opened_and_marked(
    reviewing: Reviewing, world: World
) -> None:
    r = reviewing
    odd = ["rv/odd/1", "..", "rv odd?x=1&y=%2F#z"]
    txns = [
        {**t, "transaction_id": tid}
        for t, tid in zip(card_txns(world, "rv-odd", [LIMIT + 10] * 3), odd, strict=True)
    ]
    assert score(r, txns) == ["review"] * 3
    wait_until(lambda: set(odd) <= set(queued_ids(r)), what="the odd ids queued")
    with r.client(r.analyst) as c:
        for tid in odd:
            d = c.get("/v1/review/item", params={"transaction_id": tid})
            assert d.status_code == 200, (tid, d.text)
            assert (d.json()["transaction_id"], d.json()["queued"]) == (tid, True)
            a = c.post("/v1/review/label", json={"transaction_id": tid, "label": "legitimate"})
            assert a.status_code == 200 and a.json()["matched"] is True, (tid, a.text)
            d = c.get("/v1/review/item", params={"transaction_id": tid}).json()
            assert d["queued"] is False and d["label"]["key_id"] == "analyst"
    assert not set(odd) & set(queued_ids(r))


def test_label_bodies_must_be_utf8_json(reviewing: Reviewing) -> None:
    r = reviewing
    bad = b'{"transaction_id": "rv-bytes-\xff", "label": "fraud"}'
    json_type = {"content-type": "application/json"}
    with r.client(r.analyst) as c:
        spec = c.get("/openapi.json").json()
        for path in ("/v1/feedback", "/v1/review/label"):
            a = c.post(path, content=bad, headers=json_type)
            assert a.status_code == 422, (path, a.text)
            [problem] = a.json()["detail"]
            assert (problem["field"], problem["code"]) == ("body", "invalid_json"), problem
            check_against_openapi(spec, "POST", path, a)
            # A form (what a cross-site page can post) is not JSON: 415.
            form = {"transaction_id": "rv-form", "label": "fraud"}
            a = c.post(path, data=form)
            assert a.status_code == 415, (path, a.text)
            assert a.json()["detail"][0]["field"] == "header.Content-Type"
            check_against_openapi(spec, "POST", path, a)


def test_the_page_lists_opens_and_marks_in_a_browser(reviewing: Reviewing, world: World) -> None:
    browser_path = chromium()
    from playwright import sync_api

    r = reviewing
    txns = card_txns(world, "rv-page", [LIMIT + 250, 35.0, LIMIT + 4000])
    txns[2]["transaction_id"] = "rv-page/../t2"  # the page keeps any id whole
    assert score(r, txns) == ["review", "approve", "review"]
    target = txns[2]["transaction_id"]
    wait_until(lambda: target in queued_ids(r), what="the item queued")

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            asked: list[str] = []
            page.on("request", lambda req: asked.append(req.url))
            page.goto(f"{r.srv.url}/review")
            # Auth is on: the page asks for a key once, then keeps it for the tab.
            page.locator("#key").fill(r.analyst)
            page.locator("#key-form button[type=submit]").click()
            row = page.locator(f'#items tr[data-id="{target}"]')
            sync_api.expect(row).to_contain_text("5000.00")
            sync_api.expect(row).to_contain_text("RULE_AMOUNT_OVER_LIMIT")
            sync_api.expect(row.locator(".kf").first).to_have_text("amount 5000")
            row.click()
            sync_api.expect(page.locator("#d-title")).to_contain_text("card rv-page")
            sync_api.expect(page.locator("#d-history tbody tr")).to_have_count(3)
            sync_api.expect(page.locator("#d-reasons")).to_contain_text("over the review limit")
            if shot := os.environ.get("REVIEW_SCREENSHOT"):
                page.screenshot(path=shot)
            page.reload()  # the key is kept in sessionStorage: no second prompt
            sync_api.expect(row).to_be_visible()
            assert page.locator("#key-form").is_hidden()
            row.click()
            page.locator("#mark-fraud").click()
            sync_api.expect(page.locator("#status")).to_contain_text(f"{target} marked fraud")
            sync_api.expect(page.locator("#d-state")).to_contain_text("Labelled fraud (analyst")
            sync_api.expect(row).to_have_count(0)  # the list was reloaded without it
            # Works offline: every request went to the service itself.
            assert asked and all(u.startswith(f"{r.srv.url}/") for u in asked), asked
        finally:
            browser.close()

    # Stored as POST /v1/feedback stores a label, and out of the queue.
    [stored] = labels(r, target)
    assert (stored["is_fraud"], stored["source"]) == (True, "analyst")
    assert stored["label_time"] >= stored["reported_time"] - 1_000_000
    assert target not in queued_ids(r)
    assert txns[0]["transaction_id"] in queued_ids(r)  # the other one waits


def test_the_detail_shows_declared_fields_and_a_pii_hash_by_its_prefix_only() -> None:
    """The review page's item lists the team's declared fields as logged; a PII field,
    hashed at the door, only by its hash's first characters."""
    from types import SimpleNamespace

    from fraud_scoring.fields import FieldDecl, door
    from service.edge.review import PII_SHOWN, shown_fields

    d = door(
        [
            FieldDecl(name="email", type="string", pii=True),
            FieldDecl(name="three_ds", type="category", values=("ok", "failed")),
            FieldDecl(name="account_age_days", type="number"),
        ],
        b"k" * 32,
    )
    hashed = d.pii("ana@example.com")
    logged = {"email": hashed, "three_ds": "failed", "card_id": "c1"}
    shown = shown_fields(SimpleNamespace(door=d), logged)  # type: ignore[arg-type]
    assert list(shown) == ["email", "three_ds", "account_age_days"]
    assert shown["email"] == hashed[:PII_SHOWN] + "…" and hashed.startswith("pii:")
    assert "ana" not in str(shown) and hashed not in str(shown)
    assert shown["three_ds"] == "failed" and shown["account_age_days"] is None
