"""Event sources behind one interface: Redis Streams (local default) and Kafka.

A source hands out batches of raw messages and is told when their effect is in Redis
(:meth:`Source.ack`); only then does it acknowledge them (XACK / offset commit), so a
crash replays the unacknowledged tail and nothing is lost. Malformed messages go to a
dead-letter stream/topic (:meth:`Source.dead_letter`) before they are acknowledged.

A source raises :class:`SourceUnavailable` (or ``redis.ConnectionError``) for failures
worth retrying; the updater backs off and retries the same batch. It raises
:class:`SourceFatal` for a failure no retry can mend (a fatal Kafka client error): the
updater then ends, so that the orchestrator restarts the process with a fresh client.

A dead letter keeps at most ``dead_letter_max_bytes`` of the event (the reason, the
original size and ``truncated`` are recorded beside it): one oversized event must not
make the dead letter itself fail and stall the partition behind it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis

log = logging.getLogger(__name__)

DEAD_LETTER_SUFFIX = ":dead-letter"  # Redis: <stream>:dead-letter
KAFKA_DEAD_LETTER_SUFFIX = ".dead-letter"  # Kafka: <topic>.dead-letter


DEAD_LETTER_MAX_BYTES = 65_536  # event bytes kept in a dead letter
MAX_REASON_CHARS = 2_000


class SourceUnavailable(RuntimeError):
    """The event log cannot be reached right now; retry later."""


class SourceFatal(RuntimeError):
    """The event log client failed for good (e.g. a fatal Kafka error); retrying in this
    process cannot help, so the updater ends and its orchestrator restarts it."""


def dead_letter_fields(raw: bytes, reason: str, max_bytes: int) -> tuple[bytes, dict[str, str]]:
    """The payload and metadata of one dead letter: at most ``max_bytes`` of ``raw``, and
    ``reason``, ``original_size`` (bytes) and ``truncated`` ("true"/"false")."""
    payload = raw[:max_bytes]
    meta = {
        "reason": reason[:MAX_REASON_CHARS],
        "original_size": str(len(raw)),
        "truncated": "true" if len(payload) < len(raw) else "false",
    }
    return payload, meta


@dataclass(frozen=True, slots=True)
class Message:
    raw: bytes
    append_ts: float  # epoch seconds the log stored it (for event-to-servable lag)
    ref: Any  # stream entry id, or (topic, partition, offset)


class Source(Protocol):
    def poll(self, max_messages: int, timeout_s: float) -> list[Message]: ...

    def ack(self, messages: Sequence[Message]) -> None: ...

    def dead_letter(self, items: Sequence[tuple[Message, str]]) -> None: ...

    def lag(self) -> int | None: ...

    def close(self) -> None: ...


# --- Redis Streams ----------------------------------------------------------------------


class RedisStreamSource:
    """A consumer in a Redis Streams consumer group.

    On start it first re-reads its own pending entries (delivered before a crash, never
    acknowledged); every ``claim_interval_s`` it claims entries that another consumer
    has held for longer than ``claim_idle_ms`` (XAUTOCLAIM), so a consumer that died
    and never came back under the same name loses nothing either. Entries carry the
    event JSON in the field ``data``.

    With ``keep_s`` set, every ``trim_interval_s`` it trims the stream of entries
    appended more than ``keep_s`` seconds ago (``XTRIM MINID``, approximate), but never
    an entry that a consumer group of the stream has not yet acknowledged: an updater
    that was down longer than ``keep_s`` still finds its backlog.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        claim_idle_ms: int = 30_000,
        claim_interval_s: float = 5.0,
        dead_letter_maxlen: int = 1_000_000,
        dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES,
        keep_s: float | None = None,
        trim_interval_s: float = 60.0,
        dead_letter_name: str | None = None,
    ) -> None:
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.dead_stream = dead_letter_name or stream + DEAD_LETTER_SUFFIX
        self.claim_idle_ms = claim_idle_ms
        self.claim_interval_s = claim_interval_s
        self.dead_letter_maxlen = dead_letter_maxlen
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self.keep_s, self.trim_interval_s = keep_s, trim_interval_s
        self._next_trim = 0.0
        self._own_pending = True  # drain our own PEL first
        self._next_claim = 0.0
        self._group_ready = False

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            # "0": a group created after events were written still reads them all.
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    @staticmethod
    def _messages(entries: list[Any]) -> list[Message]:
        out = []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending
                continue
            eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            raw = fields.get(b"data", b"")
            out.append(Message(raw, int(eid.split("-", 1)[0]) / 1000.0, eid))
        return out

    def poll(self, max_messages: int, timeout_s: float) -> list[Message]:
        try:
            return self._poll(max_messages, timeout_s)
        except (redis.ConnectionError, redis.TimeoutError):
            # A read that timed out here may still have been delivered by the server:
            # those entries sit in our PEL, so read it again before anything new.
            self._own_pending = True
            raise
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The server lost the stream or the group (restarted without persistence,
            # or someone deleted it): create it again on the next poll.
            self._group_ready = False
            raise SourceUnavailable(f"consumer group {self.group!r} is gone: {exc}") from exc

    def _poll(self, max_messages: int, timeout_s: float) -> list[Message]:
        self._ensure_group()
        if self._own_pending:
            reply: Any = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: "0"}, count=max_messages
            )
            msgs = self._messages(reply[0][1]) if reply else []
            if msgs:
                return msgs
            self._own_pending = False
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.claim_interval_s
            claimed: Any = self.client.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                self.claim_idle_ms,
                "0-0",
                count=max_messages,
            )
            msgs = self._messages(claimed[1])
            if msgs:
                log.info("claimed %d pending entries of other consumers", len(msgs))
                self._next_claim = now  # there may be more
                return msgs
        reply_new: Any = self.client.xreadgroup(
            self.group,
            self.consumer,
            {self.stream: ">"},
            count=max_messages,
            block=max(1, int(timeout_s * 1000)),
        )
        return self._messages(reply_new[0][1]) if reply_new else []

    def ack(self, messages: Sequence[Message]) -> None:
        if messages:
            self.client.xack(self.stream, self.group, *[m.ref for m in messages])
        if self.keep_s is not None and time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + self.trim_interval_s
            self.trim()

    def trim(self, now_s: float | None = None) -> int:
        """Trim entries older than ``keep_s`` (before ``now_s``, epoch s; default now) that
        every group has acknowledged; return how many were removed (approximate trimming
        removes whole nodes only, so recent small streams may lose none)."""
        if self.keep_s is None:
            return 0
        cutoff_ms = int(((time.time() if now_s is None else now_s) - self.keep_s) * 1000)
        minid = (cutoff_ms, 0)
        groups: Any = self.client.xinfo_groups(self.stream)
        for g in groups:
            # Keep everything a group has not read yet or not acknowledged.
            minid = min(minid, _entry_id(g["last-delivered-id"], plus_one=True))
            pending: Any = self.client.xpending(self.stream, g["name"])
            if pending["pending"]:
                minid = min(minid, _entry_id(pending["min"]))
        trimmed: Any = self.client.xtrim(
            self.stream, minid=f"{minid[0]}-{minid[1]}", approximate=True
        )
        removed = int(trimmed)
        if removed:
            log.info("trimmed %d entries older than %s from %s", removed, minid, self.stream)
        return removed

    def dead_letter(self, items: Sequence[tuple[Message, str]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for m, reason in items:
            payload, meta = dead_letter_fields(m.raw, reason, self.dead_letter_max_bytes)
            fields: dict[Any, Any] = {"data": payload, **meta, "source_id": str(m.ref)}
            pipe.xadd(
                self.dead_stream,
                fields,
                maxlen=self.dead_letter_maxlen,
                approximate=True,
            )
        pipe.execute()

    def lag(self) -> int | None:
        """Entries not yet acknowledged by the group: never delivered plus pending."""
        groups: Any = self.client.xinfo_groups(self.stream)
        for g in groups:
            if g["name"] in (self.group, self.group.encode()):
                lag = g.get("lag")
                return None if lag is None else int(lag) + int(g["pending"])
        return None

    def close(self) -> None:
        self.client.close()


def _entry_id(raw: bytes | str, plus_one: bool = False) -> tuple[int, int]:
    """A stream entry id as (ms, seq); ``plus_one``: the next id after it."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return (int(ms), int(seq or 0) + 1) if plus_one else (int(ms), int(seq or 0))


# --- Kafka ------------------------------------------------------------------------------


class KafkaSource:
    """A member of a Kafka consumer group (confluent-kafka).

    Events are keyed by card_id, so one card's events stay in one partition and one
    updater. Offsets are committed synchronously after the batch's effect is in Redis;
    after a rebalance or crash, the new owner re-reads from the last commit and the
    idempotent apply absorbs the replay. Dead letters go to ``<topic>.dead-letter`` with
    the reason in a ``reason`` header (and ``original_size``, ``truncated``, ``source``)
    and are flushed before the offsets are committed. The dead-letter topic is created
    with ``dead_letter_replication`` replicas (-1: the broker's default).

    A fatal client error (``KafkaError.fatal()``) raises :class:`SourceFatal`.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str,
        *,
        client_id: str = "session-updater",
        extra: dict[str, Any] | None = None,
        dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES,
        dead_letter_replication: int = -1,
        dead_letter_name: str | None = None,
    ) -> None:
        from confluent_kafka import Consumer, Producer

        self.topic = topic
        self.dead_topic = dead_letter_name or topic + KAFKA_DEAD_LETTER_SUFFIX
        self.dead_letter_max_bytes = dead_letter_max_bytes
        conf = {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "client.id": client_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 50,
            **(extra or {}),
        }
        self.consumer = Consumer(conf)
        self._paused = False
        self.consumer.subscribe([topic], on_assign=self._assigned)
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": False}
        )
        ensure_topic(bootstrap, self.dead_topic, 1, dead_letter_replication)

    def poll(self, max_messages: int, timeout_s: float) -> list[Message]:
        from confluent_kafka import KafkaError

        out = []
        for m in self.consumer.consume(num_messages=max_messages, timeout=timeout_s):
            err = m.error()
            if err is not None:
                raise_if_fatal(err, "consumer")
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("kafka consumer: %s", err)
                continue
            _, ts_ms = m.timestamp()
            out.append(
                Message(
                    m.value() or b"", (ts_ms or 0) / 1000.0, (m.topic(), m.partition(), m.offset())
                )
            )
        return out

    def ack(self, messages: Sequence[Message]) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        nxt: dict[tuple[str, int], int] = {}
        for m in messages:
            topic, part, off = m.ref
            nxt[(topic, part)] = max(nxt.get((topic, part), 0), off + 1)
        if not nxt:
            return
        try:
            self.consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in nxt.items()], asynchronous=False
            )
        except KafkaException as exc:
            raise_if_fatal(exc.args[0], "offset commit")
            # Typically a rebalance took the partition away: its new owner replays from
            # the last commit, and replays are harmless.
            log.warning("offset commit failed (%s); the events will be re-applied", exc)

    def dead_letter(self, items: Sequence[tuple[Message, str]]) -> None:
        """Produce one dead letter per item and wait for all of them.

        A record the broker refuses as too large (its topic limit is below
        ``dead_letter_max_bytes``) is sent again without the event bytes; any other
        failure raises :class:`SourceUnavailable` (the updater retries the batch, so a
        dead letter may be written twice) or :class:`SourceFatal`.
        """
        records = []
        for m, reason in items:
            payload, meta = dead_letter_fields(m.raw, reason, self.dead_letter_max_bytes)
            topic, part, off = m.ref
            records.append((payload, {**meta, "source": f"{topic}/{part}/{off}"}))
        for _ in range(2):
            too_large = self._produce_all(records)
            if not too_large:
                return
            # Second round: the same records without the event bytes.
            records = [(b"", {**meta, "truncated": "true"}) for _, meta in too_large]
        raise SourceUnavailable(
            "dead-letter produce failed: MSG_SIZE_TOO_LARGE even without the event bytes"
        )

    def _produce_all(
        self, records: list[tuple[bytes, dict[str, str]]]
    ) -> list[tuple[bytes, dict[str, str]]]:
        """Produce and flush ``records``; return those refused as too large."""
        from confluent_kafka import KafkaError, KafkaException

        too_large: list[tuple[bytes, dict[str, str]]] = []
        failed: list[Any] = []  # KafkaErrors from delivery reports

        def report(record: tuple[bytes, dict[str, str]], err: Any, _msg: Any) -> None:
            # Runs inside poll()/flush(): record the outcome, raise after the flush.
            if err is None:
                return
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                too_large.append(record)
            else:
                failed.append(err)

        for record in records:
            value, meta = record
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    self.producer.produce(
                        self.dead_topic,
                        value=value,
                        headers=[(k, v.encode()) for k, v in meta.items()],
                        on_delivery=functools.partial(report, record),
                    )
                    break
                except BufferError:
                    # The local queue is full: serve delivery reports to make room.
                    if time.monotonic() > deadline:
                        raise SourceUnavailable("dead-letter produce: local queue full") from None
                    self.producer.poll(0.1)
                except KafkaException as exc:
                    err = exc.args[0]
                    raise_if_fatal(err, "dead-letter producer")
                    if err.code() != KafkaError.MSG_SIZE_TOO_LARGE:
                        raise SourceUnavailable(f"dead-letter produce failed: {err}") from exc
                    too_large.append(record)
                    break
        unsent = self.producer.flush(10.0)
        for err in failed:
            raise_if_fatal(err, "dead-letter producer")
        if unsent or failed:
            reasons = [str(e) for e in failed] or [f"{unsent} not delivered in 10 s"]
            raise SourceUnavailable(f"dead-letter produce failed: {reasons}")
        return too_large

    def pause(self) -> None:
        """Stop fetching from the assigned partitions (backpressure), and from those a
        rebalance assigns until :meth:`resume`; :meth:`poll` must still be called now and
        then, to stay in the group."""
        self._paused = True
        self.consumer.pause(self.consumer.assignment())

    def resume(self) -> None:
        """Fetch from the assigned partitions again, from where fetching stopped."""
        self._paused = False
        self.consumer.resume(self.consumer.assignment())

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        """A rebalance's new assignment (called inside :meth:`poll`, before the client
        assigns ``partitions``): librdkafka's pause holds only the partitions it was given
        and outlives their revocation, so each assigned partition is paused or resumed
        here to match the source, whether it is new to this consumer or was paused when a
        rebalance took it away."""
        if self._paused:
            consumer.pause(partitions)
        else:
            consumer.resume(partitions)

    def lag(self) -> int | None:
        """Messages behind the high watermark over the assigned partitions."""
        from confluent_kafka import KafkaException

        total = 0
        try:
            parts = self.consumer.assignment()
            if not parts:
                return None
            for tp in self.consumer.position(parts):
                _, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high is None or high < 0 or tp.offset < 0:
                    continue
                total += max(0, high - tp.offset)
        except KafkaException as exc:  # lag is a metric: never let it stop the updater
            log.debug("kafka lag unavailable: %s", exc)
            return None
        return total

    def close(self) -> None:
        self.consumer.close()
        self.producer.flush(5.0)


def raise_if_fatal(err: Any, what: str) -> None:
    """Raise :class:`SourceFatal` when the ``KafkaError`` ``err`` is fatal: the client
    instance is unusable from then on, so retrying in this process would loop forever."""
    from confluent_kafka import KafkaError

    if err.fatal() or err.code() == KafkaError._FATAL:
        raise SourceFatal(
            f"kafka {what}: fatal error {err.name()}: {err.str()}; the updater exits so "
            "that it is restarted with a new client (unacknowledged events are replayed)"
        )


def ensure_topic(bootstrap: str, topic: str, partitions: int, replication_factor: int = -1) -> None:
    """Create ``topic`` unless it exists, with ``replication_factor`` replicas (-1: the
    broker's ``default.replication.factor``)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(topic, partitions, replication_factor)], operation_timeout=10
    )
    for fut in futures.values():
        try:
            fut.result(timeout=15)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise SourceUnavailable(f"creating topic {topic}: {exc}") from exc
