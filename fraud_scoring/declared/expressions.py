"""Expressions over number columns: a declaration's value (``log1p(amount)``), a derived
feature's ``expr`` and a reason's ``when``. :func:`_check_expr` refuses anything but
numbers, names, ``+ - * /``, comparisons and the functions of :data:`_FUNCS` with their
number of arguments (a text constant only as a time zone's name); a checked
expression is compiled once to numpy calls (:func:`evaluate`; ``a / b`` is 0 where
``b`` is 0).
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

# Request fields an expression may read besides features: the amount, the event time
# (epoch seconds, UTC) and the event's local UTC offset (seconds; 0 when unknown).
REQUEST_FIELDS = ("amount", "event_time_s", "utc_offset_s")
EARTH_RADIUS_KM = 6371.0088  # the mean radius (IUGG)


def _clip(x: Any, lo: Any, hi: Any) -> Any:
    """``np.clip`` by its definition (``minimum(maximum(x, lo), hi)``, NaN kept): two
    ufunc calls, where ``np.clip``'s own checks cost more than the work on a row."""
    return np.minimum(np.maximum(x, lo), hi)


def _in_zone(s: Any, zone: str | None) -> Any:
    """Epoch seconds ``s`` as the wall clock of the IANA time zone ``zone`` (seconds
    since the epoch of that zone's local time; its daylight saving time included), or
    ``s`` itself without one. Vectorized (pandas' conversion of the whole column); NaN
    stays NaN."""
    if zone is None:
        return s
    import pandas as pd  # the batch and the service have it loaded already

    x = np.asarray(s, dtype=np.float64)
    flat = np.atleast_1d(x)
    ok = np.isfinite(flat)
    us = np.where(ok, flat, 0.0) * 1e6  # µs: exact for an event time's microseconds
    utc = pd.DatetimeIndex(pd.to_datetime(np.round(us).astype(np.int64), unit="us", utc=True))
    wall = utc.tz_convert(zone).tz_localize(None).as_unit("us").asi8
    local = np.where(ok, flat + (wall - utc.as_unit("us").asi8) / 1e6, np.nan)
    return local.reshape(x.shape) if x.ndim else local[0]


def _hour_of_day(s: Any, zone: str | None = None) -> Any:
    """The hour (0-23) of epoch seconds ``s`` (UTC), or in the IANA ``zone``:
    ``hour_of_day(event_time_s + utc_offset_s)`` is the hour in the offset the event was
    sent with, ``hour_of_day(event_time_s, "Europe/Paris")`` the hour in Paris."""
    return np.floor(np.mod(_in_zone(s, zone), 86_400.0) / 3600.0)


def _day_of_week(s: Any, zone: str | None = None) -> Any:
    """The weekday of epoch seconds ``s`` (UTC, or in the IANA ``zone``), Monday 0 to
    Sunday 6 (1970-01-01 was a Thursday)."""
    local = np.asarray(_in_zone(s, zone), dtype=np.float64)
    return np.mod(np.floor(local / 86_400.0) + 3.0, 7.0)


def _speed_kmh(km: Any, seconds: Any) -> Any:
    """The speed that covers ``km`` in ``seconds``, km/h, the time taken as at least one
    second (two transactions at one instant: the distance per second): "impossible
    travel" is ``speed_kmh(distance_km(...), card_gap_1d) > 900``."""
    return np.asarray(km, dtype=np.float64) * 3600.0 / np.maximum(seconds, 1.0)


def _distance_km(lat1: Any, lon1: Any, lat2: Any, lon2: Any) -> Any:
    """The great-circle distance between two (latitude, longitude) points in degrees,
    km (haversine on a sphere of the Earth's mean radius; NaN in, NaN out)."""
    p1, p2 = np.radians(lat1), np.radians(lat2)
    dp, dl = p2 - p1, np.radians(np.asarray(lon2) - np.asarray(lon1))
    h = np.sin(dp / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))


_FUNCS: dict[str, Callable[..., Any]] = {
    "log1p": np.log1p,
    "abs": np.abs,
    "sqrt": lambda x: np.sqrt(np.maximum(x, 0.0)),
    "clip": _clip,
    "minimum": np.minimum,
    "maximum": np.maximum,
    "where": np.where,
    "hour_of_day": _hour_of_day,
    "day_of_week": _day_of_week,
    "distance_km": _distance_km,
    "speed_kmh": _speed_kmh,
}
# Each function's number of arguments (least, most), checked at load.
_ARITY = {
    "log1p": (1, 1),
    "abs": (1, 1),
    "sqrt": (1, 1),
    "clip": (3, 3),
    "minimum": (2, 2),
    "maximum": (2, 2),
    "where": (3, 3),
    "hour_of_day": (1, 2),
    "day_of_week": (1, 2),
    "distance_km": (4, 4),
    "speed_kmh": (2, 2),
}
# The functions whose last argument may be a time zone's name (a text constant).
_ZONED = ("hour_of_day", "day_of_week")
_BINOPS = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply}
_CMPS = {
    ast.Gt: np.greater,
    ast.GtE: np.greater_equal,
    ast.Lt: np.less,
    ast.LtE: np.less_equal,
    ast.Eq: np.equal,
    ast.NotEq: np.not_equal,
}


