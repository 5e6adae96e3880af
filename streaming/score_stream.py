"""Scoring the event log: poll -> validate -> score -> write the decision -> commit.

:class:`ScoreStream` reads transactions from a consumer group (Redis Streams or Kafka,
``streaming/sources.py``), hands every valid one to ``decide`` (the scorer behind the
model boundary's micro-batcher: the same scorer, model and batcher as the API, composed
by ``cli/score_stream.py``) and writes one decision per transaction to the output log,
keyed by ``transaction_id``, with the source offset / entry id beside it. The steps
overlap: while one micro-batch is at the model the next events are read.

* **Malformed** events (and events stamped more than ``max_future_s`` ahead, as the
  updater refuses them) go to the dead letter with the reason; so does a reused
  ``transaction_id`` with other content (``decide`` returns the reason, as the API's 409).
* **Commit after the write.** An event is committed (offset commit / XACK) only once its
  decision (or dead letter) is in the output log, and only up to the first event of its
  partition that is not: on a timer of its own (``commit_interval_s``), or earlier when
  the in-flight bound is reached. A crash replays the uncommitted tail: the scorer's id
  claims answer a replayed transaction with its first answer and record nothing again,
  so a consumer keeping the last decision per key sees one decision per transaction.
* **Backpressure.** At most ``max_in_flight`` events are read and not yet committed; at
  the bound a Kafka consumer pauses its partitions (``pause``/``resume``, still polling
  to stay in the group; partitions a rebalance assigns meanwhile are paused too) and a
  Redis consumer stops reading.
* **Failures.** ``decide`` raising :class:`ScoreLater` (store down, no model) is
  retried with backoff, forever; any other exception ``max_attempts``
  times, then the event is dead-lettered with the error. An output log, dead letter or
  commit that fails is retried with backoff; nothing is committed meanwhile.
* A :class:`~streaming.sources.SourceFatal` error leaves :meth:`ScoreStream.run` (the
  process ends and is restarted).

The metrics (:class:`~streaming.metrics.ScoreStreamMetrics`) export the three numbers
apart: event-time lag, queueing delay at the model boundary, commit interval (and the age
of the oldest uncommitted event); :meth:`ScoreStream.run` logs their summary at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic_core import to_json

from fraud_scoring.event_log import LogRecord, LogUnavailable, Producer
from fraud_scoring.events import Transaction
from streaming.metrics import ScoreStreamMetrics
from streaming.sources import KafkaSource, Message, Source
from streaming.updater import RETRYABLE, parse_transaction

log = logging.getLogger(__name__)
T = TypeVar("T")


class ScoreLater(Exception):
    """``decide`` cannot answer now (store down, no model, the batcher refused):
    the transaction is scored again after a backoff."""


# A decision (the API's ScoreOut as a plain dict), or the reason to dead-letter instead.
Decide = Callable[[Transaction], Awaitable[dict[str, Any] | str]]


def source_ref(ref: Any) -> str:
    """A message's place in the log as text: a Redis entry id, or ``topic/partition/offset``."""
    return "/".join(map(str, ref)) if isinstance(ref, tuple) else str(ref)


def _partition(ref: Any) -> Any:
    """The unit offsets are committed in: a Kafka (topic, partition); a Redis stream is one."""
    return ref[:2] if isinstance(ref, tuple) else None


@dataclass(slots=True)
class _Entry:
    msg: Message
    read_at: float  # time.monotonic()
    done: bool = False


class InFlight:
    """Events read and not yet committed, in read order per partition.

    :meth:`done` marks an event whose decision (or dead letter) is in the output log;
    :meth:`committable` takes the done events at the head of each partition (never one
    behind an event that is not done, so a commit never skips an undecided event)."""

    def __init__(self) -> None:
        self._parts: dict[Any, deque[_Entry]] = {}
        self._by_ref: dict[Any, _Entry] = {}

    def __len__(self) -> int:
        return len(self._by_ref)

    def add(self, msg: Message, now: float) -> bool:
        """Track ``msg``; False when it is already in flight (a Redis consumer re-reading
        its own pending entries, or claiming them back)."""
        if msg.ref in self._by_ref:
            return False
        entry = _Entry(msg, now)
        self._by_ref[msg.ref] = entry
        self._parts.setdefault(_partition(msg.ref), deque()).append(entry)
        return True

    def done(self, msg: Message) -> None:
        entry = self._by_ref.get(msg.ref)
        if entry is not None:
            entry.done = True

    def has_committable(self) -> bool:
        return any(q and q[0].done for q in self._parts.values())

    def committable(self) -> list[Message]:
        """Remove and return the done events at the head of every partition."""
        out: list[Message] = []
        for q in self._parts.values():
            while q and q[0].done:
                entry = q.popleft()
                del self._by_ref[entry.msg.ref]
                out.append(entry.msg)
        return out

    def oldest_age(self, now: float) -> float:
        """Seconds since the oldest event in flight was read (0: none)."""
        heads = [q[0].read_at for q in self._parts.values() if q]
        return now - min(heads) if heads else 0.0


