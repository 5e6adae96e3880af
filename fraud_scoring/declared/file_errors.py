"""Every error of a declarations file in one pass, each with its line.

The checks (:mod:`.language`, :mod:`.plan`, the snapshot views, the reasons) stop at their
first error, a :class:`DeclarationError` naming the field (``aggregations.3.value: ...``).
:func:`load_every_error` runs them again without the item at fault (a view, an
aggregation, a derived feature or a reason) until they pass or an error names no item,
then raises one DeclarationError listing them all, ``file:line: field: message``. The
feature names a left-out item declares stay known, so what reads them is not reported
again; a feature declared twice is reported where it is declared the second time, with
the line of the first. One error per item: an item's further errors show once it is fixed.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import yaml

from fraud_scoring.declared.language import DeclarationError

T = TypeVar("T")

# The document's lists of items, in the order the checks read them.
SECTIONS = ("snapshots", "aggregations", "derived", "reasons")
_AT = re.compile(r"^(?P<loc>[A-Za-z_][\w]*(?:\.\w+)*): (?P<msg>.*)$", re.S)
_TWICE = re.compile(r"feature '(?P<name>[^']+)' is declared twice")


def field_lines(text: str) -> dict[str, int]:
    """The line (1-based) of each field and item of the YAML ``text`` by its dotted path
    (``aggregations.3``, ``aggregations.3.windows``); empty when ``text`` is not YAML."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                at = f"{path}.{key.value}" if path else str(key.value)
                lines[at] = key.start_mark.line + 1
                walk(value, at)
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                lines[f"{path}.{i}"] = value.start_mark.line + 1
                walk(value, f"{path}.{i}")

    if root is not None:
        walk(root, "")
    return lines


def line_of(lines: dict[str, int], loc: str) -> int | None:
    """The line of ``loc`` or of the nearest field that holds it."""
    parts = loc.split(".")
    while parts:
        if ".".join(parts) in lines:
            return lines[".".join(parts)]
        parts.pop()
    return None


def declared_names(raw: object) -> list[tuple[str, str]]:
    """The feature names the document ``raw`` declares, each with the field that names it
    (``snapshots.0.features.2.name``, ``aggregations.1.features.count``, ``derived.0.name``),
    as far as they can be read from a document that may break the language."""
    out: list[tuple[str, str]] = []
    for i, view in enumerate(_items(raw, "snapshots")):
        for j, f in enumerate(_items(view, "features")):
            if isinstance(f, dict) and isinstance(f.get("name"), str):
                out.append((f["name"], f"snapshots.{i}.features.{j}.name"))
    for i, agg in enumerate(_items(raw, "aggregations")):
        features = agg.get("features") if isinstance(agg, dict) else None
        windows = agg.get("windows") if isinstance(agg, dict) else None
        windows = [windows] if isinstance(windows, str) else windows
        if isinstance(features, dict) and isinstance(windows, list):
            for kind, prefix in features.items():
                out += [(f"{prefix}_{w}", f"aggregations.{i}.features.{kind}") for w in windows]
    for i, d in enumerate(_items(raw, "derived")):
        if isinstance(d, dict) and isinstance(d.get("name"), str):
            out.append((d["name"], f"derived.{i}.name"))
    return out


def _items(doc: object, section: str) -> list[Any]:
    items = doc.get(section) if isinstance(doc, dict) else None
    return items if isinstance(items, list) else []


def load_every_error(
    raw: object,
    source: str,
    lines: dict[str, int],
    load: Callable[[object, Sequence[str]], T],
    built_in: Collection[str] = (),
) -> T:
    """``load(raw, known)``'s result when it raises no DeclarationError; else one
    DeclarationError listing every error of the document ``raw`` (read from ``source``,
    its fields at ``lines``), each as ``source:line: field: message``.

    ``load`` checks a document and must accept ``known``: feature names to treat as
    declared elsewhere (those of the items left out). ``built_in`` are the names the
    product declares itself (a feature declared under one of them is named as such)."""
    doc = copy.deepcopy(raw)
    kept = {s: list(range(len(_items(doc, s)))) for s in SECTIONS}  # doc's index -> raw's
    names = declared_names(raw)
    known: list[str] = []
    problems: list[tuple[int, str]] = []  # (line, text)

    def live(loc: str) -> bool:
        section, index = loc.split(".")[:2]
        return int(index) in kept[section]

    def leave_out(section: str, original: int) -> None:
        at = kept[section].index(original)
        del kept[section][at], doc[section][at]  # type: ignore[index]
        # Names the items left out declared and no item left declares.
        declared_by_live = {n for n, loc in names if live(loc)}
        known[:] = sorted({n for n, loc in names if not live(loc)} - declared_by_live)

    def report(loc: str, message: str) -> None:
        line = line_of(lines, loc) if loc else None
        message = message.removeprefix("Value error, ")  # pydantic's, for a validator's
        text = f"{source}:{line}: {loc}: {message}" if line else f"{source}: {message}"
        if (line or 0, text) not in problems:
            problems.append((line or 0, text))

    while True:
        try:
            result = load(doc, known)
        except DeclarationError as exc:
            text = str(exc).removeprefix(f"{source}: ")
        else:
            if not problems:
                return result
            break
        twice = _TWICE.search(text)
        at = _AT.match(text)
        parts = at["loc"].split(".") if at else []
        if twice:
            name = twice["name"]
            spots = sorted(
                (loc for n, loc in names if n == name), key=lambda loc: line_of(lines, loc) or 0
            )
            present = [loc for loc in spots if live(loc)]
            if not present:
                report("", text)
                break
            where = present[-1]
            first = next((loc for loc in spots if loc != where), None)
            if first is not None:
                said = f"first at line {line_of(lines, first)} ({first})"
            elif name in built_in:
                said = "the product declares it itself (docs/features.md)"
            else:
                said = "this item declares it twice"
            report(where, f"feature {name!r} is declared twice: {said}")
            leave_out(where.split(".")[0], int(where.split(".")[1]))
        elif len(parts) >= 2 and parts[0] in SECTIONS and parts[1].isdigit():
            if int(parts[1]) >= len(kept[parts[0]]):
                report("", text)
                break
            original = kept[parts[0]][int(parts[1])]
            loc = ".".join([parts[0], str(original), *parts[2:]])
            report(loc, at["msg"] if at else text)
            leave_out(parts[0], original)
        elif len(parts) == 1 and parts[0] not in SECTIONS and isinstance(doc, dict):
            report(parts[0], at["msg"] if at else text)  # an unknown top-level field
            if parts[0] not in doc:
                break
            del doc[parts[0]]
        else:
            report(parts[0] if parts else "", at["msg"] if at else text)
            break
    listed = [text for _, text in sorted(problems)]
    if len(listed) == 1:
        raise DeclarationError(listed[0])
    raise DeclarationError(f"{source}: {len(listed)} errors:\n" + "\n".join(listed))
