"""``fraud-scoring ingest`` on files that are not what they should be (issue 38, item 7):
an empty file and a file that is not UTF-8 are refused with exit status 2 naming the file
(the offset of the first bad byte), nothing written; any other malformed CSV either sends
its bad lines to the rejects file or is refused the same way, and never crashes the job
(a fuzz test of a few hundred generated files)."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest

from batch_jobs.ingest import IngestReport, ingest
from cli.main import main
from fraud_scoring import contract as C
from fraud_scoring.settings import read_settings

ROOT = Path(__file__).resolve().parents[1]
HEADER = b"TX_ID,CUSTOMER_ID,TERMINAL_ID,TX_AMOUNT,TX_DATETIME,TX_TYPE"
MAPPING = """\
transactions:
  files: [transactions.csv]
  time_zone: Europe/Berlin
  columns:
    transaction_id: TX_ID
    card_id: CUSTOMER_ID
    merchant_id: TERMINAL_ID
    amount: TX_AMOUNT
    event_time: {column: TX_DATETIME, format: "%Y-%m-%d %H:%M:%S"}
    channel: {column: TX_TYPE, map: {STORE: pos, ONLINE: ecom, CASH: atm}}
    country: {const: DE}
"""
LABELS = """\
labels:
  files: [frauds.csv]
  arrival_delay_days: 7
  columns:
    transaction_id: TX_ID
    is_fraud: FRAUD
"""


def _rows(n: int = 8) -> list[bytes]:
    return [
        b"%d,c%d,m%d,%d.50,2025-03-25 %02d:00:00,%s"
        % (i, i % 3, i % 2, 10 + i, 8 + i % 12, (b"STORE", b"ONLINE", b"CASH")[i % 3])
        for i in range(1, n + 1)
    ]


def _good() -> bytes:
    return b"\n".join([HEADER, *_rows()]) + b"\n"


def _export(folder: Path, transactions: bytes, frauds: bytes | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transactions.csv").write_bytes(transactions)
    if frauds is not None:
        (folder / "frauds.csv").write_bytes(frauds)
    (folder / "mapping.yaml").write_text(MAPPING + (LABELS if frauds is not None else ""))
    return folder / "mapping.yaml"


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """FRAUD_DATA_DIR under ``tmp_path`` for in-process CLI calls."""
    for k in ("REDIS_URL", "FRAUD_DATA_DIR", "FRAUD_MODEL_REPO", "FRAUD_DECISION_LOG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("FRAUD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FRAUD_MODEL_REPO", str(tmp_path / "models"))
    read_settings.cache_clear()
    yield tmp_path / "data"
    read_settings.cache_clear()


def _refused(
    caplog: pytest.LogCaptureFixture, mapping: Path, data: Path, name: str = "transactions.csv"
) -> str:
    """Run the CLI, expect exit status 2 and nothing written; the line naming the file."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="fraud_scoring"):
        assert main(["ingest", str(mapping)]) == 2
    assert not data.exists(), "a refused run wrote something"
    lines = [ln for ln in caplog.text.splitlines() if str(mapping.parent / name) in ln]
    assert len(lines) == 1, caplog.text
    return lines[0]


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"", "empty file (0 bytes)"),
        (b"\n\r\n  \n", "empty file (blank, no header line)"),
        (b"\xef\xbb\xbf", "empty file (blank, no header line)"),  # a UTF-8 BOM alone
    ],
)
def test_an_empty_file_is_refused_naming_it(
    data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, what: str
) -> None:
    mapping = _export(tmp_path / "in", content)
    assert what in _refused(caplog, mapping, data_dir)
    # An empty labels file too, the transactions being fine.
    mapping = _export(tmp_path / "in2", _good(), frauds=content)
    assert what in _refused(caplog, mapping, data_dir, "frauds.csv")


