"""A team's own fields (``fraud_scoring/fields.py``, docs/data-contract.md "Your own
fields"): declared once in the declarations file, checked at every door (API, event log,
ingest, the raw partitions) and refused there naming the field; a PII field hashed at the
door and stored in clear nowhere."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import yaml
from pydantic import ValidationError

from batch_jobs.declared_sql import training_columns
from batch_jobs.ingest import ingest
from cli.main import main
from fraud_scoring import contract as C
from fraud_scoring import declared as D
from fraud_scoring import fields as F
from fraud_scoring.events import Transaction, raw_row_to_event
from fraud_scoring.features import declarations, declarations_path
from fraud_scoring.settings import read_settings
from fraud_scoring.storage import partition_file
from service.core import idempotency
from service.edge.app import create_app
from service.settings import ServiceSettings
from streaming.metrics import UpdaterMetrics
from streaming.sources import Message, RedisStreamSource
from streaming.state import SessionWriter
from streaming.updater import Updater, decode, parse_transaction
from tests.conftest import World, private_db, start_server, stop_server
from tests.conftest_streaming import connect, encode, feed, stream_redis, xadd_all

__all__ = ["stream_redis"]

KEY = b"a test key of 32 bytes, not real"
FIELDS = """\
fields:
  - {name: email, type: string, pii: true, max_length: 200, pattern: '[^@\\s]+@[^@\\s]+'}
  - {name: three_ds, type: category, values: [passed, failed, none], default: none}
  - {name: account_age_days, type: number, min: 0, max: 36500}
  - {name: ip_matches_country, type: bool}
  - {name: signup_time, type: timestamp}
  - {name: bin, type: string, pattern: '[0-9]{6}', description: the card's issuer number}
"""
BODY: dict[str, Any] = {
    "transaction_id": "t-1",
    "card_id": "c-1",
    "merchant_id": "m-1",
    "amount": 12.5,
    "currency": "EUR",
    "event_time": "2026-01-16T10:00:00+01:00",
    "country": "DE",
    "channel": "ecom",
    "mcc": "5411",
}
CLEAR = "alice.clear@example.com"
DAY = date(2025, 3, 24)  # the export's day


def declarations_with_fields(folder: Path, fields: str = FIELDS) -> Path:
    """The shipped declarations file with a ``fields`` section, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "features.yaml"
    path.write_text(declarations_path().read_text() + "\n" + fields)
    return path


@pytest.fixture
def declared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[F.Door]:
    """FRAUD_FEATURES_FILE with :data:`FIELDS`, the PII key set; the door they make."""
    path = declarations_with_fields(tmp_path)
    monkeypatch.setenv("FRAUD_FEATURES_FILE", str(path))
    monkeypatch.setenv("FRAUD_PII_KEY", KEY.decode())
    read_settings.cache_clear()
    yield F.door(F.load(path), KEY, str(path))
    read_settings.cache_clear()
    declarations.cache_clear()  # read from this file by a command the test ran


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            "[{name: ip, type: string}, {name: ip, type: number}]",
            "fields.1 (ip).name: 'ip' is declared twice",
        ),
        ("[{name: amount, type: number}]", "fields.0 (amount).name: 'amount' is a contract field"),
        ("[{name: fraud_pattern, type: string}]", "fraud_pattern' is a contract field or column"),
        ("[{name: ip, type: ipv4}]", "fields.0 (ip).type: Input should be 'string', 'number'"),
        (
            "[{name: age, type: number, default: old}]",
            "fields.0 (age): default: Input should be a valid number",
        ),
        (
            "[{name: age, type: number, min: 0, default: -1}]",
            "fields.0 (age): default: Input should be greater than or equal to 0",
        ),
        (
            "[{name: tds, type: category, values: [a], default: b}]",
            "fields.0 (tds): default: Input should be 'a'",
        ),
        ("[{name: tds, type: category}]", "fields.0 (tds): a category lists its values"),
        ("[{name: ip, type: string, min: 3}]", "fields.0 (ip): min: not for a string field"),
        ("[{name: age, type: number, pii: true}]", "fields.0 (age): pii: only a string field"),
        (
            "[{name: ip, type: string, pattern: '('}]",
            "fields.0 (ip): pattern: not a regular expression",
        ),
        ("[{name: ip, type: string, pattern: '(?=a)b'}]", "look-around"),
        (
            "[{name: ip, type: string, required: true, default: x}]",
            "fields.0 (ip): default: a required field takes none",
        ),
        (
            "[{name: email, type: string, pii: true, default: x}]",
            "fields.0 (email): default: a pii field takes none",
        ),
        ("[{name: IP, type: string}]", "fields.0 (IP).name: String should match pattern"),
        (
            "[{name: ip, type: string, colour: red}]",
            "fields.0 (ip).colour: Extra inputs are not permitted",
        ),
    ],
)
def test_a_declaration_that_breaks_the_language_is_refused_naming_the_field(
    tmp_path: Path, fields: str, said: str
) -> None:
    path = declarations_with_fields(tmp_path, f"fields: {fields}\n")
    with pytest.raises(F.FieldError) as exc:
        F.load(path)
    # file:line: field: what, the line the field's item (or key) is on.
    assert re.match(rf"{re.escape(str(path))}:\d+: fields\.", str(exc.value)), exc.value
    assert said in str(exc.value), exc.value


