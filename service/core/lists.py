"""Named lists of values of one key column (blocked cards, trusted merchants, ...): their
online-store layout, their read in a micro-batch's round trip, and their changes.

Layout (one hash slot per list: ``{<name>}`` is the hash tag)::

    fraud:list:{<name>}:items  hash   value -> expires_at (epoch s; 0: never)
    fraud:list:{<name>}:meta   hash   value -> JSON {added_by, reason, added_at, expires_at}
    fraud:list:{<name>}:audit  stream op, value, expires_at, key_id, reason, at (append-only)

**Read.** :func:`queue_reads` adds one ``HMGET`` per (list, transaction field) the rules
look up to the micro-batch's own pipeline (no round trip of its own); :func:`members`
turns the replies into one bool column each. An item past its expiry reads as absent.

**Change.** :func:`add` and :func:`remove` run ``lists_change.lua``: the items, their
meta and one audit entry per item change at once, or nothing does (an addition past
``FRAUD_LIST_MAX_ITEMS`` is refused whole). Values are checked against their key column's
contract (:func:`check_value`: an MCC is 4 digits, a country ISO 3166) first.

**Show.** :func:`show` (items by value) and :func:`audit` (changes, oldest first) answer a
:class:`Page` of at most ``limit`` rows and the opaque cursor of the next one (the last
row's value or stream id, encoded; a cursor that does not decode is :class:`BadCursor`).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from fraud_scoring.events import Transaction
from fraud_scoring.rules import RuleSet, member_column, value_of

CHANGE_LUA = (Path(__file__).parent / "lists_change.lua").read_text()
# Items per EVAL of a change: an import of many is several atomic steps (each audited).
CHUNK = 1000


class ListError(ValueError):
    """A list change refused: an unknown list, a value that breaks its column's contract,
    a list past its limit. The message names the item."""


class UnknownList(ListError):
    """The rules file declares no list of that name."""


class BadCursor(ListError):
    """A page's cursor that no page of this list's items (or audit) answered."""


# Rows per page of show/audit (GET /v1/lists/{name}/items and .../audit): the default and
# the most one page holds.
PAGE_DEFAULT, PAGE_MAX = 100, 1000
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


@dataclass(frozen=True)
class Page:
    rows: list[dict[str, Any]]
    next_cursor: str | None  # None: the last page


def _cursor(kind: str, after: str) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{after}".encode()).decode().rstrip("=")


def _after(kind: str, cursor: str) -> str:
    """The value (or stream id) a :func:`_cursor` of ``kind`` holds; BadCursor else."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    found, sep, after = text.partition(":")
    if found != kind or not sep or (kind == "audit" and not _STREAM_ID.fullmatch(after)):
        raise BadCursor(f"not a cursor of this list's {kind}: {cursor[:64]!r}")
    return after


def items_key(name: str) -> str:
    return f"fraud:list:{{{name}}}:items"


def meta_key(name: str) -> str:
    return f"fraud:list:{{{name}}}:meta"


def audit_key(name: str) -> str:
    return f"fraud:list:{{{name}}}:audit"


# --- the micro-batch's read ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListReads:
    """What :func:`queue_reads` queued: the (list, field) pairs, one reply each."""

    pairs: tuple[tuple[str, str], ...]

    def __len__(self) -> int:
        return len(self.pairs)


NO_READS = ListReads(())


def queue_reads(pipe: Any, rules: RuleSet | None, txns: Sequence[Transaction]) -> ListReads:
    """One ``HMGET`` per (list, field) the rules look up, for every transaction's value."""
    if rules is None or not rules.list_reads or not txns:
        return NO_READS
    for name, fld in rules.list_reads:
        pipe.execute_command("HMGET", items_key(name), *[value_of(t, fld) for t in txns])
    return ListReads(rules.list_reads)


def members(
    reads: ListReads, replies: Sequence[Any], now_s: float | None = None
) -> dict[str, np.ndarray]:
    """Per (list, field) read, named by :func:`fraud_scoring.rules.member_column`, which
    rows hold a live item (the replies of :func:`queue_reads`, in order; an error reply
    was refused with the batch's reads already)."""
    now = time.time() if now_s is None else now_s
    out: dict[str, np.ndarray] = {}
    for pair, reply in zip(reads.pairs, replies, strict=True):
        got = np.array(reply, dtype=object)
        hit = got != None  # noqa: E711  # elementwise over the object array
        if hit.any():  # the rare rows on a list: their expiry
            rows = np.flatnonzero(hit)
            until = np.array([float(got[i]) for i in rows])
            hit[rows] = (until == 0) | (until > now)
        out[member_column(*pair)] = hit
    return out


# --- values and changes ----------------------------------------------------------------


def _adapter(column: str) -> TypeAdapter[Any]:
    info = Transaction.model_fields["card_id" if column == "device_id" else column]
    return TypeAdapter(Annotated[info.annotation, info])  # type: ignore[arg-type]


_ADAPTERS: dict[str, TypeAdapter[Any]] = {}


def check_value(column: str, value: str) -> str:
    """``value`` as the key column ``column`` holds it, or ListError saying why not."""
    adapter = _ADAPTERS.get(column)
    if adapter is None:
        adapter = _ADAPTERS[column] = _adapter(column)
    try:
        return str(adapter.validate_python(value.strip()))
    except ValidationError as exc:
        raise ListError(f"{value!r} is not a {column}: {exc.errors()[0]['msg']}") from None


@dataclass(frozen=True)
class Item:
    value: str
    reason: str
    expires_at: datetime | None = None  # None: never