def _zones(tree: ast.AST) -> set[int]:
    """The text constants of ``tree`` that name a time zone (a zoned function's second
    argument), checked: an unknown zone is refused naming it."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        arg = node.args[-1] if node.func.id in _ZONED and len(node.args) == 2 else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            _zone(arg.value)
            out.add(id(arg))
    return out


@functools.lru_cache(maxsize=256)
def _zone(name: str) -> str:
    """``name`` when it is an IANA time zone this machine knows (``Europe/Paris``)."""
    import zoneinfo

    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name: Europe/Paris)") from None
    return name


def _check_expr(expr: str, known: set[str]) -> None:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None
    zones = _zones(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            lo, hi = _ARITY.get(node.func.id, (0, 99))
            if not lo <= len(node.args) <= hi or node.keywords:
                want = f"{lo}" if lo == hi else f"{lo} or {hi}"
                raise ValueError(f"{node.func.id} takes {want} arguments")
        if isinstance(node, ast.Name) and node.id not in known and node.id not in _FUNCS:
            raise ValueError(f"unknown name {node.id!r}")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in _FUNCS
        ):
            raise ValueError(f"only these functions: {', '.join(_FUNCS)}")
        ok = (
            ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.Compare, ast.Call,
            ast.Name, ast.Load, ast.Constant, ast.Div, *_BINOPS, *_CMPS,
        )  # fmt: skip
        if not isinstance(node, ok):
            raise ValueError(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.Constant) and id(node) in zones:
            continue
        if isinstance(node, ast.Constant) and (
            not isinstance(node.value, int | float) or isinstance(node.value, bool)
        ):
            raise ValueError(
                "constants must be numbers (a text only as hour_of_day's or day_of_week's "
                "time zone)"
            )


def evaluate(expr: str, columns: Mapping[str, npt.ArrayLike]) -> np.ndarray:
    """An expression over float64 columns. ``a / b`` is 0 where ``b`` is 0 (write the
    default you want with ``where``); clipping is written in the expression."""
    return np.asarray(_compiled(expr)(columns), dtype=np.float64)


def _div(a: Any, b: Any) -> Any:
    b = np.asarray(b, dtype=np.float64)
    some = b != 0
    return np.where(some, np.asarray(a) / np.where(some, b, 1.0), 0.0)


def _chain(*parts: Any) -> Any:
    """A comparison (chained: ``0 < x < 3``) as 1.0 / 0.0."""
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return np.asarray(out).astype(np.float64)


# The names a compiled expression calls: numpy's operations, and each function by name.
_NAMESPACE: dict[str, Any] = {
    "__builtins__": {},
    "_col": lambda c, k: np.asarray(c[k], dtype=np.float64),
    "_div": _div,
    "_neg": operator.neg,
    "_chain": _chain,
    **{f"_op_{op.__name__}": fn for op, fn in _BINOPS.items()},
    **{f"_op_{op.__name__}": fn for op, fn in _CMPS.items()},
    **{f"_fn_{name}": fn for name, fn in _FUNCS.items()},
}


class _Compile(ast.NodeTransformer):
    """A checked expression (:func:`_check_expr`) as calls into :data:`_NAMESPACE`: the
    tree is walked once, not per evaluation."""

    @staticmethod
    def _call(name: str, *args: ast.expr) -> ast.Call:
        return ast.Call(ast.Name(name, ast.Load()), list(args), [])

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self._call("_col", ast.Name("c", ast.Load()), ast.Constant(node.id))

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str):  # a time zone's name (checked)
            return node
        return ast.Constant(float(node.value))  # type: ignore[arg-type]  # numbers only

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return self._call("_neg", self.visit(node.operand))

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        a, b = self.visit(node.left), self.visit(node.right)
        if isinstance(node.op, ast.Div):
            return self._call("_div", a, b)
        return self._call(f"_op_{type(node.op).__name__}", a, b)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        sides = [node.left, *node.comparators]
        parts = [
            self._call(f"_op_{type(op).__name__}", self.visit(x), self.visit(y))
            for op, x, y in zip(node.ops, sides, sides[1:], strict=False)
        ]
        return self._call("_chain", *parts)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        assert isinstance(node.func, ast.Name)
        return self._call(f"_fn_{node.func.id}", *(self.visit(a) for a in node.args))


@functools.lru_cache(maxsize=1024)  # derived features and reasons: per micro-batch
def _compiled(expr: str) -> Callable[[Mapping[str, npt.ArrayLike]], Any]:
    _check_expr(expr, _AnyName())
    body = _Compile().visit(ast.parse(expr, mode="eval").body)
    tree = ast.fix_missing_locations(ast.Expression(ast.Lambda(_lambda_args("c"), body)))
    fn: Callable[[Mapping[str, npt.ArrayLike]], Any] = eval(  # checked above
        compile(tree, f"<expression {expr!r}>", "eval"), _NAMESPACE
    )
    return fn


def _lambda_args(name: str) -> ast.arguments:
    return ast.arguments(
        posonlyargs=[], args=[ast.arg(name)], kwonlyargs=[], kw_defaults=[], defaults=[]
    )


class _AnyName(set[str]):
    """Every name is known: :func:`_check_expr` then checks the shape alone (the names
    were checked when the declarations were loaded)."""

    def __contains__(self, _name: object) -> bool:
        return True


def is_expression(value: str | None) -> bool:
    """A declaration's value is an expression, not a column name."""
    return value is not None and not value.isidentifier()


@functools.lru_cache(maxsize=1024)  # read per event (a label's value): parsed once
def value_names(value: str | None) -> frozenset[str]:
    """The columns a declaration's value reads (none without a value)."""
    if value is None:
        return frozenset()
    if not is_expression(value):
        return frozenset({value})
    tree = _parsed(value)
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS)


@functools.lru_cache(maxsize=1024)  # derived features are evaluated per micro-batch
def _parsed(expr: str) -> ast.Expression:
    return ast.parse(expr, mode="eval")
