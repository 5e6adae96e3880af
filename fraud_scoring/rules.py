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
import functools
import hashlib
import logging
import operator
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fraud_scoring.declared.expressions import _BINOPS, _CMPS, _FUNCS, _check_expr, _div
from fraud_scoring.declared.language import KEY_COLUMNS

log = logging.getLogger(__name__)

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "feature_repo" / "rules.yaml"
Action = Literal["allow", "decline", "review"]
# The stages in the order they decide (the model's thresholds sit in their stage's end:
# service/core/decision.py); a row's first matching active rule of the first stage wins.
ACTIONS: tuple[Action, ...] = ("allow", "decline", "review")
# Transaction fields a rule compares with strings or looks up in a list.
STRING_FIELDS = (*KEY_COLUMNS, "currency")
# The string tests by prefix or suffix a rule may call (rewritten like ``==``).
AFFIX_TESTS = {"starts_with": "prefix", "ends_with": "suffix"}
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
    ``values`` (``match`` "equal"), starting or ending with one of them ("prefix",
    "suffix"), or (``list_name``) in the list's live items."""

    name: str
    field: str
    values: tuple[str, ...] = ()
    list_name: str | None = None
    match: str = "equal"


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
        """The message with ``row``'s values (its names checked at load). A value ``row``
        lacks (a feature not available in rules-only mode) reads as NaN, a string field
        as ''."""
        try:
            return self.decl.message.format_map(row)
        except KeyError:
            return self.decl.message.format_map(_Lacking(row))


class _Lacking(dict[str, Any]):
    """A message's values where a lacking number is NaN and a lacking string ''."""

    def __missing__(self, key: str) -> Any:
        return "" if key in STRING_FIELDS else float("nan")


@dataclass(frozen=True)
class RuleSet:
    """A checked rules file, ready to evaluate. ``version``: the first 12 hex digits of
    the file's SHA-256 (what responses, the decision log and /readyz carry)."""

    rules: tuple[Rule, ...]
    lists: Mapping[str, ListDecl]
    version: str
    source: str
    tests: tuple[StringTest, ...] = field(init=False)
    # The compiled masks of the whole set (None, built at load) and of the subsets asked
    # for (rules-only mode, by their rules' codes): once per rules version.
    _programs: dict[tuple[str, ...] | None, _Program] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        seen = {t.name: t for r in self.rules for t in r.tests}
        object.__setattr__(self, "tests", tuple(seen.values()))
        self._programs[None] = _Program(self.rules)  # at load, not in a micro-batch

    @functools.cached_property  # the set is frozen: once per rules version
    def features(self) -> frozenset[str]:
        """The served features the rules read, in ``when`` or in a message (not the score
        nor the settings): what the scorer reads and hands the decision."""
        return frozenset(
            n
            for r in self.rules
            for n in (*r.numbers, *r.message_names)
            if n != SCORE and n not in SETTINGS_NAMES and n not in STRING_FIELDS
        )

    @functools.cached_property  # the set is frozen: once per rules version
    def list_reads(self) -> tuple[tuple[str, str], ...]:
        """(list, transaction field) pairs the rules look up, each once."""
        pairs = {(t.list_name, t.field) for t in self.tests if t.list_name is not None}
        return tuple(sorted((lst, f) for lst, f in pairs if lst is not None))

    @functools.cached_property  # the set is frozen: once per rules version
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
        rows: a (rules, n) bool matrix, the rules compiled together once per set
        (:class:`_Program`: each distinct sub-expression, column and string test computed
        once per micro-batch). ``numbers``:
        the number columns (features, ``score``, ``amount``, the settings as scalars);
        ``strings``: the transactions' string fields the rules test (object arrays);
        ``members``: per :func:`member_column`, the rows whose value is a live item of
        the list (a lookup not read, e.g. rules reloaded during the micro-batch, reads as
        no row, logged). A NaN result does not hold."""
        chosen = self.rules if rules is None else tuple(rules)
        key = None if rules is None else tuple(r.code for r in chosen)  # codes are unique
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = _Program(chosen)
        return program.run(numbers, strings, members, n)


@dataclass(frozen=True)
class _Condition:
    """A number expression as :class:`_Program` compiles a rule's (no string tests)."""

    expr: str
    tests: tuple[StringTest, ...] = ()


