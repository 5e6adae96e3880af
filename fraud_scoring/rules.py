"""Decision rules and lists as data (``feature_repo/rules.yaml``, or ``FRAUD_RULES_FILE``):
the language, its checks and its vectorized evaluation (docs/rules.md).

A rule is ``{code, action: allow | decline | review, when, message, mode: active |
shadow}``. ``when`` is an expression of the declared features' language
(:mod:`fraud_scoring.declared.expressions`) over the served number features, the model's
``score``, the transaction's ``amount`` and the setting ``review_amount_limit``, with
three additions rewritten into that language before it is checked: ``and`` / ``or`` /
``not``; a string field compared with a string (``country == 'US'``, ``mcc in ('7995',
'4829')``); list membership (``card_id in blocked_cards``, a list the file declares with
its key column). Each string test becomes a 0/1 column computed once per micro-batch, so a
rule is one compiled numpy expression over the batch's columns (:meth:`RuleSet.masks`).

:func:`load` refuses a file that breaks the language (:class:`RulesError`, naming the file
and the field): an unknown feature, list, field or action, a ``when`` that is not a
condition, a message naming an unknown value, a code used twice.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fraud_scoring.declared.expressions import _FUNCS, _check_expr, evaluate
from fraud_scoring.declared.language import KEY_COLUMNS

log = logging.getLogger(__name__)

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "feature_repo" / "rules.yaml"
Action = Literal["allow", "decline", "review"]
# The stages in the order they decide (the model's thresholds sit in their stage's end:
# service/core/decision.py); a row's first matching active rule of the first stage wins.
ACTIONS: tuple[Action, ...] = ("allow", "decline", "review")
# Transaction fields a rule compares with strings or looks up in a list.
STRING_FIELDS = (*KEY_COLUMNS, "currency")
# Numbers a rule reads besides the served features: the model's score and the setting
# FRAUD_REVIEW_AMOUNT_LIMIT (the shipped AMOUNT_OVER_LIMIT rule reads it).
SCORE = "score"
SETTINGS_NAMES = ("review_amount_limit",)
LIST_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"


class RulesError(ValueError):
    """The rules file is unreadable or breaks the language; the message names the file
    and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListDecl(_Strict):
    """A named list of values of one key column (items live in the online store)."""

    key: Literal["card_id", "merchant_id", "device_id", "country", "channel", "mcc"]
    description: str = ""


class RuleDecl(_Strict):
    code: str = Field(pattern=r"^[A-Z][A-Z0-9_]*$", max_length=59)  # RULE_ + 59 <= 64
    action: Action
    when: str = Field(min_length=1)
    message: str = Field(min_length=1, max_length=300)
    mode: Literal["active", "shadow"] = "active"
    description: str = ""


class RulesFile(_Strict):
    lists: dict[str, ListDecl] = {}
    rules: tuple[RuleDecl, ...] = ()


@dataclass(frozen=True)
class StringTest:
    """A string test a rule makes, as a 0/1 column named ``name``: ``field`` among
    ``values``, or (``list_name``) in the list's live items."""

    name: str
    field: str
    values: tuple[str, ...] = ()
    list_name: str | None = None


@dataclass(frozen=True)
class Rule:
    decl: RuleDecl
    expr: str  # ``when`` in the declared features' language
    numbers: tuple[str, ...]  # the number columns it reads (features, score, amount)
    tests: tuple[StringTest, ...]
    message_names: tuple[str, ...]

    @property
    def code(self) -> str:
        return self.decl.code

    @property
    def reason_code(self) -> str:
        return f"RULE_{self.decl.code}"

    @property
    def action(self) -> Action:
        return self.decl.action

    @property
    def active(self) -> bool:
        return self.decl.mode == "active"

    @property
    def reads_list(self) -> bool:
        return any(t.list_name is not None for t in self.tests)

    @property
    def reads_score(self) -> bool:
        return SCORE in self.numbers

    def message(self, row: Mapping[str, Any]) -> str:
        """The message with ``row``'s values (its names checked at load)."""
        return self.decl.message.format_map(row)