@dataclass
class Totals:
    """What :meth:`ScoreStream.run` did, and the three numbers' summary."""

    messages: int = 0
    decided: int = 0
    dead_letters: int = 0
    id_reused: int = 0
    score_retries: int = 0
    commits: int = 0
    pauses: int = 0
    max_in_flight_seen: int = 0
    max_uncommitted_age_s: float = 0.0
    event_lag_s: list[float] = field(default_factory=list)  # a sample, for the summary
    commit_intervals_s: list[float] = field(default_factory=list)

    def summary(self, queueing_s: tuple[float, float]) -> str:
        def pct(xs: list[float], q: float) -> float:
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

        qsum, qcount = queueing_s
        return (
            f"{self.messages} events, {self.decided} decided, {self.dead_letters} dead-lettered "
            f"({self.id_reused} reused ids), {self.score_retries} scoring retries; "
            f"event-time lag p50 {pct(self.event_lag_s, 0.5):.3f}s p99 "
            f"{pct(self.event_lag_s, 0.99):.3f}s; queueing delay mean "
            f"{(qsum / qcount if qcount else 0.0) * 1e3:.2f}ms; {self.commits} commits, "
            f"interval p50 {pct(self.commit_intervals_s, 0.5):.3f}s; oldest uncommitted "
            f"at most {self.max_uncommitted_age_s:.3f}s; in flight at most "
            f"{self.max_in_flight_seen}; paused {self.pauses} times"
        )


LAG_SAMPLE = 100_000  # event-time lags kept for the exit summary


