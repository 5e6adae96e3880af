"""The input contract (``fraud_scoring/contract.py``, ``docs/data-contract.md``) and
``fraud-scoring ingest``: every break is refused at the door naming the column, with
nothing written, and another company's export goes ingest -> batch -> train -> evaluate
-> serve end to end."""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import yaml
from pydantic import ValidationError

from batch_jobs.evaluate import HOLDOUT_FILE, Holdout
from batch_jobs.labels import known_frauds
from cli.main import main
from fraud_scoring import contract as C
from fraud_scoring.events import Transaction, raw_row_to_event
from fraud_scoring.features import declarations, declarations_path
from fraud_scoring.model_repo import load_metadata, resolve
from fraud_scoring.settings import read_settings
from fraud_scoring.storage import partition_days, partition_file, write_partition
from service.edge.server import spawn
from tests.declared_reference import derived_reference, reference

BERLIN = ZoneInfo("Europe/Berlin")
START = date(2025, 3, 24)  # a DST change (Mar 30) inside the export

MAPPING = """\
# Another company's export: integer ids, Berlin wall-clock times to the second, no
# country, currency or MCC, labels without an arrival time.
transactions:
  files: [export/transactions_*.csv]
  time_zone: Europe/Berlin
  columns:
    transaction_id: TX_ID
    card_id: CUSTOMER_ID
    merchant_id: TERMINAL_ID
    amount: TX_AMOUNT
    event_time: {column: TX_DATETIME, format: "%Y-%m-%d %H:%M:%S"}
    channel: {column: TX_TYPE, map: {STORE: pos, ONLINE: ecom, CASH: atm}}
    country: {const: DE}
labels:
  files: [export/frauds.csv]
  arrival_delay_days: 7
  columns:
    transaction_id: TX_ID
    is_fraud: FRAUD
"""


# The export's own fields (docs/data-contract.md, "Your own fields"): its customer id
# again as a PII field (hashed at every door), a category read from its type column, the
# customer's home and the terminal's coordinates, the client's IP (online payments only)
# and the e-mail's domain.
OWN_FIELDS = """
fields:
  - {name: customer_ref, type: string, pii: true, pattern: '[0-9]+'}
  - {name: three_ds, type: category, values: [passed, failed, none], default: none}
  - {name: customer_lat, type: number, min: -90, max: 90}
  - {name: customer_lon, type: number, min: -180, max: 180}
  - {name: terminal_lat, type: number, min: -90, max: 90}
  - {name: terminal_lon, type: number, min: -180, max: 180}
  - {name: ip_address, type: string, max_length: 45}
  - {name: email_domain, type: string}
"""
OWN_COLUMNS = """\
    customer_ref: CUSTOMER_ID
    three_ds: {column: TX_TYPE, map: {STORE: none, ONLINE: passed, CASH: none}}
    customer_lat: CUST_LAT
    customer_lon: CUST_LON
    terminal_lat: TERM_LAT
    terminal_lon: TERM_LON
    ip_address: IP
    email_domain: EMAIL_DOMAIN
"""
OWN_NAMES = ("customer_ref", "three_ds", "customer_lat", "customer_lon", "terminal_lat")
OWN_NAMES += ("terminal_lon", "ip_address", "email_domain")
# Features over them (docs/features.md, "Over your own fields"): a velocity per IP, the
# distance from the customer's home to the terminal, and a card's farthest of the day.
DISTANCE = "distance_km(customer_lat, customer_lon, terminal_lat, terminal_lon)"
OWN_FEATURES = {
    "aggregations": [
        {"entity": "ip_address", "windows": ["1h", "1d"], "features": {"count": "ip_txn_count"}},
        {
            "entity": "card_id",
            "value": DISTANCE,
            "windows": ["1d"],
            "features": {"max": "card_distance_max"},
        },
    ],
    "derived": [{"name": "home_distance_km", "expr": DISTANCE}],
}
HEADER = ["TX_ID", "CUSTOMER_ID", "TERMINAL_ID", "TX_AMOUNT", "TX_DATETIME", "TX_TYPE"]
HEADER += ["CUST_LAT", "CUST_LON", "TERM_LAT", "TERM_LON", "IP", "EMAIL_DOMAIN"]


