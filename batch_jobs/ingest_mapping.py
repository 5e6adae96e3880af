"""``fraud-scoring ingest``'s mapping file (YAML, :class:`Mapping`): which of a user's
columns is which contract field (``fraud_scoring/contract.py``) or declared field, with
casts, constants and value maps, the time zone of naive times, and when labels arrived.
Read by :func:`load_mapping`; the job is ``batch_jobs/ingest.py``."""

from __future__ import annotations

import re
from datetime import timedelta, timezone
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from fraud_scoring import contract as C
from fraud_scoring import fields as F

TIME_FIELDS = ("event_time", "label_time")
LABEL_FIELDS = ("transaction_id", "is_fraud", "label_time")
# A label attribute: mapped in the labels (or the transactions), kept on the transaction's
# row (the simulator's ground truth too), where the evaluation report reads it.
PATTERN = "fraud_pattern"


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
