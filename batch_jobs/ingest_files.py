"""``fraud-scoring ingest``'s reading of a user's files (CSV or parquet): the files a
mapping names, refused whole when empty, not UTF-8 or not CSV; malformed lines to the
rejects (:class:`Rejects`) with the reason. The job is ``batch_jobs/ingest.py``."""

from __future__ import annotations

import codecs
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from batch_jobs.ingest_mapping import Files
from fraud_scoring import contract as C

log = logging.getLogger(__name__)


# --- reading ------------------------------------------------------------------------------


@dataclass
class Rejects:
    """Rows refused, with their reason: a category (the summary counts them) and a detail."""

    rows: list[dict[str, str]] = field(default_factory=list)
    # A mapped PII field's clear value must not land here: malformed lines are not shown.
    hide_lines: bool = False

    def add(self, source: str, row: object, category: str, detail: str, record: object) -> None:
        self.rows.append(
            {
                "source": source,
                "row": str(row),
                "reason": category,
                "detail": detail,
                "record": json.dumps(record, default=str),
            }
        )

    def counts(self) -> Counter[str]:
        return Counter(r["reason"] for r in self.rows)


def input_files(spec: Files, base: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in spec.files:
        p = Path(pattern)
        found = sorted(p.parent.glob(p.name)) if p.is_absolute() else sorted(base.glob(pattern))
        if not found:
            raise C.ContractError(
                [C.Problem(str(base / pattern), "*", "no file matches", "fix files:")]
            )
        out.extend(found)
    return out


def _refuse(path: Path, what: str, fix: str) -> C.ContractError:
    return C.ContractError([C.Problem(str(path), "*", what, fix)])


def _check_text(path: Path) -> bool:
    """Refuse (ContractError naming the file) a CSV that is empty (0 bytes, or blank: no
    header line) or not UTF-8 (with the offset of the first bad byte). Returns whether a
    line break follows the header's first character (a header alone without one is read
    apart: pyarrow wants it ended)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, blank, newline = 0, True, False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the chunk
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset - pending + exc.start, exc) from None
            if not chunk:
                break
            if blank:  # from the first character that is not blank on
                text = text.lstrip("\ufeff \t\r\n\f\v")
                blank = not text
            newline = newline or "\n" in text or "\r" in text
            offset += len(chunk)
    if offset == 0:
        raise _refuse(path, "empty file (0 bytes)", "export the file again, with its header")
    if blank:
        raise _refuse(
            path, "empty file (blank, no header line)", "export the file again, with its header"
        )
    return newline


def _not_utf8(path: Path, at: int, exc: UnicodeDecodeError) -> C.ContractError:
    bom = at == 0 and exc.object[:2] in (b"\xff\xfe", b"\xfe\xff")
    return _refuse(
        path,
        f"not UTF-8: byte 0x{exc.object[exc.start : exc.start + 1].hex()} at offset {at}"
        + (" (a UTF-16 byte order mark)" if bom else ""),
        "export the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
    )


def _read_csv(path: Path, spec: Files, rejects: Rejects) -> pd.DataFrame:
    """A CSV as text columns, its malformed lines in ``rejects``; a file that is empty,
    not UTF-8 or that pyarrow cannot parse is refused (ContractError) naming it."""
    has_newline = _check_text(path)

    def malformed(row: pacsv.InvalidRow) -> str:
        try:
            text: object = row.text
        except ValueError:  # UnicodeDecodeError: not after _check_text, but never a crash
            text = "(not UTF-8)"
        if rejects.hide_lines:
            text = "(not shown: the mapping maps a pii field)"
        rejects.add(
            str(path),
            "?",
            "malformed line",
            f"{row.actual_columns} fields, expected {row.expected_columns}",
            text,
        )
        return "skip"

    data = None if has_newline else path.read_bytes() + b"\n"  # a header alone: ended
    size = path.stat().st_size + 1
    mark = len(rejects.rows)
    try:
        for block in (None, size):
            # A line longer than a block (a huge field) straddles blocks: then the file
            # is read again as one block.
            del rejects.rows[mark:]
            read = pacsv.ReadOptions() if block is None else pacsv.ReadOptions(block_size=block)
            try:
                probe = pacsv.open_csv(
                    path if data is None else pa.BufferReader(data),
                    read_options=read,
                    parse_options=pacsv.ParseOptions(
                        delimiter=spec.delimiter, invalid_row_handler=lambda _: "skip"
                    ),
                )
                header = probe.schema.names
                probe.close()
                return pacsv.read_csv(
                    path if data is None else pa.BufferReader(data),
                    read_options=read,
                    parse_options=pacsv.ParseOptions(
                        delimiter=spec.delimiter, invalid_row_handler=malformed
                    ),
                    convert_options=pacsv.ConvertOptions(
                        column_types={h: pa.string() for h in header}, strings_can_be_null=False
                    ),
                ).to_pandas()
            except pa.ArrowInvalid as exc:
                if block is not None or "straddl" not in str(exc) or size >= 1 << 31:
                    raise
        raise AssertionError("unreachable")
    except pa.ArrowMemoryError:
        raise
    except pa.ArrowException as exc:
        msg = str(exc).splitlines()[0][:200]
        if "cannot infer number of columns" in msg:  # not blank, yet no header row: a quote
            msg = "the header line does not end: a quote not closed?"
        raise _refuse(
            path,
            f"not readable as CSV ({msg})",
            "fix the file (quotes, line breaks, delimiter) or export it again",
        ) from None


def read_file(path: Path, spec: Files, rejects: Rejects) -> pd.DataFrame:
    """One source file as a frame (CSV: every column as text), with ``_source`` and ``_row``
    (the record's number among the file's well-formed ones). Malformed CSV lines go to
    ``rejects``. Raises ContractError when the file is empty, not UTF-8 or not readable as
    CSV (parquet), when a mapped column is not in the file or in it more than once."""
    fmt = spec.format or ("parquet" if path.suffix in (".parquet", ".pq") else "csv")
    if fmt == "parquet":
        try:
            df = pq.read_table(path).to_pandas()
        except pa.ArrowMemoryError:
            raise
        except pa.ArrowException as exc:
            raise _refuse(
                path,
                f"not readable as parquet ({str(exc).splitlines()[0][:200]})",
                "export the file again",
            ) from None
    else:
        df = _read_csv(path, spec, rejects)
    wanted = {s.column for s in spec.columns.values() if s.column is not None}
    missing = sorted(wanted - set(df.columns))
    if missing:
        raise C.ContractError(
            [
                C.Problem(
                    str(path),
                    m,
                    "not in the file",
                    f"fix the mapping (the file has {list(df.columns)})",
                )
                for m in missing
            ]
        )
    seen = Counter(map(str, df.columns))
    twice = sorted(m for m in wanted if seen[m] > 1)
    if twice:
        raise C.ContractError(
            [
                C.Problem(str(path), m, f"{seen[m]} columns of this name", "rename all but one")
                for m in twice
            ]
        )
    if any(n > 1 for n in seen.values()):  # unmapped repeats: kept, told apart
        names: list[str] = []
        for c in map(str, df.columns):
            k = 0
            while (name := c if k == 0 else f"{c}.{k}") in names or (k and name in seen):
                k += 1
            names.append(name)
        df.columns = pd.Index(names)
    df["_source"], df["_row"] = str(path), np.arange(1, len(df) + 1)
    return df
