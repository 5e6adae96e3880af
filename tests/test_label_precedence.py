"""Which label of a transaction stands (``batch_jobs.labels``): analyst > chargeback >
any other source, the newest first within a source; the same rule for training's
positives and for the labelled view of the served decisions, with the sources the
compaction keeps beside the label files. Quick: no world, no server (the HTTP side is in
tests/test_review.py)."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from batch_jobs.decisions import (
    LABEL_SCHEMA,
    compact_day,
    decisions_with_labels,
    feedback_labels,
)
from batch_jobs.labels import (
    SOURCES_SCHEMA,
    SOURCES_TABLE,
    known_frauds,
    known_labels,
    newest_label_time,
    standing_labels,
)
from fraud_scoring.contract import check_raw
from fraud_scoring.storage import partition_file, read_partition, write_partition
from service.edge.feedback import feedback_key

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def rows(*labels: tuple[str, float, bool, str]) -> tuple[pa.Table, pa.Table]:
    """(label rows, source rows) of ``(transaction_id, arrival hours, is_fraud,
    source)``; source "" writes no source row (a chargeback file's label)."""
    got = [
        {"transaction_id": t, "label_time": at(h), "is_fraud": f, "source": s or None}
        for t, h, f, s in labels
    ]
    return (
        pa.Table.from_pylist(got, schema=LABEL_SCHEMA),
        pa.Table.from_pylist([r for r in got if r["source"]], schema=SOURCES_SCHEMA),
    )


def standing(*labels: tuple[str, float, bool, str], as_of: float = 1000) -> dict[str, Any]:
    got = standing_labels(*rows(*labels), at(as_of)).to_pylist()
    return {r["transaction_id"]: (r["is_fraud"], r["source"]) for r in got}


def test_an_analyst_overrules_a_chargeback_which_overrules_any_other_source() -> None:
    assert standing(
        # the case: a pre-label, then the analyst's mark
        ("a", 1, False, "customer"),
        ("a", 2, True, "analyst"),
        # an analyst's verdict stands against a later chargeback, either way round
        ("b", 1, False, "analyst"),
        ("b", 5, True, "chargeback"),
        ("c", 1, True, "analyst"),
        ("c", 5, False, ""),  # a chargeback file's row: a chargeback
        # a chargeback stands against a later customer report
        ("d", 1, True, ""),
        ("d", 9, False, "customer"),
        # one label: itself
        ("e", 3, False, "customer"),
    ) == {
        "a": (True, "analyst"),
        "b": (False, "analyst"),
        "c": (True, "analyst"),
        "d": (True, "chargeback"),
        "e": (False, "customer"),
    }


def test_within_a_source_the_newest_stands_and_only_arrivals_before_as_of_count() -> None:
    labels = [
        ("cb", 1, True, "chargeback"),
        ("cb", 4, False, ""),  # the chargeback cleared later
        ("an", 1, True, "analyst"),
        ("an", 6, False, "analyst"),  # a second analyst's later mark
        ("tie", 2, False, "customer"),
        ("tie", 2, True, "customer"),  # one instant, one source: fraud
    ]
    assert standing(*labels) == {
        "cb": (False, "chargeback"),
        "an": (False, "analyst"),
        "tie": (True, "customer"),
    }
    # As of hour 3: the clearing and the second mark had not arrived (strictly before).
    assert standing(*labels, as_of=3) == {
        "cb": (True, "chargeback"),
        "an": (True, "analyst"),
        "tie": (True, "customer"),
    }
    assert standing(*labels, as_of=1) == {}
    # An analyst's mark arriving after as_of does not overrule what stood before it.
    assert standing(("x", 1, True, "customer"), ("x", 5, False, "analyst"), as_of=5) == {
        "x": (True, "customer")
    }


def feedback(tid: str, hours: float, fraud: bool, source: str, key_id: str) -> bytes:
    return json.dumps(
        {
            "transaction_id": tid,
            "is_fraud": fraud,
            "source": source,
            "reported_time": int(at(hours).timestamp() * 1e6),
            "label_time": int(at(hours).timestamp() * 1e6),
            "matched": True,
            "key_id": key_id,
        }
    ).encode()


def decision(tid: str) -> bytes:
    t = {"event_time": T0.isoformat(), "card_id": "c", "merchant_id": "m", "amount": 1.0}
    return json.dumps(
        {
            "transaction_id": tid,
            "decided_at": int(T0.timestamp() * 1e6),
            "transaction": t,
            "score": 0.5,
            "decision": "review",
            "model_version": "1",
            "reasons": [],
            "missing": [],
            "stale": [],
            "features": {"amount": 1.0},
            "timing_ms": {},
        }
    ).encode()


def test_compaction_keeps_sources_and_every_reader_takes_the_standing_label(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    day = T0.date()
    # A chargeback file ingested for the same day: the contract's columns, no source.
    write_partition(
        raw,
        "labels",
        day,
        pa.Table.from_pylist(
            [
                {"transaction_id": "t-cb", "label_time": at(1), "is_fraud": True},
                {"transaction_id": "t-pre", "label_time": at(1), "is_fraud": True},
            ],
            schema=LABEL_SCHEMA,
        ),
    )
    logged = [
        # a label key's pre-label, then the analyst's mark (the issue)
        feedback("t-pre", 2, False, "customer", "feed"),
        feedback("t-pre", 3, False, "analyst", "ana"),
        # a chargeback feed through the API against an analyst
        feedback("t-an", 2, True, "analyst", "ana"),
        feedback("t-an", 4, False, "chargeback", "feed"),
        # an analyst's label stored under another key before sources were checked, then
        # the analyst's own mark: two labels, the newest stands
        feedback("t-two", 2, False, "analyst", "feed"),
        feedback("t-two", 3, True, "analyst", "ana"),
        feedback("t-two", 4, True, "analyst", "ana"),  # a retry of the same key: dropped
        feedback("t-cust", 2, True, "customer", "feed"),
        feedback("t-cust", 3, False, "customer", "feed"),  # same source again: dropped
    ]
    decisions = [decision(t) for t in ("t-cb", "t-pre", "t-an", "t-two", "t-cust", "t-none")]
    report = compact_day(raw, day, decisions, logged)
    assert report.labels == 7
    again = read_partition(raw, SOURCES_TABLE, day)
    compact_day(raw, day, decisions, logged)  # idempotent
    assert read_partition(raw, SOURCES_TABLE, day).equals(again)
    assert read_partition(raw, "labels", day).num_rows == 2 + 7
    check_raw(raw)  # the label partitions keep the contract's columns

    as_of = at(100)
    expected = {
        "t-cb": (True, "chargeback"),
        "t-pre": (False, "analyst"),
        "t-an": (True, "analyst"),
        "t-two": (True, "analyst"),
        "t-cust": (True, "customer"),
    }
    got = {
        r["transaction_id"]: (r["is_fraud"], r["source"])
        for r in known_labels(raw, as_of).to_pylist()
    }
    assert got == expected
    # Training's positives and the served decisions' view agree with it.
    assert known_frauds(raw, as_of) == {t for t, (f, _) in expected.items() if f}
    view = decisions_with_labels(raw, day, day, as_of).to_pylist()
    assert {r["transaction_id"]: (r["is_fraud"], r["label_source"]) for r in view} == {
        **expected,
        "t-none": (None, None),
    }
    # Before the analyst's mark arrived, the chargeback file's fraud stood for t-pre.
    assert "t-pre" in known_frauds(raw, at(2.5))
    # Where the feed stops (training's refusal for too few frauds names it).
    assert newest_label_time(raw, as_of) == at(4)
    assert newest_label_time(raw, at(2.5)) == at(2)


def test_no_label_files_no_labels(tmp_path: Path) -> None:
    assert known_frauds(tmp_path / "raw", T0) == set()
    assert known_labels(tmp_path / "raw", T0).num_rows == 0
    assert newest_label_time(tmp_path / "raw", T0) is None
    assert not partition_file(tmp_path / "raw", SOURCES_TABLE, date(2026, 3, 1)).exists()


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (("t", "analyst", "ana"), ("t", "analyst", "ana"), True),  # a retry
        (("t", "analyst", "feed"), ("t", "analyst", "ana"), False),  # another key's
        (("t", "customer", "feed"), ("t", "analyst", "ana"), False),
        (("t", "chargeback", "feed"), ("t", "chargeback", "bank"), True),  # first stands
    ],
)
def test_an_analysts_mark_is_a_duplicate_only_of_the_same_keys(
    a: tuple[str, str, str], b: tuple[str, str, str], same: bool
) -> None:
    assert (feedback_key(*a) == feedback_key(*b)) is same
    # The compaction keeps one label per the same key.
    kept = feedback_labels(
        [feedback(a[0], 1, True, a[1], a[2]), feedback(b[0], 2, True, b[1], b[2])]
    )
    assert kept.num_rows == (1 if same else 2)