def test_the_shipped_declarations_declare_no_fields_and_serve_the_contract_model() -> None:
    """Without fields the door is the contract's own model: no extra work per request."""
    assert F.load(declarations_path()) == ()
    door = F.door((), None)
    assert door.model is Transaction and door is F.PLAIN


def test_a_pii_field_without_a_key_is_refused_at_start_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = declarations_with_fields(tmp_path)
    monkeypatch.setenv("FRAUD_FEATURES_FILE", str(path))
    monkeypatch.delenv("FRAUD_PII_KEY", raising=False)
    with pytest.raises(F.FieldError, match=r"email: pii: true needs a hash key"):
        create_app(ServiceSettings(embedded_redis=True))
    read_settings.cache_clear()
    assert main(["ingest", str(tmp_path / "mapping.yaml")]) == 2  # before it reads anything
    too_short = ServiceSettings(embedded_redis=True, pii_key="short")
    with pytest.raises(ValueError, match="FRAUD_PII_KEY: the key is 5 bytes; at least 16"):
        F.door_for(too_short)


@pytest.mark.parametrize(
    ("given", "field", "said"),
    [
        ({"three_ds": "maybe"}, "three_ds", "Input should be 'passed', 'failed' or 'none'"),
        ({"three_ds": 1}, "three_ds", "Input should be 'passed', 'failed' or 'none'"),
        ({"account_age_days": "12"}, "account_age_days", "valid number"),
        ({"account_age_days": True}, "account_age_days", "valid number"),
        ({"account_age_days": -1}, "account_age_days", "greater than or equal to 0"),
        ({"ip_matches_country": "yes"}, "ip_matches_country", "valid boolean"),
        ({"signup_time": "2026-01-01T10:00:00"}, "signup_time", "timezone"),
        ({"bin": "12345"}, "bin", "should match pattern"),
        ({"bin": "1" * (10 << 20)}, "bin", "at most 256 characters"),
        ({"email": "not an address"}, "email", "should match pattern"),
        ({"email": 7}, "email", "valid string"),
    ],
)
def test_a_body_that_breaks_a_declared_field_is_refused_naming_it(
    declared: F.Door, given: dict[str, Any], field: str, said: str
) -> None:
    with pytest.raises(ValidationError) as exc:
        declared.model.model_validate_json(json.dumps(BODY | given))
    (err,) = exc.value.errors()
    assert err["loc"] == (field,) and said in err["msg"], err["msg"]


def test_a_body_carries_declared_fields_pii_hashed_and_undeclared_ones_ignored(
    declared: F.Door,
) -> None:
    body = BODY | {"email": f"  {CLEAR} ", "bin": "412345", "ip_address": "10.0.0.1"}
    txn = declared.model.model_validate_json(json.dumps(body))
    hashed = F.pii_hash(KEY)(CLEAR)  # after the whitespace is stripped, as every string
    assert txn.email == hashed and F.HASHED.match(hashed)  # type: ignore[attr-defined]
    assert txn.three_ds == "none" and txn.account_age_days is None  # type: ignore[attr-defined]
    assert "ip_address" not in txn.model_dump() and CLEAR not in txn.model_dump_json()
    # A hash passes every later door as it is (raw history sent again as events).
    again = declared.model.model_validate_json(txn.model_dump_json())
    assert again == txn
    assert F.pii_hash(b"another key of 16 bytes")(CLEAR) != hashed