def conditions(exprs: Sequence[str]) -> Callable[[Mapping[str, npt.ArrayLike], int], np.ndarray]:
    """Checked number expressions compiled together as conditions, as rules are
    (:class:`_Program`: each distinct sub-expression once; a NaN or a 0 does not hold):
    the function of a micro-batch's columns and size that returns where each holds, a
    (len(exprs), n) bool matrix. Every name an expression reads must be a column."""
    # _Program reads a rule's expr and tests alone
    program = _Program(cast("list[Rule]", [_Condition(e) for e in exprs]))
    return lambda numbers, n: program.run(numbers, {}, {}, n)


def member_column(list_name: str, fld: str) -> str:
    """The name of the column saying which rows' ``fld`` is on the list."""
    return f"in_list:{list_name}:{fld}"


class _Program:
    """Rules compiled into one function of a micro-batch's columns, with the semantics of
    :func:`fraud_scoring.declared.expressions.evaluate` of each rule's ``expr`` (float64
    columns, ``a / b`` 0 where ``b`` is 0, a NaN or a 0 does not hold), evaluated once per
    distinct sub-expression across the rules: a number column is converted to float64
    once, a string test (same field and values, or same list) is computed once, and a
    condition the rules share (``amount > 1000``) is one numpy call. Comparisons stay
    booleans: the rewrite's ``x != 0`` of a condition is the condition, ``x == 0`` its
    negation, ``a * b`` of conditions ``a & b`` and ``maximum(a, b)`` of conditions
    ``a | b`` (the same values as the float 0/1 the language computes); a condition
    used as a number is converted to 0.0 / 1.0 there."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        self._lines: list[str] = []
        self._memo: dict[str, tuple[str, bool]] = {}
        self._names: dict[str, Any] = {
            "__builtins__": {},
            "_f64": _f64,
            "_col": lambda c, k: np.asarray(c[k], dtype=np.float64),
            "_div": _div,
            "_neg": operator.neg,
            "_not": np.logical_not,
            "_and": np.logical_and,
            "_or": np.logical_or,
            "_among": _among,
            "_affix": _affix,
            "_member": _member,
            "_holds": _holds,
            **{f"_op_{op.__name__}": fn for op, fn in _BINOPS.items()},
            **{f"_op_{op.__name__}": fn for op, fn in _CMPS.items()},
            **{f"_fn_{name}": fn for name, fn in _FUNCS.items()},
        }
        for i, r in enumerate(self.rules):
            tests = {t.name: t for t in r.tests}
            code, cond = self._emit(ast.parse(r.expr, mode="eval").body, tests)
            self._lines.append(f"out[{i}] = {code if cond else f'_holds({code})'}")
        body = "\n    ".join(self._lines) or "pass"
        src = f"def _masks(c, s, m, n, out):\n    {body}\n"
        exec(compile(src, "<rules>", "exec"), self._names)  # built from checked rules
        self._fn = self._names["_masks"]

    def run(
        self,
        numbers: Mapping[str, npt.ArrayLike],
        strings: Mapping[str, np.ndarray],
        members: Mapping[str, np.ndarray],
        n: int,
    ) -> np.ndarray:
        out = np.zeros((len(self.rules), n), dtype=bool)
        self._fn(numbers, strings, members, n, out)
        return out

    def _bind(self, code: str, cond: bool) -> tuple[str, bool]:
        """``code`` computed once, in a variable of the function."""
        got = self._memo.get(code)
        if got is None:
            var = f"v{len(self._memo)}"
            self._lines.append(f"{var} = {code}")
            got = self._memo[code] = (var, cond)
        return got

    def _const(self, value: float) -> str:
        name = f"k{len(self._names)}"
        for k, v in self._names.items():  # one name per value (repr: -0.0, nan apart)
            if k.startswith("k") and repr(v) == repr(value):
                return k
        self._names[name] = value
        return name

    def _number(self, node: ast.expr, tests: Mapping[str, StringTest]) -> str:
        code, cond = self._emit(node, tests)
        return self._bind(f"_f64({code})", False)[0] if cond else code

    def _emit(self, node: ast.expr, tests: Mapping[str, StringTest]) -> tuple[str, bool]:
        """``node`` as a variable (or constant) and whether it is a condition (bool)."""
        if isinstance(node, ast.Name):
            t = tests.get(node.id)
            if t is None:
                return self._bind(f"_col(c, {node.id!r})", False)
            if t.list_name is not None:
                col = member_column(t.list_name, t.field)
                return self._bind(f"_member(m, {col!r}, {t.list_name!r}, n)", True)
            if t.match != "equal":  # starts_with / ends_with
                return self._bind(f"_affix(s[{t.field!r}], {t.values!r}, {t.match!r})", True)
            return self._bind(f"_among(s[{t.field!r}], {t.values!r})", True)
        if isinstance(node, ast.Constant):
            return self._const(float(node.value)), False  # type: ignore[arg-type]
        if isinstance(node, ast.UnaryOp):  # USub: the language's only unary operator
            return self._bind(f"_neg({self._number(node.operand, tests)})", False)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Mult):
                (a, ca), (b, cb) = self._emit(node.left, tests), self._emit(node.right, tests)
                if ca and cb:
                    return self._bind(f"_and({a}, {b})", True)
            a, b = self._number(node.left, tests), self._number(node.right, tests)
            if isinstance(node.op, ast.Div):
                return self._bind(f"_div({a}, {b})", False)
            return self._bind(f"_op_{type(node.op).__name__}({a}, {b})", False)
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            if node.func.id == "maximum" and len(node.args) == 2:
                (a, ca), (b, cb) = (self._emit(x, tests) for x in node.args)
                if ca and cb:
                    return self._bind(f"_or({a}, {b})", True)
            args = ", ".join(self._number(x, tests) for x in node.args)
            return self._bind(f"_fn_{node.func.id}({args})", False)
        if isinstance(node, ast.Compare):
            right = node.comparators[0]
            if (
                len(node.ops) == 1
                and isinstance(node.ops[0], ast.Eq | ast.NotEq)
                and isinstance(right, ast.Constant)
                and right.value == 0
            ):
                a, ca = self._emit(node.left, tests)
                if ca:  # a condition != 0: itself; == 0: its negation
                    return (
                        (a, True)
                        if isinstance(node.ops[0], ast.NotEq)
                        else self._bind(f"_not({a})", True)
                    )
            sides = [self._number(x, tests) for x in (node.left, *node.comparators)]
            parts = [
                self._bind(f"_op_{type(op).__name__}({x}, {y})", True)[0]
                for op, x, y in zip(node.ops, sides, sides[1:], strict=False)
            ]
            out = parts[0]
            for p in parts[1:]:
                out = self._bind(f"_and({out}, {p})", True)[0]
            return out, True
        raise ValueError(f"{type(node).__name__} is not allowed")  # checked at load


def _f64(cond: Any) -> np.ndarray:
    """A condition as the language's number: 1.0 where it holds, else 0.0."""
    return np.asarray(cond, dtype=np.float64)


