"""The input contract: the raw transactions and labels tables as data, and the check at the door.

Layout (``docs/data-contract.md`` is the page a user reads)::

    raw/transactions/date=YYYY-MM-DD/part-0.parquet   rows whose event_time (UTC) is that day
    raw/labels/date=YYYY-MM-DD/part-0.parquet         labels whose label_time (UTC) is that day

Each partition holds every column of :data:`TRANSACTIONS` (or exactly those of
:data:`LABELS`); a column that a user's export lacks is written by ``fraud-scoring ingest``
with its declared default. :func:`check_raw` reads the partitions a job will read and
raises :class:`ContractError` listing every break (file, column, what, how to fix) before
the job writes anything. The value rules are the event model's
(:class:`fraud_scoring.events.Transaction`), so a raw row is also a valid event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import ValidationError

from fraud_scoring import fields as F
from fraud_scoring.events import (
    AMOUNT_MAX,
    CHANNELS,
    ID_MAX_LEN,
    ID_PATTERN,
    country_codes,
    currency_codes,
)
from fraud_scoring.features import declarations_path
from fraud_scoring.storage import partition_days, partition_file

TS = pa.timestamp("us", tz="UTC")
MAX_OFFSET_MIN = 14 * 60  # UTC-14:00 .. UTC+14:00
INGEST_FIX = "write it with `fraud-scoring ingest` and a mapping (docs/data-contract.md)"


@dataclass(frozen=True)
class Column:
    """One column of a raw table: its stored type, whether a user's export must provide it
    (``required``) or ``fraud-scoring ingest`` writes ``default`` without it, and its rule."""

    name: str
    type: pa.DataType
    rule: str
    required: bool = True
    default: object = None
    nullable: bool = False
    partitions: bool = False  # its UTC day names the partition the row is in


def _id(name: str, rule: str) -> Column:
    return Column(name, pa.string(), f"{rule}; text of 1-{ID_MAX_LEN} characters, no control ones")


TRANSACTION_COLUMNS: tuple[Column, ...] = (
    _id("transaction_id", "unique across every day"),
    _id("card_id", "the card (or customer, account) entity"),
    _id("merchant_id", "the merchant (or terminal) entity"),
    Column("amount", pa.float64(), f"greater than 0 and below {AMOUNT_MAX:g}, in `currency`"),
    Column("currency", pa.string(), "an ISO 4217 code", required=False, default="XXX"),
    Column(
        "event_time",
        TS,
        "a time-zone-aware instant; its UTC day is the partition's day",
        partitions=True,
    ),
    Column(
        "utc_offset_min",
        pa.int16(),
        f"the local time's offset from UTC in minutes, within +-{MAX_OFFSET_MIN}",
        required=False,
        default=0,
    ),
    Column("country", pa.string(), "an ISO 3166-1 alpha-2 code"),
    Column("channel", pa.string(), "one of " + ", ".join(CHANNELS)),
    Column(
        "mcc", pa.string(), "the merchant category code, 4 digits", required=False, default="0000"
    ),
    Column("device_id", pa.string(), "empty when unknown", required=False, nullable=True),
)

LABEL_COLUMNS: tuple[Column, ...] = (
    Column("transaction_id", pa.string(), "the labelled transaction"),
    Column("card_id", pa.string(), "the transaction's card", required=False, nullable=True),
    Column("merchant_id", pa.string(), "the transaction's merchant", required=False, nullable=True),
    Column("event_time", TS, "the transaction's event time", required=False, nullable=True),
    Column(
        "label_time",
        TS,
        "when the label arrived (aware); its UTC day is the partition's",
        partitions=True,
    ),
    Column("is_fraud", pa.bool_(), "true for fraud (a chargeback), false for a cleared one"),
)

TRANSACTIONS = pa.schema([pa.field(c.name, c.type, c.nullable) for c in TRANSACTION_COLUMNS])
LABELS = pa.schema([pa.field(c.name, c.type, c.nullable) for c in LABEL_COLUMNS])
DEFAULTS = {c.name: c.default for c in TRANSACTION_COLUMNS if not c.required}


@dataclass(frozen=True)
class Problem:
    """One break of the contract: where (file), which column, what is wrong, how to fix it."""

    source: str
    column: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.source}: column {self.column!r}: {self.what}; fix: {self.fix}"


class ContractError(ValueError):
    """Input breaks the contract (exit status 2); ``problems`` lists every break found."""

    def __init__(self, problems: list[Problem], shown: int = 20) -> None:
        self.problems = problems
        lines = [str(p) for p in problems[:shown]]
        if len(problems) > shown:
            lines.append(f"... and {len(problems) - shown} more")
        super().__init__(
            "the input breaks the data contract (docs/data-contract.md), nothing was written:\n  "
            + "\n  ".join(lines)
        )


def _first_rows(mask: pa.ChunkedArray | pa.Array, n: int = 3) -> str:
    idx = pc.indices_nonzero(pc.fill_null(mask, False)).to_pylist()
    more = "" if len(idx) <= n else ", ..."
    return f"{len(idx)} row(s), first at row {', '.join(map(str, idx[:n]))}{more}"


def _type_problem(col: Column, t: pa.DataType) -> tuple[str, str] | None:
    """(what, fix) when a stored column's type cannot stand for ``col``, else None."""
    if col.type == TS:
        if not pa.types.is_timestamp(t):
            return f"is {t}, not a timestamp", "store an aware timestamp (UTC)"
        if t.tz is None:
            return (
                "naive timestamp (no time zone): the instant is unknown",
                "store UTC-aware times, or ingest with `time_zone:` in the mapping",
            )
        return None
    if pa.types.is_string(col.type):
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return None
        if pa.types.is_null(t) and col.nullable:
            return None
        what = "integers" if pa.types.is_integer(t) else str(t)
        return f"is {what}, not text", f"store it as strings ({INGEST_FIX}: it casts)"
    if pa.types.is_floating(col.type):
        if pa.types.is_floating(t) or pa.types.is_integer(t):
            return None
        return f"is {t}, not a number", "store it as float64"
    if pa.types.is_integer(col.type):
        return None if pa.types.is_integer(t) else (f"is {t}, not an integer", "store int16")
    if pa.types.is_boolean(col.type):
        return None if pa.types.is_boolean(t) else (f"is {t}, not a boolean", "store bool")
    raise AssertionError(col)


