"""Online feature read for a batch of transactions: one pipelined Redis round trip.

Batch features are read straight from Feast's Redis layout (the same key and field
encoding Feast's own reader uses, via Feast's helpers), which lets the batch and the
declared features (``fraud_scoring/declared.py``, queued by the scorer) of a whole
micro-batch travel in one pipeline. Feast's Python read path
does not check TTL, so this reader does, as of each transaction's own event time:

* snapshot time > t (a snapshot newer than the transaction, e.g. a replay): not usable;
* t - snapshot time > the view's TTL: stale.

Either way the view's features become their declared defaults and are listed.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from feast.protos.feast.types.Value_pb2 import Value

from fraud_scoring.events import Transaction
from fraud_scoring.feast_store import online_field, online_key, stored_time
from fraud_scoring.features import BatchView, apply_defaults, view_features, views
from fraud_scoring.redis_clients import hmget_packed, hmget_parts, is_cluster_pipeline


@dataclass
class FeatureRows:
    """Feature columns for n transactions plus, per row, what was replaced by defaults."""

    columns: dict[str, np.ndarray]
    missing: list[list[str]] = field(default_factory=list)
    stale: list[list[str]] = field(default_factory=list)


# Stored values repeat (a merchant's features for each of its transactions, small counts,
# zeros): decoding each distinct encoding once saves the protobuf parse (~1 us) per
# feature per row. Results are immutable scalars, safe to share.
@functools.lru_cache(maxsize=1 << 16)
def _decode(v: bytes) -> Any:
    pv = Value()
    pv.ParseFromString(v)
    kind = pv.WhichOneof("val")
    return None if kind is None or kind == "null_val" else getattr(pv, kind)


# Rows repeat too (a merchant's snapshot for each of its transactions): a whole stored row
# decoded at once (None for an absent or null value), with the positions of its holes
# (absent, null or NaN).
@functools.lru_cache(maxsize=1 << 14)
def _decode_row(stored: tuple[bytes | None, ...]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    values = tuple(_decode(v) if v else None for v in stored)
    return values, tuple(j for j, x in enumerate(values) if x is None or x != x)


# The batch features of a whole micro-batch in one command, for a redis-py pipeline on one
# server (not a Cluster: Feast's keys carry no hash tag, so a Cluster needs one HMGET per
# key). KEYS: per transaction, one key per view in views() order; ARGV: the number of
# views, then per view its field count and fields. The reply is what the HMGETs would have
# answered, in order. redis-py packs each command in Python (~10 us plus each argument),
# so 2 x n HMGETs of ~20 fields cost its event loop far more than one call. The service's
# held connections take commands packed already (``packed``): there plain HMGETs cost the
# client no more, and the server a fraction of the script (which copies every reply
# through Lua: ~30 us a call and ~15 us a transaction more, bench/README.md).
HMGET_LUA = """
local nv, pos, fields = tonumber(ARGV[1]), 2, {}
for v = 1, nv do
  local c = tonumber(ARGV[pos])
  fields[v] = {unpack(ARGV, pos + 1, pos + c)}
  pos = pos + c + 1
end
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('HMGET', KEYS[i], unpack(fields[(i - 1) % nv + 1]))
end
return out
"""
HMGET_SHA = hashlib.sha1(HMGET_LUA.encode()).hexdigest()


class OnlineFeatureReader:
    """Reads the batch (Feast) features of many transactions at once."""

    def __init__(self, project: str, entity_key_serialization_version: int = 3) -> None:
        self.project = project
        self.eksv = entity_key_serialization_version
        self.views = views()
        self._fields = {
            v.name: [online_field(v.name, f.name) for f in view_features(v)]
            + [f"_ts:{v.name}".encode()]
            for v in self.views
        }
        # Per view, in order: its feature names and TTL (s), as parse reads them.
        self._views = [
            ([f.name for f in view_features(v)], v.ttl.total_seconds()) for v in self.views
        ]
        self._hmget_args: list[Any] = [len(self.views)]
        for v in self.views:
            self._hmget_args += [len(self._fields[v.name]), *self._fields[v.name]]
        # Per view (in order), its HMGET in the protocol around the key: the command's
        # head and its fields (as hiredis packs them).
        self._packed = [hmget_parts(self._fields[v.name]) for v in self.views]
        # Scripts a server must have loaded for :meth:`queue` (SCRIPT LOAD each).
        self.scripts = (HMGET_LUA,)

    def key(self, view: BatchView, entity_id: str) -> bytes:
        return online_key(self.project, view.join_key, entity_id, self.eksv)

    def queue(self, pipe: Any, txns: Sequence[Transaction]) -> None:
        """Queue every command the batch needs on ``pipe`` (sync or asyncio pipeline, or
        the scorer's :class:`service.core.in_flight.Commands`): one HMGET per transaction
        and view, packed already where the pipe takes that (``packed``: the service's held
        connections) and on a Redis Cluster; else one :data:`HMGET_LUA` call for the batch,
        which needs :attr:`scripts` loaded (``SCRIPT LOAD``; otherwise the reply is
        ``NoScriptError``)."""
        # A transaction without the key (no device id) reads the empty key's: never written.
        keys = [
            self.key(view, getattr(t, view.join_key, None) or "")
            for t in txns
            for view in self.views
        ]
        packed = getattr(pipe, "packed", None)
        if packed is not None:
            parts = self._packed
            for k, key in enumerate(keys):  # per transaction: one per view, in order
                packed(hmget_packed(parts[k % len(parts)], key))
        elif is_cluster_pipeline(pipe):
            for k, key in enumerate(keys):
                pipe.hmget(key, self._fields[self.views[k % len(self.views)].name])
        elif keys:
            pipe.execute_command("EVALSHA", HMGET_SHA, len(keys), *keys, *self._hmget_args)

    def parse(self, replies: Sequence[Any], txns: Sequence[Transaction]) -> FeatureRows:
        """Turn the pipeline's replies (in queue order, exactly those :meth:`queue` queued)
        into defaulted feature columns."""
        n = len(txns)
        if n and len(replies) == 1 and replies[0] and isinstance(replies[0][0], list):
            # HMGET_LUA's one reply: the HMGETs' replies, in order (an HMGET's own reply
            # holds values, never lists).
            replies = replies[0]
        event_ts = [t.event_ts for t in txns]  # a property that converts: once per row
        raw: dict[str, list[Any]] = {}
        missing: list[list[str]] = [[] for _ in range(n)]
        stale: list[list[str]] = [[] for _ in range(n)]
        n_views = len(self.views)
        for vi, (names, ttl) in enumerate(self._views):
            # An unusable snapshot reads as holes, so one apply_defaults call below
            # defaults every view at once.
            holes = (None,) * len(names)
            rows: list[tuple[Any, ...]] = []
            for i in range(n):
                vals = replies[n_views * i + vi]
                ts_raw = vals[-1]
                if not ts_raw:
                    missing[i].extend(names)
                    rows.append(holes)
                    continue
                age = event_ts[i] - stored_time(ts_raw)
                if not 0 <= age <= ttl:
                    stale[i].extend(names)
                    rows.append(holes)
                    continue
                values, absent = _decode_row(tuple(vals[:-1]))
                if absent:  # holes in a usable snapshot
                    missing[i].extend(names[j] for j in absent)
                rows.append(values)
            columns = zip(*rows, strict=True) if rows else ((),) * len(names)
            raw.update(zip(names, map(list, columns), strict=True))
        return FeatureRows(apply_defaults(raw), missing, stale)
