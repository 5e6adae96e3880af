"""The transaction event: the one schema shared by HTTP requests, stream events and raw files.

The fields and their rules are listed in ``docs/architecture.md`` (Transaction event); the
raw files' columns, which follow the same rules, in ``docs/data-contract.md``
(``fraud_scoring/contract.py`` checks them).
Validation errors name the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from functools import cache
from typing import Annotated, Any, Literal

import pycountry
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field

CHANNELS = ("pos", "ecom", "atm")
ID_PATTERN = r"^[^\x00-\x1f\x7f]+$"
ID_MAX_LEN = 128
AMOUNT_MAX = 1e9  # exclusive; amounts are > 0


@cache
def _currencies() -> frozenset[str]:
    return frozenset(c.alpha_3 for c in pycountry.currencies)


@cache
def _countries() -> frozenset[str]:
    return frozenset(c.alpha_2 for c in pycountry.countries)


def currency_codes() -> frozenset[str]:
    """The ISO 4217 alpha-3 codes ``currency`` accepts (the raw-file contract reads them too)."""
    return _currencies()


def country_codes() -> frozenset[str]:
    """The ISO 3166-1 alpha-2 codes ``country`` accepts."""
    return _countries()


def _currency(v: str) -> str:
    if v not in _currencies():
        raise ValueError(f"unknown ISO 4217 currency code {v!r}")
    return v


def _country(v: str) -> str:
    if v not in _countries():
        raise ValueError(f"unknown ISO 3166-1 alpha-2 country code {v!r}")
    return v


class Transaction(BaseModel):
    """One card transaction. ``event_time`` must carry a time zone (or be epoch seconds/ms)."""

    model_config = ConfigDict(extra="ignore", frozen=True, str_strip_whitespace=True)

    # Ids: printable, no control characters (the session state joins fields with \x1f).
    transaction_id: str = Field(min_length=1, max_length=ID_MAX_LEN, pattern=ID_PATTERN)
    card_id: str = Field(min_length=1, max_length=ID_MAX_LEN, pattern=ID_PATTERN)
    merchant_id: str = Field(min_length=1, max_length=ID_MAX_LEN, pattern=ID_PATTERN)
    # strict: a number, never a boolean (true would be 1.0) or a numeric string.
    amount: float = Field(gt=0, lt=AMOUNT_MAX, allow_inf_nan=False, strict=True)
    currency: Annotated[str, Field(pattern=r"^[A-Z]{3}$"), AfterValidator(_currency)]
    event_time: AwareDatetime
    country: Annotated[str, Field(pattern=r"^[A-Z]{2}$"), AfterValidator(_country)]
    channel: Literal["pos", "ecom", "atm"]
    mcc: str = Field(pattern=r"^[0-9]{4}$")
    device_id: str | None = Field(default=None, max_length=ID_MAX_LEN, pattern=ID_PATTERN)

    @classmethod
    def model_validate_event(cls, raw: object) -> Transaction:
        """Validate one event from a stream or file (same rules as the HTTP body).

        ``event_time`` may be RFC 3339 with an offset, or epoch seconds / milliseconds
        (pydantic reads numbers above 2e10 as milliseconds), always UTC.
        """
        return cls.model_validate(raw)

    @property
    def event_ts(self) -> float:
        """Event time as epoch seconds (UTC)."""
        return self.event_time.timestamp()

    @property
    def utc_offset_s(self) -> float:
        """The UTC offset the event time was sent with, in seconds: the local time of the
        transaction. Epoch times carry none and count as UTC (0)."""
        off = self.event_time.utcoffset()
        return off.total_seconds() if off is not None else 0.0


Transaction.model_rebuild()


def local_iso(ts: datetime, utc_offset_min: int) -> str:
    """An aware datetime as RFC 3339 in the given UTC offset (minutes east of UTC)."""
    return ts.astimezone(timezone(timedelta(minutes=utc_offset_min))).isoformat()


def raw_row_to_event(row: Mapping[str, Any], fields: Iterable[str] = ()) -> dict[str, Any]:
    """One row of raw history (a dict, as pyarrow's ``to_pylist`` gives it) as an event
    or request body: the schema's fields and the declared ``fields`` (their names,
    ``fraud_scoring.fields``) only, ``event_time`` in RFC 3339 with the row's own UTC
    offset (``utc_offset_min``, 0 when absent), a declared time in RFC 3339, no nulls."""
    ev = {k: row[k] for k in (*Transaction.model_fields, *fields) if row.get(k) is not None}
    for k, v in ev.items():
        if isinstance(v, datetime):
            ev[k] = v.isoformat()
    ev["event_time"] = local_iso(row["event_time"], int(row.get("utc_offset_min") or 0))
    return ev
