"""Feast's serialized protos for whole columns at once: what its Redis online store
writes for each feature value (a ``Value`` proto) and each row's time (a ``Timestamp``).

Feast builds one proto per value in Python; a 10-million-row night spends most of its
time there. The wire format of these messages is small and fixed by protobuf: a tag
byte, then the payload (4 little-endian bytes for a float, a base-128 varint for an
int64 or a length, the UTF-8 bytes of a string). Here it is written with numpy and
pyarrow for a whole column. ``tests/test_feast_encode.py`` holds every encoder byte for
byte equal to Feast's own conversion (``feast.type_map.python_values_to_proto_values``
over ``to_numpy``, as ``materialize`` calls it) and to protobuf's serializer.

Missing values follow Feast: a null (and, for float32, a NaN, which Feast's numpy path
cannot tell from a null) is written as an empty ``Value``: zero bytes. One difference is
left: an int64 column *with nulls* goes through float64 in Feast's path, so Feast rounds
values beyond 2**53 there; these encoders keep them exact.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

# Tag bytes (field number << 3 | wire type) of feast.types.Value and Timestamp.
_STRING_TAG = 0x12  # Value.string_val = 2, length-delimited
_INT64_TAG = 0x20  # Value.int64_val = 4, varint
_FLOAT_TAG = 0x35  # Value.float_val = 6, fixed 32 bits
_SECONDS_TAG = 0x08  # Timestamp.seconds = 1, varint
_NANOS_TAG = 0x10  # Timestamp.nanos = 2, varint

_EMPTY = pa.scalar(b"", pa.binary())


def _binary(lengths: npt.NDArray[np.int64], data: npt.NDArray[np.uint8]) -> pa.BinaryArray:
    """A binary array whose row ``i`` is the next ``lengths[i]`` bytes of ``data``."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    ).cast(pa.binary())


def tagged_varints(tag: int, values: npt.NDArray[np.int64]) -> pa.BinaryArray:
    """Each value as protobuf writes an int64 field: ``tag`` then the value's base-128
    varint (7 bits a byte, low group first, high bit set on all but the last; a negative
    number is its 64-bit two's complement, ten bytes)."""
    u = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)
    # Only as many 7-bit groups as the largest value needs (counts: two, not ten).
    width = max(1, -(-int(u.max(initial=0)).bit_length() // 7))
    groups = ((u[:, None] >> (np.arange(width, dtype=np.uint64) * 7)) & 0x7F).astype(np.uint8)
    # Groups used: up to the highest non-zero one, at least one (zero is one 0x00 byte).
    nonzero = groups != 0
    used = np.where(nonzero.any(axis=1), width - np.argmax(nonzero[:, ::-1], axis=1), 1)
    groups |= np.where(np.arange(width) < used[:, None] - 1, 0x80, 0).astype(np.uint8)
    out = np.empty((len(u), width + 1), dtype=np.uint8)
    out[:, 0] = tag
    out[:, 1:] = groups
    keep = np.arange(width + 1) <= used[:, None]
    return _binary((used + 1).astype(np.int64), out[keep])


def value_column(dtype: str, column: pa.Array | pa.ChunkedArray) -> pa.BinaryArray:
    """Each value of ``column`` (declared ``dtype``: float32, int64 or string) as the
    serialized ``Value`` proto Feast's Redis store holds; missing values as ``b""``.
    Raises ValueError for another dtype."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    valid = column.is_valid()
    if dtype == "float32":
        floats = column.fill_null(0).to_numpy(zero_copy_only=False).astype("<f4")
        packed = np.empty(len(floats), dtype=[("tag", "u1"), ("value", "<f4")])
        packed["tag"] = _FLOAT_TAG
        packed["value"] = floats
        encoded = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(5), len(floats), [None, pa.py_buffer(packed.tobytes())]
        ).cast(pa.binary())
        valid = pc.and_(valid, pa.array(~np.isnan(floats)))
    elif dtype == "int64":
        encoded = tagged_varints(_INT64_TAG, column.fill_null(0).to_numpy(zero_copy_only=False))
    elif dtype == "string":
        utf8 = column.fill_null("").cast(pa.binary())
        lengths = pc.binary_length(utf8).to_numpy(zero_copy_only=False).astype(np.int64)
        encoded = pc.binary_join_element_wise(tagged_varints(_STRING_TAG, lengths), utf8, _EMPTY)
    else:
        raise ValueError(f"no Feast Value encoding for dtype {dtype!r}")
    return pc.if_else(valid, encoded, _EMPTY)


def timestamp_nanos(column: pa.Array | pa.ChunkedArray) -> npt.NDArray[np.int64]:
    """A timestamp column as epoch nanoseconds, truncated to microseconds as Feast's
    ``Timestamp.FromDatetime`` of a Python datetime is. A naive time counts as UTC."""
    micros = pc.cast(column, pa.timestamp("us", tz="UTC")).cast(pa.int64())
    return micros.to_numpy(zero_copy_only=False).astype(np.int64) * 1_000


def timestamp_column(nanos: npt.NDArray[np.int64]) -> pa.BinaryArray:
    """Each epoch-nanosecond time as a serialized ``Timestamp`` proto (seconds, then
    nanos; proto3 leaves out a zero field)."""
    seconds, frac = np.divmod(nanos, 1_000_000_000)
    secs = tagged_varints(_SECONDS_TAG, seconds)
    subs = tagged_varints(_NANOS_TAG, frac)
    return pc.binary_join_element_wise(
        pc.if_else(pa.array(seconds != 0), secs, _EMPTY),
        pc.if_else(pa.array(frac != 0), subs, _EMPTY),
        _EMPTY,
    )
