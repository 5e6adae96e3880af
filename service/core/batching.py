"""Dynamic batching at the model boundary (one module owns it).

Request handlers ``submit`` an item with a deadline and await its result. One worker
task forms micro-batches (not to be confused with the client's batch endpoint, whose
transactions are submitted one by one) and hands each to ``run_batch`` (feature read +
inference for the whole micro-batch). Bounds, all from settings:

* ``max_batch_size``: a batch never holds more items;
* batches form by themselves: when no batch is running, whatever is queued runs at once
  (a lone request is not held: with nothing queued and nothing running, its caller runs
  it as a batch of one itself, without a hand-over to the worker), and requests that
  arrive while a batch runs queue up for the next one;
* ``max_queue_delay``: bounds how long the oldest item waits for company, which happens
  only while another batch is already running (``concurrency`` > 1) or when
  ``preferred_batch_sizes`` are set (then the worker waits for one, and flushes early
  when the batch reaches one);
* ``max_queue_size``: a submit beyond it fails at once with :class:`QueueFull`;
* deadlines: a batch never waits past the earliest deadline it holds minus the
  measured batch time, and an item that can no longer make its deadline is failed with
  :class:`DeadlineExceeded` before it reaches the model; at the deadline itself a caller
  still waiting (queued, or in a batch that runs late) gets :class:`TimedOut` (one timer
  handle per item, cheaper than wrapping the await in ``asyncio.timeout``); a result
  that arrives later is dropped (``BatchStats.on_answered`` is told which were not).

All three are :class:`~service.errors.Rejected` (answered 503 with Retry-After and counted by
the service's one handler); this module counts nothing itself.

Cancellation: a caller that goes away (its awaiting task is cancelled, e.g. the client
timed out) cancels its future; the worker drops cancelled items when it forms the batch,
so they never run, never hang the queue and never hold a slot. A caller may also pass
``gone`` (e.g. "the HTTP client disconnected"), which the worker asks when it forms the
batch: an item whose ``gone()`` is true is dropped the same way and fails with
:class:`ClientGone`, so no watcher task per request is needed. Order is FIFO.
Up to ``concurrency`` batches run at once (one per model instance).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from service.errors import Rejected, RejectReason

log = logging.getLogger(__name__)

# Flush this long before the earliest deadline's last useful moment: timers overshoot.
FLUSH_SLACK_S = 0.005

T = TypeVar("T")
R = TypeVar("R")


class QueueFull(Rejected):
    """The queue is at max_queue_size; answer 503 with Retry-After."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectReason.QUEUE_FULL, f"overloaded: {detail}")


class ClientGone(Rejected):
    """The caller's ``gone()`` said it went away before its batch ran; nobody reads the
    answer, it is only counted (reason ``disconnected``)."""

    def __init__(self) -> None:
        super().__init__(RejectReason.DISCONNECTED, "the client went away")


class DeadlineExceeded(Rejected):
    """The item's deadline passed (or cannot be met) before it reached the model."""

    def __init__(self, detail: str) -> None:
        super().__init__(RejectReason.DEADLINE, f"deadline exceeded: {detail}")


class TimedOut(Rejected):
    """The item's deadline fired while its caller was still waiting (reason ``timeout``)."""

    def __init__(self) -> None:
        super().__init__(RejectReason.TIMEOUT, "deadline exceeded: timed out")


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimedOut())


@dataclass
class _Item(Generic[T, R]):
    payload: T
    deadline: float  # time.monotonic()
    enqueued: float
    future: asyncio.Future[R]
    gone: Callable[[], bool] | None = None

    def dropped(self) -> bool:
        """Cancelled by its caller, or its caller is gone (then failed with ClientGone)."""
        if self.future.done():
            return True
        if self.gone is not None and self.gone():
            self.future.set_exception(ClientGone())
            return True
        return False


