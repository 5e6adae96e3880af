"""Appending records to a durable log, and reading a day of it back.

The writing half of the event log the streaming updater consumes (``streaming/sources.py``):
the scoring service appends its decisions and the labels it is sent here, the daily batch
job reads them back by day. One :class:`Producer` interface, two transports:

* :class:`RedisStreamProducer` (local default): one Lua call per batch appends the records
  with ``XADD`` and is idempotent on each record's key: a ``SET NX`` marker per key, kept
  as long as the stream keeps its entries (``retention_s``), so a retried or replayed key
  is one entry. The stream is trimmed (``XADD MINID ~``) to ``retention_s`` as it grows.
* :class:`KafkaProducer` (production): keyed records on a topic; the broker cannot dedup
  by key, so a retried key may appear twice there: readers (the compaction) keep the
  first entry per key.

A producer raises :class:`LogUnavailable` when the log cannot take the records now; the
caller decides whether to retry (the decision log does, from its buffer).

Entries are read back by the time the log stored them: the Redis entry id is its append
time in ms, so one UTC day is one ``XRANGE`` (:func:`read_redis_day`); a Kafka record's
timestamp is its produce time (or the broker's append time, with
``message.timestamp.type=LogAppendTime``), so a day is each partition read from the first
offset stamped at or after the day's start (``offsets_for_times``) until records are
stamped past its end (:func:`read_kafka_day`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, Protocol

from fraud_scoring.redis_clients import (
    STORE_ERRORS,
    async_client,
    is_cluster,
    packed_by_hiredis,
    sync_client,
)

PAYLOAD_FIELD = "d"  # the stream entry's field holding the record (JSON bytes)
KEY_FIELD = "k"  # ... and its idempotence key

# KEYS[1]: the stream. ARGV: marker TTL (ms), MINID for trimming ("" for none), then
# (marker key, record key, payload) triples. Returns how many records were new.
_APPEND_LUA = """
local n = 0
for i = 3, #ARGV, 3 do
  if redis.call('SET', ARGV[i], '1', 'NX', 'PX', ARGV[1]) then
    if ARGV[2] ~= '' then
      redis.call('XADD', KEYS[1], 'MINID', '~', ARGV[2], '*', 'k', ARGV[i + 1], 'd', ARGV[i + 2])
    else
      redis.call('XADD', KEYS[1], '*', 'k', ARGV[i + 1], 'd', ARGV[i + 2])
    end
    n = n + 1
  end