def _holds(v: Any) -> np.ndarray:
    """Where a number holds as a condition: not 0 and not NaN."""
    v = np.asarray(v, dtype=np.float64)
    return (v != 0) & ~np.isnan(v)


def _among(column: np.ndarray, values: tuple[str, ...]) -> np.ndarray:
    """Rows whose string is one of ``values`` (``np.isin``, without its sort)."""
    column = np.asarray(column, dtype=object)
    if len(values) == 1:
        return np.asarray(column == values[0], dtype=bool).reshape(len(column))
    member = frozenset(values).__contains__
    return np.fromiter(map(member, column), dtype=bool, count=len(column))


def _affix(column: np.ndarray, values: tuple[str, ...], match: str) -> np.ndarray:
    """Rows whose string starts (``match`` "prefix") or ends ("suffix") with one of
    ``values``."""
    test = str.startswith if match == "prefix" else str.endswith
    return np.fromiter((test(str(v), values) for v in column), dtype=bool, count=len(column))


def _member(members: Mapping[str, np.ndarray], col: str, list_name: str, n: int) -> np.ndarray:
    got = members.get(col)
    if got is None:
        log.warning("list %s was not read for this micro-batch", list_name)
        return np.zeros(n, dtype=bool)
    got = np.asarray(got)
    return got if got.dtype == bool else np.asarray(got, dtype=np.float64) != 0


