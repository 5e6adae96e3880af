"""``fraud-scoring ingest``: a user's CSV or parquet export into the raw daily partitions.

A mapping file (YAML, :class:`Mapping`) says which of the user's columns is which contract
field (``fraud_scoring/contract.py``), with casts, constants and value maps, the time zone
of naive times, and when labels arrived (a column, or event time + N days). Rows that
cannot be read (malformed lines, missing or unparsable values, repeated ids) are written
to a rejects file with the reason, never dropped silently. A break of the mapping itself
(a column that is not there, naive times and no zone) is refused before anything is
written, and so is a file that is empty, not UTF-8 or not CSV. Idempotent per day: each
UTC day the run holds is replaced as a whole (written beside, then renamed), so the same
input writes the same files; a run owns the labels of the transactions it ingests and
keeps every other label (feedback). Layout and rules: ``docs/data-contract.md``.
"""

from __future__ import annotations

import codecs
import csv
import json
import logging
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from tqdm import tqdm

from fraud_scoring import contract as C
from fraud_scoring import fields as F
from fraud_scoring.events import CHANNELS, ID_MAX_LEN, country_codes, currency_codes
from fraud_scoring.storage import (
    partition_days,
    partition_dir,
    read_partition,
    staging_dir,
    write_partition,
)

log = logging.getLogger(__name__)

TIME_FIELDS = ("event_time", "label_time")
LABEL_FIELDS = ("transaction_id", "is_fraud", "label_time")
# A label attribute: mapped in the labels (or the transactions), kept on the transaction's
# row (the simulator's ground truth too), where the evaluation report reads it.
PATTERN = "fraud_pattern"

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}
_HAS_OFFSET = re.compile(r"(?:Z|[+-]\d\d:?\d\d)$")


class Source(BaseModel):
    """How one contract field is read: a column of the user's file or a constant, a map of
    values (e.g. ``ONLINE: ecom``), and for times a ``format`` (strptime, ``epoch_s``,
    ``epoch_ms``; default ISO 8601)."""

    model_config = ConfigDict(extra="forbid")
    column: str | None = None
    const: str | int | float | bool | None = None
    map: dict[str, str] | None = None
    format: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: object) -> object:
        return {"column": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _one(self) -> Source:
        if (self.column is None) == (self.const is None):
            raise ValueError("give exactly one of column or const")
        return self


class Files(BaseModel):
    model_config = ConfigDict(extra="forbid")
    files: list[str] = Field(
        default_factory=list, description="paths or globs, relative to the mapping"
    )
    format: Literal["csv", "parquet"] | None = None  # default: from the file's extension
    delimiter: str = Field(",", min_length=1, max_length=1)
    time_zone: str | None = None  # of naive times: an IANA zone or a fixed offset (+05:30)
    columns: dict[str, Source]

    @model_validator(mode="after")
    def _zone(self) -> Files:
        if self.time_zone is not None:
            zone(self.time_zone)
        return self


class TransactionFiles(Files):
    @model_validator(mode="after")
    def _fields(self, info: ValidationInfo) -> TransactionFiles:
        declared: tuple[F.FieldDecl, ...] = (info.context or {}).get("fields", ())
        known = {c.name for c in C.TRANSACTION_COLUMNS} | {"is_fraud", PATTERN}
        known |= {f.name for f in declared}
        unknown = sorted(set(self.columns) - known)
        if unknown:
            raise ValueError(
                f"columns: not contract fields: {unknown} (known: {sorted(known)}; declare "
                "a field of your own in the declarations file's fields: section)"
            )
        missing = [
            c.name for c in C.TRANSACTION_COLUMNS if c.required and c.name not in self.columns
        ]
        missing += [f.name for f in declared if f.required and f.name not in self.columns]
        if missing:
            raise ValueError(
                f"columns: required fields not mapped: {missing} (map a column, or a const "
                "such as `country: {const: DE}` when the export has none)"
            )
        if not self.files:
            raise ValueError("files: list the export's files")
        return self


class LabelFiles(Files):
    arrival_delay_days: float | None = Field(None, gt=0)  # label_time = event_time + N days
    # Labels from the transaction files' is_fraud column (no files) map no column.
    columns: dict[str, Source] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fields(self) -> LabelFiles:
        unknown = sorted(set(self.columns) - {*LABEL_FIELDS, PATTERN})
        if unknown:
            raise ValueError(
                f"columns: not label fields: {unknown} (known: {[*LABEL_FIELDS, PATTERN]})"
            )
        missing = [f for f in ("transaction_id", "is_fraud") if f not in self.columns]
        if missing and self.files:
            raise ValueError(
                f"columns: {' and '.join(missing)} not mapped: a labels file maps both, e.g. "
                "`columns: {transaction_id: TX_ID, is_fraud: FRAUD}` (labels from an is_fraud "
                "column of the transaction files take no files and no columns)"
            )
        if ("label_time" in self.columns) == (self.arrival_delay_days is not None):
            raise ValueError(
                "give exactly one of columns.label_time (when each label arrived) or "
                "arrival_delay_days (label_time = event_time + N days)"
                + (
                    ""
                    if self.files
                    else "; labels from an is_fraud column (no files) need `arrival_delay_days: N`"
                )
            )
        return self


class Mapping(BaseModel):
    """The mapping file: ``transactions`` (required) and ``labels``. Labels without
    ``files`` come from the transaction files' ``is_fraud`` column (the frauds only)."""

    model_config = ConfigDict(extra="forbid")
    transactions: TransactionFiles
    labels: LabelFiles | None = None

    @model_validator(mode="after")
    def _inline(self) -> Mapping:
        if (
            self.labels is not None
            and not self.labels.files
            and "is_fraud" not in self.transactions.columns
        ):
            raise ValueError("labels: without files, map is_fraud in transactions.columns")
        return self


def zone(name: str) -> ZoneInfo | timezone:
    """An IANA zone (``Europe/Berlin``) or a fixed offset (``+05:30``, ``-03:00``)."""
    m = re.fullmatch(r"([+-])(\d\d):?(\d\d)", name)
    if m:
        sign = 1 if m.group(1) == "+" else -1
        return timezone(sign * timedelta(hours=int(m.group(2)), minutes=int(m.group(3))))
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"time_zone: unknown zone {name!r} (an IANA name or +HH:MM)") from None