end
return n
"""


class LogUnavailable(RuntimeError):
    """The log did not take the records (unreachable, timed out, refused); retry later."""


@dataclass(frozen=True, slots=True)
class LogRecord:
    key: str  # idempotence key: the same key twice is one entry (e.g. a transaction_id)
    payload: bytes


class Producer(Protocol):
    async def send(self, records: Sequence[LogRecord]) -> int:
        """Append ``records`` (all or none); returns how many were new. Raises
        LogUnavailable."""
        ...

    async def close(self) -> None: ...


class RedisStreamProducer:
    """Appends to the Redis stream ``stream`` at ``url``. ``timeout_s`` bounds every
    call (connect included), so an unreachable server fails fast instead of hanging the
    writer. Markers and stream entries live ``retention_s`` (0: forever)."""

    def __init__(self, url: str, stream: str, retention_s: float, timeout_s: float) -> None:
        self.stream = stream
        self.retention_ms = int(retention_s * 1000)
        self.timeout_s = timeout_s
        # No per-reply socket timeout (redis-py wraps each send and each reply in a timer
        # of its own): ``send`` bounds the whole call with one. Commands packed in C.
        self.client = async_client(url, socket_timeout=None, socket_connect_timeout=timeout_s)
        if not is_cluster(url):
            packed_by_hiredis(self.client.connection_pool)
        self.script = self.client.register_script(_APPEND_LUA)

    def marker(self, key: str) -> str:
        # The stream's name as the hash tag: marker and stream share a Cluster slot.
        return f"{{{self.stream}}}:seen:{key}"

    async def send(self, records: Sequence[LogRecord]) -> int:
        if not records:
            return 0
        now_ms = int(time.time() * 1000)
        ttl = self.retention_ms or 10 * 365 * 86_400_000  # "forever": ten years
        minid = f"{now_ms - self.retention_ms}-0" if self.retention_ms else ""
        args: list[Any] = [ttl, minid]
        for r in records:
            args += [self.marker(r.key), r.key, r.payload]
        try:
            async with asyncio.timeout(self.timeout_s):
                return int(await self.script(keys=[self.stream], args=args))
        except (*STORE_ERRORS, OSError) as exc:  # type: ignore[misc]  # OSError: timeouts too
            raise LogUnavailable(f"Redis stream {self.stream!r}: {exc}") from exc

    async def close(self) -> None:
        await self.client.aclose()


class KafkaProducer:
    """Appends to the Kafka topic ``topic`` (records keyed by their key, so one key stays
    on one partition). ``send`` waits up to ``timeout_s`` for the broker's acks; what is
    not acknowledged by then is purged from the client's queue and LogUnavailable raised
    (a purged record the broker did get is a duplicate the reader drops).

    After a failed write the client is replaced by a new one: an idempotent client whose
    queue was purged bumps its epoch, and a broker may fence it for good (tansu answers
    every later write PRODUCER_FENCED), so retrying on it would stall the log forever
    although the broker is back. The new client has a new producer id; its queue is
    empty, so dropping the old one loses nothing that was not already refused."""

    def __init__(self, bootstrap: str, topic: str, timeout_s: float) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.timeout_s = timeout_s
        self.producer = self._client()

    def _client(self) -> Any:
        from confluent_kafka import Producer as _Producer

        return _Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "enable.idempotence": True,  # the client's own retries make no duplicates
                "linger.ms": 5,
            }
        )

    def _failed(self, why: str) -> LogUnavailable:
        """Purge what is queued, replace the client and say why."""
        self.producer.purge()
        self.producer.flush(0)
        self.producer = self._client()
        return LogUnavailable(f"Kafka topic {self.topic!r}: {why}")

    def _send(self, records: Sequence[LogRecord]) -> int:
        from confluent_kafka import KafkaException

        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        try:
            for r in records:
                self.producer.produce(
                    self.topic, key=r.key.encode(), value=r.payload, on_delivery=delivered
                )
        except (BufferError, KafkaException) as exc:
            raise self._failed(str(exc)) from exc
        left = self.producer.flush(self.timeout_s)
        if left:
            raise self._failed(f"{left} record(s) not acknowledged")
        if errors:
            raise self._failed(errors[0])
        return len(records)

    async def send(self, records: Sequence[LogRecord]) -> int:
        # The client blocks while it flushes: off the event loop.
        return await asyncio.to_thread(self._send, records)

    async def close(self) -> None:
        await asyncio.to_thread(self.producer.flush, self.timeout_s)


def day_bounds_ms(day: date) -> tuple[int, int]:
    """[start, end) of a UTC day in epoch milliseconds."""
    start = datetime.combine(day, datetime.min.time(), UTC)
    return int(start.timestamp() * 1000), int((start + timedelta(days=1)).timestamp() * 1000)


def read_redis_day(
    url: str, stream: str, day: date, page: int = 10_000
) -> Iterator[tuple[int, bytes]]:
    """The entries the stream stored during UTC ``day`` (by append time), in order, as
    (append time in epoch ms, payload). Reads ``page`` entries per round trip."""
    start_ms, end_ms = day_bounds_ms(day)
    client = sync_client(url)
    try:
        lo = f"{start_ms}-0"
        while True:
            batch = client.xrange(stream, min=lo, max=f"({end_ms}-0", count=page)
            for entry_id, fields in batch:
                yield int(entry_id.split(b"-")[0]), fields[PAYLOAD_FIELD.encode()]
            if len(batch) < page:
                return
            lo = f"({batch[-1][0].decode()}"
    finally:
        client.close()


# A Kafka partition is read until a record stamped this long after the day's end: records
# are stamped by the producers' clocks, so the day's last ones can sit behind a few of the
# next day's (service replicas' clocks, a retried send).
KAFKA_DAY_MARGIN_S = 300.0


def read_kafka_day(
    bootstrap: str,
    topic: str,
    day: date,
    *,
    margin_s: float = KAFKA_DAY_MARGIN_S,
    timeout_s: float = 30.0,
    page: int = 10_000,
) -> Iterator[tuple[int, bytes]]:
    """The records of ``topic`` stamped during UTC ``day`` (record timestamp, epoch ms),
    as (timestamp ms, value): each partition in offset order, partitions interleaved
    (records keyed by an id share a partition, so "the first per id" keeps its meaning).

    Each partition is read from the first offset stamped at or after the day's start
    (``offsets_for_times``) until a record stamped ``margin_s`` past the day's end, or
    the partition's end at the time of reading; records stamped outside the day are
    skipped. A broker that answers the timestamp lookup with an earlier offset (the tansu
    broker the tests use answers 0) only makes the read longer, never different.
    Nothing is committed (no consumer group state). A missing topic is an empty day.
    Raises LogUnavailable when the brokers do not answer within ``timeout_s``.
    """
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, KafkaException
    from confluent_kafka import TopicPartition as TP

    start_ms, end_ms = day_bounds_ms(day)
    stop_ms = end_ms + int(margin_s * 1000)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "fraud-scoring-log-reader",  # never joined nor committed: assign()
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        try:
            meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if meta is None or meta.error is not None:
                if meta is None or meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    return
                raise LogUnavailable(f"Kafka topic {topic!r}: {meta.error}")
            starts = consumer.offsets_for_times(
                [TP(topic, p, start_ms) for p in sorted(meta.partitions)], timeout=timeout_s
            )
        except KafkaException as exc:
            raise LogUnavailable(f"Kafka topic {topic!r}: {exc}") from exc
        # Offset -1: nothing stamped at or after the day's start in that partition.
        todo = [tp for tp in starts if tp.offset >= 0]
        open_parts = {tp.partition for tp in todo}
        if not todo:
            return
        consumer.assign(todo)
        last_progress = time.monotonic()
        while open_parts:
            if time.monotonic() - last_progress > timeout_s:
                raise LogUnavailable(
                    f"Kafka topic {topic!r}: no progress for {timeout_s:.0f}s while reading "
                    f"partitions {sorted(open_parts)}"
                )
            done = []
            for m in consumer.consume(num_messages=page, timeout=1.0):
                err = m.error()
                if err is not None and err.code() != KafkaError._PARTITION_EOF:
                    if err.fatal():
                        raise LogUnavailable(f"Kafka topic {topic!r}: {err}")
                    continue  # transient (a broker reconnecting): librdkafka retries
                part = m.partition()
                if part not in open_parts:
                    continue
                if err is not None:
                    ts = stop_ms  # end of the partition at the time of reading
                else:
                    ts_type, ts = m.timestamp()
                    if ts_type == TIMESTAMP_NOT_AVAILABLE:
                        raise LogUnavailable(
                            f"Kafka topic {topic!r}: a record without a timestamp (partition "
                            f"{part}, offset {m.offset()}); needs message format v1 or later"
                        )
                last_progress = time.monotonic()
                if ts >= stop_ms:
                    open_parts.discard(part)
                    done.append(TP(topic, part))
                elif start_ms <= ts < end_ms and (value := m.value()) is not None:
                    yield ts, value
            if done:
                consumer.pause(done)
    finally:
        consumer.close()
