"""``fraud-scoring lists`` (cli/lists.py) against a real Redis-protocol server of its own:
add, show, import a CSV, remove, the audit trail with ``--by``, and a bad CSV row refused
naming its line with nothing added."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fraud_scoring.redis_server import embedded_redis

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with embedded_redis() as u:
        yield u


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", "lists", *args],
        env={**os.environ, "REDIS_URL": url, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_add_import_show_remove_and_the_audit_trail(url: str, tmp_path: Path) -> None:
    added = cli(url, "add", "blocked_cards", "c1", "c2", "--reason", "case 9", "--by", "ana")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == "blocked_cards: 2 added, 0 renewed"
    csv = tmp_path / "cards.csv"
    csv.write_text("value,reason,expires_at\nc3,chargeback,2099-01-01T00:00:00+00:00\nc1,,\n")
    imported = cli(url, "import", "blocked_cards", str(csv), "--reason", "bulk", "--by", "ana")
    assert imported.stdout.strip() == "blocked_cards: 1 added, 1 renewed", imported.stderr
    shown = {r["value"]: r for r in rows(cli(url, "show", "blocked_cards").stdout)}
    assert sorted(shown) == ["c1", "c2", "c3"]
    assert (shown["c1"]["reason"], shown["c1"]["added_by"]) == ("bulk", "ana")
    assert shown["c3"]["expires_at"] == "2099-01-01T00:00:00+00:00"
    removed = cli(url, "remove", "blocked_cards", "c2", "--reason", "paid", "--by", "bob")
    assert removed.stdout.strip() == "blocked_cards: 1 removed"
    audit = rows(cli(url, "show", "blocked_cards", "--audit").stdout)
    assert [(a["op"], a["value"], a["key_id"]) for a in audit] == [
        ("add", "c1", "ana"),
        ("add", "c2", "ana"),
        ("add", "c3", "ana"),
        ("add", "c1", "ana"),
        ("remove", "c2", "bob"),
    ]


def test_a_bad_row_or_value_is_refused_naming_it_and_adds_nothing(url: str, tmp_path: Path) -> None:
    csv = tmp_path / "bad.csv"
    csv.write_text("value,reason\nd-ok,seen in fraud\n,no value\n")
    bad = cli(url, "import", "blocked_devices", str(csv))
    assert bad.returncode == 2 and f"{csv}:3: value: missing" in bad.stderr, bad.stderr
    wrong = cli(url, "add", "blocked_devices", "d-ok", "bad\x01id", "--reason", "r")
    assert wrong.returncode == 2 and "items.1.value" in wrong.stderr, wrong.stderr
    unknown = cli(url, "show", "stolen_cards")
    assert unknown.returncode == 2 and "no list 'stolen_cards'" in unknown.stderr
    assert rows(cli(url, "show", "blocked_devices").stdout) == []


def test_show_follows_every_page(url: str, tmp_path: Path) -> None:
    """More items than one page holds (service.core.lists.PAGE_MAX): ``show`` prints them
    all, once each, by value, and the audit trail as whole."""
    from service.core.lists import PAGE_MAX

    n = PAGE_MAX * 2 + 5
    csv = tmp_path / "merchants.csv"
    csv.write_text("value\n" + "".join(f"m{i:05d}\n" for i in range(n)))
    done = cli(url, "import", "trusted_merchants", str(csv), "--reason", "bulk")
    assert done.stdout.strip() == f"trusted_merchants: {n} added, 0 renewed", done.stderr
    shown = [r["value"] for r in rows(cli(url, "show", "trusted_merchants").stdout)]
    assert shown == [f"m{i:05d}" for i in range(n)]
    audit = rows(cli(url, "show", "trusted_merchants", "--audit").stdout)
    assert [a["value"] for a in audit] == shown