def load_mapping(path: Path, fields: tuple[F.FieldDecl, ...] = ()) -> Mapping:
    """Read and validate a mapping file (``fields``: the declared ones, which it may map
    too); errors name the file and the field."""
    try:
        raw = yaml.safe_load(path.read_text())
        return Mapping.model_validate(raw, context={"fields": fields})
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the mapping ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({exc})") from exc
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'mapping'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"{path}: {errs}") from None


# --- reading ------------------------------------------------------------------------------


@dataclass
class Rejects:
    """Rows refused, with their reason: a category (the summary counts them) and a detail."""

    rows: list[dict[str, str]] = field(default_factory=list)
    # A mapped PII field's clear value must not land here: malformed lines are not shown.
    hide_lines: bool = False

    def add(self, source: str, row: object, category: str, detail: str, record: object) -> None:
        self.rows.append(
            {
                "source": source,
                "row": str(row),
                "reason": category,
                "detail": detail,
                "record": json.dumps(record, default=str),
            }
        )

    def counts(self) -> Counter[str]:
        return Counter(r["reason"] for r in self.rows)


def _files(spec: Files, base: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in spec.files:
        p = Path(pattern)
        found = sorted(p.parent.glob(p.name)) if p.is_absolute() else sorted(base.glob(pattern))
        if not found:
            raise C.ContractError(
                [C.Problem(str(base / pattern), "*", "no file matches", "fix files:")]
            )
        out.extend(found)
    return out


def _refuse(path: Path, what: str, fix: str) -> C.ContractError:
    return C.ContractError([C.Problem(str(path), "*", what, fix)])


def _check_text(path: Path) -> bool:
    """Refuse (ContractError naming the file) a CSV that is empty (0 bytes, or blank: no
    header line) or not UTF-8 (with the offset of the first bad byte). Returns whether a
    line break follows the header's first character (a header alone without one is read
    apart: pyarrow wants it ended)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, blank, newline = 0, True, False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the chunk
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset - pending + exc.start, exc) from None
            if not chunk:
                break
            if blank:  # from the first character that is not blank on
                text = text.lstrip("\ufeff \t\r\n\f\v")
                blank = not text
            newline = newline or "\n" in text or "\r" in text
            offset += len(chunk)
    if offset == 0:
        raise _refuse(path, "empty file (0 bytes)", "export the file again, with its header")
    if blank:
        raise _refuse(
            path, "empty file (blank, no header line)", "export the file again, with its header"
        )
    return newline


def _not_utf8(path: Path, at: int, exc: UnicodeDecodeError) -> C.ContractError:
    bom = at == 0 and exc.object[:2] in (b"\xff\xfe", b"\xfe\xff")
    return _refuse(
        path,
        f"not UTF-8: byte 0x{exc.object[exc.start : exc.start + 1].hex()} at offset {at}"
        + (" (a UTF-16 byte order mark)" if bom else ""),
        "export the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
    )


def _read_csv(path: Path, spec: Files, rejects: Rejects) -> pd.DataFrame:
    """A CSV as text columns, its malformed lines in ``rejects``; a file that is empty,
    not UTF-8 or that pyarrow cannot parse is refused (ContractError) naming it."""
    has_newline = _check_text(path)

    def malformed(row: pacsv.InvalidRow) -> str:
        try:
            text: object = row.text
        except ValueError:  # UnicodeDecodeError: not after _check_text, but never a crash
            text = "(not UTF-8)"
        if rejects.hide_lines:
            text = "(not shown: the mapping maps a pii field)"
        rejects.add(
            str(path),
            "?",
            "malformed line",
            f"{row.actual_columns} fields, expected {row.expected_columns}",
            text,
        )
        return "skip"

    data = None if has_newline else path.read_bytes() + b"\n"  # a header alone: ended
    size = path.stat().st_size + 1
    mark = len(rejects.rows)
    try:
        for block in (None, size):
            # A line longer than a block (a huge field) straddles blocks: then the file
            # is read again as one block.
            del rejects.rows[mark:]
            read = pacsv.ReadOptions() if block is None else pacsv.ReadOptions(block_size=block)
            try:
                probe = pacsv.open_csv(
                    path if data is None else pa.BufferReader(data),
                    read_options=read,
                    parse_options=pacsv.ParseOptions(
                        delimiter=spec.delimiter, invalid_row_handler=lambda _: "skip"
                    ),
                )
                header = probe.schema.names
                probe.close()
                return pacsv.read_csv(
                    path if data is None else pa.BufferReader(data),
                    read_options=read,
                    parse_options=pacsv.ParseOptions(
                        delimiter=spec.delimiter, invalid_row_handler=malformed
                    ),
                    convert_options=pacsv.ConvertOptions(
                        column_types={h: pa.string() for h in header}, strings_can_be_null=False
                    ),
                ).to_pandas()
            except pa.ArrowInvalid as exc:
                if block is not None or "straddl" not in str(exc) or size >= 1 << 31:
                    raise
        raise AssertionError("unreachable")
    except pa.ArrowMemoryError:
        raise
    except pa.ArrowException as exc:
        msg = str(exc).splitlines()[0][:200]
        if "cannot infer number of columns" in msg:  # not blank, yet no header row: a quote
            msg = "the header line does not end: a quote not closed?"
        raise _refuse(
            path,
            f"not readable as CSV ({msg})",
            "fix the file (quotes, line breaks, delimiter) or export it again",
        ) from None


def read_file(path: Path, spec: Files, rejects: Rejects) -> pd.DataFrame:
    """One source file as a frame (CSV: every column as text), with ``_source`` and ``_row``
    (the record's number among the file's well-formed ones). Malformed CSV lines go to
    ``rejects``. Raises ContractError when the file is empty, not UTF-8 or not readable as
    CSV (parquet), when a mapped column is not in the file or in it more than once."""
    fmt = spec.format or ("parquet" if path.suffix in (".parquet", ".pq") else "csv")
    if fmt == "parquet":
        try:
            df = pq.read_table(path).to_pandas()
        except pa.ArrowMemoryError:
            raise
        except pa.ArrowException as exc:
            raise _refuse(
                path,
                f"not readable as parquet ({str(exc).splitlines()[0][:200]})",
                "export the file again",
            ) from None
    else:
        df = _read_csv(path, spec, rejects)
    wanted = {s.column for s in spec.columns.values() if s.column is not None}
    missing = sorted(wanted - set(df.columns))
    if missing:
        raise C.ContractError(
            [
                C.Problem(
                    str(path),
                    m,
                    "not in the file",
                    f"fix the mapping (the file has {list(df.columns)})",
                )
                for m in missing
            ]
        )
    seen = Counter(map(str, df.columns))
    twice = sorted(m for m in wanted if seen[m] > 1)
    if twice:
        raise C.ContractError(
            [
                C.Problem(str(path), m, f"{seen[m]} columns of this name", "rename all but one")
                for m in twice
            ]
        )
    if any(n > 1 for n in seen.values()):  # unmapped repeats: kept, told apart
        names: list[str] = []
        for c in map(str, df.columns):
            k = 0
            while (name := c if k == 0 else f"{c}.{k}") in names or (k and name in seen):
                k += 1
            names.append(name)
        df.columns = pd.Index(names)
    df["_source"], df["_row"] = str(path), np.arange(1, len(df) + 1)
    return df


# --- casting ------------------------------------------------------------------------------


def _raw(df: pd.DataFrame, src: Source) -> pd.Series:
    if src.const is not None:
        return pd.Series([src.const] * len(df), index=df.index, dtype=object)
    s = df[src.column]
    if src.map:
        s = s.map(lambda v: src.map.get(str(v), v) if src.map else v)
    return s


def _text(s: pd.Series) -> pd.Series:
    """Values as stripped strings; missing (None, NaN, empty) as None. Integral floats (a
    parquet integer column with nulls) lose their ``.0``."""
    if pd.api.types.is_float_dtype(s):
        s = s.map(
            lambda v: None if pd.isna(v) else (str(int(v)) if float(v).is_integer() else str(v))
        )
    out = s.map(
        lambda v: None if v is None or (not isinstance(v, str) and pd.isna(v)) else str(v).strip()
    )
    return out.where(out != "", None)


def _times(
    s: pd.Series, src: Source, tz: str | None, offset_min: pd.Series | None, name: str, where: str
) -> tuple[pd.Series, pd.Series, pd.Series, pd.Series]:
    """(UTC instants, local UTC offsets in minutes, unparsable mask, mask of local times
    the zone skips or repeats at a DST change) for one time field. Aware strings keep
    their own offset; naive ones take ``tz`` (or the mapped ``utc_offset_min``); a naive
    time with neither is a contract break."""
    idx = s.index
    no_gap = pd.Series(False, index=idx)
    if src.format in ("epoch_s", "epoch_ms"):
        num = pd.to_numeric(s, errors="coerce")
        lim = 9e9 if src.format == "epoch_s" else 9e12  # beyond ~2255: unparsable, no overflow
        num = num.where(num.abs() < lim)
        utc = pd.to_datetime(
            num, unit="s" if src.format == "epoch_s" else "ms", utc=True, errors="coerce"
        )
        local_off = _zone_offsets(utc, tz) if tz else pd.Series(0, index=idx)
        return utc, local_off, utc.isna(), no_gap
    if pd.api.types.is_datetime64_any_dtype(s):
        if s.dt.tz is not None:  # aware parquet timestamps
            utc = s.dt.tz_convert("UTC")
            off = _zone_offsets(utc, tz) if tz else pd.Series(0, index=idx)
            return utc, off, utc.isna(), no_gap
        naive = s
        aware_mask = pd.Series(False, index=idx)
    else:
        text = _text(s)
        aware_mask = text.fillna("").str.contains(_HAS_OFFSET)
        naive = pd.to_datetime(text.where(~aware_mask), format=src.format, errors="coerce")
    utc = pd.Series(pd.NaT, index=idx, dtype="datetime64[ns, UTC]")
    off = pd.Series(0, index=idx, dtype=np.int64)
    if aware_mask.any():
        parsed = text[aware_mask].map(_aware)
        utc[aware_mask] = pd.to_datetime(parsed.map(lambda v: v[0]), utc=True)
        off[aware_mask] = parsed.map(lambda v: v[1]).astype(np.int64)
    n_naive = (~aware_mask & naive.notna()).sum()
    gap = no_gap
    if n_naive:
        sel = ~aware_mask & naive.notna()
        if tz is not None:
            loc = naive[sel].dt.tz_localize(zone(tz), ambiguous="NaT", nonexistent="NaT")
            utc[sel] = loc.dt.tz_convert("UTC")
            ok = sel & utc.notna()
            gap = sel & utc.isna()
            off[ok] = (
                (naive[ok] - utc[ok].dt.tz_localize(None)) // pd.Timedelta(minutes=1)
            ).astype(np.int64)
        elif offset_min is not None:
            utc[sel] = (naive[sel] - pd.to_timedelta(offset_min[sel], unit="min")).dt.tz_localize(
                "UTC"
            )
            off[sel] = offset_min[sel].astype(np.int64)
        else:
            raise C.ContractError(
                [
                    C.Problem(
                        where,
                        f"{name} ({src.column})",
                        f"{n_naive} naive time(s) (no UTC offset) and no time zone declared",
                        "add `time_zone:` (e.g. Europe/Berlin) to the mapping, "
                        "or map utc_offset_min",
                    )
                ]
            )
    return utc, off, utc.isna() & ~gap, gap


def _aware(v: str) -> tuple[Any, int]:
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00"))
        ts = pd.Timestamp(t)  # beyond pandas' nanoseconds (1677..2262): unparsable
        (ts.tz_convert("UTC") if ts.tzinfo is not None else ts).as_unit("ns")
    except (ValueError, OverflowError):
        return pd.NaT, 0
    o = t.utcoffset()
    return t, int(o.total_seconds() // 60) if o is not None else 0


def _zone_offsets(utc: pd.Series, tz: str) -> pd.Series:
    local = utc.dt.tz_convert(zone(tz)).dt.tz_localize(None)
    return (
        ((local - utc.dt.tz_localize(None)) // pd.Timedelta(minutes=1)).fillna(0).astype(np.int64)
    )


def _bad(mask: pd.Series, reasons: pd.Series, category: str, detail: str) -> None:
    """Give each row of ``mask`` without a reason yet this one."""
    new = mask & (reasons == "")
    reasons[new] = category + "\x1f" + detail


def cast_transactions(
    df: pd.DataFrame, spec: TransactionFiles, door: F.Door = F.PLAIN
) -> tuple[pd.DataFrame, pd.Series]:
    """The contract's columns and the declared fields (``door``) from a source frame, and
    each row's first reason to refuse it ("" for none): missing required values,
    unparsable values, rule breaks."""
    reasons = pd.Series("", index=df.index, dtype=object)
    where = str(df["_source"].iloc[0]) if len(df) else "transactions"
    out: dict[str, pd.Series] = {}
    offset_src = spec.columns.get("utc_offset_min")
    offset = pd.to_numeric(_raw(df, offset_src), errors="coerce") if offset_src else None
    for col in C.TRANSACTION_COLUMNS:
        name = col.name
        src = spec.columns.get(name)
        if name == "utc_offset_min":
            continue  # set with event_time
        if src is None:
            out[name] = pd.Series([col.default] * len(df), index=df.index, dtype=object)
            continue
        raw = _raw(df, src)
        if name == "event_time":
            utc, off, bad, gap = _times(raw, src, spec.time_zone, offset, name, where)
            _bad(
                gap,
                reasons,
                "rule: event_time",
                f"the local time does not exist or is ambiguous in {spec.time_zone} (DST change)",
            )
            _bad(bad & _text(raw).notna(), reasons, "unparsable value: event_time", "not a time")
            _bad(
                _text(raw).isna() if not pd.api.types.is_datetime64_any_dtype(raw) else raw.isna(),
                reasons,
                "missing value: event_time",
                "empty",
            )
            out["event_time"], out["utc_offset_min"] = utc, off
            _bad(
                off.abs() > C.MAX_OFFSET_MIN,
                reasons,
                "unparsable value: utc_offset_min",
                "beyond +-14 h",
            )
            continue
        if name == "amount":
            text = _text(raw)
            num = pd.to_numeric(text, errors="coerce")
            _bad(text.isna(), reasons, "missing value: amount", "empty")
            _bad(num.isna(), reasons, "unparsable value: amount", "not a number")
            _bad(~((num > 0) & (num < C.AMOUNT_MAX)), reasons, "rule: amount", col.rule)
            out[name] = num
            continue
        text = _text(raw)
        if name in ("currency", "country"):
            text = text.str.upper()
        elif name == "channel":
            text = text.str.lower()
        elif name == "mcc":
            text = text.map(
                lambda v: v.zfill(4) if v is not None and v.isdigit() and len(v) < 4 else v
            )
        if not col.nullable:
            if col.default is not None:
                text = text.fillna(col.default)
            _bad(text.isna(), reasons, f"missing value: {name}", "empty")
        allowed = {
            "currency": currency_codes(),
            "country": country_codes(),
            "channel": frozenset(CHANNELS),
        }.get(name)
        if allowed is not None:
            _bad(text.notna() & ~text.isin(allowed), reasons, f"rule: {name}", col.rule)
        if name == "mcc":
            _bad(
                text.notna() & ~text.fillna("").str.fullmatch(r"[0-9]{4}"),
                reasons,
                "rule: mcc",
                col.rule,
            )
        if name.endswith("_id"):
            n = text.fillna("").str.len()
            ctrl = text.fillna("").str.contains(r"[\x00-\x1f\x7f]")
            _bad(text.notna() & ((n > ID_MAX_LEN) | ctrl), reasons, f"rule: {name}", col.rule)
        out[name] = text
    if "is_fraud" in spec.columns:
        flag = _flags(_raw(df, spec.columns["is_fraud"]))
        _bad(flag.isna(), reasons, "unparsable value: is_fraud", "not true/false or 1/0")
        out["is_fraud"] = flag
    if PATTERN in spec.columns:
        out[PATTERN] = _text(_raw(df, spec.columns[PATTERN]))
    for f in door.fields:
        out[f.name] = cast_field(df, spec, f, reasons, where, door)
    frame = pd.DataFrame(out, index=df.index)
    return frame, reasons


def cast_field(
    df: pd.DataFrame,
    spec: TransactionFiles,
    f: F.FieldDecl,
    reasons: pd.Series,
    where: str,
    door: F.Door,
) -> pd.Series:
    """A declared field's column from its source (unmapped: taken from its ``from``
    field's column, else its default, or null), each value checked by the declaration as
    the API checks it (``rule: <field>``, the check's message), a PII field's then
    hashed."""
    src = spec.columns.get(f.name)
    if src is None and f.source is not None and f.source in spec.columns:
        # taken from its source's clear values (before that one's hash), as at the API
        src = spec.columns[f.source]
        raw = _text(_raw(df, src)).map(lambda v: None if v is None else f.derive(v))
    elif src is None:
        return pd.Series([f.default] * len(df), index=df.index, dtype=object)
    else:
        raw = _raw(df, src)
    name = f.name
    if f.type == "timestamp":
        values, _, bad, gap = _times(raw, src, spec.time_zone, None, name, where)
        _bad(
            gap,
            reasons,
            f"rule: {name}",
            f"the local time is skipped or repeated in {spec.time_zone}",
        )
        _bad(bad & _text(raw).notna(), reasons, f"unparsable value: {name}", "not a time")
        missing = _text(raw).isna() if not pd.api.types.is_datetime64_any_dtype(raw) else raw.isna()
    else:
        text = _text(raw)
        missing = text.isna()
        if f.type == "number":
            values = pd.to_numeric(text, errors="coerce")
            _bad(~missing & values.isna(), reasons, f"unparsable value: {name}", "not a number")
        elif f.type == "bool":
            values = _flags(raw)
            _bad(~missing & values.isna(), reasons, f"unparsable value: {name}", "not true/false")
        else:
            values = text
        check = TypeAdapter(f.annotation())
        refused: dict[Any, str] = {}
        for v in pd.unique(values[~missing & values.notna()]):  # each distinct value once
            try:
                check.validate_python(v)
            except ValidationError as exc:
                refused[v] = exc.errors()[0]["msg"]
        for v, msg in refused.items():
            _bad(values == v, reasons, f"rule: {name}", msg)
    if f.required:
        _bad(missing, reasons, f"missing value: {name}", "empty")
    elif f.default is not None:
        values = values.where(~missing, f.default)
    if f.pii:
        values = values.map(lambda v: None if v is None or v != v else door.pii(v))
    return values


def _flags(s: pd.Series) -> pd.Series:
    def one(v: object) -> object:
        if isinstance(v, bool | np.bool_):
            return bool(v)
        t = "" if v is None or (not isinstance(v, str) and pd.isna(v)) else str(v).strip().lower()
        if t.endswith(".0"):
            t = t[:-2]
        return True if t in _TRUE else False if t in _FALSE else None

    return s.map(one)


# --- the job ------------------------------------------------------------------------------


@dataclass
class IngestReport:
    rows_read: int
    transactions: int
    days: list[date]
    labels: int
    label_days: list[date]
    rejected: Counter[str]
    rejects_path: Path
    label_rule: str | None

    def text(self) -> str:
        span = f"{self.days[0]}..{self.days[-1]}" if self.days else "none"
        lines = [
            f"ingest: {self.rows_read:,} rows read; {self.transactions:,} transactions over "
            f"{len(self.days)} day(s) ({span}) written",
            f"labels: {self.labels:,} over {len(self.label_days)} arrival day(s)"
            + (f" (label_time: {self.label_rule})" if self.label_rule else ""),
            f"rejected: {sum(self.rejected.values()):,} row(s) -> {self.rejects_path}",
        ]
        lines += [f"  {n:,}  {reason}" for reason, n in sorted(self.rejected.items())]
        return "\n".join(lines)


def _record(df: pd.DataFrame, i: Any) -> dict[str, Any]:
    return {k: v for k, v in df.loc[i].items() if not str(k).startswith("_")}


def _reject(rejects: Rejects, src: pd.DataFrame, idx: pd.Index, reasons: pd.Series) -> None:
    for i in idx:
        category, _, detail = str(reasons[i]).partition("\x1f")
        rejects.add(src.at[i, "_source"], src.at[i, "_row"], category, detail, _record(src, i))


def _dedupe(
    frame: pd.DataFrame, src: pd.DataFrame, rejects: Rejects, key: str, what: str
) -> pd.DataFrame:
    """Drop exact repeats (keep the first) and every row of a key that comes with
    different content; both go to ``rejects``."""
    content = [c for c in frame.columns if not c.startswith("_")]
    repeat = frame.duplicated(content, keep="first")
    reasons = pd.Series("", index=frame.index, dtype=object)
    reasons[repeat] = f"duplicate {what}\x1fsame content as an earlier row"
    rest = frame[~repeat]
    clash = rest[key].duplicated(keep=False)
    reasons[rest.index[clash]] = f"conflicting {key}\x1fthe same {key} with other content"
    _reject(rejects, src, reasons.index[reasons != ""], reasons)
    return frame[reasons == ""]


def ingest(
    mapping_path: Path,
    data_dir: Path,
    rejects_path: Path | None = None,
    door: F.Door = F.PLAIN,
) -> IngestReport:
    """Read the export the mapping names and write its raw partitions under
    ``data_dir/raw``, the refused rows to ``rejects_path`` (default
    ``data_dir/ingest/rejects.csv``) and a manifest beside it (the mapping, the label
    rule, the counts). ``door``: the declared fields the mapping may map (a PII field's
    values are hashed before they reach a partition or the rejects file). Raises
    ContractError (nothing written) on a break of the mapping or of the contract, and
    naming the file on one that is empty (or, for the transactions, headers only), not
    UTF-8 or not readable; ValueError naming the field for an invalid mapping file."""
    mapping = load_mapping(mapping_path, door.fields)
    base = mapping_path.parent
    raw = data_dir / "raw"
    rejects_path = rejects_path or data_dir / "ingest" / "rejects.csv"
    tspec = mapping.transactions
    pii = [tspec.columns[f.name] for f in door.fields if f.pii and f.name in tspec.columns]
    rejects = Rejects(hide_lines=bool(pii))

    frames: list[pd.DataFrame] = []
    sources: list[pd.DataFrame] = []
    tfiles = _files(tspec, base)
    for path in tqdm(tfiles, desc="read transactions", unit="file", disable=None):
        src = read_file(path, tspec, rejects)
        frame, reasons = cast_transactions(src, tspec, door)
        for p in pii:  # the rejects file shows the source row: its PII hashed too
            if p.column is not None:
                src[p.column] = _text(src[p.column]).map(
                    lambda v: None if v is None else door.pii(v)
                )
        _reject(rejects, src, src.index[reasons != ""], reasons)
        frames.append(frame[reasons == ""].assign(_file=len(sources)))
        sources.append(src)
    rows_read = sum(len(s) for s in sources) + rejects.counts()["malformed line"]
    if rows_read == 0:  # every transaction file a header alone: nothing to write
        raise C.ContractError(
            [
                C.Problem(str(p), "*", "no rows, a header only", "export the transactions again")
                for p in tfiles
            ]
        )
    src_all = (
        pd.concat(sources, ignore_index=False, keys=range(len(sources)))
        if sources
        else pd.DataFrame()
    )
    txns = (
        pd.concat(
            [
                f.set_index(pd.MultiIndex.from_arrays([[k] * len(f), f.index]))
                for k, f in enumerate(frames)
            ]
        )
        if frames
        else pd.DataFrame(columns=[c.name for c in C.TRANSACTION_COLUMNS])
    )
    txns = _dedupe(txns.drop(columns="_file"), src_all, rejects, "transaction_id", "row")
    txns = txns.assign(_day=txns["event_time"].dt.date)
    days = sorted(set(txns["_day"]))

    # Ids already ingested on a day this run does not rewrite.
    written_days = set(days)
    clash = pd.Series(False, index=txns.index)
    for d in partition_days(raw, "transactions"):
        if d in written_days:
            continue
        old = set(read_partition(raw, "transactions", d, ["transaction_id"]).column(0).to_pylist())
        hit = txns["transaction_id"].isin(old)
        if hit.any():
            r = pd.Series(
                f"conflicting transaction_id\x1falready in raw/transactions/date={d}",
                index=txns.index,
            )
            _reject(rejects, src_all, txns.index[hit & ~clash], r)
            clash |= hit
    txns = txns[~clash]

    labels, rule = _labels(mapping, base, txns, src_all, rejects)
    if PATTERN in labels.columns:  # a label attribute, kept on its transaction's row
        given = txns["transaction_id"].map(labels.set_index("transaction_id")[PATTERN])
        mapped = txns[PATTERN] if PATTERN in txns.columns else None
        txns = txns.assign(**{PATTERN: given if mapped is None else given.fillna(mapped)})
    tables = _day_tables(txns, labels, door.fields)
    emptied = _keep_other_labels(raw, set(txns["transaction_id"]), tables)
    problems = [
        p
        for (table, d), t in tables.items()
        for p in C.check_table(
            t,
            C.TRANSACTION_COLUMNS if table == "transactions" else C.LABEL_COLUMNS,
            f"{table} {d}",
            d,
        )
    ]
    problems += [
        p
        for (table, d), t in tables.items()
        if table == "transactions"
        for p in C.check_fields(t, door.fields, f"{table} {d}")
    ]
    if problems:
        raise C.ContractError(problems)

    for (table, d), t in tqdm(tables.items(), desc="write days", unit="partition", disable=None):
        write_partition(raw, table, d, t)
    for d in emptied:
        shutil.rmtree(partition_dir(raw, "labels", d))
    counts = rejects.counts()
    _write_rejects(rejects_path, rejects)
    label_days = sorted(d for t, d in tables if t == "labels")
    report = IngestReport(
        rows_read=rows_read,
        transactions=len(txns),
        days=sorted({d for t, d in tables if t == "transactions"}),
        labels=len(labels),
        label_days=label_days,
        rejected=counts,
        rejects_path=rejects_path,
        label_rule=rule,
    )
    _write_json(
        rejects_path.parent / "manifest.json",
        {
            "mapping": str(mapping_path),
            "mapping_content": mapping.model_dump(mode="json"),
            "sources": [str(s["_source"].iloc[0]) for s in sources if len(s)],
            "rows_read": rows_read,
            "transactions": report.transactions,
            "days": [str(d) for d in report.days],
            "labels": report.labels,
            "label_days": [str(d) for d in label_days],
            "label_time": rule,
            "rejected": dict(sorted(counts.items())),
        },
    )
    return report


def _labels(
    mapping: Mapping, base: Path, txns: pd.DataFrame, src_txns: pd.DataFrame, rejects: Rejects
) -> tuple[pd.DataFrame, str | None]:
    """The label rows (LABELS' columns) and how their label_time was found."""
    cols = ["transaction_id", "card_id", "merchant_id", "event_time", "label_time", "is_fraud"]
    spec = mapping.labels
    if spec is None:
        return pd.DataFrame(columns=cols), None
    delay = pd.Timedelta(days=spec.arrival_delay_days) if spec.arrival_delay_days else None
    rule = (
        f"event_time + {spec.arrival_delay_days:g} days (arrival_delay_days)"
        if delay is not None
        else f"column {spec.columns['label_time'].column or 'const'}"
    )
    if not spec.files:  # the frauds of the transaction files
        if delay is None:
            raise C.ContractError(
                [
                    C.Problem(
                        "mapping",
                        "labels.label_time",
                        "inline labels need a rule",
                        "set arrival_delay_days",
                    )
                ]
            )
        fr = txns[txns["is_fraud"].astype(bool)]
        out = fr.assign(label_time=fr["event_time"] + delay)[cols]
        return out.reset_index(drop=True), rule
    frames = []
    for k, path in enumerate(
        tqdm(_files(spec, base), desc="read labels", unit="file", disable=None)
    ):
        src = read_file(path, spec, rejects)
        reasons = pd.Series("", index=src.index, dtype=object)
        tid = _text(_raw(src, spec.columns["transaction_id"]))
        _bad(tid.isna(), reasons, "missing value: transaction_id", "empty (label)")
        flag = _flags(_raw(src, spec.columns["is_fraud"]))
        _bad(
            flag.isna(),
            reasons,
            "unparsable value: is_fraud",
            "not true/false or 1/0 (label)",
        )
        f = pd.DataFrame({"transaction_id": tid, "is_fraud": flag}, index=src.index)
        if PATTERN in spec.columns:
            f[PATTERN] = _text(_raw(src, spec.columns[PATTERN]))
        if delay is None:
            s = spec.columns["label_time"]
            lt, _, bad, _ = _times(
                _raw(src, s),
                s,
                spec.time_zone or mapping.transactions.time_zone,
                None,
                "label_time",
                str(path),
            )
            _bad(bad, reasons, "unparsable value: label_time", "not a time (label)")
            f["label_time"] = lt
        _reject(rejects, src, src.index[reasons != ""], reasons)
        f = f[reasons == ""]
        f.index = pd.MultiIndex.from_arrays([[f"l{k}"] * len(f), f.index])
        src.index = pd.MultiIndex.from_arrays([[f"l{k}"] * len(src), src.index])
        frames.append((f, src))
    if not frames:
        return pd.DataFrame(columns=cols), rule
    lab = pd.concat([f for f, _ in frames])
    lsrc = pd.concat([s for _, s in frames])
    lab = _dedupe(lab, lsrc, rejects, "transaction_id", "label")
    known = txns.set_index("transaction_id")[["card_id", "merchant_id", "event_time"]]
    lab = lab.join(known, on="transaction_id")
    reasons = pd.Series("", index=lab.index, dtype=object)
    if delay is not None:
        _bad(
            lab["event_time"].isna(),
            reasons,
            "unknown transaction",
            "no accepted transaction with this id (arrival_delay_days needs its event time)",
        )
        lab["label_time"] = lab["event_time"] + delay
    else:
        _bad(
            lab["event_time"].notna() & (lab["label_time"] < lab["event_time"]),
            reasons,
            "rule: label_time",
            "before the transaction's event time",
        )
    _reject(rejects, lsrc, lab.index[reasons != ""], reasons)
    keep = [*cols, PATTERN] if PATTERN in lab.columns else cols
    return lab[reasons == ""][keep].reset_index(drop=True), rule


def _day_tables(
    txns: pd.DataFrame, labels: pd.DataFrame, fields: tuple[F.FieldDecl, ...] = ()
) -> dict[tuple[str, date], pa.Table]:
    out: dict[tuple[str, date], pa.Table] = {}
    schema = C.TRANSACTIONS
    for f in fields:  # the declared fields' columns, after the contract's
        schema = schema.append(pa.field(f.name, f.arrow_type(), f.nullable))
    if PATTERN in txns.columns:
        schema = schema.append(pa.field(PATTERN, pa.string()))
    t = txns.sort_values(["event_time", "transaction_id"], kind="stable")
    for d, g in t.groupby("_day", sort=True):
        g = g.assign(utc_offset_min=g["utc_offset_min"].astype(np.int16))
        out[("transactions", d)] = pa.Table.from_pandas(
            g[schema.names], schema=schema, preserve_index=False
        )
    if len(labels):
        lab = labels.sort_values(["label_time", "transaction_id"], kind="stable")
        lab = lab.assign(_day=lab["label_time"].dt.date, is_fraud=lab["is_fraud"].astype(bool))
        for d, g in lab.groupby("_day", sort=True):
            out[("labels", d)] = pa.Table.from_pandas(
                g[C.LABELS.names], schema=C.LABELS, preserve_index=False
            )
    return out


def _keep_other_labels(
    raw: Path, owned: set[str], tables: dict[tuple[str, date], pa.Table]
) -> list[date]:
    """A run owns the labels of the transactions it ingests, wherever they lie: each label
    day it writes, or that holds one of those labels today, is rewritten as the run's own
    labels beside the labels already there for other transactions (feedback labels that
    ``decisions compact`` merged in, another export's). Returns the label days left with
    no label at all (to remove)."""
    ids = pa.array(sorted(owned), pa.string())
    emptied = []
    for d in partition_days(raw, "labels"):
        old = read_partition(raw, "labels", d).select(C.LABELS.names).cast(C.LABELS)
        kept = old.filter(pc.invert(pc.is_in(old.column("transaction_id"), value_set=ids)))
        new = tables.get(("labels", d))
        if new is None and kept.num_rows == old.num_rows:
            continue  # nothing of this run's on that day
        if new is not None and kept.num_rows == 0:
            continue  # the run's own labels alone: written as a first run writes them
        merged = pa.concat_tables(
            ([new] if new is not None else []) + [kept.cast(new.schema if new else C.LABELS)]
        )
        if merged.num_rows == 0:
            emptied.append(d)
            continue
        order = pc.sort_indices(
            merged, sort_keys=[("label_time", "ascending"), ("transaction_id", "ascending")]
        )
        tables[("labels", d)] = merged.take(order)
    return emptied


def _write_rejects(path: Path, rejects: Rejects) -> None:
    with staging_dir(path) as tmp:
        with open(tmp / path.name, "w", newline="") as f:
            w = csv.DictWriter(f, ["source", "row", "reason", "detail", "record"])
            w.writeheader()
            w.writerows(rejects.rows)
        os.replace(tmp / path.name, path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with staging_dir(path) as tmp:
        (tmp / path.name).write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp / path.name, path)
