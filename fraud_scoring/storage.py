"""File layout of raw history and feature tables, and atomic writes.

Everything under ``data_dir``::

    raw/transactions/date=YYYY-MM-DD/part-0.parquet   one partition per event day
    raw/labels/date=YYYY-MM-DD/part-0.parquet         chargebacks, by arrival day
    features/<view>/date=YYYY-MM-DD/part-0.parquet    daily snapshots per feature view
    feast/registry.db                                 Feast registry
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class DataError(RuntimeError):
    """Input data is missing or unreadable; the message names the file."""


def partition_dir(root: Path, table: str, day: date) -> Path:
    return root / table / f"date={day.isoformat()}"


def partition_file(root: Path, table: str, day: date) -> Path:
    """The one parquet file of ``table``'s partition for ``day`` (it may not exist)."""
    return partition_dir(root, table, day) / "part-0.parquet"


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A new hidden directory beside ``final`` to write into before renaming into place.

    Beside, so the rename (of the directory, or of a file in it) stays on one file
    system and is atomic; hidden (``.tmp-*``), so readers ignore it. Whatever is still
    in it when the block ends (on an error, or what the caller did not move) is removed.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when renamed as a whole


def write_partition(root: Path, table: str, day: date, data: pa.Table) -> Path:
    """Replace one day's partition atomically, so a reader sees the old data or the new,
    never neither and never half: the file is written hidden beside the partition and
    flushed to disk, then renamed into place: as a whole new directory the first time
    (no partition directory ever stands empty), onto ``part-0.parquet`` after that. A
    crash leaves at most a hidden ``.tmp-*`` entry, which readers ignore."""
    final = partition_dir(root, table, day)
    with staging_dir(final) as tmp:
        pq.write_table(data, tmp / "part-0.parquet", compression="zstd")
        with open(tmp / "part-0.parquet", "rb") as f:
            os.fsync(f.fileno())
        if final.exists():
            os.replace(tmp / "part-0.parquet", final / "part-0.parquet")
        else:
            os.rename(tmp, final)
    return partition_file(root, table, day)


def partition_days(root: Path, table: str) -> list[date]:
    """Days that have a partition of ``table``, sorted."""
    base = root / table
    if not base.is_dir():
        return []
    out = []
    for p in base.iterdir():
        if p.is_dir() and p.name.startswith("date="):
            try:
                out.append(date.fromisoformat(p.name[5:]))
            except ValueError as exc:
                raise DataError(f"{p}: partition name is not date=YYYY-MM-DD") from exc
    return sorted(out)


def read_partition(root: Path, table: str, day: date, columns: list[str] | None = None) -> pa.Table:
    path = partition_file(root, table, day)
    if not path.exists():
        raise DataError(f"missing partition {path}")
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: unreadable parquet ({exc})") from exc
