"""A team's own transaction fields, declared once: the ``fields`` section of the
declarations file (``feature_repo/features.yaml`` or ``FRAUD_FEATURES_FILE``), read by
every door. The page a user reads: ``docs/data-contract.md``, "Your own fields".

A declared field is a column of the raw transactions beside the contract's, a top-level
field of the API's body and of an event, each checked by its declaration (type, range,
pattern, length, allowed values) and refused naming the field. :class:`Door` holds the
one pydantic model every door validates with (the contract's
:class:`~fraud_scoring.events.Transaction` plus the declared fields; without fields, that
model itself). A field marked ``pii`` is replaced there, after its checks, by its keyed
hash (:func:`pii_hash`: ``pii:`` and the hex HMAC-SHA256 under the process's key), so the
clear value reaches no store, log or file; a value already in that form passes as it is
(raw history sent again as events).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import SchemaError

from fraud_scoring import declared
from fraud_scoring.declared.file_errors import field_lines, line_of
from fraud_scoring.events import Transaction
from fraud_scoring.features import declarations_path
from fraud_scoring.settings import FieldSettings

FieldType = Literal["string", "number", "bool", "timestamp", "category"]
# Names the contract and the jobs already use: the raw columns, the labels', the
# simulator's ground truth, the training set's own.
RESERVED = frozenset(
    (
        *Transaction.model_fields,
        "utc_offset_min",
        "label_time",
        "is_fraud",
        "fraud_pattern",
        "event_timestamp",
        "label",
        "weight",
    )
)
STRING_MAX = 256  # a string field's max_length unless it declares one
HASHED = re.compile(r"^pii:[0-9a-f]{64}$")
_TS = pa.timestamp("us", tz="UTC")


class FieldError(ValueError):
    """The ``fields`` section breaks the language, or a PII field has no hash key; the
    message names the file and the field (exit status 2)."""


class FieldDecl(BaseModel):
    """One declared field. ``min``/``max`` (inclusive) for a number, ``pattern`` (the
    whole value) and ``max_length`` for a string, ``values`` for a category; ``default``:
    an absent optional field's value (else null); ``pii``: hashed at every door."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,62}$")
    type: FieldType
    required: bool = False
    values: tuple[str, ...] | None = None
    min: float | None = None
    max: float | None = None
    pattern: str | None = None
    max_length: int | None = Field(default=None, ge=1, le=65_536)
    default: str | float | bool | None = None
    pii: bool = False
    description: str = ""
    # A field taken at the door from another string field's clear value (before that
    # one's PII hash) when the transaction does not carry it: the text ``after`` or
    # ``before`` a separator (an e-mail's domain: ``after: "@"``), or its first
    # ``prefix`` or last ``suffix`` characters (a card number's BIN: ``prefix: 6``).
    source: str | None = Field(default=None, alias="from")
    after: str | None = Field(default=None, min_length=1)
    before: str | None = Field(default=None, min_length=1)
    prefix: int | None = Field(default=None, ge=1, le=256)
    suffix: int | None = Field(default=None, ge=1, le=256)

    @model_validator(mode="after")
    def _options_fit_the_type(self) -> FieldDecl:
        given = {k for k in ("values", "min", "max", "pattern", "max_length") if getattr(self, k)}
        allowed = {
            "category": {"values"},
            "number": {"min", "max"},
            "string": {"pattern", "max_length"},
        }.get(self.type, set())
        if extra := sorted(given - allowed):
            raise ValueError(f"{', '.join(extra)}: not for a {self.type} field")
        if self.type == "category" and not self.values:
            raise ValueError("a category lists its values (values: [a, b])")
        if self.values is not None and len(set(self.values)) != len(self.values):
            raise ValueError("values: listed twice")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
                TypeAdapter(self.annotation())  # pydantic's engine: Rust's regex syntax
            except re.error as exc:
                raise ValueError(f"pattern: not a regular expression ({exc})") from None
            except SchemaError as exc:
                raise ValueError(f"pattern: {' '.join(str(exc).split())}") from None
        if self.pii and self.type != "string":
            raise ValueError("pii: only a string field is hashed")
        parts = [k for k in ("after", "before", "prefix", "suffix") if getattr(self, k)]
        if self.source is None and parts:
            raise ValueError(f"{parts[0]}: only with from: <a string field>")
        if self.source is not None:
            if len(parts) != 1:
                raise ValueError("from: takes one of after, before, prefix, suffix")
            if self.type not in ("string", "category"):
                raise ValueError("from: a field taken from another is a string or category")
            if self.required:
                raise ValueError("from: a field taken from another is optional")
        if self.default is not None:
            if self.required:
                raise ValueError("default: a required field takes none")
            if self.pii or self.type == "timestamp":
                raise ValueError(
                    f"default: a {'pii' if self.pii else 'timestamp'} field takes none"
                )
            try:
                TypeAdapter(self.annotation()).validate_python(self.default, strict=True)
            except ValidationError as exc:
                raise ValueError(f"default: {exc.errors()[0]['msg']}") from None
        return self

    def derive(self, value: str) -> str | None:
        """This field's value taken from its source's clear ``value`` (``from``; None:
        the separator is not in it, or the value is shorter than the part)."""
        if self.after is not None:
            head, sep, tail = value.rpartition(self.after)
            return tail if sep else None
        if self.before is not None:
            head, sep, _ = value.partition(self.before)
            return head if sep else None
        n = self.prefix or self.suffix or 0
        if len(value) < n:
            return None
        return value[:n] if self.prefix else value[-n:]

    def annotation(self, hasher: Callable[[str], str] | None = None) -> Any:
        """The field's type with its checks, as pydantic validates it (``hasher``: a PII
        field's values, once checked, become their hash)."""
        if self.type == "string":
            check = StringConstraints(
                max_length=self.max_length or STRING_MAX,
                pattern=None if self.pattern is None else f"^(?:{self.pattern})$",
            )
            if hasher is None:
                return Annotated[str, check]
            return Annotated[str, check, WrapValidator(_hashing(hasher))]
        if self.type == "number":
            return Annotated[
                float, Field(ge=self.min, le=self.max, allow_inf_nan=False, strict=True)
            ]
        if self.type == "bool":
            return Annotated[bool, Field(strict=True)]
        if self.type == "timestamp":
            return AwareDatetime
        return Literal[self.values]

    def arrow_type(self) -> pa.DataType:
        """The raw column's type (a PII field: its hash, text)."""
        return {"number": pa.float64(), "bool": pa.bool_(), "timestamp": _TS}.get(
            self.type, pa.string()
        )

    @property
    def nullable(self) -> bool:
        """Whether the raw column holds nulls: an optional field without a default."""
        return not self.required and self.default is None