def list_column(rules: RuleSet, name: str) -> str:
    """The key column of the list ``name`` (UnknownList when the rules declare none)."""
    decl = rules.lists.get(name)
    if decl is None:
        known = ", ".join(rules.lists) or "none"
        raise UnknownList(f"no list {name!r} in the rules file (lists: {known})")
    return decl.key


def _epoch(t: datetime | None) -> str:
    return "0" if t is None else repr(t.timestamp())


async def add(
    redis: Any, rules: RuleSet, name: str, items: Sequence[Item], key_id: str, max_items: int
) -> int:
    """Add (or renew) ``items`` to the list ``name`` as ``key_id``; the number of new
    values. Every value is checked before anything is written; the whole addition is
    refused when the list would hold more than ``max_items``."""
    column = list_column(rules, name)
    checked: dict[str, Item] = {}
    now = time.time()
    for i, it in enumerate(items):
        if not it.reason.strip():
            raise ListError(f"items.{i}.reason: say why the item is added")
        if it.expires_at is not None and it.expires_at.timestamp() <= now:
            raise ListError(f"items.{i}.expires_at: {it.expires_at.isoformat()} is past")
        try:
            value = check_value(column, it.value)
        except ListError as exc:
            raise ListError(f"items.{i}.value: {exc}") from None
        checked[value] = Item(value, it.reason, it.expires_at)
    if not checked:
        return 0
    held = await redis.hlen(items_key(name))
    present = await redis.hmget(items_key(name), list(checked))
    new = sum(p is None for p in present)
    if held + new > max_items:
        raise ListError(
            f"list {name!r} holds {held}; {new} new would pass its limit of {max_items} "
            "(FRAUD_LIST_MAX_ITEMS): nothing was added"
        )
    added = 0
    values = list(checked.values())
    for start in range(0, len(values), CHUNK):
        args: list[str] = []
        for it in values[start : start + CHUNK]:
            meta = {
                "added_by": key_id,
                "reason": it.reason,
                "added_at": now,
                "expires_at": it.expires_at.timestamp() if it.expires_at else None,
            }
            args += [it.value, _epoch(it.expires_at), it.reason, json.dumps(meta)]
        added += int(await _change(redis, name, "add", max_items, key_id, now, args))
    return added


async def remove(
    redis: Any, rules: RuleSet, name: str, values: Sequence[str], reason: str, key_id: str
) -> int:
    """Remove ``values`` from the list ``name`` as ``key_id``; the number removed."""
    list_column(rules, name)
    if not reason.strip():
        raise ListError("reason: say why the items are removed")
    now, removed = time.time(), 0
    unique = list(dict.fromkeys(v.strip() for v in values))
    for start in range(0, len(unique), CHUNK):
        args = [x for v in unique[start : start + CHUNK] for x in (v, reason)]
        removed += int(await _change(redis, name, "remove", 0, key_id, now, args))
    return removed


async def _change(
    redis: Any, name: str, op: str, max_items: int, key_id: str, now: float, args: list[str]
) -> Any:
    keys = (items_key(name), meta_key(name), audit_key(name))
    try:
        return await redis.eval(CHANGE_LUA, 3, *keys, op, max_items, key_id, repr(now), *args)
    except Exception as exc:  # the script's refusal (a race past the pre-check)
        if str(exc).startswith("TOO_MANY"):
            raise ListError(f"list {name!r}: {exc}; nothing was added") from None
        raise


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def show(
    redis: Any, rules: RuleSet, name: str, limit: int = PAGE_DEFAULT, cursor: str | None = None
) -> Page:
    """A page of the list's items (value, added_by, reason, added_at, expires_at,
    expired), by value, after the one ``cursor`` names (None: from the first)."""
    list_column(rules, name)
    values = sorted(_text(v) for v in await redis.hkeys(meta_key(name)))
    start = 0 if cursor is None else bisect.bisect_right(values, _after("items", cursor))
    chosen = values[start : start + limit]
    metas = await redis.hmget(meta_key(name), chosen) if chosen else []
    now, out = time.time(), []
    for value, raw in zip(chosen, metas, strict=True):
        if raw is None:  # removed since the values were read
            continue
        meta = json.loads(_text(raw))
        until = meta.get("expires_at")
        out.append(
            {
                "value": value,
                "added_by": meta.get("added_by"),
                "reason": meta.get("reason"),
                "added_at": _iso(meta.get("added_at")),
                "expires_at": _iso(until),
                "expired": until is not None and until <= now,
            }
        )
    more = start + limit < len(values)
    return Page(out, _cursor("items", chosen[-1]) if more else None)


async def audit(
    redis: Any, rules: RuleSet, name: str, limit: int = PAGE_DEFAULT, cursor: str | None = None
) -> Page:
    """A page of the list's audit entries, oldest first, after the one ``cursor`` names
    (None: from the oldest)."""
    list_column(rules, name)
    start = "-" if cursor is None else f"({_after('audit', cursor)}"
    entries = await redis.xrange(audit_key(name), min=start, count=limit + 1)
    out = []
    for entry_id, fields in entries[:limit]:
        f = {_text(k): _text(v) for k, v in fields.items()}
        out.append(
            {
                "id": _text(entry_id),
                "op": f.get("op"),
                "value": f.get("value"),
                "key_id": f.get("key_id"),
                "reason": f.get("reason"),
                "at": _iso(float(f["at"])) if f.get("at") else None,
                "expires_at": _iso(float(f["expires_at"]))
                if f.get("expires_at") not in (None, "", "0")
                else None,
            }
        )
    more = len(entries) > limit
    return Page(out, _cursor("audit", _text(entries[limit - 1][0])) if more else None)


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat()