def test_events_carry_declared_fields_and_a_break_is_dead_lettered_naming_it(
    declared: F.Door,
) -> None:
    good = parse_transaction(json.dumps(BODY | {"email": CLEAR}).encode(), declared.model)
    assert isinstance(good, Transaction) and good.email == declared.pii(CLEAR)  # type: ignore[attr-defined]
    raw = json.dumps(BODY | {"three_ds": "maybe", "email": CLEAR}).encode()
    reason = decode(Message(raw, 0.0, "1-0"), None, declared.model)
    assert isinstance(reason, str) and reason.startswith("three_ds: Input should be")
    assert CLEAR not in reason
    # The contract's model ignores them, as before.
    plain = parse_transaction(raw)
    assert isinstance(plain, Transaction) and not hasattr(plain, "three_ds")


def test_the_updater_takes_declared_fields_and_dead_letters_a_break_naming_it(
    declared: F.Door, stream_redis: str
) -> None:
    """Events with declared fields through the streaming updater on a real Redis stream:
    applied, a break dead-lettered with the field named, and the clear PII value in no
    key the updater wrote (only in the log the producer wrote, and the dead letter that
    keeps a refused event as it came)."""
    good = [e | {"email": CLEAR, "three_ds": "passed"} for e in feed(cards=40)[:60]]
    bad = good[0] | {"transaction_id": "t-bad", "three_ds": "maybe"}
    client = connect(stream_redis)
    xadd_all(client, "transactions", encode([*good, bad]))
    source = RedisStreamSource(client, "transactions", "g", "test")
    updater = Updater(
        source, SessionWriter(client, 300), UpdaterMetrics.create(), model=declared.model
    )
    updater.run(max_messages=len(good) + 1)
    assert updater.totals.dead_letters == 1
    assert updater.totals.applied.added == len({e["transaction_id"] for e in good})
    ((_, dead),) = client.xrange("transactions:dead-letter")
    assert dead[b"reason"].decode().startswith("three_ds: Input should be")
    written = [k for k in client.scan_iter(count=1000) if not k.startswith(b"transactions")]
    assert written
    for k in written:
        assert CLEAR.encode() not in repr(_values(client, k)).encode(), k