def _no_key(v: str) -> str:
    raise AssertionError("a model built for its schema validated a PII value")


def _hashing(hasher: Callable[[str], str]) -> Callable[[Any, ValidatorFunctionWrapHandler], str]:
    def check_then_hash(v: Any, handler: ValidatorFunctionWrapHandler) -> str:
        if isinstance(v, str) and HASHED.match(v):
            return v  # hashed at an earlier door (raw history sent again as events)
        return hasher(handler(v))

    return check_then_hash


def pii_hash(key: bytes) -> Callable[[str], str]:
    """The keyed hash of a PII value: ``pii:`` and HMAC-SHA256(key, UTF-8 value) in hex."""

    def hashed(v: str) -> str:
        return "pii:" + hmac.new(key, v.encode(), hashlib.sha256).hexdigest()

    return hashed


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    fields: tuple[FieldDecl, ...] = ()


def parse(
    raw: object, source: str, lines: Mapping[str, int] | None = None
) -> tuple[FieldDecl, ...]:
    """The ``fields`` section of the declarations document ``raw``, checked: each field
    once, none named like a contract field. :class:`FieldError` names the file, the line
    (``lines``: each field's, as :func:`~fraud_scoring.declared.file_errors.field_lines`
    gives them) and the field."""
    section = raw.get("fields") if isinstance(raw, dict) else None

    def error(loc: Sequence[str | int], what: str) -> FieldError:
        parts = [str(p) for p in loc]
        line = line_of(dict(lines or {}), ".".join(parts))
        if len(parts) >= 2 and isinstance(section, list) and parts[1].isdigit():
            item = section[int(parts[1])] if int(parts[1]) < len(section) else None
            name = item.get("name") if isinstance(item, dict) else None
            parts[1] += f" ({name})" if isinstance(name, str) else ""
        where = f"{source}:{line}" if line else source
        return FieldError(f"{where}: {'.'.join(parts)}: {what.removeprefix('Value error, ')}")

    try:
        fields = _Fields.model_validate({"fields": section or ()}).fields
    except ValidationError as exc:
        e = exc.errors()[0]
        raise error(e["loc"], e["msg"]) from None
    seen: set[str] = set()
    types = {f.name: f.type for f in fields}
    for i, f in enumerate(fields):
        if f.name in RESERVED:
            raise error(("fields", i, "name"), f"{f.name!r} is a contract field or column")
        if f.name in seen:
            raise error(("fields", i, "name"), f"{f.name!r} is declared twice")
        seen.add(f.name)
        if f.source is not None and (types.get(f.source) != "string" or f.source == f.name):
            raise error(("fields", i, "from"), f"{f.source!r} is not another declared string field")
    return fields


