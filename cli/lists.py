"""``fraud-scoring lists add|remove|show|import``: the analysts' lists from a shell, against
the online store (REDIS_URL) and the rules file the service reads (FRAUD_RULES_FILE), with
the same checks, limit and audit trail as ``/v1/lists`` (service/core/lists.py). Changes
are audited under ``--by`` (default ``cli:<user>``)."""

from __future__ import annotations

import argparse
import asyncio
import csv
import getpass
import json
import sys
from pathlib import Path
from typing import Any

from cli.settings import Settings
from fraud_scoring.commands import Command, UsageError, aware_time
from fraud_scoring.redis_clients import async_client
from fraud_scoring.redis_server import redis_url
from service.core import lists
from service.core.rules import RulesHolder


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="lists_command", required=True, metavar="ACTION")
    me = f"cli:{getpass.getuser()}"
    by_help = "who changes it, for the audit trail"
    add = sub.add_parser("add", help="add (or renew) values")
    add.add_argument("name")
    add.add_argument("values", nargs="+")
    add.add_argument("--reason", required=True, help="why they are on the list")
    add.add_argument("--expires-at", type=aware_time, help="RFC 3339 with offset; default never")
    add.add_argument("--by", default=me, help=by_help)
    rm = sub.add_parser("remove", help="remove values")
    rm.add_argument("name")
    rm.add_argument("values", nargs="+")
    rm.add_argument("--reason", required=True)
    rm.add_argument("--by", default=me, help=by_help)
    show = sub.add_parser("show", help="the list's items as JSON lines, every page")
    show.add_argument("name")
    show.add_argument("--audit", action="store_true", help="its audit trail instead")
    imp = sub.add_parser(
        "import", help="add the rows of a CSV (value[,reason][,expires_at]; a header row)"
    )
    imp.add_argument("name")
    imp.add_argument("csv", type=Path)
    imp.add_argument("--reason", help="for rows without one")
    imp.add_argument("--by", default=me, help=by_help)


def read_csv(path: Path, reason: str | None) -> list[lists.Item]:
    """The CSV's rows as items; a row without a value or a reason, or with a bad expiry,
    is refused naming its line (nothing is added)."""
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    items = []
    for n, row in enumerate(rows, start=2):
        value = (row.get("value") or "").strip()
        why = (row.get("reason") or "").strip() or reason
        if not value:
            raise UsageError(f"{path}:{n}: value: missing (columns: value, reason, expires_at)")
        if not why:
            raise UsageError(f"{path}:{n}: reason: missing (or give --reason)")
        until = None
        if text := (row.get("expires_at") or "").strip():
            try:
                until = aware_time(text)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"{path}:{n}: expires_at: {exc}") from None
        items.append(lists.Item(value, why, until))
    return items


async def _run(args: argparse.Namespace, settings: Settings, url: str) -> Any:
    rules = RulesHolder.of(settings).current
    client = async_client(url)
    try:
        name, action = args.name, args.lists_command
        if action == "add":
            items = [lists.Item(v, args.reason, args.expires_at) for v in args.values]
        elif action == "import":
            items = read_csv(args.csv, args.reason)
        if action in ("add", "import"):
            n = await lists.add(client, rules, name, items, args.by, settings.list_max_items)
            return f"{name}: {n} added, {len(items) - n} renewed"
        if action == "remove":
            n = await lists.remove(client, rules, name, args.values, args.reason, args.by)
            return f"{name}: {n} removed"
        read = lists.audit if args.audit else lists.show
        rows, cursor = [], None
        while True:  # page by page, as GET /v1/lists/{name}/items answers them
            page = await read(client, rules, name, lists.PAGE_MAX, cursor)
            rows += page.rows
            if (cursor := page.next_cursor) is None:
                return rows
    finally:
        await client.aclose()


def run(args: argparse.Namespace, settings: Settings) -> None:
    with redis_url(settings.redis_url, allow_embedded=False) as url:
        out = asyncio.run(_run(args, settings, url))
    if isinstance(out, str):
        print(out)
        return
    for row in out:
        sys.stdout.write(json.dumps(row) + "\n")


COMMAND = Command(
    "lists",
    "Show and change the analysts' block and allow lists (docs/rules.md).",
    run,
    configure,
    settings=Settings,
)
