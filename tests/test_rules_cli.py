"""``fraud-scoring rules test`` (cli/rules.py, service/core/rule_impact.py) on a decision
log written by the project's own compaction (``compact_day``) in a temp folder, labels
fed back through it, a model version's thresholds in a model repository, and a list's
items in a real Redis-protocol server (added by ``fraud-scoring lists add``). Every figure
is checked against a count computed here, row by row, from the log entries."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_jobs.decisions import compact_day
from fraud_scoring.model_repo import (
    FeatureSpec,
    LabelCoverage,
    ModelMetadata,
    Thresholds,
    publish,
)
from fraud_scoring.redis_server import embedded_redis
from tests.conftest import Server, World, start_server, stop_server
from tests.test_auth import bearer, create_key

ROOT = Path(__file__).resolve().parent.parent
DAYS = [date(2026, 3, 1), date(2026, 3, 2), date(2026, 3, 3)]
AS_OF = datetime(2026, 3, 10, tzinfo=UTC)
# Model version 1's label delay (its metadata's): 2026-03-01's unlabelled decisions are
# past it at AS_OF (false positives), the later days' within it (not known yet).
LABEL_DELAY = 8
REVIEW, DECLINE = 0.3, 0.8
BLOCKED = {"c03", "c07"}
RULES = """
lists:
  blocked_cards: {key: card_id}
rules:
  - code: TRUSTED_GB
    action: allow
    when: "country == 'GB' and amount < 50"
    message: "Trusted."
  - code: BURST
    action: decline
    when: card_txn_count_10m >= 5
    message: "Burst."
  - code: BLOCKED_CARD
    action: decline
    when: card_id in blocked_cards
    message: "Blocked."
  - code: BIG_ABROAD
    action: review
    when: "amount > 1000 and is_foreign_country >= 1"
    message: "Abroad."
    mode: shadow