def load(path: Path, known: set[str], strings: Sequence[str] = ()) -> RuleSet:
    """The rules file at ``path``, checked against ``known`` (the served number features)
    and ``strings`` (a team's declared string and category fields, which a string test
    may name beside :data:`STRING_FIELDS`)."""
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise RulesError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(raw_bytes, str(path), known, strings)


def parse(raw_bytes: bytes, source: str, known: set[str], strings: Sequence[str] = ()) -> RuleSet:
    """A rules document (YAML bytes) named ``source`` in messages; ``strings``: the
    declared string fields a string test may name (:func:`load`)."""
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
            expr, tests = _rewrite(d.when, doc.lists, i, (*STRING_FIELDS, *strings))
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
    when: str, lists: Mapping[str, ListDecl], index: int, fields: Sequence[str] = STRING_FIELDS
) -> tuple[str, tuple[StringTest, ...]]:
    """``when`` with its conditions (``and``/``or``/``not``, string tests, list
    membership) rewritten into the declared features' language, and the string tests
    it now reads as columns. Refuses a ``when`` that is not a condition."""
    try:
        tree = ast.parse(when, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    r = _Rewrite(lists, index, fields)
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
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in AFFIX_TESTS
    if isinstance(node, ast.BoolOp):
        return all(_is_condition(v) for v in node.values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_condition(node.operand)
    return False


def _flag(node: ast.expr) -> ast.expr:
    """``node`` as 0/1 (``node != 0``)."""
    return ast.Compare(node, [ast.NotEq()], [ast.Constant(0)])


class _Rewrite(ast.NodeTransformer):
    def __init__(
        self, lists: Mapping[str, ListDecl], index: int, fields: Sequence[str] = STRING_FIELDS
    ) -> None:
        self.lists, self.index, self.fields = lists, index, tuple(fields)
        self.tests: list[StringTest] = []

    def _test(
        self,
        fld: str,
        values: tuple[str, ...] = (),
        list_name: str | None = None,
        match: str = "equal",
    ) -> str:
        for t in self.tests:
            if (t.field, t.values, t.list_name, t.match) == (fld, values, list_name, match):
                return t.name
        name = f"_r{self.index}_{fld}_{list_name or ''}{len(self.tests)}"
        self.tests.append(StringTest(name, fld, values, list_name, match))
        return name

    def visit_Call(self, node: ast.Call) -> ast.AST:
        """``starts_with(mcc, '79')``, ``ends_with(merchant_id, '-test', '-qa')``: a
        string field against one or more prefixes or suffixes."""
        if not (isinstance(node.func, ast.Name) and node.func.id in AFFIX_TESTS):
            return self.generic_visit(node)
        fn = node.func.id
        if not node.args or not isinstance(node.args[0], ast.Name):
            raise ValueError(f"{fn}(field, 'text', ...): a string field first")
        fld = node.args[0].id
        if fld not in self.fields:
            raise ValueError(f"{fn}: {fld!r} is not one of {', '.join(self.fields)}")
        texts = node.args[1:]
        if (
            not texts
            or node.keywords
            or not all(
                isinstance(t, ast.Constant) and isinstance(t.value, str) and t.value for t in texts
            )
        ):
            raise ValueError(f"{fn}({fld}, 'text', ...): one or more non-empty strings")
        values = tuple(sorted({t.value for t in texts}))  # type: ignore[attr-defined]
        name = self._test(fld, values, match=AFFIX_TESTS[fn])
        return ast.Compare(ast.Name(name, ast.Load()), [ast.NotEq()], [ast.Constant(0)])

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
            isinstance(x, ast.Name) and x.id in self.fields for x in (node.left, *node.comparators)
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
        if fld not in self.fields:
            raise ValueError(
                f"{fld!r} is not a transaction field a list or string can hold; "
                f"one of {', '.join(self.fields)}"
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
    """The transactions' string ``fields`` as object arrays (one per field), each value
    as :func:`value_of` gives it."""
    out = {}
    for f in fields:
        values = list(map(operator.attrgetter(f), txns))
        if not all(type(v) is str for v in values):
            values = ["" if v is None else str(v) for v in values]
        col = np.empty(len(values), dtype=object)
        col[:] = values
        out[f] = col
    return out