@dataclass
class BatchStats:
    """Observations for metrics; ``on_batch`` is called once per micro-batch that ran."""

    on_batch: Callable[[int, float, list[float]], None] | None = None  # size, compute_s, waits
    # Told of each batch's results and which go to a waiting caller, just before they do
    # (the decision log writes the answered ones ahead of the answers).
    on_answered: Callable[[Sequence[Any], list[bool]], None] | None = None
    ewma_batch_s: float = 0.0
    batches: int = 0
    last_batch_at: float = 0.0  # time.monotonic() when the last batch finished

    def expected_batch_s(self, now: float) -> float:
        """The measured batch time, trusted only while it is fresh (batches ran in the
        last second): otherwise one slow batch could refuse every later request, no batch
        would run, and the estimate would never recover."""
        return self.ewma_batch_s if now - self.last_batch_at < 1.0 else 0.0


class Batcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        preferred_batch_sizes: Sequence[int] = (),
        concurrency: int = 1,
        stats: BatchStats | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue_size < 1 or concurrency < 1:
            raise ValueError("max_batch_size, max_queue_size and concurrency must be >= 1")
        self._run = run_batch
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.preferred = sorted(s for s in preferred_batch_sizes if 0 < s <= max_batch_size)
        self._queue: deque[_Item[T, R]] = deque()
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task[None]] = set()
        self._busy = 0  # batches between start and release of their slot
        self._worker: asyncio.Task[None] | None = None
        self.stats = stats or BatchStats()

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop taking batches; wait up to ``drain_s`` for queued and running ones. Items
        still queued then fail with ``Rejected`` (reason ``shutting_down``)."""
        end = time.monotonic() + drain_s
        while (self._queue or self._busy) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(
                    Rejected(RejectReason.SHUTTING_DOWN, "service shutting down")
                )
        self._queue.clear()
        await asyncio.gather(*self._running, return_exceptions=True)

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (cancelled ones, not yet swept out, excluded)."""
        return sum(1 for it in self._queue if not it.future.done())

    # -- request side --------------------------------------------------------------
    async def submit(
        self, payload: T, deadline: float, gone: Callable[[], bool] | None = None
    ) -> R:
        """Queue ``payload`` and wait for its result (or QueueFull / DeadlineExceeded, or
        TimedOut at ``deadline``, or ClientGone when ``gone()`` is true as its batch forms;
        ``gone`` must be cheap and must not block: it runs on the worker)."""
        now = time.monotonic()
        if len(self._queue) >= self.max_queue_size:
            # Cancelled requests wait in the deque until the worker sweeps them; they
            # must not take the places of live ones (rare: only when it looks full).
            self._queue = deque(it for it in self._queue if not it.future.done())
        if len(self._queue) >= self.max_queue_size:
            raise QueueFull(f"queue holds {len(self._queue)} requests (max_queue_size)")
        if deadline - now < self.stats.expected_batch_s(now):
            raise DeadlineExceeded("deadline shorter than the measured batch time")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        if not self._queue and self._busy == 0 and not self.preferred and self._worker:
            return await self._alone(_Item(payload, deadline, now, fut, gone))
        timer = loop.call_later(deadline - now, _expire, fut)
        self._queue.append(_Item(payload, deadline, now, fut, gone))
        self._wakeup.set()
        # A cancelled caller cancels ``fut`` through this await, and the deadline fails
        # it; either way the worker then drops the item before its batch runs.
        try:
            return await fut
        finally:
            timer.cancel()

    async def _alone(self, item: _Item[T, R]) -> R:
        """Nothing queued and nothing running: the caller runs its batch of one itself
        (what the worker would do at once, without waking it and handing over twice).
        Requests arriving meanwhile queue up for the worker's next batch. At the deadline
        the batch is cancelled (it serves no one else) and the caller gets TimedOut."""
        await self._slots.acquire()  # free: nothing runs, the worker holds none
        self._busy += 1
        try:
            async with asyncio.timeout(item.deadline - time.monotonic()):
                await self._execute([item])
        except TimeoutError:
            raise TimedOut() from None
        return item.future.result()

    # -- worker side ---------------------------------------------------------------
    def _live_head(self) -> _Item[T, R] | None:
        """Drop cancelled and expired items from the front; return the first live one."""
        now = time.monotonic()
        while self._queue:
            head = self._queue[0]
            if head.dropped():  # cancelled by its caller, or the caller is gone
                self._queue.popleft()
            elif head.deadline - now < self.stats.expected_batch_s(now):
                self._queue.popleft()
                head.future.set_exception(DeadlineExceeded("deadline passed in the queue"))
            else:
                return head
        return None

    def _ready_size(self) -> int:
        """The live items queued, counted up to ``max_batch_size`` (all a batch can take):
        a deep queue (score-stream's backlog holds thousands) is not walked whole at
        every wake-up."""
        n = 0
        for it in self._queue:
            if not it.future.done():
                n += 1
                if n >= self.max_batch_size:
                    break
        return n

    async def _loop(self) -> None:
        while True:
            if self._live_head() is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._slots.acquire()
            try:
                batch = await self._collect()
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            self._busy += 1  # counted from here: the task may not start before the next turn
            task = asyncio.get_running_loop().create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _collect(self) -> list[_Item[T, R]]:
        """Take what is queued at once when no batch is running (and no preferred sizes
        are set); else wait until the batch is full, a preferred size is reached, the
        oldest item has waited max_queue_delay, or the earliest deadline forces a flush."""
        while True:
            head = self._live_head()
            if head is None:
                return []
            if self._busy == 0 and not self.preferred:
                break  # nothing running: waiting would only add the delay to a lone request
            ready = self._ready_size()
            if ready >= self.max_batch_size or (self.preferred and ready in self.preferred):
                break
            earliest = min(it.deadline for it in self._queue if not it.future.done())
            flush_at = min(
                head.enqueued + self.max_queue_delay_s,
                earliest - self.stats.expected_batch_s(time.monotonic()) - FLUSH_SLACK_S,
            )
            wait = flush_at - time.monotonic()
            if wait <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait)
            except TimeoutError:
                break
        batch: list[_Item[T, R]] = []
        now = time.monotonic()
        while self._queue and len(batch) < self.max_batch_size:
            item = self._queue.popleft()
            if item.dropped():
                continue
            if item.deadline - now < self.stats.expected_batch_s(now):
                item.future.set_exception(DeadlineExceeded("deadline passed in the queue"))
                continue
            batch.append(item)
        return batch

    async def _execute(self, batch: list[_Item[T, R]]) -> None:
        start = time.monotonic()
        try:
            try:
                results = await self._run([it.payload for it in batch])
                if len(results) != len(batch):
                    raise RuntimeError(
                        f"run_batch returned {len(results)} results for {len(batch)}"
                    )
            except Exception as exc:  # one failed batch fails its own items, not the queue
                if isinstance(exc, Rejected):  # an answer (store down...), not a fault
                    log.debug("batch of %d refused: %s", len(batch), exc)
                else:
                    log.exception("batch of %d failed", len(batch))
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(exc)
                return
            elapsed = time.monotonic() - start
            s = self.stats
            s.ewma_batch_s = elapsed if s.batches == 0 else 0.8 * s.ewma_batch_s + 0.2 * elapsed
            s.last_batch_at = time.monotonic()
            s.batches += 1
            if s.on_batch:
                s.on_batch(len(batch), elapsed, [start - it.enqueued for it in batch])
            waiting = [not it.future.done() for it in batch]
            if s.on_answered:
                s.on_answered(results, waiting)
            for it, res, w in zip(batch, results, waiting, strict=True):
                if w:
                    it.future.set_result(res)
        finally:
            # The slot is freed after the answers: callers woken by them (who may call
            # again at once) run before the worker forms the next batch, so their calls
            # join it rather than the one after.
            self._busy -= 1
            self._slots.release()
