"""Many Redis commands of one shape, encoded at once and sent in one round trip.

redis-py's pipeline spends about ten microseconds of Python per command (queueing,
packing, parsing each reply), more than the Redis server spends running it; at millions
of rows a night that is the bottleneck. When every row's command has the same shape
(``HSET <key> <field> <value> ...``), the RESP request for all rows can be built
column-wise with pyarrow: a command is ``*<argc>\\r\\n`` and then ``$<len>\\r\\n<arg>\\r\\n``
per argument (the protocol's array of bulk strings, exactly what ``hiredis.pack_command``
writes; tests/test_feast_encode.py holds them byte-equal). The bytes go out on one of
the client's pooled connections and redis-py's parser reads the replies, so URL options
(password, database, TLS) apply as for any other command.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import redis

Arg: TypeAlias = bytes | pa.Array  # one argument for every row, or the row's own


def commands(args: Sequence[Arg]) -> pa.BinaryArray:
    """Row ``i``'s command in RESP, its arguments ``args`` (bytes: the same in every row;
    a binary array: row ``i``'s element, never null). Raises ValueError when the arrays
    differ in length or no array is given."""
    sizes = {len(a) for a in args if isinstance(a, pa.Array)}
    if len(sizes) != 1:
        raise ValueError("commands need at least one array argument, all of one length")
    parts: list[Any] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        else:
            length = pc.binary_length(arg).cast(pa.string()).cast(pa.binary())
            parts += [b"$", length, b"\r\n", arg, b"\r\n"]
    # Neighbouring constants become one scalar: fewer inputs for the join kernel.
    merged: list[Any] = []
    for part in parts:
        if isinstance(part, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += part
        else:
            merged.append(part)
    scalars = [pa.scalar(p, pa.binary()) if isinstance(p, bytes) else p for p in merged]
    return pc.binary_join_element_wise(*scalars, pa.scalar(b"", pa.binary()))


def stream(rows: pa.BinaryArray | pa.ChunkedArray) -> bytes:
    """The rows' bytes back to back (several commands in one request). Raises
    ValueError on a null row (an argument array held a null)."""
    if isinstance(rows, pa.ChunkedArray):
        rows = rows.combine_chunks()
    if rows.null_count:
        raise ValueError("a command had a null argument")
    if len(rows) == 0:
        return b""
    _, offsets, data = rows.buffers()
    ends = np.frombuffer(offsets, dtype=np.int32)[rows.offset : rows.offset + len(rows) + 1]
    return data[int(ends[0]) : int(ends[-1])].to_pybytes()


def round_trip(client: redis.Redis, request: bytes, replies: int) -> list[Any]:
    """Send ``request`` (``replies`` commands in RESP) on one pooled connection of
    ``client`` and return the replies in order. A Redis error reply raises
    ``redis.ResponseError`` (the connection is then dropped, its other replies unread).
    ``client`` must be a plain ``redis.Redis``: the commands go to one server, so on a
    Redis Cluster the caller first splits them by the node owning each key (TypeError)."""
    if not isinstance(client, redis.Redis):
        raise TypeError(f"round_trip needs a redis.Redis client, got {type(client).__name__}")
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([request])
        return [conn.read_response() for _ in range(replies)]
    except BaseException:
        conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        pool.release(conn)
