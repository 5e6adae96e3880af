"""The streaming updater: poll -> validate -> dead-letter -> apply -> acknowledge.

One loop, one batch at a time, read top to bottom in :meth:`Updater.step`:

1. **poll** a batch of raw messages from the source (Redis Streams or Kafka);
2. **validate** each with ``Transaction.model_validate_event`` (or the model with a team's
   declared fields, PII hashed: ``fraud_scoring.fields``); a malformed one goes to
   the dead letter with the reason (and is counted), never stopping the loop;
3. **apply** the valid ones to Redis in one pipelined round trip (idempotent);
4. **acknowledge** the whole batch, only now that its effect is in Redis.

When Redis (or the log) is unavailable, the step pauses and retries the same batch
with exponential backoff: nothing is acknowledged that was not applied, so nothing is
lost, and whatever was applied before the failure is applied again harmlessly. Redis
answering ``READONLY`` (a failover left us on a replica) or ``OOM`` (maxmemory reached)
counts as unavailable too; after ``READONLY`` the client's connections are dropped so the
retry connects afresh (to the new primary, where the address follows the failover). On a
Redis Cluster a failover shows as connection errors, ``CLUSTERDOWN``/``TRYAGAIN`` or
uncovered slots until a replica takes over; redis-py's cluster client re-reads the slot
map, and the step retries the same way.

A :class:`~streaming.sources.SourceFatal` error is not retried: it leaves :meth:`Updater.run`
(after the totals are logged) so that the process ends and is restarted.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from pydantic import ValidationError
from redis.exceptions import RedisClusterException

from fraud_scoring.declared import transaction_row
from fraud_scoring.events import Transaction
from fraud_scoring.redis_clients import CLUSTER_RETRYABLE
from fraud_scoring.session import to_us
from streaming.metrics import UpdaterMetrics
from streaming.sources import Message, Source, SourceUnavailable
from streaming.state import ApplyResult, CardEvent, SessionWriter, card_event

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.ReadOnlyError,  # a replica after failover: writes succeed again on the primary
    redis.OutOfMemoryError,  # maxmemory reached: writes succeed once memory is freed
    # Redis Cluster during a failover: TRYAGAIN, CLUSTERDOWN, and slots no live node
    # serves until the replica takes over (RedisClusterException: redis-py's cluster
    # client raises it when its slot map cannot be rebuilt yet).
    *CLUSTER_RETRYABLE,
    RedisClusterException,
    SourceUnavailable,
)


def decode(
    msg: Message, latest_us: int | None = None, model: type[Transaction] = Transaction
) -> tuple[CardEvent, dict[str, Any]] | str:
    """The (card_id, event) of a message with the fields the declared aggregations read,
    or the reason it is malformed (``model``: the events' schema, declared fields included).

    ``latest_us`` (epoch µs) is the newest event time accepted: an event from further in
    the future (a producer's clock far ahead, a typo'd year) would move its card's
    newest time forward and trim away every genuine event, so it is refused instead.
    """
    txn = parse_transaction(msg.raw, model)
    if isinstance(txn, str):
        return txn
    try:
        card, event = card_event(txn)
    except Exception as exc:  # anything else about one event must not stop the updater
        return f"invalid event: {type(exc).__name__}: {exc}"
    if latest_us is not None and event.ts_us > latest_us:
        return f"event_time: {event.ts_us / 1e6:.0f} s is too far in the future"
    return (card, event), transaction_row(txn)


def parse_transaction(
    raw: bytes | str, model: type[Transaction] = Transaction
) -> Transaction | str:
    """The transaction an event's bytes hold, as ``model`` (the contract's fields, or
    with a team's declared ones: ``fraud_scoring.fields.Door``), or the reason it is
    malformed (what the updater and ``score-stream`` dead-letter)."""
    try:
        # Parsed and validated in one pass (pydantic's JSON parser, ~2.5x faster than
        # json.loads then validating the dict). It accepts what the two steps accept,
        # with the same values; whatever it refuses goes through the two steps below,
        # which decide and name the reason (a byte-order mark, which only they accept,
        # included).
        return model.model_validate_json(raw)
    except Exception:  # the two steps below decide, and say why
        pass
    try:
        return _validate_slowly(raw, model)
    except Exception as exc:  # anything else about one event must not stop the consumer
        return f"invalid event: {type(exc).__name__}: {exc}"


def _validate_slowly(raw_bytes: bytes | str, model: type[Transaction]) -> Transaction | str:
    """JSON, then :meth:`Transaction.model_validate_event`: the transaction, or the reason
    it is malformed."""
    try:
        raw = json.loads(raw_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"invalid JSON: {exc}"
    except RecursionError:
        return "invalid JSON: nested too deeply"
    if not isinstance(raw, dict):
        return f"event must be a JSON object, got {type(raw).__name__}"
    try:
        return model.model_validate_event(raw)
    except ValidationError as exc:
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg']}" for e in exc.errors()
        )


@dataclass
class Totals:
    messages: int = 0
    dead_letters: int = 0
    applied: ApplyResult = field(default_factory=ApplyResult)


class Updater:
    def __init__(
        self,
        source: Source,
        writer: SessionWriter,
        metrics: UpdaterMetrics,
        batch_size: int = 1000,
        poll_timeout_s: float = 0.2,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        lag_interval_s: float = 1.0,
        max_future_s: float = 600.0,
        on_readonly: Callable[[], None] | None = None,
        model: type[Transaction] = Transaction,
    ) -> None:
        """``on_readonly`` is called after Redis answered ``READONLY``, before the retry
        (the command passes the client's ``connection_pool.disconnect``); ``model``
        validates the events (``fraud_scoring.fields.Door.model``)."""
        self.source, self.writer, self.metrics = source, writer, metrics
        self.batch_size, self.poll_timeout_s = batch_size, poll_timeout_s
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.lag_interval_s = lag_interval_s
        self.max_future_s = max_future_s
        self.on_readonly = on_readonly
        self.model = model
        self.totals = Totals()
        self.stopping = threading.Event()
        self._next_lag = 0.0
        self._newest_event_s = 0.0

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` until it succeeds, backing off on retryable errors (or until stop)."""
        delay = self.backoff_initial_s
        while True:
            try:
                return fn()
            except RETRYABLE as exc:
                self.metrics.retries.labels(what).inc()
                log.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
                if isinstance(exc, redis.ReadOnlyError) and self.on_readonly is not None:
                    self.on_readonly()
                if self.stopping.wait(delay * (0.5 + random.random() / 2)):
                    raise
                delay = min(delay * 2, self.backoff_max_s)

    def step(self) -> int:
        """Process one batch; return the number of messages it held (0: nothing new)."""
        msgs = self._retry("poll", lambda: self.source.poll(self.batch_size, self.poll_timeout_s))
        self._observe_lag()
        if not msgs:
            return 0
        good: list[CardEvent] = []
        rows: list[dict[str, Any]] = []
        bad: list[tuple[Message, str]] = []
        latest_us = to_us(time.time() + self.max_future_s)
        for m in msgs:
            d = decode(m, latest_us, self.model)
            if isinstance(d, str):
                bad.append((m, d))
            else:
                good.append(d[0])
                rows.append(d[1])
        if bad:
            self._retry("dead_letter", lambda: self.source.dead_letter(bad))
            self.metrics.events.labels("dead_letter").inc(len(bad))
            for m, reason in bad:
                log.warning("dead-lettered %s: %s", m.ref, reason)
        result = self._retry("apply", lambda: self.writer.apply(good, rows))
        servable = time.time()
        self._retry("ack", lambda: self.source.ack(msgs))

        met = self.metrics
        met.events.labels("applied").inc(result.added)
        met.events.labels("duplicate").inc(result.duplicates)
        met.events.labels("dropped_too_late").inc(result.dropped)
        met.late.inc(result.late)
        for msg in msgs:
            met.lag.observe(max(0.0, servable - msg.append_ts))
        if good:
            self._newest_event_s = max(self._newest_event_s, max(e.ts_us for _, e in good) / 1e6)
            met.newest_event_time.set(self._newest_event_s)
        self.totals.messages += len(msgs)
        self.totals.dead_letters += len(bad)
        self.totals.applied += result
        return len(msgs)

    def _observe_lag(self) -> None:
        now = time.monotonic()
        if now < self._next_lag:
            return
        self._next_lag = now + self.lag_interval_s
        try:
            lag = self.source.lag()
        except RETRYABLE as exc:
            log.debug("consumer lag unavailable: %s", exc)
            return
        if lag is not None:
            self.metrics.consumer_lag.set(lag)

    def run(self, max_messages: int | None = None, idle_exit_s: float | None = None) -> Totals:
        """Loop until :meth:`stop`, ``max_messages`` processed, or ``idle_exit_s`` of quiet."""
        last_busy = time.monotonic()
        try:
            while not self.stopping.is_set():
                try:
                    n = self.step()
                except RETRYABLE:  # only raised once stopping
                    break
                self.metrics.mark_step()  # what /readyz reads
                now = time.monotonic()
                if n:
                    last_busy = now
                elif idle_exit_s is not None and now - last_busy >= idle_exit_s:
                    break
                if max_messages is not None and self.totals.messages >= max_messages:
                    break
        finally:
            t = self.totals
            log.info(
                "updater stopping: %d messages, %d applied, %d duplicates, %d late, "
                "%d dropped, %d dead letters",
                t.messages,
                t.applied.added,
                t.applied.duplicates,
                t.applied.late,
                t.applied.dropped,
                t.dead_letters,
            )
        return self.totals

    def stop(self) -> None:
        """Finish the current batch, acknowledge it, and leave :meth:`run`."""
        self.stopping.set()