@dataclass(frozen=True)
class RuleSet:
    """A checked rules file, ready to evaluate. ``version``: the first 12 hex digits of
    the file's SHA-256 (what responses, the decision log and /readyz carry)."""

    rules: tuple[Rule, ...]
    lists: Mapping[str, ListDecl]
    version: str
    source: str
    tests: tuple[StringTest, ...] = field(init=False)

    def __post_init__(self) -> None:
        seen = {t.name: t for r in self.rules for t in r.tests}
        object.__setattr__(self, "tests", tuple(seen.values()))

    @property
    def features(self) -> frozenset[str]:
        """The served features the rules read (not the score nor the settings)."""
        return frozenset(
            n for r in self.rules for n in r.numbers if n != SCORE and n not in SETTINGS_NAMES
        )

    @property
    def list_reads(self) -> tuple[tuple[str, str], ...]:
        """(list, transaction field) pairs the rules look up, each once."""
        pairs = {(t.list_name, t.field) for t in self.tests if t.list_name is not None}
        return tuple(sorted((lst, f) for lst, f in pairs if lst is not None))

    @property
    def string_fields(self) -> tuple[str, ...]:
        return tuple(sorted({t.field for t in self.tests}))

    def masks(
        self,
        numbers: Mapping[str, npt.ArrayLike],
        strings: Mapping[str, np.ndarray],
        members: Mapping[str, np.ndarray],
        n: int,
        rules: Sequence[Rule] | None = None,
    ) -> np.ndarray:
        """Where each rule (``rules``: these of the set; default all) holds over ``n``
        rows: a (rules, n) bool matrix, one compiled expression per rule. ``numbers``:
        the number columns (features, ``score``, ``amount``, the settings as scalars);
        ``strings``: the transactions' string fields the rules test (object arrays);
        ``members``: per :func:`member_column`, the rows whose value is a live item of
        the list (a lookup not read, e.g. rules reloaded during the micro-batch, reads as
        no row, logged). A NaN result does not hold."""
        chosen = self.rules if rules is None else tuple(rules)
        cols: dict[str, Any] = dict(numbers)
        for t in dict.fromkeys(t for r in chosen for t in r.tests):
            if t.list_name is None:
                cols[t.name] = np.isin(strings[t.field], t.values)
                continue
            got = members.get(member_column(t.list_name, t.field))
            if got is None:
                log.warning("list %s was not read for this micro-batch", t.list_name)
                got = np.zeros(n, dtype=bool)
            cols[t.name] = got
        out = np.zeros((len(chosen), n), dtype=bool)
        for i, r in enumerate(chosen):
            v = evaluate(r.expr, cols)
            out[i] = (v != 0) & ~np.isnan(v)  # a constant broadcasts
        return out


def member_column(list_name: str, fld: str) -> str:
    """The name of the column saying which rows' ``fld`` is on the list."""
    return f"in_list:{list_name}:{fld}"


def load(path: Path, known: set[str]) -> RuleSet:
    """The rules file at ``path``, checked against ``known`` (the served number features)."""
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise RulesError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(raw_bytes, str(path), known)


def parse(raw_bytes: bytes, source: str, known: set[str]) -> RuleSet:
    """A rules document (YAML bytes) named ``source`` in messages."""
    try:
        raw = yaml.safe_load(raw_bytes)
    except yaml.YAMLError as exc:
        raise RulesError(f"{source}: not YAML: {exc}") from None
    try:
        doc = RulesFile.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        raise RulesError(f"{source}: {where}: {e['msg']}") from None
    for name in doc.lists:
        if not _valid_list_name(name):
            raise RulesError(f"{source}: lists.{name}: a list name is {LIST_NAME_PATTERN}")
    numbers = known | {SCORE, "amount", *SETTINGS_NAMES}
    rules, codes = [], set()
    for i, d in enumerate(doc.rules):
        where = f"{source}: rules.{i}"
        if d.code in codes:
            raise RulesError(f"{where}.code: {d.code!r} is used by an earlier rule")
        codes.add(d.code)
        try:
            expr, tests = _rewrite(d.when, doc.lists, i)
            _check_expr(expr, numbers | {t.name for t in tests})
        except ValueError as exc:
            raise RulesError(f"{where}.when: {exc}") from None
        names = tuple(
            dict.fromkeys(
                n.id
                for n in ast.walk(ast.parse(expr, mode="eval"))
                if isinstance(n, ast.Name) and n.id not in _FUNCS
            )
        )
        try:
            message_names = _check_message(d.message, numbers | set(STRING_FIELDS))
        except ValueError as exc:
            raise RulesError(f"{where}.message: {exc}") from None
        test_names = {t.name for t in tests}
        rules.append(
            Rule(d, expr, tuple(n for n in names if n not in test_names), tests, message_names)
        )
    version = hashlib.sha256(raw_bytes).hexdigest()[:12]
    return RuleSet(tuple(rules), dict(doc.lists), version, source)


def _valid_list_name(name: str) -> bool:
    return re.fullmatch(LIST_NAME_PATTERN, name) is not None


def _check_message(message: str, known: set[str]) -> tuple[str, ...]:
    names = []
    for _, name, spec, conv in string.Formatter().parse(message):
        if name is None:
            continue
        if name not in known:
            raise ValueError(f"{{{name}}}: not a feature, the score or a transaction field")
        if conv is not None:
            raise ValueError(f"{{{name}!{conv}}}: no conversions")
        if name not in STRING_FIELDS:
            format(0.0, spec or "")
        names.append(name)
    return tuple(names)


