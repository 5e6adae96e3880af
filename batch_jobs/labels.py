"""Training's labels: the frauds known at one instant and where a label feed stops.

The label precedence itself (which of a transaction's labels stands) and the labelled
decision log are :mod:`fraud_scoring.labels` (the service's ``rules test`` reads them
too); its names are re-exported here for the batch jobs.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow.compute as pc

from fraud_scoring.labels import PRECEDENCE as PRECEDENCE
from fraud_scoring.labels import SOURCES_SCHEMA as SOURCES_SCHEMA
from fraud_scoring.labels import SOURCES_TABLE as SOURCES_TABLE
from fraud_scoring.labels import STANDING_SCHEMA as STANDING_SCHEMA
from fraud_scoring.labels import UNSOURCED as UNSOURCED
from fraud_scoring.labels import known_labels as known_labels
from fraud_scoring.labels import read_table
from fraud_scoring.labels import standing_labels as standing_labels


def newest_label_time(raw: Path, as_of: datetime) -> datetime | None:
    """The newest ``label_time`` under ``raw`` strictly before ``as_of`` (timezone-aware,
    UTC), any label, fraud or not; None when none had arrived: where a label feed stops."""
    t = read_table(raw, "labels", ["label_time"], "WHERE label_time < $as_of", as_of)
    newest = pc.max(t.column("label_time")).as_py() if t.num_rows else None
    return newest.astimezone(UTC) if newest is not None else None


def known_frauds(raw: Path, as_of: datetime) -> set[str]:
    """Ids of transactions whose standing label (:func:`known_labels`) as of ``as_of``
    is fraud: training's positives. No label partitions: an empty set."""
    t = known_labels(raw, as_of)
    return set(t.filter(t.column("is_fraud")).column("transaction_id").to_pylist())