def test_headers_without_rows(
    data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Transaction files that hold a header only (ended by a line break or not) leave the
    run nothing to write: refused. A labels file with a header only is no fraud: fine."""
    for header in (HEADER + b"\n", HEADER, HEADER + b"\r\n"):
        mapping = _export(tmp_path / "in", header)
        assert "no rows, a header only" in _refused(caplog, mapping, data_dir)
    mapping = _export(tmp_path / "in", _good(), frauds=b"TX_ID,FRAUD")
    assert main(["ingest", str(mapping)]) == 0
    assert (data_dir / "raw").is_dir()


def test_a_file_that_is_not_utf8_is_refused_naming_it_and_the_offset(
    data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = _good()
    latin1 = good.replace(b"8,c2,m0", "8,MÜNCHEN,m0".encode("latin-1"))
    at = latin1.index(b"\xdc")
    mapping = _export(tmp_path / "in", latin1)
    line = _refused(caplog, mapping, data_dir)
    assert f"not UTF-8: byte 0xdc at offset {at}" in line and "iconv" in line
    # UTF-16 (with its byte order mark): refused at offset 0, saying so.
    mapping = _export(tmp_path / "in", good.decode().encode("utf-16"))
    line = _refused(caplog, mapping, data_dir)
    assert "byte 0xff at offset 0 (a UTF-16 byte order mark)" in line
    # Past the first MiB (the check reads by chunks), and a character cut off by the end.
    big = good + b"".join(b"%d,c,m,1,2025-03-25 10:00:00,STORE\n" % i for i in range(10, 40_000))
    assert len(big) > 1 << 20
    bad = big + b"99999,c,m,1,2025-03-25 10:00:00,ST\x80RE\n"
    mapping = _export(tmp_path / "in", bad)
    at = bad.index(b"\x80")
    assert f"byte 0x80 at offset {at}" in _refused(caplog, mapping, data_dir)
    bad = good + b"99999,c,m,1,2025-03-25 10:00:00,\xc3"
    mapping = _export(tmp_path / "in", bad)
    assert f"byte 0xc3 at offset {len(bad) - 1}" in _refused(caplog, mapping, data_dir)
    # A labels file: named as well.
    mapping = _export(tmp_path / "in", good, frauds=b"TX_ID,FRAUD\n2,\xff\n")
    assert "byte 0xff at offset 14" in _refused(caplog, mapping, data_dir, "frauds.csv")


def test_a_character_across_the_check_chunks_and_a_bom_are_fine(tmp_path: Path) -> None:
    """UTF-8 that a chunk boundary of the check cuts through is still UTF-8; a UTF-8 BOM is
    not part of the first column's name."""
    head = b"\xef\xbb\xbf" + _good()
    pad = (1 << 20) - len(head) - len(b"99,c,m,1,2025-03-25 10:00:00,") - 1
    row = b"99,c,m,1,2025-03-25 10:00:00," + b"x" * pad + "é".encode() + b"\n"
    assert (head + row)[(1 << 20) - 1 : (1 << 20) + 1] == "é".encode()  # across the 1st MiB
    mapping = _export(tmp_path / "in", head + row)
    report = ingest(mapping, tmp_path / "data")
    assert report.transactions == 8 and report.rejected == {"rule: channel": 1}


def test_huge_fields_lines_and_values_go_to_the_rejects(tmp_path: Path) -> None:
    """A field longer than pyarrow's block (1 MiB), the wrong number of fields, a NUL, a
    time beyond pandas' range, an unterminated quote: rejected rows, no crash."""
    rows = [
        b"100," + b"c" * 1_500_000 + b",m,5,2025-03-25 10:00:00,STORE",
        b"101,c,m,5,2025-03-25 10:00:00",
        b"102,c\x00,m,5,2025-03-25 10:00:00,STORE",
        b"103,c,m,5,99999-03-25 10:00:00,STORE",
        b'104,c,m,5,2025-03-25 10:00:00,"STORE',
    ]
    mapping = _export(tmp_path / "in", b"\n".join([HEADER, *_rows(), *rows]) + b"\n")
    report = ingest(mapping, tmp_path / "data")
    assert report.transactions == 8
    assert report.rejected == {
        "malformed line": 1,  # 101
        "rule: card_id": 2,  # 100 (too long), 102 (a control character)
        "unparsable value: event_time": 1,  # 103
        "rule: channel": 1,  # 104: the quoted value runs to the end: 'STORE\n' is no channel
    }
    written = pd.read_csv(tmp_path / "data" / "ingest" / "rejects.csv", dtype=str)
    assert len(written) == 5 and written["record"].str.len().max() > 1_500_000


@pytest.mark.parametrize(
    ("fmt", "value"),
    [
        ("epoch_s", "1e30"),
        ("epoch_ms", "-99999999999999999999"),
        (None, "0001-01-01T00:00:00+05:00"),
    ],
)
def test_times_out_of_range_are_unparsable_not_a_crash(
    tmp_path: Path, fmt: str | None, value: str
) -> None:
    ok = {"epoch_s": "1742896800", "epoch_ms": "1742896800000", None: "2025-03-25T10:00:00Z"}
    mapping = _export(
        tmp_path / "in",
        b"%s\n1,c,m,5,%s,STORE\n2,c,m,5,%s,STORE\n" % (HEADER, ok[fmt].encode(), value.encode()),
    )
    mapping.write_text(MAPPING.replace('format: "%Y-%m-%d %H:%M:%S"', f"format: {fmt or 'null'}"))
    report = ingest(mapping, tmp_path / "data")
    assert report.transactions == 1 and report.rejected == {"unparsable value: event_time": 1}


def test_a_mapped_column_twice_in_the_header_is_refused(
    data_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mapping = _export(tmp_path / "in", HEADER + b",TX_ID\n1,c,m,5,2025-03-25 10:00:00,STORE,1\n")
    assert "'TX_ID': 2 columns of this name" in _refused(caplog, mapping, data_dir)
    # Repeats of a column the mapping does not read are kept apart, not refused.
    mapping = _export(tmp_path / "in", HEADER + b",X,X\n1,c,m,5,2025-03-25 10:00:00,STORE,1,2\n")
    assert main(["ingest", str(mapping)]) == 0


@pytest.mark.slow  # a subprocess: the real entry point, as a user runs it
def test_the_command_exits_2_on_an_empty_file(tmp_path: Path) -> None:
    """The process exits with status 2 (it aborted with 134 on an empty CSV), its error
    naming the file, nothing written."""
    mapping = _export(tmp_path / "in", b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "REDIS_"))}
    out = subprocess.run(
        [sys.executable, "-m", "cli", "ingest", str(mapping)],
        env={**env, "FRAUD_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"{tmp_path / 'in' / 'transactions.csv'}: column '*': empty file (0 bytes)" in (
        out.stderr
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "data").exists()


# --- fuzz ---------------------------------------------------------------------------------


def _insert(rng: random.Random, data: bytes, what: bytes) -> bytes:
    at = rng.randrange(len(data) + 1)
    return data[:at] + what + data[at:]


def _lines(rng: random.Random, data: bytes, edit: Callable[[bytes], bytes]) -> bytes:
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    lines[i] = edit(lines[i])
    return b"\n".join(lines)


def _fields(rng: random.Random, line: bytes) -> bytes:
    f = line.split(b",")
    if rng.random() < 0.5 and len(f) > 1:
        del f[rng.randrange(len(f))]
    else:
        f.insert(rng.randrange(len(f) + 1), b"extra")
    return b",".join(f)


def _huge(rng: random.Random, line: bytes) -> bytes:
    f = line.split(b",")
    f[rng.randrange(len(f))] = rng.choice([b"x", b"\xc3\xa9", b'"']) * rng.choice(
        [5_000, 70_000, 300_000]
    )
    return b",".join(f)


MUTATIONS: dict[str, Callable[[random.Random, bytes], bytes]] = {
    "truncate": lambda rng, d: d[: rng.randrange(len(d) + 1)],
    "stray quote": lambda rng, d: _insert(rng, d, rng.choice([b'"', b'""', b'"x"y', b"'"])),
    "nul": lambda rng, d: _insert(rng, d, b"\x00" * rng.randint(1, 4)),
    "invalid utf-8": lambda rng, d: _insert(
        rng, d, rng.choice([b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf8"])
    ),
    "huge field": lambda rng, d: _lines(rng, d, lambda ln: _huge(rng, ln)),
    "column count": lambda rng, d: _lines(rng, d, lambda ln: _fields(rng, ln)),
    "garbage span": lambda rng, d: _insert(rng, d, rng.randbytes(rng.randint(1, 64))),
    "garbage file": lambda rng, d: rng.randbytes(rng.randint(0, 2048)),
    "bom": lambda rng, d: rng.choice([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"]) + d,
    "crlf": lambda rng, d: b"".join(
        p + rng.choice([b"\n", b"\r\n", b"\r", b"\n\n"]) for p in d.split(b"\n")
    ),
    "delimiter": lambda rng, d: _lines(rng, d, lambda ln: ln.replace(b",", b";")),
    "header": lambda rng, d: d.replace(
        HEADER, rng.choice([HEADER + b",TX_ID", HEADER + b",X,X", b'"TX_ID', b"", b"a"]), 1
    ),
    "blank": lambda rng, d: rng.choice([b"", b"\n", b" \r\n\t", b"\xef\xbb\xbf\n"]),
    "valid text": lambda rng, d: _insert(rng, d, rng.choice(["é", "€", "\u2028", "😀"]).encode()),
}
CASES = 300


FRAUDS = b"TX_ID,FRAUD\n2,1\n5,0\n7,1\n"


def _fuzzed(seed: int) -> tuple[bytes, bytes | None, list[str]]:
    """The transactions and the labels file (None: no labels); one of five seeds breaks
    the labels file instead of the transactions."""
    rng = random.Random(seed)
    labels = seed % 5 == 4
    data = FRAUDS if labels else _good()
    names = rng.sample(sorted(MUTATIONS), rng.randint(1, 3))
    for name in names:
        data = MUTATIONS[name](rng, data)
    return (_good(), data, names) if labels else (data, None, names)


def test_fuzz_malformed_csv_is_rejected_or_refused_never_a_crash(tmp_path: Path) -> None:
    """A few hundred malformed files (seeded), each through ``ingest`` in-process: it ends
    in a report (bad lines in the rejects) or in the clean refusal (ContractError naming
    the broken file, exit status 2 in the CLI) with nothing written; never another
    exception."""
    outcomes: dict[str, int] = {"written": 0, "refused": 0}
    for seed in range(CASES):
        transactions, frauds, names = _fuzzed(seed)
        folder = tmp_path / f"case{seed}"
        mapping = _export(folder, transactions, frauds)
        out = folder / "data"
        try:
            report = ingest(mapping, out)
        except C.ContractError as exc:
            assert not out.exists(), f"seed {seed} ({names}): refused but wrote {out}"
            broken = folder / ("transactions.csv" if frauds is None else "frauds.csv")
            assert f"{broken}: column" in str(exc), (seed, names, str(exc))
            outcomes["refused"] += 1
        except Exception as exc:  # the finding this test is for
            pytest.fail(f"seed {seed} ({names}): {type(exc).__name__}: {exc}"[:2000])
        else:
            assert isinstance(report, IngestReport)
            assert (out / "ingest" / "rejects.csv").exists()
            outcomes["written"] += 1
    # Both ends are reached: the generator is not all refusals nor all harmless.
    assert outcomes["written"] > CASES // 10 and outcomes["refused"] > CASES // 10, outcomes