def test_the_openapi_document_lists_the_declared_fields_with_their_types(
    declared: F.Door,
) -> None:
    doc = create_app().openapi()
    one = doc["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]
    many = doc["paths"]["/v1/score/batch"]["post"]["requestBody"]["content"]["application/json"]
    props = one["schema"]["properties"]
    assert many["schema"]["properties"]["transactions"]["items"] == one["schema"]
    assert props["three_ds"]["anyOf"][0] == {"enum": ["passed", "failed", "none"], "type": "string"}
    assert props["three_ds"]["default"] == "none"
    assert props["account_age_days"]["anyOf"][0] == {
        "maximum": 36500.0,
        "minimum": 0.0,
        "type": "number",
    }
    assert props["ip_matches_country"]["anyOf"][0] == {"type": "boolean"}
    assert props["signup_time"]["anyOf"][0] == {"format": "date-time", "type": "string"}
    assert props["bin"]["description"] == "the card's issuer number"
    assert props["email"]["anyOf"][0]["maxLength"] == 200
    assert "PII" in props["email"]["description"]
    assert "ignored" in one["schema"]["description"]
    # The contract's fields as documented without declared fields.
    assert props["currency"]["enum"] and props["event_time"]["anyOf"]


MAPPING = """\
transactions:
  files: [tx.csv]
  time_zone: Europe/Berlin
  columns:
    transaction_id: TX_ID
    card_id: CUSTOMER_ID
    merchant_id: TERMINAL_ID
    amount: TX_AMOUNT
    event_time: {column: TX_DATETIME, format: "%Y-%m-%d %H:%M:%S"}
    channel: {column: TX_TYPE, map: {STORE: pos, ONLINE: ecom}}
    country: {const: DE}
    email: EMAIL
    three_ds: {column: THREE_DS, map: {Y: passed, N: failed}}
    account_age_days: AGE
    signup_time: SIGNUP
labels:
  files: [fr.csv]
  arrival_delay_days: 30
  columns:
    transaction_id: TX_ID
    is_fraud: FRAUD
    fraud_pattern: KIND
"""
ROWS = [
    # id, customer, terminal, amount, time, type, email, 3ds, age, signup
    [
        "1",
        "17",
        "42",
        "23.90",
        "2025-03-24 08:15:42",
        "STORE",
        CLEAR,
        "Y",
        "100",
        "2024-01-02 10:00:00",
    ],
    ["2", "17", "42", "4.50", "2025-03-24 08:16:03", "STORE", CLEAR, "", "", ""],
    ["3", "230", "7", "129.00", "2025-03-24 12:01:59", "ONLINE", "bob@example.com", "N", "3", ""],
    ["4", "230", "7", "9.00", "2025-03-24 12:02:59", "ONLINE", "no address", "N", "3", ""],
    ["5", "230", "7", "9.00", "2025-03-24 12:03:59", "ONLINE", CLEAR, "maybe", "3", ""],
    ["6", "230", "7", "9.00", "2025-03-24 12:04:59", "ONLINE", CLEAR, "N", "-1", ""],
    ["7", "230", "7", "9.00", "2025-03-24 12:05:59", "ONLINE", CLEAR, "N", "x", ""],
    ["8", CLEAR, "7", "9.00"],  # malformed: the line is not shown in the rejects
]


def write_export(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tx.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "TX_ID",
                "CUSTOMER_ID",
                "TERMINAL_ID",
                "TX_AMOUNT",
                "TX_DATETIME",
                "TX_TYPE",
                "EMAIL",
                "THREE_DS",
                "AGE",
                "SIGNUP",
            ]
        )
        w.writerows(ROWS)
    (folder / "fr.csv").write_text("TX_ID,FRAUD,KIND\n3,1,account_takeover\n")
    (folder / "mapping.yaml").write_text(MAPPING)
    return folder / "mapping.yaml"


def test_ingest_maps_declared_fields_hashes_pii_and_keeps_the_fraud_pattern(
    declared: F.Door, tmp_path: Path
) -> None:
    mapping = write_export(tmp_path / "in")
    data = tmp_path / "data"
    report = ingest(mapping, data, door=declared)
    assert report.transactions == 3
    assert report.rejected == {
        "malformed line": 1,
        "rule: email": 1,
        "rule: three_ds": 1,
        "rule: account_age_days": 1,
        "unparsable value: account_age_days": 1,
    }
    t = pq.read_table(partition_file(data / "raw", "transactions", DAY))
    assert t.schema.names[-7:] == [*declared.names, "fraud_pattern"]
    assert t.schema.field("signup_time").type == pa.timestamp("us", tz="UTC")
    assert t.column("email").to_pylist() == [declared.pii(CLEAR)] * 2 + [
        declared.pii("bob@example.com")
    ]
    assert t.column("three_ds").to_pylist() == ["passed", "none", "failed"]  # the default
    assert t.column("account_age_days").to_pylist() == [100.0, None, 3.0]
    assert t.column("fraud_pattern").to_pylist() == [None, None, "account_takeover"]
    assert t.column("signup_time")[0].as_py().isoformat() == "2024-01-02T09:00:00+00:00"
    C.check_raw(data / "raw", fields=declared.fields)  # the partitions keep the contract
    # The rejects name the field and show the source row with its PII hashed.
    rejects = (data / "ingest" / "rejects.csv").read_text()
    assert CLEAR not in rejects and declared.pii(CLEAR) in rejects
    # A raw row is an event with its declared fields, and the model takes it back as is.
    row = raw_row_to_event(t.to_pylist()[0], declared.names)
    assert row["email"] == declared.pii(CLEAR) and row["signup_time"].startswith("2024-01-02")
    assert declared.model.model_validate(row).email == declared.pii(CLEAR)  # type: ignore[attr-defined]