def _value_problems(
    col: Column, values: pa.ChunkedArray, day: date | None, source: str
) -> list[Problem]:
    out: list[Problem] = []

    def bad(mask: pa.ChunkedArray, what: str, fix: str) -> None:
        if pc.any(pc.fill_null(mask, False)).as_py():
            out.append(Problem(source, col.name, f"{what} ({_first_rows(mask)})", fix))

    if not col.nullable:
        bad(pc.is_null(values), "null values", f"give every row a value ({col.rule})")
    v = values
    if pa.types.is_string(col.type):
        v = values.cast(pa.string())
        if col.name in ("transaction_id", "card_id", "merchant_id", "device_id"):
            n = pc.utf8_length(v)
            bad(
                pc.or_(
                    pc.or_(pc.less(n, 1), pc.greater(n, ID_MAX_LEN)),
                    pc.invert(pc.match_substring_regex(v, ID_PATTERN)),
                ),
                "ids must be 1-128 characters without control characters",
                "clean the ids",
            )
        allowed = {
            "currency": currency_codes,
            "country": country_codes,
            "channel": lambda: frozenset(CHANNELS),
        }.get(col.name)
        if allowed is not None:
            bad(
                pc.invert(pc.is_in(v, pa.array(sorted(allowed())))),
                f"values outside the rule ({col.rule})",
                "map them in the ingest mapping",
            )
        if col.name == "mcc":
            bad(pc.invert(pc.match_substring_regex(v, r"^[0-9]{4}$")), "not 4 digits", col.rule)
    elif col.name == "amount":
        a = v.cast(pa.float64())
        bad(
            pc.invert(pc.and_(pc.greater(a, 0), pc.less(a, AMOUNT_MAX))),
            "amounts not > 0 and < 1e9 (or NaN)",
            "drop or correct those rows",
        )
    elif col.name == "utc_offset_min":
        bad(
            pc.greater(pc.abs(v.cast(pa.int32())), MAX_OFFSET_MIN),
            f"offsets beyond +-{MAX_OFFSET_MIN} minutes",
            col.rule,
        )
    elif col.partitions and day is not None:
        lo = datetime.combine(day, datetime.min.time(), UTC)
        t = v.cast(TS)
        outside = pc.or_(
            pc.less(t, pa.scalar(lo, TS)), pc.greater_equal(t, pa.scalar(lo + timedelta(1), TS))
        )
        bad(outside, f"times outside the partition's UTC day {day}", "partition by the UTC day")
    return out


def check_table(
    table: pa.Table, columns: Iterable[Column], source: str, day: date | None = None
) -> list[Problem]:
    """Every break of ``columns``' rules in one table (``day``: the partition it is for).

    Columns not declared are allowed and ignored (the simulator's ``is_fraud``,
    ``fraud_pattern``); an empty table is a break: a day partition holds that day's rows.
    """
    out: list[Problem] = []
    if table.num_rows == 0:
        out.append(Problem(source, "*", "no rows", "write a partition only for a day with rows"))
    for col in columns:
        if col.name not in table.column_names:
            out.append(Problem(source, col.name, "missing", f"add it ({col.rule})"))
            continue
        wrong = _type_problem(col, table.schema.field(col.name).type)
        if wrong:
            out.append(Problem(source, col.name, *wrong))
        elif table.num_rows:
            out.extend(_value_problems(col, table.column(col.name), day, source))
    return out


