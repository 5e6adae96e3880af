"""The decision log's local spool: an append-only file of log records on the pod's volume,
written before the answers leave, so that a crash loses no answered decision.

Segments ``<dir>/<ns>-<pid>.spool``, each a run of framed records (``HEADER``: key,
payload and extra lengths, then a CRC-32 of the three; then the bytes), one ``os.write``
per :meth:`Spool.append`. A process holds an exclusive ``flock`` on each segment it
writes, released by the kernel when it dies, however it dies: :meth:`Spool.orphans` takes
the segments no live process holds (a previous run's, or a dead worker's), for replay.

Durability: a record is in the kernel's page cache when ``append`` returns, so a killed
process (SIGKILL, OOM) loses nothing; ``fsync`` runs every ``fsync_s`` seconds off the
event loop (Redis's ``appendfsync everysec``), so a machine that loses power loses at most
that much; ``fsync_s`` 0: after every append, on the caller's thread. A torn or corrupt
tail (power loss) ends a segment's read: the records before it are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

HEADER = struct.Struct(">IIII")  # key, payload and extra lengths; crc32 of the three
SUFFIX = ".spool"


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    key: str
    payload: bytes
    extra: bytes = b""  # what the log's after_write needs beyond the payload


def frame(records: Sequence[SpoolRecord]) -> bytes:
    out = bytearray()
    for r in records:
        key = r.key.encode()
        crc = zlib.crc32(r.extra, zlib.crc32(r.payload, zlib.crc32(key)))
        out += HEADER.pack(len(key), len(r.payload), len(r.extra), crc)
        out += key + r.payload + r.extra
    return bytes(out)


def read_segment(path: Path) -> Iterator[SpoolRecord]:
    """A segment's records in order, up to a torn or corrupt tail (logged)."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if at + HEADER.size > len(data):
            break
        nk, np_, ne, crc = HEADER.unpack_from(data, at)
        body = data[at + HEADER.size : at + HEADER.size + nk + np_ + ne]
        if len(body) < nk + np_ + ne or zlib.crc32(body) != crc:
            break
        yield SpoolRecord(body[:nk].decode(), body[nk : nk + np_], body[nk + np_ :])
        at += HEADER.size + nk + np_ + ne
    if at < len(data):
        log.warning("decision spool %s: %d byte(s) of a torn tail skipped", path, len(data) - at)


@dataclass
class Spool:
    """Appends to the current segment of ``directory`` (made if missing); a segment past
    ``segment_bytes`` is closed and a new one opened. Each segment is held (its file
    open and locked) until :meth:`release`. See the module docstring."""

    directory: Path
    fsync_s: float = 1.0
    segment_bytes: int = 8 << 20
    current: Path | None = None  # the segment appends go to (None: opened at the next)
    _size: int = 0
    _held: dict[Path, int] = field(default_factory=dict)  # segment -> its locked fd
    _dirty: set[int] = field(default_factory=set)  # fds written since their last fsync
    _seq: int = 0

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def orphans(self) -> list[Path]:
        """Segments no live process holds, oldest first; held by this one from now on."""
        out = []
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            if path in self._held:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process writes it
                os.close(fd)
                continue
            self._held[path] = fd
            out.append(path)
        return out

    def append(self, records: Sequence[SpoolRecord]) -> Path:
        """Write ``records`` (one system call); returns the segment they are in. Raises
        OSError (disk full, read-only volume)."""
        if self.current is None:
            self._seq += 1
            path = self.directory / f"{time.time_ns()}-{os.getpid()}-{self._seq}{SUFFIX}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._held[path], self.current, self._size = fd, path, 0
        path, fd = self.current, self._held[self.current]
        data = frame(records)
        os.write(fd, data)
        self._size += len(data)
        if self.fsync_s <= 0:
            os.fsync(fd)
        else:
            self._dirty.add(fd)
        if self._size >= self.segment_bytes:
            self.rotate()
        return path

    def rotate(self) -> None:
        """Close the current segment to appends; the next append opens a new one."""
        self.current = None

    def release(self, path: Path) -> None:
        """Delete a segment whose records are all in the log (the current one is rotated
        first)."""
        if path == self.current:
            self.rotate()
        path.unlink(missing_ok=True)
        fd = self._held.pop(path, None)
        if fd is not None:
            self._dirty.discard(fd)
            os.close(fd)

    def sync(self) -> None:
        """fsync what was written since the last call, and the directory (new names)."""
        dirty, self._dirty = self._dirty, set()
        for fd in tuple(dirty):  # a snapshot: the event loop may still add to it
            with contextlib.suppress(OSError):  # released meanwhile
                os.fsync(fd)
        if dirty:
            dfd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    async def run_sync(self) -> None:
        """fsync every ``fsync_s`` seconds, off the event loop (a task; cancel to stop)."""
        if self.fsync_s <= 0:
            return
        while True:
            await asyncio.sleep(self.fsync_s)
            await asyncio.to_thread(self.sync)

    def close(self) -> None:
        """fsync everything and let go of the segments (what is left stays for the next
        start)."""
        self.rotate()
        self._dirty = set(self._held.values())
        self.sync()
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()