def test_a_raw_partition_that_breaks_a_declared_field_is_refused_naming_it(
    declared: F.Door, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    ingest(write_export(tmp_path / "in"), data, door=declared)
    path = partition_file(data / "raw", "transactions", DAY)
    good = pq.read_table(path)

    def refused(table: pa.Table) -> str:
        pq.write_table(table, path)
        with pytest.raises(C.ContractError) as exc:
            C.check_raw(data / "raw", fields=declared.fields)
        return str(exc.value)

    emails = pa.array([CLEAR, *good.column("email").to_pylist()[1:]])
    said = refused(good.set_column(good.schema.get_field_index("email"), "email", emails))
    assert "column 'email': clear values, not their hash (1 row(s), first at row 0)" in said
    assert CLEAR not in said
    tds = pa.array(["maybe", "none", "failed"])
    said = refused(good.set_column(good.schema.get_field_index("three_ds"), "three_ds", tds))
    assert "column 'three_ds': values the declaration refuses (Input should be" in said
    # An optional field's column may be absent (it reads as its default): only bin's break.
    bins = pa.array(["1", None, None], pa.string())
    no_signup = good.drop_columns(["signup_time"])
    said = refused(no_signup.set_column(no_signup.schema.get_field_index("bin"), "bin", bins))
    assert "column 'bin': values the declaration refuses (String should match pattern" in said
    assert "signup_time" not in said
    ages = pa.array(["1", "2", "3"])
    said = refused(
        good.set_column(good.schema.get_field_index("account_age_days"), "account_age_days", ages)
    )
    assert "column 'account_age_days': is string, not a number" in said


def test_pii_is_in_clear_nowhere_after_ingest_and_scoring(
    declared: F.Door, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export through ingest, then the world's held-out transactions scored over HTTP
    with a clear PII value (one refused for another field's break), the decisions
    compacted into raw files: the clear value is in no Redis key or value (the decision
    log's stream included), no spool file, no parquet file, no rejects or manifest."""
    url = private_db(world, 9)
    env = {
        "FRAUD_FEATURES_FILE": str(declarations_path()),  # the declared fixture's file
        "FRAUD_PII_KEY": KEY.decode(),
        "REDIS_URL": url,
    }
    monkeypatch.setenv("REDIS_URL", url)
    data = tmp_path / "data"
    monkeypatch.setenv("FRAUD_DATA_DIR", str(data))
    read_settings.cache_clear()
    assert main(["ingest", str(write_export(tmp_path / "in"))]) == 0

    day = world.last_day
    rows = pq.read_table(partition_file(world.data_dir / "raw", "transactions", day)).to_pylist()
    bodies = [raw_row_to_event(r) | {"email": CLEAR, "three_ds": "passed"} for r in rows[:40]]
    spool = tmp_path / "spool"
    # A rule over a declared number field (NaN, so never matching, where a body has none).
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - {code: NEW_ACCOUNT, action: review, when: 'account_age_days < 7',\n"
        "     message: 'An account of {account_age_days:.0f} days.'}\n"
    )
    bodies[0] |= {"account_age_days": 2}
    srv = start_server(
        world, tmp_path, **env, FRAUD_DECISION_SPOOL_DIR=str(spool), FRAUD_RULES_FILE=str(rules)
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            r = http.post("/v1/score", json=bodies[0])
            assert r.status_code == 200, r.text
            assert r.json()["decided_by"] == "rule", r.text
            assert r.json()["reasons"][0] == {
                "code": "RULE_NEW_ACCOUNT",
                "message": "An account of 2 days.",
            }
            r = http.post("/v1/score/batch", json={"transactions": bodies[1:]})
            assert r.status_code == 200, r.text
            assert all(d["decided_by"] != "rule" for d in r.json()["results"]), r.text
            bad = bodies[0] | {"transaction_id": "t-bad", "three_ds": "maybe"}
            r = http.post("/v1/score/batch", json={"transactions": [bad]})
            assert r.status_code == 422, r.text
            assert r.json()["detail"][0]["field"] == "transactions.0.three_ds"
            assert CLEAR not in r.text
    finally:
        stop_server(srv)
    monkeypatch.setenv("FRAUD_DECISION_SPOOL_DIR", str(spool))
    read_settings.cache_clear()
    assert main(["decisions", "compact", "--date", str(datetime.now(UTC).date())]) == 0

    clear = CLEAR.encode()
    client = redis.Redis.from_url(url)
    logged = repr(client.xrange("decisions")).encode()
    assert logged.count(F.pii_hash(KEY)(CLEAR).encode()) == len(bodies)  # with its hash
    for key in client.scan_iter(count=1000):
        assert clear not in key and clear not in repr(_values(client, key)).encode(), key
    assert list(data.glob("raw/decisions/*/*.parquet")), "the decisions were compacted"
    for p in data.rglob("*.parquet"):
        assert CLEAR not in json.dumps(pq.read_table(p).to_pylist(), default=str), p
    for p in [*data.rglob("*"), *spool.rglob("*")]:
        if p.is_file():
            assert clear not in p.read_bytes(), p


def test_the_documented_declaration_loads() -> None:
    """docs/data-contract.md's "Your own fields" declares what it shows."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "data-contract.md").read_text()
    block = page.split("## Your own fields", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    fields = F.parse(yaml.safe_load(block), "docs/data-contract.md")
    names = ["email", "three_ds", "account_age_days", "signup_time", "email_domain"]
    assert [f.name for f in fields] == names
    door = F.door(fields, KEY)
    body = BODY | {"email": "alice@example.com", "three_ds": "failed"}
    t = door.model.model_validate(body)
    assert t.email.startswith("pii:") and t.email_domain == "example.com"  # type: ignore[attr-defined]
    # "Use it in a feature": its declarations file's fields and features over them
    use = page.split("### Use it in a feature", 1)[1].split("### ", 1)[0]
    doc = yaml.safe_load(use.split("```yaml\n", 2)[2].split("```", 1)[0])
    assert [f.name for f in F.parse(doc, "docs")] == ["ip_address", "three_ds"]
    decl = D.parse(doc, "docs/data-contract.md")
    assert decl.aggregate_names() == [
        "ip_txn_count_10m",
        "ip_txn_count_1d",
        "card_3ds_failed_count_1h",
    ]


def test_a_declared_field_is_part_of_what_makes_a_transaction_the_same_one(
    declared: F.Door,
) -> None:
    """One id, one transaction: a retry that changes a declared field is another
    transaction (409 naming it), one that sends the same values is the same."""
    first = declared.model.model_validate(BODY | {"email": CLEAR, "three_ds": "passed"})
    same = declared.model.model_validate(BODY | {"email": f" {CLEAR}", "three_ds": "passed"})
    other = declared.model.model_validate(BODY | {"email": CLEAR, "three_ds": "failed"})
    assert idempotency.content(first) == idempotency.content(same)
    differ = {
        k for k, v in idempotency.content(first).items() if idempotency.content(other)[k] != v
    }
    assert differ == {"three_ds"}
    assert CLEAR not in idempotency.encode(idempotency.content(first))
    plain = Transaction.model_validate(BODY)
    assert set(idempotency.content(plain)) == set(Transaction.model_fields) - {"transaction_id"}


def _values(client: Any, key: bytes) -> Any:
    """Everything a Redis key holds, whatever its type."""
    kind = client.type(key)
    read = {
        b"string": client.get,
        b"hash": client.hgetall,
        b"list": lambda k: client.lrange(k, 0, -1),
        b"set": client.smembers,
        b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
        b"stream": client.xrange,
    }
    return read[kind](key)


def test_features_plan_checks_and_lists_the_declared_fields(
    declared: F.Door,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path / "data"))
    read_settings.cache_clear()
    assert main(["features", "plan"]) == 0
    out = capsys.readouterr().out
    assert "declared fields: email (string, pii), three_ds (category), account_age_days" in out
    broken = declarations_with_fields(tmp_path / "broken", "fields: [{name: x, type: ipv4}]\n")
    monkeypatch.setenv("FRAUD_FEATURES_FILE", str(broken))
    assert main(["features", "plan"]) == 2


# Features over declared fields (docs/features.md, "Over your own fields"): a key over a
# PII field (its hash), a category filter, a number value absent on some events.
OVER_FIELDS = [
    {
        "entity": "email",
        "filter": {"three_ds": ["failed"]},
        "windows": ["1d"],
        "features": {"count": "email_3ds_failed", "seconds_since_last": "email_3ds_since"},
    },
    {
        "entity": "merchant_id",
        "value": "account_age_days",
        "windows": ["1d"],
        "features": {"count": "m_aged", "max": "m_age_max", "mean": "m_age_mean"},
    },
]


def test_the_updater_records_features_over_declared_fields_as_training_computes_them(
    declared: F.Door, stream_redis: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events with declared fields through the streaming updater on a real Redis stream
    into states keyed by a PII field (its hash), filtered by a category and reading a
    number absent on some events; read back after the last event they equal training's
    DuckDB over the same events as the door stored them."""
    raw = yaml.safe_load(declarations_path().read_text())
    raw["fields"] = yaml.safe_load(FIELDS)["fields"]
    raw["aggregations"] = [*raw["aggregations"], *OVER_FIELDS]
    path = tmp_path / "over" / "features.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("FRAUD_FEATURES_FILE", str(path))
    declarations.cache_clear()
    door = F.door(F.load(path), KEY, str(path))
    decl = declarations()
    events = feed(cards=40)[:400]
    for e in events:  # a few emails; some events without a field (a retry: the same)
        i = int(e["transaction_id"].rsplit("-", 1)[1])
        e["email"] = f"buyer{i % 7}@example.com"
        e["three_ds"] = ("failed", "passed", "none")[i % 3]
        if i % 4:
            e["account_age_days"] = float(i % 50)
    client = connect(stream_redis)
    for script in D.SCRIPTS:
        client.script_load(script)
    xadd_all(client, "transactions", encode(events))
    source = RedisStreamSource(client, "transactions", "g", "test")
    updater = Updater(source, SessionWriter(client, 300), UpdaterMetrics.create(), model=door.model)
    updater.run(max_messages=len(events))
    assert updater.totals.dead_letters == 0
    stored = [door.model.model_validate(e) for e in events]
    hist = pd.DataFrame(D.transaction_rows(stored)).assign(
        event_time=[t.event_time for t in stored]
    )
    hist["event_time"] = pd.to_datetime(hist["event_time"], utc=True)
    q = hist.drop_duplicates("transaction_id").sort_values("event_time").tail(60)
    # read as of a second after the newest event (every event before it)
    end = hist["event_time"].max() + pd.Timedelta(seconds=1)
    q = q.assign(event_timestamp=end).reset_index(drop=True)
    names = ["email_3ds_failed_1d", "email_3ds_since_1d", "m_aged_1d", "m_age_max_1d"]
    specs = [s for s in decl.specs if set(s.feature_names()) & set(names)]
    served: dict[str, list[float]] = {}
    rows = q.to_dict("records")
    t_us = [int(t.value // 1000) for t in q["event_timestamp"]]
    for spec in specs:
        pipe = client.pipeline(transaction=False)
        keys = [spec.key_value(r) for r in rows]
        for key, t in zip(keys, t_us, strict=True):
            if key is not None:
                D.queue_read(pipe, spec, key, t)
        read = [t for k, t in zip(keys, t_us, strict=True) if k is not None]
        got = iter(D.parse_reads(spec, pipe.execute(), read))
        for key, t in zip(keys, t_us, strict=True):
            state = next(got) if key is not None else None
            feats, exact = D.online_row(spec, state, t)
            assert exact, (spec.feature_names(), key, state)
            for k, v in feats.items():
                served.setdefault(k, []).append(v)
    trained = training_columns(decl, q, hist)
    for n in names:
        assert np.allclose(served[n], trained[n]), (n, served[n], list(trained[n]))
    assert max(served["email_3ds_failed_1d"]) > 5 and max(served["m_age_max_1d"]) > 0
    emails = {k for s in specs for k in client.scan_iter(match=f"{{agg:{s.id}:*", count=1000)}
    assert emails and all(CLEAR.encode() not in k for k in emails)
    assert any(b"pii:" in k for k in emails)  # keyed by the hash
    declarations.cache_clear()


DERIVED = """\
  - {name: email_domain, type: string, from: email, after: '@', max_length: 100}
  - {name: bin6, type: string, from: bin, prefix: 4}
"""


def test_a_field_taken_from_another_at_the_door_is_clear_where_its_source_is_hashed(
    tmp_path: Path,
) -> None:
    """``from:`` (an e-mail's domain, a number's prefix) is taken from the source's clear
    value at every door, before the source's hash: the API's model and an event, and
    ingest's columns; a transaction that carries it keeps its own, and one whose source is
    already hashed (raw history sent again) brings the column it was stored with. A
    velocity per domain is then an ordinary key."""
    fields = F.parse(yaml.safe_load(FIELDS + DERIVED), "features.yaml")
    door = F.door(fields, KEY)
    body = BODY | {"email": CLEAR, "bin": "411111"}
    for t in (
        door.model.model_validate(body),
        parse_transaction(json.dumps(body).encode(), door.model),
    ):
        assert isinstance(t, Transaction)
        assert (t.email, t.email_domain, t.bin6) == (door.pii(CLEAR), "example.com", "4111")  # type: ignore[attr-defined]
    again = door.model.model_validate(BODY | {"email": door.pii(CLEAR), "email_domain": "x.org"})
    assert again.email_domain == "x.org"  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="email_domain"):  # its own checks hold
        door.model.model_validate(BODY | {"email": "a@" + "d" * 120 + ".com"})

    data = tmp_path / "data"
    assert ingest(write_export(tmp_path / "in"), data, door=door).transactions == 3
    t = pq.read_table(partition_file(data / "raw", "transactions", DAY))
    assert t.column("email_domain").to_pylist() == ["example.com"] * 3
    assert CLEAR not in json.dumps(t.to_pylist(), default=str)

    doc = yaml.safe_load(FIELDS + DERIVED) | {
        "aggregations": [
            {"entity": "email_domain", "windows": ["1h"], "features": {"count": "domain_count"}}
        ]
    }
    (spec,) = D.parse(doc, "features.yaml").specs
    assert spec.fields == (("email_domain", "string"),)
    with pytest.raises(F.FieldError, match=r"fields\.6 \(email_domain\)\.from: 'three_ds'"):
        F.parse(yaml.safe_load(FIELDS + DERIVED.replace("from: email", "from: three_ds")), "f")


def test_a_rule_tests_a_declared_string_field(declared: F.Door) -> None:
    """A string test (==, in, starts_with) may name a declared string or category field
    (its value as the door left it: a PII field's hash); an undeclared name is refused
    naming the fields a test may read."""
    from fraud_scoring import rules as R
    from service.core.rules import known_features, known_strings

    known_strings.cache_clear()  # the fixture's declarations
    assert known_strings() == ("email", "three_ds", "bin")
    doc = b"""
rules:
  - {code: THREE_DS_FAILED, action: review, when: "three_ds == 'failed' and amount > 100",
     message: 3-D Secure failed}
  - {code: TEST_BIN, action: decline, when: "starts_with(bin, '4000')", message: a test BIN}
"""
    rs = R.parse(doc, "rules.yaml", set(known_features()), known_strings())
    txns = [
        declared.model.model_validate(BODY | {"amount": a, "three_ds": t, "bin": b})
        for a, t, b in [
            (500.0, "failed", "411111"),
            (50.0, "failed", "400012"),
            (500.0, "passed", None),
        ]
    ]
    strings = R.string_columns(txns, rs.string_fields)
    masks = rs.masks({"amount": np.array([t.amount for t in txns])}, strings, {}, len(txns))
    assert masks.tolist() == [[True, False, False], [False, True, False]]
    with pytest.raises(R.RulesError, match=r"starts_with: 'ip' is not one of card_id, .*, bin"):
        R.parse(doc.replace(b"(bin,", b"(ip,"), "rules.yaml", set(), known_strings())
    known_strings.cache_clear()