"""


def _entries(rng: random.Random, day: date, n: int) -> tuple[list[dict], list[dict]]:
    """``n`` decision log entries of ``day`` (5 % rules-only: no score, no vector but the
    velocity count) and the labels fed back for them (some arriving after AS_OF)."""
    out: list[dict] = []
    labels: list[dict] = []
    for i in range(n):
        at = datetime(day.year, day.month, day.day, 8, tzinfo=UTC) + timedelta(seconds=97 * i)
        amount = round(rng.choice([rng.uniform(5, 120), rng.uniform(200, 3000)]), 2)
        count = rng.randrange(0, 9)
        degraded = rng.random() < 0.05
        score = None if degraded else round(rng.random() ** 3, 6)
        features = (
            {"card_txn_count_10m": float(count)}
            if degraded
            else {
                "amount": amount,
                "card_txn_count_10m": float(count),
                "is_foreign_country": float(rng.random() < 0.3),
            }
        )
        decision = (
            "approve"
            if score is None or score < REVIEW
            else "review"
            if score < DECLINE
            else "decline"
        )
        tid = f"t-{day.isoformat()}-{i}"
        txn = {
            "event_time": at.isoformat(),
            "card_id": f"c{rng.randrange(12):02d}",
            "merchant_id": "m1",
            "amount": amount,
            "currency": "USD",
            "country": rng.choice(["US", "GB", "FR"]),
            "channel": "ecom",
            "mcc": "5411",
        }
        out.append(
            {
                "transaction_id": tid,
                "decided_at": int(at.timestamp() * 1e6),
                "transaction": txn,
                "features": features,
                **{k: [] for k in ("missing", "stale", "reasons")},
                "score": score,
                "model_version": "rules-only" if degraded else "1",
                "decision": decision,
                "timing_ms": {"total": 1.0},
            }
        )
        if rng.random() < 0.7:
            fraud = rng.random() < (0.8 if (score or 0) > 0.3 or count >= 5 else 0.1)
            late = rng.random() < 0.1  # arrives after AS_OF: unlabelled in the report
            when = AS_OF + timedelta(hours=1) if late else at + timedelta(hours=2)
            labels.append(
                {
                    "transaction_id": tid,
                    "label_time": when.isoformat(),
                    "is_fraud": fraud,
                    "source": "chargeback",
                    "key_id": None,
                }
            )
    return out, labels


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with embedded_redis() as u:
        yield u


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict[str, bool]]:
    """A data dir with three days of compacted decisions and labels, a model repository
    holding version 1's thresholds and the rules file; the entries and the labels known
    at AS_OF."""
    root = tmp_path_factory.mktemp("rules-test")
    rng = random.Random(40)
    every: list[dict] = []
    known: dict[str, bool] = {}
    for day in DAYS:
        entries, labels = _entries(rng, day, 150)
        enc = [json.dumps(e).encode() for e in entries]
        compact_day(root / "raw", day, enc, [json.dumps(x).encode() for x in labels])
        every += entries
        known |= {
            x["transaction_id"]: x["is_fraud"]
            for x in labels
            if datetime.fromisoformat(x["label_time"]) < AS_OF
        }
    window = (datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 2, 1, tzinfo=UTC))
    meta = ModelMetadata(
        name="fraud",
        version="1",
        created_at=window[1],
        framework="onnx",
        features=[FeatureSpec(name=n) for n in ("amount", "card_txn_count_10m")],
        training_window=window,
        holdout_window=window,
        thresholds=Thresholds(review=REVIEW, decline=DECLINE),
        metrics={},
        label_coverage=LabelCoverage(
            expected_rate=0.1, min_fraction=0.5, label_delay_days=LABEL_DELAY
        ),
    )
    publish(root / "models", "fraud", {"model.onnx": b"only the metadata is read"}, meta)
    (root / "rules.yaml").write_text(RULES)
    return root, every, known


def cli(root: Path, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("FRAUD_")}
    env |= {
        "PYTHONPATH": str(ROOT),
        "FRAUD_DATA_DIR": str(root),
        "FRAUD_MODEL_REPO": str(root / "models"),
        "FRAUD_RULES_FILE": str(root / "rules.yaml"),
    }
    if url is not None:
        env["REDIS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _reference(entries: list[dict], known: dict[str, bool], blocked: set[str]) -> dict[str, Any]:
    """The report, row by row from the log entries (the documented order by hand)."""

    cutoff = AS_OF - timedelta(days=LABEL_DELAY)

    def counts(rows: list[dict]) -> dict[str, Any]:
        label = [known.get(e["transaction_id"]) for e in rows]
        old = [datetime.fromisoformat(e["transaction"]["event_time"]) < cutoff for e in rows]
        past = sum(x is None and o for x, o in zip(label, old, strict=True))
        return {
            "transactions": len(rows),
            "fraud": sum(x is True for x in label),
            "false_positives": sum(x is False for x in label) + past,
            "legitimate": sum(x is False for x in label),
            "unlabelled_past_delay": past,
            "unlabelled_within_delay": sum(x is None for x in label) - past,
            "volume": round(sum(e["transaction"]["amount"] for e in rows), 2),
        }

    def holds(e: dict, code: str) -> bool | None:
        f, t = e["features"], e["transaction"]
        amount = f.get("amount", t["amount"])
        if code == "TRUSTED_GB":
            return t["country"] == "GB" and amount < 50
        if code == "BURST":
            return f["card_txn_count_10m"] >= 5
        if code == "BLOCKED_CARD":
            return t["card_id"] in blocked
        if "is_foreign_country" not in f:
            return None  # not evaluated
        return amount > 1000 and f["is_foreign_country"] >= 1

    def decide(e: dict, shadow_active: bool) -> tuple[str, str | None]:
        s = e["score"]
        if holds(e, "TRUSTED_GB"):
            return "approve", "TRUSTED_GB"
        for code in ("BURST", "BLOCKED_CARD"):
            if holds(e, code):
                return "decline", code
        if s is not None and s >= DECLINE:
            return "decline", None
        if shadow_active and holds(e, "BIG_ABROAD"):
            return "review", "BIG_ABROAD"
        if s is not None and s >= REVIEW:
            return "review", None
        return "approve", None

    rules = {}
    for code in ("TRUSTED_GB", "BURST", "BLOCKED_CARD", "BIG_ABROAD"):
        shadow = code == "BIG_ABROAD"
        decided = [e for e in entries if decide(e, shadow)[1] == code]
        moved = Counter(
            f"{e['decision']} -> {decide(e, shadow)[0]}"
            for e in decided
            if e["decision"] != decide(e, shadow)[0]
        )
        rules[code] = {
            "matched": counts([e for e in entries if holds(e, code)]),
            "decides": len(decided),
            "changes": dict(moved),
            "lacking": sum(holds(e, code) is None for e in entries),
        }
    allowed = [e for e in entries if decide(e, False)[1] == "TRUSTED_GB"]
    overrides = []
    for e in allowed:  # without the allow rule: the next stages
        rest = (
            "decline"
            if holds(e, "BURST") or holds(e, "BLOCKED_CARD") or (e["score"] or 0) >= DECLINE
            else "review"
            if e["score"] is not None and e["score"] >= REVIEW
            else "approve"
        )
        if rest != "approve":
            overrides.append(e)
    after = [decide(e, False)[0] for e in entries]
    return {
        "rules": rules,
        "overrides": counts(overrides),
        "after": dict(Counter(after)),
        "before": dict(Counter(e["decision"] for e in entries)),
        "changes": dict(
            Counter(
                f"{e['decision']} -> {a}"
                for e, a in zip(entries, after, strict=True)
                if e["decision"] != a
            )
        ),
        "labels": counts(entries),
    }


def _sub(d: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in keys}


def test_rules_test_reports_each_rule_and_the_file_as_counted_from_the_log(
    world: tuple[Path, list[dict], dict[str, bool]], url: str
) -> None:
    root, entries, known = world
    added = cli(root, "lists", "add", "blocked_cards", *sorted(BLOCKED), "--reason", "t", url=url)
    assert added.returncode == 0, added.stderr
    run = cli(
        root,
        "rules",
        "test",
        "--since",
        "2026-03-01",
        "--until",
        "2026-03-02",
        "--as-of",
        AS_OF.isoformat(),
        "--json",
        url=url,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    in_range = [e for e in entries if e["transaction"]["event_time"][:10] != "2026-03-03"]
    ref = _reference(in_range, known, BLOCKED)
    assert got["decisions"] == len(in_range) == 300
    assert got["days"] == ["2026-03-01", "2026-03-02"]
    assert got["label_delay_days"] == LABEL_DELAY
    assert _sub(got["labels"], ref["labels"]) == ref["labels"]
    # Both sides of the delay are in the range: 2026-03-01 past it, 2026-03-02 within.
    assert got["labels"]["unlabelled_past_delay"] > 0 < got["labels"]["unlabelled_within_delay"]
    assert {k: v for k, v in got["before"].items() if v} == ref["before"]
    assert {k: v for k, v in got["after"].items() if v} == ref["after"]
    changes = {k: v["transactions"] for k, v in got["changes"].items()}
    assert changes == ref["changes"] and changes  # the file changes decisions
    by = {r["code"]: r for r in got["rules"]}
    for code, want in ref["rules"].items():
        r = by[code]
        assert _sub(r["matched"], want["matched"]) == want["matched"], code
        assert r["matched"]["transactions"] > 0, code
        assert r["decides"] == want["decides"], code
        assert {k: v["transactions"] for k, v in r["changes"].items()} == want["changes"], code
        lacking = {"is_foreign_country": want["lacking"]} if want["lacking"] else {}
        assert r["lacking"] == lacking, code
    assert by["BIG_ABROAD"]["lacking"]["is_foreign_country"] > 0  # the rules-only rows
    assert by["BLOCKED_CARD"]["decides"] > 0  # the list's items were read from the store
    assert _sub(by["TRUSTED_GB"]["overrides"], ref["overrides"]) == ref["overrides"]
    assert by["TRUSTED_GB"]["overrides"]["transactions"] > 0
    assert by["BURST"]["overrides"] is None
    assert got["decided_by"]["list"] == by["BLOCKED_CARD"]["decides"]
    assert got["lists"]["blocked_cards"].startswith("read now")


def test_rules_test_text_and_its_refusals(
    world: tuple[Path, list[dict], dict[str, bool]], tmp_path: Path
) -> None:
    root, _, _ = world
    text = cli(root, "rules", "test", "--days", "2", "--as-of", AS_OF.isoformat())
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "over 300 decisions of 2026-03-02..2026-03-03" in out
    assert f"; label delay {LABEL_DELAY} days: unlabelled before 2026-03-02T00:00:00" in out
    assert "past the label delay" in out and "false positives" in out
    assert "list blocked_cards: not read (REDIS_URL unset)" in out
    assert "BIG_ABROAD  review, shadow" in out and "(were it active)" in out
    assert "overrides (reviewed or declined without it)" in out
    assert "whole file, in order" in out

    empty = cli(root, "rules", "test", "--since", "2026-02-01", "--until", "2026-02-03")
    assert empty.returncode == 2
    assert "no decisions logged 2026-02-01..2026-02-03 (the log holds 2026-03-01..2026-03-03)" in (
        empty.stderr
    )
    nolog = cli(tmp_path, "rules", "test", "--rules", str(root / "rules.yaml"))
    assert nolog.returncode == 2 and "no decision log under" in nolog.stderr

    unlogged = tmp_path / "unlogged.yaml"
    unlogged.write_text(
        "rules:\n  - {code: FAST, action: review, when: card_txn_count_1h > 3, message: x}\n"
    )
    refused = cli(root, "rules", "test", "--rules", str(unlogged))
    assert refused.returncode == 2
    assert "rules.0 (FAST) reads card_txn_count_1h" in refused.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "rules:\n  - {code: X, action: review, when: card_txn_count_1x > 3, message: x}\n"
    )
    assert "rules.0.when: unknown name 'card_txn_count_1x'" in (
        cli(root, "rules", "test", "--rules", str(bad)).stderr
    )


def test_rules_test_out_writes_the_matched_transactions_and_the_per_day_figures(
    world: tuple[Path, list[dict], dict[str, bool]], url: str, tmp_path: Path
) -> None:
    """``--out DIR``: matched.csv has one row per (rule, matched transaction), as many as
    the report's matched counts, each with the log's fields, the file's decision and the
    label known at --as-of; per_day.csv sums to the same counts; per_day.png is a PNG."""
    import csv

    root, entries, known = world
    added = cli(root, "lists", "add", "blocked_cards", *sorted(BLOCKED), "--reason", "t", url=url)
    assert added.returncode == 0, added.stderr
    out = tmp_path / "out"
    run = cli(
        root, "rules", "test", "--days", "3", "--as-of", AS_OF.isoformat(), "--json",
        "--out", str(out), url=url,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    matched = {r["code"]: r["matched"] for r in got["rules"]}
    with open(out / "matched.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert (
        got["files"]["matched_rows"]
        == len(rows)
        == sum(m["transactions"] for m in matched.values())
    )
    assert Counter(r["rule"] for r in rows) == {c: m["transactions"] for c, m in matched.items()}
    by_id = {e["transaction_id"]: e for e in entries}
    for r in rows:
        e = by_id[r["transaction_id"]]
        assert r["card_id"] == e["transaction"]["card_id"]
        assert float(r["amount"]) == e["transaction"]["amount"]
        assert r["logged_decision"] == e["decision"]
        assert r["event_time"][:19] == e["transaction"]["event_time"][:19]
        want = {True: "fraud", False: "legitimate", None: ""}[known.get(r["transaction_id"])]
        assert r["label"] == want
        past = datetime.fromisoformat(e["transaction"]["event_time"]) < AS_OF - timedelta(
            days=LABEL_DELAY
        )
        assert r["past_label_delay"] == str(past).lower()
    for code, m in matched.items():
        mine = [r for r in rows if r["rule"] == code]
        assert sum(r["label"] == "fraud" for r in mine) == m["fraud"], code
        assert sum(r["label"] == "legitimate" for r in mine) == m["legitimate"], code
        unl = [r["past_label_delay"] for r in mine if r["label"] == ""]
        assert unl.count("true") == m["unlabelled_past_delay"], code
        assert unl.count("false") == m["unlabelled_within_delay"], code
    blocked = [r for r in rows if r["rule"] == "BLOCKED_CARD"]
    assert blocked and {r["card_id"] for r in blocked} <= BLOCKED
    decides = {r["code"]: r["decides"] for r in got["rules"]}
    assert Counter(r["rule"] for r in rows if r["rule_decides"] == "true") == {
        c: n for c, n in decides.items() if n
    }
    assert {
        r["file_decision"] for r in rows if r["rule"] == "BURST" and r["rule_decides"] == "true"
    } == {"decline"}

    with open(out / "per_day.csv", newline="") as f:
        days = list(csv.DictReader(f))
    for code, m in matched.items():
        mine = [d for d in days if d["rule"] == code]
        assert [d["day"] for d in mine] == [d.isoformat() for d in DAYS]
        figures = ("fraud", "false_positives", "legitimate", "unlabelled_past_delay")
        for k in (*figures, "unlabelled_within_delay"):
            assert sum(int(d[k]) for d in mine) == m[k], (code, k)
        assert sum(int(d["matched"]) for d in mine) == m["transactions"]
        assert sum(int(d["decides"]) for d in mine) == decides[code]
    assert (out / "per_day.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert got["files"]["chart"] == str(out / "per_day.png")

    text = cli(
        root, "rules", "test", "--days", "3", "--as-of", AS_OF.isoformat(), "--out", str(out)
    )
    assert text.returncode == 0, text.stderr
    assert (
        f"wrote {len(rows) - len(blocked):,} matched rows to {out / 'matched.csv'}" in text.stdout
    )


# --- POST /v1/rules/test: the same figures over HTTP -------------------------------------

RULES_BODY = yaml.safe_load(RULES)


@pytest.fixture(scope="module")
def served(
    world: tuple[Path, list[dict], dict[str, bool]],
    url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, str, str]]:
    """The service over the same data dir, model repository, rules file and store, auth
    on, with an admin key and a score key. The model is metadata only (it never loads:
    the route needs none), so the server is waited for on /healthz."""
    root = world[0]
    tmp = tmp_path_factory.mktemp("rules-api")
    keys = tmp / "keys.jsonl"
    admin, scorer = create_key(keys, "ops", "admin"), create_key(keys, "checkout", "score")
    place = World(root, root / "models", url, DAYS[0], len(DAYS))
    srv = start_server(
        place,
        tmp,
        wait_for="/healthz",
        FRAUD_AUTH="required",
        FRAUD_API_KEYS_FILE=str(keys),
        FRAUD_RULES_FILE=str(root / "rules.yaml"),
    )
    yield srv, admin, scorer
    stop_server(srv)


def test_post_rules_test_answers_the_clis_figures_for_admin_only(
    world: tuple[Path, list[dict], dict[str, bool]], url: str, served: tuple[Server, str, str]
) -> None:
    root = world[0]
    srv, admin, scorer = served
    added = cli(root, "lists", "add", "blocked_cards", *sorted(BLOCKED), "--reason", "t", url=url)
    assert added.returncode == 0, added.stderr
    days = {"since": "2026-03-01", "until": "2026-03-02", "as_of": AS_OF.isoformat()}
    run = cli(
        root, "rules", "test", "--since", days["since"], "--until", days["until"],
        "--as-of", days["as_of"], "--json", url=url,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    want = json.loads(run.stdout)
    with srv.client() as c:
        got = c.post("/v1/rules/test", json=RULES_BODY | days, headers=bearer(admin))
        assert got.status_code == 200, got.text
        answer = got.json()
        assert len(answer["rules_version"]) == 12  # of the body, not of the file
        same = {k: v for k, v in want.items() if k != "rules_version"}
        assert answer.keys() == want.keys() and {k: answer[k] for k in same} == same
        assert answer["decided_by"]["list"] > 0  # the list was read from the store

        # Without `lists`: the serving rules file's lists (the same declaration here).
        bare = {"rules": RULES_BODY["rules"], **days}
        again = c.post("/v1/rules/test", json=bare, headers=bearer(admin))
        assert again.status_code == 200, again.text
        assert {k: again.json()[k] for k in same} == same

        refused = c.post("/v1/rules/test", json=RULES_BODY | days, headers=bearer(scorer))
        assert refused.status_code == 403 and "admin" in refused.text

        bad = {"rules": [{"code": "X", "action": "review", "when": "card_txn_count_1x > 3",
                          "message": "x"}]}  # fmt: skip
        wrong = c.post("/v1/rules/test", json=bad, headers=bearer(admin))
        assert wrong.status_code == 422, wrong.text
        problem = wrong.json()["detail"][0]
        assert problem["field"] == "rules.0.when"
        assert "unknown name 'card_txn_count_1x'" in problem["message"]

        badaction = {"rules": [bad["rules"][0] | {"when": "amount > 1", "action": "block"}]}
        wrong = c.post("/v1/rules/test", json=badaction, headers=bearer(admin))
        assert wrong.status_code == 422 and wrong.json()["detail"][0]["field"] == "rules.0.action"

        empty = c.post(
            "/v1/rules/test",
            json=RULES_BODY | {"since": "2026-02-01", "until": "2026-02-03"},
            headers=bearer(admin),
        )
        assert empty.status_code == 422
        assert "no decisions logged 2026-02-01..2026-02-03" in empty.json()["detail"][0]["message"]

        doc = c.get("/openapi.json").json()
        op = doc["paths"]["/v1/rules/test"]["post"]
        assert {"200", "403", "422", "501"} <= set(op["responses"])
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["properties"]["rules"]["items"]["properties"]["action"]["enum"] == [
            "allow", "decline", "review",
        ]  # fmt: skip


def test_the_label_delay_is_the_range_s_models_longest_else_training_s_default() -> None:
    from service.core import rule_log

    def meta(version: str, delay: int | None) -> ModelMetadata:
        window = (datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 2, 1, tzinfo=UTC))
        cover = (
            None
            if delay is None
            else LabelCoverage(expected_rate=0.1, min_fraction=0.5, label_delay_days=delay)
        )
        return ModelMetadata(
            name="fraud", version=version, created_at=window[1], framework="onnx",
            features=[], training_window=window, holdout_window=window,
            thresholds=Thresholds(review=REVIEW, decline=DECLINE), metrics={},
            label_coverage=cover,
        )  # fmt: skip

    assert rule_log.label_delay_days({}) == rule_log.DEFAULT_LABEL_DELAY_DAYS == 20
    assert rule_log.label_delay_days({"1": meta("1", 8), "2": meta("2", 12)}) == 12
    assert rule_log.label_delay_days({"1": meta("1", None)}) == 20


def test_without_duckdb_the_log_reader_is_unavailable_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The serving image has no DuckDB: the reader (``fraud_scoring.labels``) is imported
    only when asked, and DuckDB's absence is ReaderUnavailable (the route's 501), naming
    it."""
    from service.core import rule_log

    monkeypatch.setitem(sys.modules, "duckdb", None)  # `import duckdb` raises ImportError
    monkeypatch.delitem(sys.modules, "fraud_scoring.labels", raising=False)
    with pytest.raises(rule_log.ReaderUnavailable, match="needs duckdb "):
        rule_log.log_reader()
    monkeypatch.undo()
    assert rule_log.log_reader().__name__ == "decisions_with_labels"


def test_the_service_without_duckdb_starts_and_answers_501(
    world: tuple[Path, list[dict], dict[str, bool]], url: str, tmp_path: Path
) -> None:
    """As on the serving image: DuckDB cannot be imported (a sitecustomize hides it); the
    service starts (nothing imports it at start) and the route answers 501 naming it,
    after checking the rules (a bad rule is still a 422)."""
    root = world[0]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['duckdb'] = None\n")
    place = World(root, root / "models", url, DAYS[0], len(DAYS))
    srv = start_server(
        place,
        tmp_path,
        wait_for="/healthz",
        PYTHONPATH=f"{shim}{os.pathsep}{ROOT}",
        FRAUD_RULES_FILE=str(root / "rules.yaml"),
    )
    try:
        with srv.client() as c:
            got = c.post("/v1/rules/test", json=RULES_BODY)
            assert got.status_code == 501, got.text
            problem = got.json()["detail"][0]
            assert problem["code"] == "not_available"
            assert "needs duckdb" in problem["message"]
            bad = {"rules": [RULES_BODY["rules"][0] | {"when": "nope > 1"}]}
            assert c.post("/v1/rules/test", json=bad).status_code == 422
    finally:
        stop_server(srv)
