"""``fraud-scoring ingest``: a user's CSV or parquet export into the raw daily partitions.

A mapping file (YAML, :class:`Mapping`) says which of the user's columns is which contract
field (``fraud_scoring/contract.py``), with casts, constants and value maps, the time zone
of naive times, and when labels arrived (a column, or event time + N days). Rows that
cannot be read (malformed lines, missing or unparsable values, repeated ids) are written
to a rejects file with the reason, never dropped silently. A break of the mapping itself
(a column that is not there, naive times and no zone) is refused before anything is
written, and so is a file that is empty, not UTF-8 or not CSV. Idempotent per day: each
UTC day the run holds is replaced as a whole (written beside, then renamed), so the same
input writes the same files; a run owns the labels of the transactions it ingests and
keeps every other label (feedback). Layout and rules: ``docs/data-contract.md``.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from batch_jobs.ingest_cast import (
    as_text,
    cast_flags,
    cast_times,
    cast_transactions,
    mark_bad,
    raw_column,
)
from batch_jobs.ingest_files import Rejects, input_files, read_file
from batch_jobs.ingest_mapping import PATTERN, Mapping, load_mapping
from fraud_scoring import contract as C
from fraud_scoring import fields as F
from fraud_scoring.storage import (
    partition_days,
    partition_dir,
    read_partition,
    staging_dir,
    write_partition,
)

log = logging.getLogger(__name__)


# --- the job ------------------------------------------------------------------------------


@dataclass
class IngestReport:
    rows_read: int
    transactions: int
    days: list[date]
    labels: int
    label_days: list[date]
    rejected: Counter[str]
    rejects_path: Path
    label_rule: str | None

    def text(self) -> str:
        span = f"{self.days[0]}..{self.days[-1]}" if self.days else "none"
        lines = [
            f"ingest: {self.rows_read:,} rows read; {self.transactions:,} transactions over "
            f"{len(self.days)} day(s) ({span}) written",
            f"labels: {self.labels:,} over {len(self.label_days)} arrival day(s)"
            + (f" (label_time: {self.label_rule})" if self.label_rule else ""),
            f"rejected: {sum(self.rejected.values()):,} row(s) -> {self.rejects_path}",
        ]
        lines += [f"  {n:,}  {reason}" for reason, n in sorted(self.rejected.items())]
        return "\n".join(lines)


def _record(df: pd.DataFrame, i: Any) -> dict[str, Any]:
    return {k: v for k, v in df.loc[i].items() if not str(k).startswith("_")}


def _reject(rejects: Rejects, src: pd.DataFrame, idx: pd.Index, reasons: pd.Series) -> None:
    for i in idx:
        category, _, detail = str(reasons[i]).partition("\x1f")
        rejects.add(src.at[i, "_source"], src.at[i, "_row"], category, detail, _record(src, i))


def _dedupe(
    frame: pd.DataFrame, src: pd.DataFrame, rejects: Rejects, key: str, what: str
) -> pd.DataFrame:
    """Drop exact repeats (keep the first) and every row of a key that comes with
    different content; both go to ``rejects``."""
    content = [c for c in frame.columns if not c.startswith("_")]
    repeat = frame.duplicated(content, keep="first")
    reasons = pd.Series("", index=frame.index, dtype=object)
    reasons[repeat] = f"duplicate {what}\x1fsame content as an earlier row"
    rest = frame[~repeat]
    clash = rest[key].duplicated(keep=False)
    reasons[rest.index[clash]] = f"conflicting {key}\x1fthe same {key} with other content"
    _reject(rejects, src, reasons.index[reasons != ""], reasons)
    return frame[reasons == ""]


def ingest(
    mapping_path: Path,
    data_dir: Path,
    rejects_path: Path | None = None,
    door: F.Door = F.PLAIN,
) -> IngestReport:
    """Read the export the mapping names and write its raw partitions under
    ``data_dir/raw``, the refused rows to ``rejects_path`` (default
    ``data_dir/ingest/rejects.csv``) and a manifest beside it (the mapping, the label
    rule, the counts). ``door``: the declared fields the mapping may map (a PII field's
    values are hashed before they reach a partition or the rejects file). Raises
    ContractError (nothing written) on a break of the mapping or of the contract, and
    naming the file on one that is empty (or, for the transactions, headers only), not
    UTF-8 or not readable; ValueError naming the field for an invalid mapping file."""
    mapping = load_mapping(mapping_path, door.fields)
    base = mapping_path.parent
    raw = data_dir / "raw"
    rejects_path = rejects_path or data_dir / "ingest" / "rejects.csv"
    tspec = mapping.transactions
    pii = [tspec.columns[f.name] for f in door.fields if f.pii and f.name in tspec.columns]
    rejects = Rejects(hide_lines=bool(pii))

    frames: list[pd.DataFrame] = []
    sources: list[pd.DataFrame] = []
    tfiles = input_files(tspec, base)
    for path in tqdm(tfiles, desc="read transactions", unit="file", disable=None):
        src = read_file(path, tspec, rejects)
        frame, reasons = cast_transactions(src, tspec, door)
        for p in pii:  # the rejects file shows the source row: its PII hashed too
            if p.column is not None:
                src[p.column] = as_text(src[p.column]).map(
                    lambda v: None if v is None else door.pii(v)
                )
        _reject(rejects, src, src.index[reasons != ""], reasons)
        frames.append(frame[reasons == ""].assign(_file=len(sources)))
        sources.append(src)
    rows_read = sum(len(s) for s in sources) + rejects.counts()["malformed line"]
    if rows_read == 0:  # every transaction file a header alone: nothing to write
        raise C.ContractError(
            [
                C.Problem(str(p), "*", "no rows, a header only", "export the transactions again")
                for p in tfiles
            ]
        )
    src_all = (
        pd.concat(sources, ignore_index=False, keys=range(len(sources)))
        if sources
        else pd.DataFrame()
    )
    txns = (
        pd.concat(
            [
                f.set_index(pd.MultiIndex.from_arrays([[k] * len(f), f.index]))
                for k, f in enumerate(frames)
            ]
        )
        if frames
        else pd.DataFrame(columns=[c.name for c in C.TRANSACTION_COLUMNS])
    )
    txns = _dedupe(txns.drop(columns="_file"), src_all, rejects, "transaction_id", "row")
    txns = txns.assign(_day=txns["event_time"].dt.date)
    days = sorted(set(txns["_day"]))

    # Ids already ingested on a day this run does not rewrite.
    written_days = set(days)
    clash = pd.Series(False, index=txns.index)
    for d in partition_days(raw, "transactions"):
        if d in written_days:
            continue
        old = set(read_partition(raw, "transactions", d, ["transaction_id"]).column(0).to_pylist())
        hit = txns["transaction_id"].isin(old)
        if hit.any():
            r = pd.Series(
                f"conflicting transaction_id\x1falready in raw/transactions/date={d}",
                index=txns.index,
            )
            _reject(rejects, src_all, txns.index[hit & ~clash], r)
            clash |= hit
    txns = txns[~clash]

    labels, rule = _labels(mapping, base, txns, src_all, rejects)
    if PATTERN in labels.columns:  # a label attribute, kept on its transaction's row
        given = txns["transaction_id"].map(labels.set_index("transaction_id")[PATTERN])
        mapped = txns[PATTERN] if PATTERN in txns.columns else None
        txns = txns.assign(**{PATTERN: given if mapped is None else given.fillna(mapped)})
    tables = _day_tables(txns, labels, door.fields)
    emptied = _keep_other_labels(raw, set(txns["transaction_id"]), tables)
    problems = [
        p
        for (table, d), t in tables.items()
        for p in C.check_table(
            t,
            C.TRANSACTION_COLUMNS if table == "transactions" else C.LABEL_COLUMNS,
            f"{table} {d}",
            d,
        )
    ]
    problems += [
        p
        for (table, d), t in tables.items()
        if table == "transactions"
        for p in C.check_fields(t, door.fields, f"{table} {d}")
    ]
    if problems:
        raise C.ContractError(problems)

    for (table, d), t in tqdm(tables.items(), desc="write days", unit="partition", disable=None):
        write_partition(raw, table, d, t)
    for d in emptied:
        shutil.rmtree(partition_dir(raw, "labels", d))
    counts = rejects.counts()
    _write_rejects(rejects_path, rejects)
    label_days = sorted(d for t, d in tables if t == "labels")
    report = IngestReport(
        rows_read=rows_read,
        transactions=len(txns),
        days=sorted({d for t, d in tables if t == "transactions"}),
        labels=len(labels),
        label_days=label_days,
        rejected=counts,
        rejects_path=rejects_path,
        label_rule=rule,
    )
    _write_json(
        rejects_path.parent / "manifest.json",
        {
            "mapping": str(mapping_path),
            "mapping_content": mapping.model_dump(mode="json"),
            "sources": [str(s["_source"].iloc[0]) for s in sources if len(s)],
            "rows_read": rows_read,
            "transactions": report.transactions,
            "days": [str(d) for d in report.days],
            "labels": report.labels,
            "label_days": [str(d) for d in label_days],
            "label_time": rule,
            "rejected": dict(sorted(counts.items())),
        },
    )
    return report


def _labels(
    mapping: Mapping, base: Path, txns: pd.DataFrame, src_txns: pd.DataFrame, rejects: Rejects
) -> tuple[pd.DataFrame, str | None]:
    """The label rows (LABELS' columns) and how their label_time was found."""
    cols = ["transaction_id", "card_id", "merchant_id", "event_time", "label_time", "is_fraud"]
    spec = mapping.labels
    if spec is None:
        return pd.DataFrame(columns=cols), None
    delay = pd.Timedelta(days=spec.arrival_delay_days) if spec.arrival_delay_days else None
    rule = (
        f"event_time + {spec.arrival_delay_days:g} days (arrival_delay_days)"
        if delay is not None
        else f"column {spec.columns['label_time'].column or 'const'}"
    )
    if not spec.files:  # the frauds of the transaction files
        if delay is None:
            raise C.ContractError(
                [
                    C.Problem(
                        "mapping",
                        "labels.label_time",
                        "inline labels need a rule",
                        "set arrival_delay_days",
                    )
                ]
            )
        fr = txns[txns["is_fraud"].astype(bool)]
        out = fr.assign(label_time=fr["event_time"] + delay)[cols]
        return out.reset_index(drop=True), rule
    frames = []
    for k, path in enumerate(
        tqdm(input_files(spec, base), desc="read labels", unit="file", disable=None)
    ):
        src = read_file(path, spec, rejects)
        reasons = pd.Series("", index=src.index, dtype=object)
        tid = as_text(raw_column(src, spec.columns["transaction_id"]))
        mark_bad(tid.isna(), reasons, "missing value: transaction_id", "empty (label)")
        flag = cast_flags(raw_column(src, spec.columns["is_fraud"]))
        mark_bad(
            flag.isna(),
            reasons,
            "unparsable value: is_fraud",
            "not true/false or 1/0 (label)",
        )
        f = pd.DataFrame({"transaction_id": tid, "is_fraud": flag}, index=src.index)
        if PATTERN in spec.columns:
            f[PATTERN] = as_text(raw_column(src, spec.columns[PATTERN]))
        if delay is None:
            s = spec.columns["label_time"]
            lt, _, bad, _ = cast_times(
                raw_column(src, s),
                s,
                spec.time_zone or mapping.transactions.time_zone,
                None,
                "label_time",
                str(path),
            )
            mark_bad(bad, reasons, "unparsable value: label_time", "not a time (label)")
            f["label_time"] = lt
        _reject(rejects, src, src.index[reasons != ""], reasons)
        f = f[reasons == ""]
        f.index = pd.MultiIndex.from_arrays([[f"l{k}"] * len(f), f.index])
        src.index = pd.MultiIndex.from_arrays([[f"l{k}"] * len(src), src.index])
        frames.append((f, src))
    if not frames:
        return pd.DataFrame(columns=cols), rule
    lab = pd.concat([f for f, _ in frames])
    lsrc = pd.concat([s for _, s in frames])
    lab = _dedupe(lab, lsrc, rejects, "transaction_id", "label")
    known = txns.set_index("transaction_id")[["card_id", "merchant_id", "event_time"]]
    lab = lab.join(known, on="transaction_id")
    reasons = pd.Series("", index=lab.index, dtype=object)
    if delay is not None:
        mark_bad(
            lab["event_time"].isna(),
            reasons,
            "unknown transaction",
            "no accepted transaction with this id (arrival_delay_days needs its event time)",
        )
        lab["label_time"] = lab["event_time"] + delay
    else:
        mark_bad(
            lab["event_time"].notna() & (lab["label_time"] < lab["event_time"]),
            reasons,
            "rule: label_time",
            "before the transaction's event time",
        )
    _reject(rejects, lsrc, lab.index[reasons != ""], reasons)
    keep = [*cols, PATTERN] if PATTERN in lab.columns else cols
    return lab[reasons == ""][keep].reset_index(drop=True), rule


def _day_tables(
    txns: pd.DataFrame, labels: pd.DataFrame, fields: tuple[F.FieldDecl, ...] = ()
) -> dict[tuple[str, date], pa.Table]:
    out: dict[tuple[str, date], pa.Table] = {}
    schema = C.TRANSACTIONS
    for f in fields:  # the declared fields' columns, after the contract's
        schema = schema.append(pa.field(f.name, f.arrow_type(), f.nullable))
    if PATTERN in txns.columns:
        schema = schema.append(pa.field(PATTERN, pa.string()))
    t = txns.sort_values(["event_time", "transaction_id"], kind="stable")
    for d, g in t.groupby("_day", sort=True):
        g = g.assign(utc_offset_min=g["utc_offset_min"].astype(np.int16))
        out[("transactions", d)] = pa.Table.from_pandas(
            g[schema.names], schema=schema, preserve_index=False
        )
    if len(labels):
        lab = labels.sort_values(["label_time", "transaction_id"], kind="stable")
        lab = lab.assign(_day=lab["label_time"].dt.date, is_fraud=lab["is_fraud"].astype(bool))
        for d, g in lab.groupby("_day", sort=True):
            out[("labels", d)] = pa.Table.from_pandas(
                g[C.LABELS.names], schema=C.LABELS, preserve_index=False
            )
    return out


def _keep_other_labels(
    raw: Path, owned: set[str], tables: dict[tuple[str, date], pa.Table]
) -> list[date]:
    """A run owns the labels of the transactions it ingests, wherever they lie: each label
    day it writes, or that holds one of those labels today, is rewritten as the run's own
    labels beside the labels already there for other transactions (feedback labels that
    ``decisions compact`` merged in, another export's). Returns the label days left with
    no label at all (to remove)."""
    ids = pa.array(sorted(owned), pa.string())
    emptied = []
    for d in partition_days(raw, "labels"):
        old = read_partition(raw, "labels", d).select(C.LABELS.names).cast(C.LABELS)
        kept = old.filter(pc.invert(pc.is_in(old.column("transaction_id"), value_set=ids)))
        new = tables.get(("labels", d))
        if new is None and kept.num_rows == old.num_rows:
            continue  # nothing of this run's on that day
        if new is not None and kept.num_rows == 0:
            continue  # the run's own labels alone: written as a first run writes them
        merged = pa.concat_tables(
            ([new] if new is not None else []) + [kept.cast(new.schema if new else C.LABELS)]
        )
        if merged.num_rows == 0:
            emptied.append(d)
            continue
        order = pc.sort_indices(
            merged, sort_keys=[("label_time", "ascending"), ("transaction_id", "ascending")]
        )
        tables[("labels", d)] = merged.take(order)
    return emptied


def _write_rejects(path: Path, rejects: Rejects) -> None:
    with staging_dir(path) as tmp:
        with open(tmp / path.name, "w", newline="") as f:
            w = csv.DictWriter(f, ["source", "row", "reason", "detail", "record"])
            w.writeheader()
            w.writerows(rejects.rows)
        os.replace(tmp / path.name, path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with staging_dir(path) as tmp:
        (tmp / path.name).write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp / path.name, path)
