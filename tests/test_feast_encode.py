"""The column-wise encoders of the direct materializer against the libraries they stand in
for: Feast's own value conversion and protobuf's serializer (batch_jobs/feast_encode.py),
hiredis's command packer (batch_jobs/resp.py) and Feast's Redis key
(fraud_scoring/feast_store.py). Every output must be byte for byte the same.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import hiredis
import numpy as np
import pyarrow as pa
import pytest
import redis
from feast.type_map import python_values_to_proto_values
from feast.value_type import ValueType
from google.protobuf.timestamp_pb2 import Timestamp

from batch_jobs import resp
from batch_jobs.feast_encode import timestamp_column, timestamp_nanos, value_column
from fraud_scoring.feast_store import (
    feast_online_key,
    online_key,
    online_key_column,
    online_keys,
)
from fraud_scoring.redis_server import embedded_redis

_TYPES = {"float32": ValueType.FLOAT, "int64": ValueType.INT64, "string": ValueType.STRING}
_RNG = np.random.default_rng(7)
_COLUMNS = {
    "float32": pa.array(
        [
            *(1.5, None, float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.4e38),
            *_RNG.normal(0, 1e4, 300).tolist(),
        ],
        pa.float32(),
    ),
    "int64": pa.array(
        [
            *(0, 1, -1, 127, 128, 16_383, 16_384, 2**31, -(2**31), 2**63 - 1, -(2**63)),
            *_RNG.integers(-(2**62), 2**62, 300).tolist(),
        ],
        pa.int64(),
    ),
    # Feast's path converts an int64 column with nulls through float64: exact up to 2**53.
    "int64 with nulls": pa.array(
        [None, 0, -5, 2**53, None, *_RNG.integers(-(2**53), 2**53, 100).tolist()], pa.int64()
    ),
    "string": pa.array(["US", None, "", "é", "日本", "x" * 127, "y" * 128, "z" * 20_000]),
}


def _feast(dtype: str, column: pa.Array) -> list[bytes]:
    """What Feast's materialize serializes for each value of ``column``."""
    values = python_values_to_proto_values(column.to_numpy(zero_copy_only=False), _TYPES[dtype])
    return [v.SerializeToString() for v in values]


@pytest.mark.parametrize("name", list(_COLUMNS))
def test_value_column_is_byte_equal_to_feasts_conversion(name: str) -> None:
    dtype = name.split()[0]
    column = _COLUMNS[name]
    want = _feast(dtype, column)
    assert value_column(dtype, column).to_pylist() == want
    # Chunked and sliced input (a table's column after filter/slice) too.
    chunked = pa.chunked_array([column.slice(0, 3), column.slice(3)])
    assert value_column(dtype, chunked.slice(2)).to_pylist() == want[2:]


def test_value_column_refuses_an_undeclared_dtype() -> None:
    with pytest.raises(ValueError, match="bool"):
        value_column("bool", pa.array([True]))


def test_timestamps_are_byte_equal_to_protobufs() -> None:
    base = datetime(2026, 1, 10, tzinfo=UTC)
    instants = [
        base,
        base + timedelta(microseconds=1),
        base + timedelta(seconds=-1, microseconds=999_999),
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=UTC),
        datetime(1900, 3, 1, tzinfo=UTC),
    ]
    want = []
    for instant in instants:
        ts = Timestamp()
        ts.FromDatetime(instant)
        want.append(ts.SerializeToString())
    for unit in ("us", "ns"):
        column = pa.array(instants, pa.timestamp(unit, tz="UTC"))
        nanos = timestamp_nanos(column)
        assert timestamp_column(nanos).to_pylist() == want
    # A naive column counts as UTC, as Feast's make_tzaware does.
    naive = pa.array([i.replace(tzinfo=None) for i in instants], pa.timestamp("us"))
    assert timestamp_column(timestamp_nanos(naive)).to_pylist() == want


def test_resp_commands_equal_hiredis_packing() -> None:
    keys = pa.array([b"k1", b"", b"\r\n\x00" * 40, "é".encode()], pa.binary())
    values = pa.array([b"v", b"value", b"", b"\xff" * 300], pa.binary())
    args: list[resp.Arg] = [b"HSET", keys, b"_ts:card_30d", values, b"f", b"x"]
    rows = resp.commands(args)
    want = [
        hiredis.pack_command((b"HSET", k, b"_ts:card_30d", v, b"f", b"x"))
        for k, v in zip(keys.to_pylist(), values.to_pylist(), strict=True)
    ]
    assert rows.to_pylist() == want
    assert resp.stream(rows.slice(1)) == b"".join(want[1:])
    assert resp.stream(rows.slice(0, 0)) == b""
    with pytest.raises(ValueError, match="null"):
        resp.stream(resp.commands([b"GET", pa.array([b"a", None], pa.binary())]))
    with pytest.raises(ValueError, match="one length"):
        resp.commands([b"GET", keys, values.slice(1)])


def test_round_trip_returns_replies_and_raises_a_redis_error() -> None:
    with embedded_redis() as url:
        client = redis.Redis.from_url(url)
        try:
            keys = pa.array([b"a", b"b"], pa.binary())
            request = resp.stream(resp.commands([b"SET", keys, b"1"]))
            assert resp.round_trip(client, request, 2) == [b"OK", b"OK"]
            # HSET on a string key: Redis answers WRONGTYPE, which must not pass silently.
            bad = resp.stream(resp.commands([b"HSET", keys, b"f", b"v"]))
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                resp.round_trip(client, bad, 2)
            # The dropped connection's unread reply does not leak into the next call.
            get = resp.stream(resp.commands([b"GET", keys]))
            assert resp.round_trip(client, get, 2) == [b"1", b"1"]
            with pytest.raises(TypeError, match=r"redis\.Redis"):  # e.g. a cluster client
                resp.round_trip(object(), get, 2)  # type: ignore[arg-type]
        finally:
            client.close()


def test_online_key_column_equals_feasts_key() -> None:
    ids = ["c0000001", "", "é-日本", "m" * 300]
    want = [feast_online_key("fraud_scoring", "card_id", e) for e in ids]
    # One key at a time without Feast's protobuf: the same bytes, for every join key.
    for join_key in ("card_id", "merchant_id", "device_id"):
        for e in [*ids, "a\x00b"]:
            assert online_key("fraud_scoring", join_key, e) == feast_online_key(
                "fraud_scoring", join_key, e
            )
    got = online_key_column("fraud_scoring", "card_id", pa.array(ids, pa.string()))
    assert got.to_pylist() == want
    assert online_keys("fraud_scoring", "card_id", ids) == want