# --- ``when`` in the declared features' language -------------------------------------


def _rewrite(
    when: str, lists: Mapping[str, ListDecl], index: int
) -> tuple[str, tuple[StringTest, ...]]:
    """``when`` with its conditions (``and``/``or``/``not``, string tests, list
    membership) rewritten into the declared features' language, and the string tests
    it now reads as columns. Refuses a ``when`` that is not a condition."""
    try:
        tree = ast.parse(when, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    r = _Rewrite(lists, index)
    if not _is_condition(tree.body):
        raise ValueError(
            "not a condition: write a comparison (score >= 0.5), a membership "
            "(card_id in blocked_cards) or and/or/not of them"
        )
    body = r.visit(tree.body)
    return ast.unparse(ast.fix_missing_locations(body)), tuple(r.tests)


def _is_condition(node: ast.expr) -> bool:
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.BoolOp):
        return all(_is_condition(v) for v in node.values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_condition(node.operand)
    return False


def _flag(node: ast.expr) -> ast.expr:
    """``node`` as 0/1 (``node != 0``)."""
    return ast.Compare(node, [ast.NotEq()], [ast.Constant(0)])


class _Rewrite(ast.NodeTransformer):
    def __init__(self, lists: Mapping[str, ListDecl], index: int) -> None:
        self.lists, self.index = lists, index
        self.tests: list[StringTest] = []

    def _test(self, fld: str, values: tuple[str, ...] = (), list_name: str | None = None) -> str:
        for t in self.tests:
            if (t.field, t.values, t.list_name) == (fld, values, list_name):
                return t.name
        name = f"_r{self.index}_{fld}_{list_name or ''}{len(self.tests)}"
        self.tests.append(StringTest(name, fld, values, list_name))
        return name

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        values = [_flag(self.visit(v)) for v in node.values]
        out = values[0]
        for v in values[1:]:
            if isinstance(node.op, ast.And):
                out = ast.BinOp(out, ast.Mult(), v)
            else:
                out = ast.Call(ast.Name("maximum", ast.Load()), [out, v], [])
        return out

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        if isinstance(node.op, ast.Not):
            return ast.Compare(self.visit(node.operand), [ast.Eq()], [ast.Constant(0)])
        return self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        strings = [
            isinstance(x, ast.Name) and x.id in STRING_FIELDS
            for x in (node.left, *node.comparators)
        ]
        membership = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
        if not any(strings) and not membership:
            return self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.left, ast.Name):
            raise ValueError(
                "a string test or membership is one comparison with the field first: "
                "country == 'US', card_id in blocked_cards"
            )
        fld, op, right = node.left.id, node.ops[0], node.comparators[0]
        if fld not in STRING_FIELDS:
            raise ValueError(
                f"{fld!r} is not a transaction field a list or string can hold; "
                f"one of {', '.join(STRING_FIELDS)}"
            )
        negate = isinstance(op, ast.NotEq | ast.NotIn)
        if isinstance(op, ast.Eq | ast.NotEq):
            if not (isinstance(right, ast.Constant) and isinstance(right.value, str)):
                raise ValueError(f"{fld} is compared with a string: {fld} == 'value'")
            name = self._test(fld, (right.value,))
        elif isinstance(op, ast.In | ast.NotIn):
            if isinstance(right, ast.Tuple | ast.List | ast.Set):
                if not all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in right.elts
                ):
                    raise ValueError(f"{fld} in (...): strings only")
                values = tuple(sorted({e.value for e in right.elts}))  # type: ignore[attr-defined]
                name = self._test(fld, values)
            elif isinstance(right, ast.Name):
                decl = self.lists.get(right.id)
                if decl is None:
                    known = ", ".join(self.lists) or "none declared"
                    raise ValueError(f"unknown list {right.id!r} (lists: {known})")
                if decl.key != fld:
                    raise ValueError(
                        f"list {right.id!r} holds {decl.key} values, not {fld}: "
                        f"{decl.key} in {right.id}"
                    )
                name = self._test(fld, list_name=right.id)
            else:
                raise ValueError(f"{fld} in: a list's name or a tuple of strings")
        else:
            raise ValueError(f"{fld}: only ==, !=, in and not in compare strings")
        col = ast.Name(name, ast.Load())
        return ast.Compare(col, [ast.Eq() if negate else ast.NotEq()], [ast.Constant(0)])


def value_of(txn: Any, fld: str) -> str:
    """A transaction's string field as lists and tests see it ('' for no device)."""
    v = getattr(txn, fld)
    return "" if v is None else str(v)


def string_columns(txns: Sequence[Any], fields: Sequence[str]) -> dict[str, np.ndarray]:
    """The transactions' string ``fields`` as object arrays (one per field)."""
    return {f: np.array([value_of(t, f) for t in txns], dtype=object) for f in fields}