def own_declarations() -> str:
    """The shipped declarations with the export's fields and the features over them."""
    raw = yaml.safe_load(declarations_path().read_text())
    raw |= yaml.safe_load(OWN_FIELDS)
    for section, items in OWN_FEATURES.items():
        raw[section] = [*raw.get(section, []), *items]
    return yaml.safe_dump(raw, sort_keys=False)


def other_company_export(folder: Path, customers: int = 700, days: int = 16, seed: int = 3) -> int:
    """Write a CSV export in another company's shape under ``folder/export``; returns the
    number of good transactions. Customers shop at terminals near their home, online
    from their own IP. Fraud (its type in the labels' KIND): a stolen customer's burst of
    large online payments at a few terminals in the night (``night_burst``); a cloned
    card used at a store far from its customer's home in the day (``far_store``); one IP
    testing several customers' cards with small online payments (``ip_burst``). Some
    lines are repeated, one id comes back with other content, and a few lines are
    malformed."""
    rng = np.random.default_rng(seed)
    out = folder / "export"
    out.mkdir(parents=True)
    rows: list[list[str]] = []
    frauds: list[tuple[int, str]] = []
    tx = 100_000
    terminals = 150
    home = np.column_stack([rng.uniform(47.5, 54.5, customers), rng.uniform(6, 15, customers)])
    place = np.column_stack([rng.uniform(47.5, 54.5, terminals), rng.uniform(6, 15, terminals)])
    far_away = np.array([[40.42, -3.70], [41.01, 28.98], [38.72, -9.14]])  # fraud terminals
    place = np.vstack([place, far_away])
    gap = ((home[:, None, :] - place[None, :terminals, :]) ** 2).sum(axis=2)
    near = np.argsort(gap, axis=1)[:, :8]  # each customer's usual terminals
    domains = rng.choice(["gmail.com", "web.de", "gmx.de", "t-online.de"], customers)

    def line(c: int, term: int, amount: float, t: datetime, kind: str, ip: str) -> list[str]:
        if t.replace(tzinfo=BERLIN).utcoffset() != t.replace(tzinfo=BERLIN, fold=1).utcoffset():
            t += timedelta(hours=1)  # a night in the DST change's missing hour: after it
        return [
            str(tx),
            str(c),
            str(term),
            f"{amount:.2f}",
            f"{t:%Y-%m-%d %H:%M:%S}",
            kind,
            f"{home[c, 0]:.5f}",
            f"{home[c, 1]:.5f}",
            f"{place[term, 0]:.5f}",
            f"{place[term, 1]:.5f}",
            ip if kind == "ONLINE" else "",  # a store or cash payment has no IP
            str(domains[c]),
        ]

    for d in range(days):
        day = START + timedelta(days=d)
        midnight = datetime.combine(day, datetime.min.time())
        for c in range(customers):
            for _ in range(rng.poisson(2.0)):
                local = midnight + timedelta(seconds=int(rng.integers(7 * 3600, 23 * 3600)))
                kind = str(rng.choice(["STORE", "ONLINE", "CASH"], p=[0.6, 0.35, 0.05]))
                term = int(rng.choice(near[c]) if rng.random() < 0.9 else rng.integers(terminals))
                ip = f"10.{c // 250}.{c % 250}.{1 + int(rng.random() < 0.1)}"
                rows.append(line(c, term, rng.lognormal(3.2, 0.6), local, kind, ip))
                tx += 1
        for c in rng.choice(customers, size=4, replace=False):  # stolen cards
            t = midnight + timedelta(seconds=int(rng.integers(0, 5 * 3600)))
            for _ in range(int(rng.integers(3, 7))):
                t += timedelta(seconds=int(rng.integers(20, 400)))
                term = terminals + int(rng.integers(0, 3))  # a few fraud terminals
                ip = f"203.0.113.{int(rng.integers(1, 4))}"
                rows.append(line(c, term, rng.uniform(300, 1500), t, "ONLINE", ip))
                frauds.append((tx, "night_burst"))
                tx += 1
        for c in rng.choice(customers, size=3, replace=False):  # cloned cards, far away
            t = midnight + timedelta(seconds=int(rng.integers(9 * 3600, 20 * 3600)))
            term = int(np.argsort(gap[c])[-int(rng.integers(1, 10))])  # a far terminal
            rows.append(line(c, term, rng.lognormal(4.0, 0.5), t, "STORE", ""))
            frauds.append((tx, "far_store"))
            tx += 1
        ip = f"198.51.100.{d + 1}"  # one IP tests several cards within minutes
        t = midnight + timedelta(seconds=int(rng.integers(8 * 3600, 22 * 3600)))
        for c in rng.choice(customers, size=6, replace=False):
            t += timedelta(seconds=int(rng.integers(10, 120)))
            term = int(rng.choice(near[c]))
            rows.append(line(c, term, rng.uniform(1, 5), t, "ONLINE", ip))
            frauds.append((tx, "ip_burst"))
            tx += 1
    good = len(rows)
    rows.sort(key=lambda r: r[4])
    dup = [rows[i] for i in rng.choice(len(rows), size=25, replace=False)]
    clash = [rows[7][0], *rows[8][1:]]
    rest = ["", "", "", "", "", ""]  # the own columns, empty
    bad = [
        ["999000001", "5", "7", "12.00"],  # too few fields
        ["999000002", "5", "7", "n/a", "2025-03-25 10:00:00", "STORE", *rest],
        ["999000003", "", "7", "9.99", "2025-03-25 10:00:00", "STORE", *rest],
        ["999000004", "5", "7", "9.99", "25/03/2025 10:00", "STORE", *rest],
        # no such Berlin time
        ["999000005", "5", "7", "9.99", "2025-03-30 02:30:00", "STORE", *rest],
    ]
    lines = rows + dup + [clash] + bad
    half = len(lines) // 2
    for i, part in enumerate((lines[:half], lines[half:])):
        with open(out / f"transactions_{i}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(HEADER)
            w.writerows(part)
    with open(out / "frauds.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["TX_ID", "FRAUD", "KIND"])  # KIND: the fraud's type, mapped or not
        w.writerows([[t, 1, kind] for t, kind in frauds])
        w.writerow([frauds[0][0], 1, frauds[0][1]])  # a repeated label
    (folder / "mapping.yaml").write_text(MAPPING)
    return good - 1  # the clash refuses rows[7] and its twin


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """FRAUD_DATA_DIR and FRAUD_MODEL_REPO under ``tmp_path`` for in-process CLI calls."""
    for k in ("REDIS_URL", "FRAUD_DATA_DIR", "FRAUD_MODEL_REPO", "FRAUD_DECISION_LOG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FRAUD_MODEL_REPO", str(tmp_path / "models"))
    read_settings.cache_clear()
    yield tmp_path / "data"
    read_settings.cache_clear()


def _good_day(day: date, ids: range) -> pa.Table:
    t0 = datetime.combine(day, datetime.min.time(), UTC)
    n = len(ids)
    return pa.table(
        {
            "transaction_id": [f"t{i}" for i in ids],
            "card_id": [f"c{i % 3}" for i in ids],
            "merchant_id": ["m1"] * n,
            "amount": [10.0 + i for i in range(n)],
            "currency": ["EUR"] * n,
            "event_time": [t0 + timedelta(hours=1 + i) for i in range(n)],
            "utc_offset_min": [60] * n,
            "country": ["DE"] * n,
            "channel": ["pos"] * n,
            "mcc": ["5411"] * n,
            "device_id": [None] * n,
        },
        schema=C.TRANSACTIONS,
    )


def _raw_world(data: Path) -> Path:
    raw = data / "raw"
    for k in range(3):
        day = date(2026, 1, 1) + timedelta(days=k)
        write_partition(raw, "transactions", day, _good_day(day, range(10 * k, 10 * k + 5)))
    return raw


def _replace(raw: Path, day: date, table: pa.Table) -> None:
    pq.write_table(table, partition_file(raw, "transactions", day))


JAN2 = date(2026, 1, 2)


def _naive(t: pa.Table) -> pa.Table:
    i = t.schema.get_field_index("event_time")
    return t.set_column(i, "event_time", t.column("event_time").cast(pa.timestamp("us")))


def _int_ids(t: pa.Table) -> pa.Table:
    i = t.schema.get_field_index("card_id")
    return t.set_column(i, "card_id", pa.array(range(t.num_rows), pa.int64()))


@pytest.mark.parametrize(
    ("break_", "column", "what"),
    [
        (_naive, "event_time", "naive timestamp"),
        (lambda t: t.drop_columns(["merchant_id"]), "merchant_id", "missing"),
        (_int_ids, "card_id", "integers, not text"),
        (
            lambda t: t.set_column(0, "transaction_id", pa.array(["t0"] * t.num_rows)),
            "transaction_id",
            "more than one row",
        ),
        (lambda t: t.slice(0, 0), "*", "no rows"),
    ],
    ids=["naive-time", "missing-column", "integer-ids", "duplicate-ids", "empty-day"],
)
@pytest.mark.parametrize("command", ["batch", "train"])
def test_a_contract_break_is_refused_at_the_door_naming_the_column(
    cli_env: Path,
    caplog: pytest.LogCaptureFixture,
    command: str,
    break_: object,
    column: str,
    what: str,
) -> None:
    raw = _raw_world(cli_env)
    _replace(raw, JAN2, break_(pq.read_table(partition_file(raw, "transactions", JAN2))))  # type: ignore[operator]
    argv = ["batch", "--no-materialize", "--from", "2026-01-01", "--to", "2026-01-03"]
    with caplog.at_level(logging.ERROR, logger="fraud_scoring"):
        rc = main(argv if command == "batch" else ["train"])
    assert rc == 2
    text = caplog.text
    assert f"column {column!r}" in text and what in text, text
    assert "fix:" in text and ("date=2026-01-02" in text or "transactions" in text)
    assert not (cli_env / "features").exists() and not (cli_env.parent / "models").exists()


def test_a_missing_day_is_refused_before_any_day_is_written(
    cli_env: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _raw_world(cli_env)
    with caplog.at_level(logging.ERROR, logger="fraud_scoring"):
        rc = main(["batch", "--no-materialize", "--from", "2026-01-01", "--to", "2026-01-05"])
    assert rc == 2 and "date=2026-01-04" in caplog.text and "fraud-scoring ingest" in caplog.text
    assert not (cli_env / "features").exists()


def test_a_raw_row_that_keeps_the_contract_is_a_valid_event() -> None:
    """The doc, the contract and the event model agree: each good row validates as a
    ``Transaction``, and values the contract refuses, the model refuses too."""
    table = _good_day(JAN2, range(4))
    assert C.check_table(table, C.TRANSACTION_COLUMNS, "t", JAN2) == []
    for row in table.to_pylist():
        Transaction.model_validate_event(raw_row_to_event(row))
    for column, value in (("country", "ZZ"), ("currency", "EU"), ("channel", "web"), ("mcc", "54")):
        bad = table.set_column(table.schema.get_field_index(column), column, pa.array([value] * 4))
        problems = C.check_table(bad, C.TRANSACTION_COLUMNS, "t", JAN2)
        assert [p.column for p in problems] == [column]
        with pytest.raises(ValidationError, match=column):
            Transaction.model_validate_event(raw_row_to_event(bad.to_pylist()[0]))
    for c in C.TRANSACTION_COLUMNS:
        assert c.name in Transaction.model_fields or c.name == "utc_offset_min"


def _small_export(folder: Path, time_col: str = "2025-03-25 10:00:00") -> Path:
    (folder / "export").mkdir(parents=True)
    with open(folder / "export" / "transactions_0.csv", "w") as f:
        f.write("TX_ID,CUSTOMER_ID,TERMINAL_ID,TX_AMOUNT,TX_DATETIME,TX_TYPE\n")
        f.write(f"1,5,7,12.5,{time_col},STORE\n2,5,7,3.0,{time_col},ONLINE\n")
    (folder / "export" / "frauds.csv").write_text("TX_ID,FRAUD\n2,1\n")
    (folder / "mapping.yaml").write_text(MAPPING)
    return folder / "mapping.yaml"


def test_ingest_refuses_naive_times_without_a_zone_and_writes_nothing(
    cli_env: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = _small_export(tmp_path / "in")
    mapping.write_text(MAPPING.replace("  time_zone: Europe/Berlin\n", ""))
    with caplog.at_level(logging.ERROR, logger="fraud_scoring"):
        assert main(["ingest", str(mapping)]) == 2
    assert "'event_time (TX_DATETIME)'" in caplog.text and "time_zone" in caplog.text
    assert not cli_env.exists()


def test_ingest_refuses_a_mapping_that_names_a_missing_column(
    cli_env: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = _small_export(tmp_path / "in")
    mapping.write_text(MAPPING.replace("TX_AMOUNT", "AMOUNT_EUR"))
    with caplog.at_level(logging.ERROR, logger="fraud_scoring"):
        assert main(["ingest", str(mapping)]) == 2
    assert "'AMOUNT_EUR': not in the file" in caplog.text and not cli_env.exists()
    mapping.write_text(MAPPING.replace("    country: {const: DE}\n", ""))
    assert main(["ingest", str(mapping)]) == 2
    assert "required fields not mapped: ['country']" in caplog.text


def test_a_label_mapping_that_maps_too_little_says_what_to_write(tmp_path: Path) -> None:
    """Labels from an is_fraud column map no label column; a labels file maps two, and
    the message shows how."""
    from batch_jobs.ingest import load_mapping

    head = MAPPING[: MAPPING.index("labels:")]
    path = tmp_path / "m.yaml"
    path.write_text(head.replace("    country:", "    is_fraud: FRAUD\n    country:"))
    for labels, words in [
        ("labels: {arrival_delay_days: 30}\n", None),
        ("labels: {}\n", "labels from an is_fraud column (no files) need `arrival_delay_days: N`"),
        (
            "labels: {files: [f.csv], arrival_delay_days: 3}\n",
            "transaction_id and is_fraud not mapped: a labels file maps both, e.g. "
            "`columns: {transaction_id: TX_ID, is_fraud: FRAUD}`",
        ),
    ]:
        path.write_text(path.read_text().split("labels:")[0] + labels)
        if words is None:
            assert load_mapping(path).labels is not None
        else:
            with pytest.raises(ValueError, match=re.escape(words)):
                load_mapping(path)


def test_ingest_reads_aware_times_with_their_own_offset(cli_env: Path, tmp_path: Path) -> None:
    mapping = _small_export(tmp_path / "in", time_col="2025-03-25T10:00:00+05:30")
    mapping.write_text(MAPPING.replace('format: "%Y-%m-%d %H:%M:%S"', "format: null"))
    assert main(["ingest", str(mapping)]) == 0
    t = pq.read_table(partition_file(cli_env / "raw", "transactions", date(2025, 3, 25)))
    assert t.column("utc_offset_min").to_pylist() == [330, 330]
    assert t.column("event_time")[0].as_py() == datetime(2025, 3, 25, 4, 30, tzinfo=UTC)
    assert t.column("currency").to_pylist() == ["XXX", "XXX"]  # the declared default


def test_another_companys_export_goes_ingest_batch_train_evaluate_serve(
    cli_env: Path,
    tmp_path: Path,
    redis_server: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    """The export, through the CLI as a user runs it: ingest, batch (the last day held
    out of the online store, as if scored live the day after the nightly run), train,
    evaluate, then the real service scores the export's held-out day over HTTP (a known
    customer's first transaction with every batch feature read from the store), the
    served report reads the decisions it logged with the export's labels, and every
    logged vector equals the training row of its transaction. The export's own fields
    (coordinates, an IP, an e-mail domain) come in through the mapping, and the features
    over them (an IP velocity, a distance) are model inputs whose served values equal
    the naive reference; the evaluation report's recall per fraud pattern names the
    export's three fraud types."""
    # A database of its own: the export's ids ("5", "DE", "ecom") must not meet the
    # world's state in the shared server.
    redis_url = redis_server.rsplit("/", 1)[0] + "/11"
    redis.Redis.from_url(redis_url).flushdb()
    monkeypatch.setenv("REDIS_URL", redis_url)
    # Its own fields declared and mapped: every step below runs with them present.
    features = tmp_path / "features.yaml"
    features.write_text(own_declarations())
    monkeypatch.setenv("FRAUD_FEATURES_FILE", str(features))
    declarations.cache_clear()  # this process's commands read it (cleared again below)
    request.addfinalizer(declarations.cache_clear)
    monkeypatch.setenv("FRAUD_PII_KEY", "the export's key, 16 bytes or more")
    read_settings.cache_clear()
    good = other_company_export(tmp_path / "in")
    mapping = str(tmp_path / "in" / "mapping.yaml")
    own = MAPPING.replace("    country: {const: DE}\n", "    country: {const: DE}\n" + OWN_COLUMNS)
    own += "    fraud_pattern: KIND\n"  # the labels' fraud type, kept on each transaction
    Path(mapping).write_text(own)
    assert main(["ingest", mapping]) == 0
    summary = capsys.readouterr().out
    raw = cli_env / "raw"
    files = {p: p.read_bytes() for p in sorted(raw.rglob("*.parquet"))}
    # Idempotent: the same export writes the same files.
    assert main(["ingest", mapping]) == 0
    assert capsys.readouterr().out.splitlines()[:-1] == summary.splitlines()[:-1]
    assert {p: p.read_bytes() for p in sorted(raw.rglob("*.parquet"))} == files

    days = partition_days(raw, "transactions")
    assert len(days) in (16, 17)  # 16 Berlin days; early hours of the 24th are the 23rd in UTC
    txns = pa.concat_tables(pq.read_table(partition_file(raw, "transactions", d)) for d in days)
    assert txns.num_rows == good and len(set(txns.column("transaction_id").to_pylist())) == good
    assert set(txns.column("utc_offset_min").to_pylist()) == {60, 120}  # CET, then CEST
    assert set(txns.column("country").to_pylist()) == {"DE"}
    assert set(txns.column("three_ds").to_pylist()) == {"none", "passed"}
    refs = txns.column("customer_ref").to_pylist()
    assert all(r.startswith("pii:") for r in refs) and len(set(refs)) > 100
    with open(cli_env / "ingest" / "rejects.csv") as f:
        rejects = list(csv.DictReader(f))
    reasons = {r["reason"] for r in rejects}
    assert {
        "duplicate row",
        "conflicting transaction_id",
        "malformed line",
        "unparsable value: amount",
        "missing value: card_id",
        "unparsable value: event_time",
        "rule: event_time",
        "duplicate label",
        "unknown transaction",  # the label of a refused transaction
    } <= reasons, reasons
    assert "rejected: " in summary and "duplicate row" in summary
    labels = pa.concat_tables(
        pq.read_table(partition_file(raw, "labels", d)) for d in partition_days(raw, "labels")
    )
    lt, et = labels.column("label_time").to_pylist(), labels.column("event_time").to_pylist()
    assert all(a - b == timedelta(days=7) for a, b in zip(lt, et, strict=True))

    last = days[-1]
    assert main(["batch", "--from", str(days[0]), "--to", str(last - timedelta(days=1))]) == 0
    assert main(["batch", "--date", str(last), "--no-materialize"]) == 0
    assert main(["train", "--holdout-days", "3"]) == 0, capsys.readouterr()
    version = resolve(cli_env.parent / "models", "fraud")
    meta = load_metadata(version)
    assert meta.metrics["holdout_frauds"] >= 10
    assert meta.metrics["holdout_roc_auc"] > 0.8

    # evaluate: the report again from the stored holdout, labels refreshed from the export.
    report = version / "evaluation" / "report.md"
    report.unlink()
    capsys.readouterr()
    assert main(["evaluate", "--refresh-labels"]) == 0
    assert str(report) in capsys.readouterr().out
    text = report.read_text()
    assert "labels as of" in text.lower(), text[:500]
    for pattern in ("night_burst", "far_store", "ip_burst"):  # not "unknown"
        assert re.search(rf"^\| {pattern} \| \d+ \|", text, re.M), text
    assert {p.name for p in report.parent.glob("*.png")} >= {"pr_curve.png", "reliability.png"}

    # serve: the held-out day's transactions, as the API's requests (the mapped fields),
    # in event-time order as they would arrive live.
    seen = pq.read_table(partition_file(raw, "transactions", last - timedelta(days=1)))
    cards = set(seen.column("card_id").to_pylist())
    terminals = set(seen.column("merchant_id").to_pylist())
    day_rows = sorted(
        pq.read_table(partition_file(raw, "transactions", last)).to_pylist(),
        key=lambda r: (r["event_time"], r["transaction_id"]),
    )
    bodies = [raw_row_to_event(r, OWN_NAMES) for r in day_rows]
    first = next(
        i for i, r in enumerate(day_rows) if r["card_id"] in cards and r["merchant_id"] in terminals
    )
    body = bodies[first]
    assert body["card_id"].isdigit() and body["country"] == "DE" and body["currency"] == "XXX"
    frauds = known_frauds(raw, datetime.now(UTC))
    log = tmp_path / "serve.log"
    decided_from = datetime.now(UTC).date()
    srv = spawn(
        {
            "FRAUD_MAX_EVENT_SKEW_S": "0",  # the export lies in the past
            "FRAUD_REQUEST_TIMEOUT_MS": "30000",  # a day in batches on a shared CI core
            "FRAUD_DECISION_SPOOL_DIR": str(tmp_path / "spool"),
        },
        output=log.open("wb"),
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:

            def score(txns: list[dict[str, object]]) -> list[dict[str, Any]]:
                got = []
                for k in range(0, len(txns), 64):
                    r = http.post("/v1/score/batch", json={"transactions": txns[k : k + 64]})
                    assert r.status_code == 200, (r.text, log.read_text()[-3000:])
                    got += r.json()["results"]
                return got

            # In event-time order, as live: each sees the day's earlier transactions.
            answers = score(bodies[:first])
            r = http.post("/v1/score", json=body)
            assert r.status_code == 200, (r.text, log.read_text()[-3000:])
            out = r.json()
            answers += [out, *score(bodies[first + 1 :])]
    finally:
        srv.stop(timeout_s=15)
    assert out["decision"] in ("approve", "review", "decline")
    assert out["model_version"] == meta.version and out["score"] is not None
    # Every batch feature of a known customer and terminal came from the store: none
    # defaulted as missing or stale.
    assert out["features"] == {"missing": [], "stale": [], "inexact": []}, out
    assert len(answers) == len(bodies) and not any(a["degraded"] for a in answers)
    fraud_scores = [a["score"] for a in answers if a["transaction_id"] in frauds]
    legit_scores = [a["score"] for a in answers if a["transaction_id"] not in frauds]
    assert fraud_scores and np.median(fraud_scores) > np.quantile(legit_scores, 0.99)

    # The served report on the decisions the service logged (days by decision time).
    decided = [
        decided_from + timedelta(days=k)
        for k in range((datetime.now(UTC).date() - decided_from).days + 1)
    ]
    for d in decided:
        assert main(["decisions", "compact", "--date", str(d)]) == 0
    folder = tmp_path / "served"
    args = ["--from", str(decided[0]), "--to", str(decided[-1]), "--out", str(folder)]
    assert main(["evaluate", "--served", *args]) == 0
    served = json.loads((folder / "served.json").read_text())
    assert served["rows"] == len(bodies)
    assert served["labels"]["fraud"] == len(fraud_scores)
    version_report = served["versions"][meta.version]
    assert version_report["rows"] == len(bodies)
    assert version_report["as_decided"]["flagged_recall"] > 0.5, version_report["as_decided"]

    # Online = offline on this data: the vector each logged decision was scored on is
    # the training row of the same transaction (the held-out day is in the holdout).
    holdout = Holdout.read(version / HOLDOUT_FILE)
    row_of = {t: i for i, t in enumerate(holdout.transaction_id)}
    logged = pa.concat_tables(
        pq.read_table(partition_file(raw, "decisions", d)) for d in decided
    ).to_pylist()
    assert {d["transaction_id"] for d in logged} <= set(row_of)
    served_x = np.array(
        [[dict(d["features"])[n] for n in holdout.names] for d in logged], np.float64
    )
    trained_x = holdout.x[[row_of[d["transaction_id"]] for d in logged]].astype(np.float64)
    bad = ~np.isclose(served_x, trained_x, rtol=1e-5, atol=1e-6)
    assert not bad.any(), {
        holdout.names[j]: (logged[i]["transaction_id"], served_x[i, j], trained_x[i, j])
        for i, j in zip(*np.nonzero(bad), strict=True)
    }

    # The features over the export's own fields are model inputs, and what was served
    # equals the naive reference over the raw history (tests/declared_reference.py).
    mine = ["ip_txn_count_1h", "ip_txn_count_1d", "card_distance_max_1d", "home_distance_km"]
    assert set(mine) <= set(holdout.names)
    history = pa.concat_tables(
        pq.read_table(partition_file(raw, "transactions", d)) for d in days
    ).to_pandas()
    by_id = {r["transaction_id"]: r for r in day_rows}
    q = pd.DataFrame([by_id[d["transaction_id"]] for d in logged])
    q = q.rename(columns={"event_time": "event_timestamp"})
    ref = reference(OWN_FEATURES | yaml.safe_load(OWN_FIELDS), q, history, "event_timestamp")
    ref["home_distance_km"] = [
        derived_reference(DISTANCE, {k: float(r[k]) for k in OWN_NAMES[2:6]})
        for r in q.to_dict("records")
    ]
    for name in mine:
        got = np.array([dict(d["features"])[name] for d in logged], np.float64)
        assert np.allclose(got, ref[name], rtol=1e-5, atol=1e-3), name
    served_ip = np.array([dict(d["features"])["ip_txn_count_1h"] for d in logged])
    assert served_ip.max() >= 3 and (served_ip == 0).any()  # bursts; store payments: no IP


def test_the_documented_example_ingests(cli_env: Path) -> None:
    """docs/examples/ (the page's mapping and export) as a user runs it."""
    mapping = Path(__file__).resolve().parent.parent / "docs" / "examples" / "mapping.yaml"
    assert main(["ingest", str(mapping)]) == 0
    raw = cli_env / "raw"
    assert partition_days(raw, "transactions") == [date(2025, 3, 24), date(2025, 3, 25)]
    labels = pq.read_table(partition_file(raw, "labels", date(2025, 4, 24)))
    assert labels.column("transaction_id").to_pylist() == ["100004", "100005"]
    C.check_raw(raw)


def test_ingest_again_keeps_feedback_labels_and_moves_its_own(cli_env: Path) -> None:
    """A run owns the labels of the transactions it ingests: a feedback label compacted
    into one of its label days survives a second run, and a label of its own that lay on
    another day (an earlier arrival rule) is moved, not duplicated."""
    from batch_jobs.decisions import LABEL_SCHEMA, merge_labels

    mapping = Path(__file__).resolve().parent.parent / "docs" / "examples" / "mapping.yaml"
    assert main(["ingest", str(mapping)]) == 0
    raw, day, early = cli_env / "raw", date(2025, 4, 24), date(2025, 4, 20)
    first = pq.read_table(partition_file(raw, "labels", day))
    t = datetime(2025, 4, 24, 23, tzinfo=UTC)
    feedback = pa.table(
        {
            "transaction_id": ["live-1"],
            "card_id": ["c9"],
            "merchant_id": ["m9"],
            "event_time": [t - timedelta(days=3)],
            "label_time": [t],
            "is_fraud": [True],
        }
    )
    merge_labels(raw, day, feedback.cast(LABEL_SCHEMA))
    write_partition(raw, "labels", early, first.slice(0, 1))  # 100004, where it once lay

    assert main(["ingest", str(mapping)]) == 0
    labels = pq.read_table(partition_file(raw, "labels", day))
    assert labels.column("transaction_id").to_pylist() == ["100004", "100005", "live-1"]
    assert early not in partition_days(raw, "labels")
    C.check_raw(raw)


def test_ingest_reads_parquet_with_integer_ids_and_aware_times(
    cli_env: Path, tmp_path: Path
) -> None:
    src = tmp_path / "in"
    src.mkdir()
    t0 = datetime(2025, 6, 1, 12, tzinfo=UTC)
    pq.write_table(
        pa.table(
            {
                "id": pa.array([7, 8, 9], pa.int64()),
                "cust": pa.array([1, 1, 2], pa.int64()),
                "shop": pa.array([3, 3, None], pa.int64()),
                "eur": [5.0, 6.0, 7.0],
                "ts": pa.array([t0, t0 + timedelta(hours=1), t0], pa.timestamp("ms", tz="UTC")),
                "fraud": [False, True, False],
            }
        ),
        src / "export.parquet",
    )
    (src / "m.yaml").write_text(
        """\
transactions:
  files: [export.parquet]
  time_zone: America/New_York   # aware times keep their instant; the zone gives the local hour
  columns:
    transaction_id: id
    card_id: cust
    merchant_id: shop
    amount: eur
    event_time: ts
    channel: {const: ecom}
    country: {const: US}
    currency: {const: usd}
    is_fraud: fraud
labels:
  arrival_delay_days: 10
"""
    )
    assert main(["ingest", str(src / "m.yaml")]) == 0
    t = pq.read_table(partition_file(cli_env / "raw", "transactions", t0.date())).to_pylist()
    assert [r["transaction_id"] for r in t] == ["7", "8"]  # 9 has no merchant: rejected
    assert {r["utc_offset_min"] for r in t} == {-240} and {r["currency"] for r in t} == {"USD"}
    labels = pq.read_table(partition_file(cli_env / "raw", "labels", date(2025, 6, 11)))
    assert labels.column("transaction_id").to_pylist() == ["8"]
    with open(cli_env / "ingest" / "rejects.csv") as f:
        assert [r["reason"] for r in csv.DictReader(f)] == ["missing value: merchant_id"]