class ScoreStream:
    def __init__(
        self,
        source: Source,
        decide: Decide,
        output: Producer,
        metrics: ScoreStreamMetrics,
        *,
        max_in_flight: int = 4096,
        commit_interval_s: float = 1.0,
        poll_batch: int = 500,
        poll_timeout_s: float = 0.1,
        max_future_s: float = 600.0,
        max_attempts: int = 5,
        write_batch: int = 1000,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        lag_interval_s: float = 1.0,
        model: type[Transaction] = Transaction,
    ) -> None:
        self.source, self.decide, self.output, self.metrics = source, decide, output, metrics
        self.max_in_flight = max_in_flight
        self.commit_interval_s = commit_interval_s
        self.poll_batch, self.poll_timeout_s = poll_batch, poll_timeout_s
        self.max_future_s = max_future_s
        self.model = model  # the events' schema, declared fields included
        self.max_attempts = max_attempts
        self.write_batch = write_batch
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.lag_interval_s = lag_interval_s
        self.totals = Totals()
        self.in_flight = InFlight()
        # One thread for every call on the source: a consumer is not shared by threads.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score-stream-io")
        self._decided: asyncio.Queue[tuple[Message, Transaction, dict[str, Any]]] | None = None
        self._progress: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._paused = False
        self._last_commit = time.monotonic()
        self._next_lag = 0.0
        self._newest_event_s = 0.0
        metrics.in_flight_limit.set(max_in_flight)

    # -- lifecycle ---------------------------------------------------------------------
    async def run(
        self,
        max_messages: int | None = None,
        idle_exit_s: float | None = None,
        drain_s: float = 10.0,
    ) -> Totals:
        """Score until :meth:`stop`, ``max_messages`` read, or ``idle_exit_s`` without new
        events and nothing in flight; then finish what is in flight (up to ``drain_s``),
        commit it, and log the summary."""
        self._decided, self._progress = asyncio.Queue(), asyncio.Event()
        self._stopping = self._stopping or asyncio.Event()
        writer = asyncio.get_running_loop().create_task(self._write_loop(), name="writer")
        try:
            try:
                await self._loop(max_messages, idle_exit_s)
                await self._drain(drain_s)
            except RETRYABLE:  # only raised once stopping
                log.warning("stopping while the event log is unavailable")
        finally:
            writer.cancel()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(writer, *self._tasks, return_exceptions=True)
            self._io.shutdown(wait=True)
            self._log_summary()
        return self.totals

    async def _loop(self, max_messages: int | None, idle_exit_s: float | None) -> None:
        """Read and hand out events until stopped, ``max_messages`` or idle."""
        assert self._stopping is not None
        last_busy = time.monotonic()
        while not self._stopping.is_set():
            await self._commit(due_only=True)
            self._observe()
            if len(self.in_flight) >= self.max_in_flight:
                await self._hold()
                continue
            await self._resume()
            most = min(self.poll_batch, self.max_in_flight - len(self.in_flight))
            wait_s = self._wait_s()
            poll = functools.partial(self.source.poll, most, wait_s)
            msgs = await self._io_retry("poll", poll)
            n = await self._take(msgs)
            now = time.monotonic()
            if n or len(self.in_flight):
                last_busy = now
            elif idle_exit_s is not None and now - last_busy >= idle_exit_s:
                break
            if max_messages is not None and self.totals.messages >= max_messages:
                break

    def stop(self) -> None:
        """Stop reading, finish and commit what is in flight, and leave :meth:`run`
        (call from the event loop's thread, e.g. a signal handler added to the loop)."""
        if self._stopping is None:
            self._stopping = asyncio.Event()
        self._stopping.set()

    async def _drain(self, drain_s: float) -> None:
        """Wait (up to ``drain_s``) until every event read has its decision written, then
        commit; what is still in flight stays uncommitted and is read again."""
        assert self._progress is not None
        end = time.monotonic() + drain_s
        while len(self.in_flight) and time.monotonic() < end:
            await self._commit(due_only=False)
            if not len(self.in_flight):
                break
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), timeout=0.05)
        await self._commit(due_only=False)
        if left := len(self.in_flight):
            log.warning("stopping with %d events in flight: they will be read again", left)

    def _wait_s(self) -> float:
        """How long a poll may block: not past the next commit."""
        left = self._last_commit + self.commit_interval_s - time.monotonic()
        return max(0.001, min(self.poll_timeout_s, left))

    # -- read --------------------------------------------------------------------------
    async def _take(self, msgs: Sequence[Message]) -> int:
        """Track the new events, dead-letter the malformed ones, send the others to be
        scored; return how many were new."""
        now = time.monotonic()
        latest = time.time() + self.max_future_s
        bad: list[tuple[Message, str]] = []
        new = 0
        for m in msgs:
            if not self.in_flight.add(m, now):
                continue
            new += 1
            txn = parse_transaction(m.raw, self.model)
            if isinstance(txn, str):
                bad.append((m, txn))
            elif txn.event_time.timestamp() > latest:
                reason = f"event_time: {txn.event_time.isoformat()} is too far in the future"
                bad.append((m, reason))
            else:
                self._spawn(self._score(m, txn))
        self.totals.messages += new
        self.totals.max_in_flight_seen = max(self.totals.max_in_flight_seen, len(self.in_flight))
        if bad:
            await self._dead_letter(bad)
        return new

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- score -------------------------------------------------------------------------
    async def _score(self, msg: Message, txn: Transaction) -> None:
        """Decide ``txn``, retrying what may pass; queue the decision for the writer, or
        dead-letter the event."""
        assert self._decided is not None and self._stopping is not None
        delay, failures = self.backoff_initial_s, 0
        while True:
            try:
                out = await self.decide(txn)
                break
            except ScoreLater as exc:
                log.debug("scoring %s later: %s", txn.transaction_id, exc)
            except Exception as exc:  # one event's failure must not stop the stream
                failures += 1
                log.warning("scoring %s failed (%d): %r", txn.transaction_id, failures, exc)
                if failures >= self.max_attempts:
                    await self._dead_letter([(msg, f"scoring failed: {type(exc).__name__}: {exc}")])
                    return
            self.metrics.retries.labels("score").inc()
            self.totals.score_retries += 1
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self.backoff_max_s)
        if isinstance(out, str):  # an id used for another transaction (the API's 409)
            self.totals.id_reused += 1
            self.metrics.events.labels("id_reused").inc()
            await self._dead_letter([(msg, out)])
            return
        self._decided.put_nowait((msg, txn, out))

    # -- write -------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        """Write queued decisions to the output log in batches, retrying until it takes
        them; only then are their events done (committable)."""
        assert self._decided is not None
        while True:
            batch = [await self._decided.get()]
            while len(batch) < self.write_batch and not self._decided.empty():
                batch.append(self._decided.get_nowait())
            records = [
                LogRecord(
                    t.transaction_id,
                    # pydantic-core's encoder (~4x json.dumps here); NaN as json writes it
                    to_json({**out, "source": source_ref(m.ref)}, inf_nan_mode="constants"),
                )
                for m, t, out in batch
            ]
            delay = self.backoff_initial_s
            while True:
                try:
                    await self.output.send(records)
                    break
                except LogUnavailable as exc:
                    self.metrics.retries.labels("write").inc()
                    log.warning("writing %d decisions failed (%s); retrying", len(records), exc)
                    await asyncio.sleep(delay * (0.5 + random.random() / 2))
                    delay = min(delay * 2, self.backoff_max_s)
            now = time.time()
            for m, t, _ in batch:
                self.in_flight.done(m)
                ts = t.event_time.timestamp()
                self._newest_event_s = max(self._newest_event_s, ts)
                self.metrics.event_lag.observe(max(0.0, now - ts))
                if len(self.totals.event_lag_s) < LAG_SAMPLE:
                    self.totals.event_lag_s.append(now - ts)
            self.metrics.newest_event_time.set(self._newest_event_s)
            self.metrics.events.labels("decided").inc(len(batch))
            self.totals.decided += len(batch)
            self._wake()

    async def _dead_letter(self, items: list[tuple[Message, str]]) -> None:
        """Dead-letter ``items`` (retried until the log takes them); then they are done."""
        await self._io_retry("dead_letter", lambda: self.source.dead_letter(items))
        for m, reason in items:
            log.warning("dead-lettered %s: %s", source_ref(m.ref), reason)
            self.in_flight.done(m)
        self.metrics.events.labels("dead_letter").inc(len(items))
        self.totals.dead_letters += len(items)
        self._wake()

    def _wake(self) -> None:
        if self._progress is not None:
            self._progress.set()

    # -- commit ------------------------------------------------------------------------
    async def _commit(self, due_only: bool) -> None:
        """Commit the done events at the head of each partition: when the interval has
        passed (``due_only``), else whenever there are any."""
        now = time.monotonic()
        if due_only and now - self._last_commit < self.commit_interval_s:
            return
        msgs = self.in_flight.committable()
        if not msgs:
            if due_only:
                self._last_commit = now  # nothing to commit: the next interval starts
            return
        await self._io_retry("commit", lambda: self.source.ack(msgs))
        done = time.monotonic()
        interval = done - self._last_commit
        self.metrics.commit_interval.observe(interval)
        self.metrics.last_commit.set(time.time())
        self.totals.commits += 1
        self.totals.commit_intervals_s.append(interval)
        self._last_commit = done

    # -- backpressure ------------------------------------------------------------------
    async def _hold(self) -> None:
        """At the in-flight bound: pause reading, commit what is done, and wait for
        progress. A paused Kafka consumer still polls (once a second, nothing arrives
        from paused partitions) so that it stays in its group."""
        assert self._progress is not None
        if not self._paused:
            self._paused = True
            self.totals.pauses += 1
            self.metrics.pauses.inc()
            self.metrics.paused.set(1)
            if isinstance(self.source, KafkaSource):
                await self._io_retry("poll", self.source.pause)
            log.info("in-flight bound %d reached: reading paused", self.max_in_flight)
        if self.in_flight.has_committable():
            await self._commit(due_only=False)
            return
        self._progress.clear()
        try:
            await asyncio.wait_for(self._progress.wait(), timeout=1.0)
        except TimeoutError:
            if isinstance(self.source, KafkaSource):  # keep the group membership alive
                await self._take(await self._io_retry("poll", lambda: self.source.poll(1, 0.0)))

    async def _resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        self.metrics.paused.set(0)
        if isinstance(self.source, KafkaSource):
            await self._io_retry("poll", self.source.resume)
        log.info("reading resumed (%d in flight)", len(self.in_flight))

    # -- plumbing ----------------------------------------------------------------------
    async def _io_retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn`` on the source's thread, retried with backoff on retryable errors."""
        loop = asyncio.get_running_loop()
        delay = self.backoff_initial_s
        while True:
            try:
                return await loop.run_in_executor(self._io, fn)
            except RETRYABLE as exc:
                if self._stopping is not None and self._stopping.is_set():
                    raise  # stopping: what is in flight stays uncommitted, read again
                self.metrics.retries.labels(what).inc()
                log.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self.backoff_max_s)

    def _observe(self) -> None:
        now = time.monotonic()
        age = self.in_flight.oldest_age(now)
        m, t = self.metrics, self.totals
        m.in_flight.set(len(self.in_flight))
        m.oldest_uncommitted.set(age)
        t.max_uncommitted_age_s = max(t.max_uncommitted_age_s, age)
        m.mark_step()
        if now >= self._next_lag:
            self._next_lag = now + self.lag_interval_s
            self._spawn(self._observe_lag())

    async def _observe_lag(self) -> None:
        try:
            lag = await asyncio.get_running_loop().run_in_executor(self._io, self.source.lag)
        except RETRYABLE as exc:
            log.debug("consumer lag unavailable: %s", exc)
            return
        if lag is not None:
            self.metrics.consumer_lag.set(lag)

    def _log_summary(self) -> None:
        q = self.metrics.queueing
        qsum = _sample(q, "_sum")
        qcount = _sample(q, "_count")
        log.info("score-stream stopping: %s", self.totals.summary((qsum, qcount)))


def _sample(metric: Any, suffix: str) -> float:
    """A histogram's ``_sum`` or ``_count`` as it stands."""
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith(suffix):
                return float(s.value)
    return 0.0
