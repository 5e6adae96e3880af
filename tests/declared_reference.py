"""A naive reference of the declaration semantics (docs/features.md, "Declared
features"), straight from raw rows, sharing no code with the compiled paths: for each
row, filter the history with pandas and aggregate in plain Python.

Used by the tests to check every declared feature: served = training row = this.
"""

from __future__ import annotations

import ast
import math
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd

US = 1_000_000
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_WIDTHS_S = (1, 5, 60, 300, 3600, 21_600, 86_400)
CAP = 100  # distinct_count saturates here (docs/features.md)
_KEYS = ("card_id", "merchant_id", "device_id", "country", "channel", "mcc")


def _window_s(label: str) -> int:
    return int(label[:-1]) * _UNITS[label[-1]]


def _width_s(window_s: int) -> int:
    return max(u for u in _WIDTHS_S if window_s % u == 0 and window_s // u >= 10)


def _us(col: pd.Series) -> np.ndarray:
    return pd.to_datetime(col, utc=True).dt.as_unit("us").astype("int64").to_numpy()


def reference(
    declarations: dict[str, Any],
    rows: pd.DataFrame,
    history: pd.DataFrame,
    time_col: str,
    labels: pd.DataFrame | None = None,
    label_after_s: float = 0.0,
    decisions: pd.DataFrame | None = None,
) -> dict[str, list[float]]:
    """Every declared feature of ``rows`` (a YAML document ``declarations``, as loaded);
    ``labels`` are the raw labels (transaction_id, label_time, is_fraud) and
    ``decisions`` the service's decisions (transaction_id, decided_at, score, decision),
    which both reach the store ``label_after_s`` after the UTC midnight that follows
    their arrival; a label with ``live`` true (the service recorded it as it arrived:
    the transaction's first) reaches it at its arrival."""
    hist = history.drop_duplicates("transaction_id").copy()
    hist["_us"] = _us(hist["event_time"])
    t_all = _us(rows[time_col])
    out: dict[str, list[float]] = {}
    # A team's declared fields: a string, category or bool one is categorical.
    kinds = {f["name"]: f["type"] for f in declarations.get("fields") or []}
    keys = (*_KEYS, *(n for n, t in kinds.items() if t != "number"))
    for decl in declarations.get("aggregations", []):
        entity = [decl["entity"]] if isinstance(decl["entity"], str) else decl["entity"]
        delay = _window_s(decl["delay"]) * US if decl.get("delay") else 0
        src = decl.get("source", "transactions")
        whole = bool(delay) or src in ("labels", "decisions")
        if src in ("labels", "decisions"):  # each transaction's first label / decision
            raw, arrived = (labels, "label_time") if src == "labels" else (decisions, "decided_at")
            lab = raw.copy() if raw is not None else pd.DataFrame()
            if len(lab):
                lab["_lus"] = _us(lab[arrived])
                lab = lab.sort_values("_lus").drop_duplicates("transaction_id")
                lab = lab.merge(hist, on="transaction_id", suffixes=("", "_txn"))
            if len(lab):
                day = 86_400 * US
                avail = (lab["_lus"] // day + 1) * day + int(label_after_s * US)
                if "live" in lab:  # recorded by the service when it arrived
                    avail = np.where(lab["live"].fillna(False).astype(bool), lab["_lus"], avail)
                lab["_us"] = np.maximum(avail, lab["_us"] + delay)
                if src == "labels":
                    lab["is_fraud"] = lab["is_fraud"].astype(float)
            ev = lab if len(lab) else hist.iloc[:0].assign(is_fraud=0.0, score=0.0, decision="")
        else:
            ev = hist.assign(_us=hist["_us"] + delay)
        for col, allowed in decl.get("filter", {}).items():
            allowed = [allowed] if isinstance(allowed, str) else allowed
            ev = ev[ev[col].isin(allowed)]
        value = decl.get("value")
        categorical = value in keys
        default = decl.get("default")
        for c in [*entity, value] if categorical else entity:
            ev = ev[ev[c].notna() & (ev[c].astype(str) != "")]
        # An event without a declared number field its value reads is not counted.
        for c in _names(value) & {n for n, t in kinds.items() if t == "number"}:
            ev = ev[ev[c].notna()]
        # Each event's number (a column or an expression, evaluated per event) and
        # categorical value, once.
        # (without a value each event counts 1.0, as a decayed count reads it)
        ev = ev.assign(_x=_numbers(ev, value) if value and not categorical else float(not value))
        ev = ev.assign(_cat=ev[value].astype(str) if categorical else "")
        groups = {
            (k if isinstance(k, tuple) else (k,)): (
                g["_us"].to_numpy(np.int64),
                g["_x"].to_numpy(np.float64),
                g["_cat"].to_numpy(object),
            )
            for k, g in (ev.groupby(entity) if len(ev) else [])
        }
        nothing = (np.zeros(0, np.int64), np.zeros(0), np.zeros(0, object))
        for label in decl["windows"]:
            w_s = _window_s(label)
            u = _width_s(w_s) * US
            cols: dict[str, list[float]] = {a: [] for a in decl["features"]}
            for i, (_, row) in enumerate(rows.iterrows()):
                t = int(t_all[i])
                key = tuple(row[c] for c in entity)
                if any(k is None or k != k or k == "" for k in key):
                    ts, xs, cats = nothing
                else:
                    ts, xs, cats = groups.get(key, nothing)
                # whole tiles: the window ends at the tile edge at or before t
                before = ts // u < t // u if whole else ts < t
                inwin = before & (ts // u >= t // u - w_s * US // u)  # snapped start
                recent = before & (ts >= t - w_s * US)  # the exact window
                x = [float(v) for v in xs[inwin]]
                for agg in decl["features"]:
                    if agg == "count":
                        v = float(len(x))
                    elif agg == "sum":
                        v = math.fsum(x)
                    elif agg == "mean":
                        v = math.fsum(x) / len(x) if x else 0.0
                    elif agg == "std":
                        v = float(np.std(x)) if x else 0.0
                    elif agg == "min":
                        v = min(x) if x else 0.0
                    elif agg == "max":
                        v = max(x) if x else 0.0
                    elif agg == "decayed_sum":  # each value weighted 2^-(age / half-life)
                        h = _window_s(decl["features"][agg]["half_life"]) * US
                        v = math.fsum(
                            float(a) * 2.0 ** ((int(b) - t) / h)
                            for a, b in zip(xs[inwin], ts[inwin], strict=True)
                        )
                    elif agg == "distinct_count":
                        v = float(min(len(set(cats[inwin])), CAP))
                    elif agg in ("changed", "last"):
                        at = recent & (ts == ts[recent].max()) if recent.any() else recent
                        if agg == "last":  # the newest event's value (ties: the largest)
                            v = float(max(xs[at])) if at.any() else 0.0
                        else:
                            own = row[value]
                            missing = own is None or own != own or own == ""
                            v = 0.0 if missing or not at.any() or str(own) in set(cats[at]) else 1.0
                    else:  # seconds_since_last: exact window
                        v = (t - int(ts[recent].max())) / US if recent.any() else float(w_s)
                    mine = default.get(agg) if isinstance(default, dict) else default
                    exact = agg in ("seconds_since_last", "last", "changed")
                    if mine is not None and not (recent if exact else inwin).any():
                        v = float(mine)  # the declared default: the window holds nothing
                    cols[agg].append(v)
            for agg, prefix in decl["features"].items():
                name = prefix["name"] if isinstance(prefix, dict) else prefix
                out[f"{name}_{label}"] = cols[agg]
    return out


def _names(value: str | None) -> set[str]:
    """The columns a declaration's value reads."""
    if not value:
        return set()
    tree = ast.parse(value, mode="eval")
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def _numbers(events: pd.DataFrame, value: str) -> list[float]:
    """The events' values: a number column, or an expression over them per event."""
    if value.isidentifier():
        return [float(v) for v in events[value]]
    names = [c for c in sorted(_names(value)) if c in events]
    rows = events[names].astype(float).to_dict("records")
    return [derived_reference(value, r) for r in rows]


_FUNCS = {
    "log1p": math.log1p,
    "abs": abs,
    "sqrt": lambda x: math.sqrt(max(x, 0.0)),
    "clip": lambda x, lo, hi: min(max(x, lo), hi),
    "minimum": min,
    "maximum": max,
    "where": lambda c, a, b: a if c else b,
    "hour_of_day": lambda s, zone=None: float(_wall(s, zone).hour),
    "day_of_week": lambda s, zone=None: float(_wall(s, zone).weekday()),
    "speed_kmh": lambda km, seconds: km * 3600.0 / max(seconds, 1.0),
    "distance_km": lambda a, b, c, d: (
        2
        * 6371.0088
        * math.asin(
            math.sqrt(
                math.sin(math.radians(c - a) / 2) ** 2
                + math.cos(math.radians(a))
                * math.cos(math.radians(c))
                * math.sin(math.radians(d - b) / 2) ** 2
            )
        )
    ),
}


def _wall(s: float, zone: str | None) -> datetime:
    """Epoch seconds as a wall clock: UTC, or in the IANA ``zone`` (zoneinfo)."""
    return datetime.fromtimestamp(s, ZoneInfo(zone) if zone else UTC)


def derived_reference(expr: str, row: dict[str, float]) -> float:
    """One row of a derived expression, evaluated on Python floats (``a / 0`` is 0)."""

    class Div(ast.NodeTransformer):
        def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
            self.generic_visit(node)
            if isinstance(node.op, ast.Div):
                return ast.Call(ast.Name("_div", ast.Load()), [node.left, node.right], [])
            return node

    tree = ast.fix_missing_locations(Div().visit(ast.parse(expr, mode="eval")))
    env = {**_FUNCS, "_div": lambda a, b: a / b if b != 0 else 0.0, **row}
    return float(eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}}, env))
