"""A declarations file's errors, every one in one pass with its line
(``fraud_scoring/declared/file_errors.py`` through ``features.load_declarations``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.declared.file_errors import field_lines


def _line(text: str, needle: str, after: int = 0) -> int:
    """The line (1-based) of the first line after ``after`` holding ``needle``."""
    lines = text.splitlines()
    return next(i + 1 for i in range(after, len(lines)) if needle in lines[i])


def test_every_error_of_a_file_is_reported_at_once_with_its_line(tmp_path: Path) -> None:
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    n_aggs, n_derived, n_reasons = (
        len(doc["aggregations"]),
        len(doc["derived"]),
        len(doc["reasons"]),
    )
    doc["aggregations"] += [
        {"entity": "card_id", "windows": ["1h"], "features": {"count": "card_txn_count"}},
        {"entity": "card_id", "windows": ["90s2"], "features": {"count": "odd"}},
        {"entity": "card_id", "value": "colour", "windows": ["1h"], "features": {"sum": "hue"}},
    ]
    # Reads the features of broken items only: not reported again.
    doc["derived"].append({"name": "ratio", "expr": "hue_1h / nope"})
    doc["reasons"] += [
        {"code": "NO_CARD_HISTORY", "when": "amount > 1", "message": "taken"},
        {"code": "ODD", "when": "odd_90s2 > 1", "message": "{ratio}"},
    ]
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    text = path.read_text()
    with pytest.raises(D.DeclarationError) as err:
        F.load_declarations(path)
    listed = str(err.value).splitlines()

    velocity = _line(text, "count: card_txn_count")  # the product's own declaration
    again = _line(text, "count: card_txn_count", _line(text, "count: odd") - 10)
    expected = [
        f"{path}: 5 errors:",
        f"{path}:{again}: aggregations.{n_aggs}.features.count: feature 'card_txn_count_1h' "
        f"is declared twice: first at line {velocity} (aggregations.",
        f"{path}:{_line(text, '90s2') - 1}: aggregations.{n_aggs + 1}.windows: window '90s2'",
        f"{path}:{_line(text, 'value: colour')}: aggregations.{n_aggs + 2}.value: unknown "
        "column 'colour'",
        f"{path}:{_line(text, 'hue_1h / nope')}: derived.{n_derived}.expr: unknown name 'nope'",
        f"{path}:{_line(text, 'code: NO_CARD_HISTORY')}: reasons.{n_reasons}.code: "
        "'NO_CARD_HISTORY' is taken",
    ]
    assert len(listed) == len(expected), str(err.value)
    for line, start in zip(listed, expected, strict=True):
        assert line.startswith(start), (line, start)


def test_one_error_is_one_line_and_a_sound_file_loads(tmp_path: Path) -> None:
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["aggregationz"] = []
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(D.DeclarationError) as err:
        F.load_declarations(path)
    line = _line(path.read_text(), "aggregationz")
    assert str(err.value) == f"{path}:{line}: aggregationz: Extra inputs are not permitted"
    assert F.load_declarations(D.DEFAULT_PATH).names()


def test_a_feature_named_as_a_built_in_one_says_so(tmp_path: Path) -> None:
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["derived"].append({"name": "amount_log", "expr": "amount * 2"})
    path = tmp_path / "features.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(D.DeclarationError, match="'amount_log' is declared twice: the product"):
        F.load_declarations(path)


def test_field_lines_maps_items_and_fields() -> None:
    text = "aggregations:\n  - entity: card_id\n    features: {count: n}\nderived: []\n"
    assert field_lines(text) == {
        "aggregations": 1,
        "aggregations.0": 2,
        "aggregations.0.entity": 2,
        "aggregations.0.features": 3,
        "aggregations.0.features.count": 3,
        "derived": 4,
    }
    assert field_lines("a: [") == {}