def load(path: Path) -> tuple[FieldDecl, ...]:
    """The fields declared in the declarations file ``path``."""
    return parse(declared.read(path), str(path), field_lines(path.read_text()))


@cache
def stored(f: FieldDecl) -> TypeAdapter[Any]:
    """What a raw column of ``f`` holds: its values as declared, or for a PII field
    their hashes."""
    if f.pii:
        return TypeAdapter(Annotated[str, StringConstraints(pattern=HASHED.pattern)])
    return TypeAdapter(f.annotation())


@dataclass(frozen=True)
class Door:
    """What a door validates with: ``model`` (one transaction, the declared fields
    included and PII hashed) and ``many`` (a list of them)."""

    fields: tuple[FieldDecl, ...]
    model: type[Transaction]
    many: TypeAdapter[list[Transaction]]
    hasher: Callable[[str], str] = _no_key

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def pii(self, value: str) -> str:
        """A PII field's checked value as it is stored: its hash (a hash stays as it is)."""
        return value if HASHED.match(value) else self.hasher(value)


PLAIN = Door((), Transaction, TypeAdapter(list[Transaction]))


def transaction_model(
    fields: Sequence[FieldDecl], hasher: Callable[[str], str] = _no_key
) -> type[Transaction]:
    """The contract's :class:`Transaction` with ``fields`` beside its own (itself when
    there are none): an optional field absent from a body takes its default (or null);
    a PII field's value becomes ``hasher``'s (the default serves a model built for its
    JSON schema only)."""
    if not fields:
        return Transaction
    derived = tuple(f for f in fields if f.source is not None)
    base = _deriving(derived) if derived else Transaction
    defs: dict[str, Any] = {}
    for f in fields:
        kind = f.annotation(hasher if f.pii else None)
        pii = "PII: stored as its keyed hash, pii:<64 hex>" if f.pii else ""
        info = Field(description="; ".join(d for d in (f.description, pii) if d) or None)
        if f.required:
            defs[f.name] = (kind, info)
        else:
            info = Field(default=f.default, description=info.description)
            defs[f.name] = (kind | None, info)
    model: type[Transaction] = create_model(  # type: ignore[call-overload]
        "Transaction",
        __base__=base,
        __module__=__name__,
        __doc__=Transaction.__doc__,
        **defs,
    )
    return model


def _deriving(derived: tuple[FieldDecl, ...]) -> type[Transaction]:
    """The contract's model that first takes ``derived``'s values from their sources'
    clear values where a transaction does not carry them (a source already hashed, or
    absent: none)."""

    class Deriving(Transaction):
        @model_validator(mode="before")
        @classmethod
        def _derive(cls, data: Any) -> Any:
            if not isinstance(data, dict):
                return data
            out = data
            for f in derived:
                v = data.get(f.source)  # type: ignore[arg-type]
                if data.get(f.name) in (None, "") and isinstance(v, str) and not HASHED.match(v):
                    out = {**out, f.name: f.derive(v.strip())}
            return out

    Deriving.__doc__ = Transaction.__doc__
    return Deriving


def door(fields: Sequence[FieldDecl], key: bytes | None, source: str = "fields") -> Door:
    """The door for ``fields``, hashing PII under ``key``. Raises :class:`FieldError`
    naming the field when one is ``pii`` and there is no key."""
    if not fields:
        return PLAIN
    pii = [f.name for f in fields if f.pii]
    if pii and key is None:
        raise FieldError(
            f"{source}: {', '.join(pii)}: pii: true needs a hash key; set FRAUD_PII_KEY_FILE "
            "(or FRAUD_PII_KEY) in every process that takes transactions"
        )
    hasher = pii_hash(key) if key is not None else _no_key
    model = transaction_model(fields, hasher)
    return Door(tuple(fields), model, TypeAdapter(list[model]), hasher)  # type: ignore[valid-type]


@cache
def declared_fields(path: Path) -> tuple[FieldDecl, ...]:
    """The fields of the declarations file ``path``, read once per process."""
    return load(path)


def door_for(settings: FieldSettings) -> Door:
    """This process's door: the fields of its declarations file, hashed under the key of
    ``settings``."""
    path = declarations_path()
    fields = declared_fields(path)
    return door(fields, settings.pii_key_bytes() if fields else None, str(path))
