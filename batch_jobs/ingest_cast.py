"""``fraud-scoring ingest``'s casting of a user's columns to the contract's fields (and
the declared ones): times with their zone, ids, codes, flags, numbers; a row whose value
cannot be cast goes to the rejects with the reason. The job is ``batch_jobs/ingest.py``."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd
from pydantic import (
    TypeAdapter,
    ValidationError,
)

from batch_jobs.ingest_mapping import PATTERN, Source, TransactionFiles, zone
from fraud_scoring import contract as C
from fraud_scoring import fields as F
from fraud_scoring.events import CHANNELS, ID_MAX_LEN, country_codes, currency_codes

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}
_HAS_OFFSET = re.compile(r"(?:Z|[+-]\d\d:?\d\d)$")


# --- casting ------------------------------------------------------------------------------


def raw_column(df: pd.DataFrame, src: Source) -> pd.Series:
    if src.const is not None:
        return pd.Series([src.const] * len(df), index=df.index, dtype=object)
    s = df[src.column]
    if src.map:
        s = s.map(lambda v: src.map.get(str(v), v) if src.map else v)
    return s


def as_text(s: pd.Series) -> pd.Series:
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


def cast_times(
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
        text = as_text(s)
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


def mark_bad(mask: pd.Series, reasons: pd.Series, category: str, detail: str) -> None:
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
    offset = pd.to_numeric(raw_column(df, offset_src), errors="coerce") if offset_src else None
    for col in C.TRANSACTION_COLUMNS:
        name = col.name
        src = spec.columns.get(name)
        if name == "utc_offset_min":
            continue  # set with event_time
        if src is None:
            out[name] = pd.Series([col.default] * len(df), index=df.index, dtype=object)
            continue
        raw = raw_column(df, src)
        if name == "event_time":
            utc, off, bad, gap = cast_times(raw, src, spec.time_zone, offset, name, where)
            mark_bad(
                gap,
                reasons,
                "rule: event_time",
                f"the local time does not exist or is ambiguous in {spec.time_zone} (DST change)",
            )
            mark_bad(
                bad & as_text(raw).notna(), reasons, "unparsable value: event_time", "not a time"
            )
            mark_bad(
                as_text(raw).isna()
                if not pd.api.types.is_datetime64_any_dtype(raw)
                else raw.isna(),
                reasons,
                "missing value: event_time",
                "empty",
            )
            out["event_time"], out["utc_offset_min"] = utc, off
            mark_bad(
                off.abs() > C.MAX_OFFSET_MIN,
                reasons,
                "unparsable value: utc_offset_min",
                "beyond +-14 h",
            )
            continue
        if name == "amount":
            text = as_text(raw)
            num = pd.to_numeric(text, errors="coerce")
            mark_bad(text.isna(), reasons, "missing value: amount", "empty")
            mark_bad(num.isna(), reasons, "unparsable value: amount", "not a number")
            mark_bad(~((num > 0) & (num < C.AMOUNT_MAX)), reasons, "rule: amount", col.rule)
            out[name] = num
            continue
        text = as_text(raw)
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
            mark_bad(text.isna(), reasons, f"missing value: {name}", "empty")
        allowed = {
            "currency": currency_codes(),
            "country": country_codes(),
            "channel": frozenset(CHANNELS),
        }.get(name)
        if allowed is not None:
            mark_bad(text.notna() & ~text.isin(allowed), reasons, f"rule: {name}", col.rule)
        if name == "mcc":
            mark_bad(
                text.notna() & ~text.fillna("").str.fullmatch(r"[0-9]{4}"),
                reasons,
                "rule: mcc",
                col.rule,
            )
        if name.endswith("_id"):
            n = text.fillna("").str.len()
            ctrl = text.fillna("").str.contains(r"[\x00-\x1f\x7f]")
            mark_bad(text.notna() & ((n > ID_MAX_LEN) | ctrl), reasons, f"rule: {name}", col.rule)
        out[name] = text
    if "is_fraud" in spec.columns:
        flag = cast_flags(raw_column(df, spec.columns["is_fraud"]))
        mark_bad(flag.isna(), reasons, "unparsable value: is_fraud", "not true/false or 1/0")
        out["is_fraud"] = flag
    if PATTERN in spec.columns:
        out[PATTERN] = as_text(raw_column(df, spec.columns[PATTERN]))
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
        raw = as_text(raw_column(df, src)).map(lambda v: None if v is None else f.derive(v))
    elif src is None:
        return pd.Series([f.default] * len(df), index=df.index, dtype=object)
    else:
        raw = raw_column(df, src)
    name = f.name
    if f.type == "timestamp":
        values, _, bad, gap = cast_times(raw, src, spec.time_zone, None, name, where)
        mark_bad(
            gap,
            reasons,
            f"rule: {name}",
            f"the local time is skipped or repeated in {spec.time_zone}",
        )
        mark_bad(bad & as_text(raw).notna(), reasons, f"unparsable value: {name}", "not a time")
        missing = (
            as_text(raw).isna() if not pd.api.types.is_datetime64_any_dtype(raw) else raw.isna()
        )
    else:
        text = as_text(raw)
        missing = text.isna()
        if f.type == "number":
            values = pd.to_numeric(text, errors="coerce")
            mark_bad(~missing & values.isna(), reasons, f"unparsable value: {name}", "not a number")
        elif f.type == "bool":
            values = cast_flags(raw)
            mark_bad(
                ~missing & values.isna(), reasons, f"unparsable value: {name}", "not true/false"
            )
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
            mark_bad(values == v, reasons, f"rule: {name}", msg)
    if f.required:
        mark_bad(missing, reasons, f"missing value: {name}", "empty")
    elif f.default is not None:
        values = values.where(~missing, f.default)
    if f.pii:
        values = values.map(lambda v: None if v is None or v != v else door.pii(v))
    return values


def cast_flags(s: pd.Series) -> pd.Series:
    def one(v: object) -> object:
        if isinstance(v, bool | np.bool_):
            return bool(v)
        t = "" if v is None or (not isinstance(v, str) and pd.isna(v)) else str(v).strip().lower()
        if t.endswith(".0"):
            t = t[:-2]
        return True if t in _TRUE else False if t in _FALSE else None

    return s.map(one)
