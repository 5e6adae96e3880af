"""Fraud labels (chargebacks) as they stood at one instant.

Labels arrive days after the transaction (``raw/labels/`` is partitioned by arrival
day), so "is this transaction fraud?" always has an as-of time.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb

from fraud_scoring.storage import DataError, partition_days, partition_dir


def known_frauds(raw: Path, as_of: datetime) -> set[str]:
    """Ids of transactions whose fraud chargeback had arrived strictly before ``as_of``
    (timezone-aware). No label partitions: an empty set."""
    days = partition_days(raw, "labels")
    if not days:
        return set()
    files = [str(partition_dir(raw, "labels", d) / "part-0.parquet") for d in days]
    con = duckdb.connect()
    try:
        rows = con.execute(
            "SELECT DISTINCT transaction_id FROM read_parquet($f)"
            " WHERE label_time < $c AND is_fraud",
            {"f": files, "c": as_of},
        ).fetchall()
    except duckdb.Error as exc:
        raise DataError(f"reading labels under {raw / 'labels'}: {exc}") from exc
    finally:
        con.close()
    return {r[0] for r in rows}