def check_fields(table: pa.Table, fields: Sequence[F.FieldDecl], source: str) -> list[Problem]:
    """Every break of the declared ``fields`` (``fraud_scoring/fields.py``) in one
    transactions table: a required one missing (an optional one missing reads as its
    default), a wrong type, nulls where the field has a value, values its declaration
    refuses, and for a PII field any value that is not its hash. A value is never
    shown (it may be PII): the rows are."""
    out: list[Problem] = []
    for f in fields:
        if f.name not in table.column_names:
            if f.required:
                out.append(Problem(source, f.name, "missing", "map it (a required declared field)"))
            continue
        col = Column(f.name, f.arrow_type(), f"declared {f.type}", nullable=f.nullable)
        values = table.column(f.name)
        wrong = _type_problem(col, values.type)
        if wrong:
            out.append(Problem(source, f.name, *wrong))
            continue
        if not f.nullable and values.null_count:
            what = f"null values ({_first_rows(pc.is_null(values))})"
            out.append(Problem(source, f.name, what, "give every row a value"))
        check = F.stored(f)
        bad, why = [], ""
        for v in pc.unique(values.drop_null()).to_pylist():  # each distinct value once
            try:
                check.validate_python(v)
            except ValidationError as exc:
                bad.append(v)
                why = why or exc.errors()[0]["msg"]
        if bad:
            what = (
                "clear values, not their hash"
                if f.pii
                else f"values the declaration refuses ({why})"
            )
            rows = _first_rows(pc.is_in(values, pa.array(bad, values.type)))
            fix = (
                "ingest it again with FRAUD_PII_KEY_FILE set"
                if f.pii
                else "fix or reject those rows"
            )
            out.append(Problem(source, f.name, f"{what} ({rows})", fix))
    return out


def duplicate_ids(ids: pa.ChunkedArray | pa.Array) -> list[str]:
    """The values that occur more than once (nulls ignored), sorted."""
    counts = pc.value_counts(
        ids.drop_null() if isinstance(ids, pa.Array) else ids.combine_chunks().drop_null()
    )
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    return sorted(str(v) for v in dup.field("values").to_pylist())


def check_raw(
    raw: Path,
    until: date | None = None,
    need: Iterable[date] = (),
    fields: Sequence[F.FieldDecl] | None = None,
) -> None:
    """Check the raw partitions a job reads: transactions and labels of every day up to
    ``until`` (None: all), and that each day of ``need`` has a transactions partition;
    the transactions hold the declared ``fields`` too (None: this process's, from its
    declarations file). Raises :class:`ContractError` naming every file and column that
    breaks the contract; returns quietly when all hold. Reads every such file once."""
    if fields is None:
        fields = F.declared_fields(declarations_path())
    problems: list[Problem] = []
    for day in need:
        path = partition_file(raw, "transactions", day)
        if not path.exists():
            problems.append(
                Problem(
                    str(path), "*", "missing partition", "run `fraud-scoring ingest` (or simulate)"
                )
            )
    for table, columns in (("transactions", TRANSACTION_COLUMNS), ("labels", LABEL_COLUMNS)):
        ids: list[pa.ChunkedArray] = []
        first_names: tuple[str, list[str]] | None = None
        for day in partition_days(raw, table):
            if until is not None and day > until:
                continue
            path = partition_file(raw, table, day)
            if not path.exists():
                problems.append(
                    Problem(str(path), "*", "missing", "remove the empty partition folder")
                )
                continue
            try:
                data = pq.read_table(path)
            except (pa.ArrowInvalid, OSError) as exc:
                problems.append(
                    Problem(str(path), "*", f"unreadable parquet ({exc})", "rewrite it")
                )
                continue
            problems.extend(check_table(data, columns, str(path), day))
            if table == "transactions":
                problems.extend(check_fields(data, fields, str(path)))
            if first_names is None:
                first_names = (str(path), sorted(data.column_names))
            elif sorted(data.column_names) != first_names[1]:
                problems.append(
                    Problem(
                        str(path),
                        "*",
                        f"columns {sorted(data.column_names)} differ from {first_names[0]}'s "
                        f"{first_names[1]}",
                        "write every partition of a table with the same columns",
                    )
                )
            if table == "transactions" and "transaction_id" in data.column_names:
                ids.append(data.column("transaction_id"))
        if ids:
            dup = duplicate_ids(
                pa.chunked_array([c for a in ids for c in a.cast(pa.string()).chunks])
            )
            if dup:
                problems.append(
                    Problem(
                        str(raw / "transactions"),
                        "transaction_id",
                        f"{len(dup)} id(s) used by more than one row: {', '.join(dup[:5])}",
                        "keep one row per transaction (ingest rejects repeats)",
                    )
                )
    if problems:
        raise ContractError(problems)
