"""The decision log: every decision, with the exact feature vector the model saw, appended
to a durable log (``fraud_scoring.event_log``) without slowing or failing scoring.

The scorer hands each micro-batch to :meth:`DecisionLog.submit`, which only appends to a
bounded in-memory buffer (no I/O, no await). One background task drains the buffer, one
producer call (one Redis round trip) per up to ``MAX_SEND`` decisions. When the log is
slow or unreachable the decisions wait in the buffer and the writer retries with backoff;
a buffer that is full drops the *new* decisions and counts them. State on ``/metrics``:
``fraud_decision_log_written``, ``fraud_decision_log_dropped``,
``fraud_decision_log_buffered`` and ``fraud_decision_log_up`` (0 while the last write
failed); :meth:`DecisionLog.readiness` says the same in words. A retried or replayed
``transaction_id`` is one entry (the producer's idempotence key). ``after_write`` is
told of each written batch before it leaves the buffer (the review queue, fed from here
so that it too costs scoring nothing).

One entry (JSON): ``transaction_id``, ``decided_at`` (epoch µs, UTC), ``transaction`` (the
request's fields), ``features`` (name → value, in the model's order, as given to the
model), ``missing``, ``stale``, ``score``, ``model_version``, ``decision``, ``reasons``
(codes), ``timing_ms``, ``challenger_version`` and ``challenger_score`` (null when no
challenger ran), ``routed_to`` (``champion`` | ``challenger``: which model decided, the
one ``model_version`` and ``score`` are of, and whose vector ``features`` is),
``champion_version`` and ``champion_score``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
from prometheus_client import Counter, Gauge
from pydantic_core import to_json

from fraud_scoring.event_log import LogRecord, LogUnavailable, Producer
from fraud_scoring.events import Transaction
from service.core.scoring import ScoreResult

log = logging.getLogger(__name__)

MAX_SEND = 512  # decisions per producer call
# After the first decision of a quiet spell the writer gathers for this long before its
# call: one producer call per ~50 ms under load instead of one per micro-batch. A call
# costs far more than its records (on the 2-core VM ~0.2 ms hot, ~1 ms when it is the
# only work in a while); with a 10 ms linger the log was 15-25 % of the service's CPU at
# 50-300 req/s (`bench_ab --after-env FRAUD_DECISION_LOG=off`). A decision reaches the
# log about this much later; a backlog of MAX_SEND or more is written without waiting.
LINGER_S = 0.05
# Decisions encoded between two turns of the event loop: a call's records are encoded in
# slices, so a large call does not hold up the requests that arrive meanwhile.
ENCODE_SLICE = 16
BACKOFF_S = (0.1, 5.0)  # first and longest wait between failed writes

# Told of each batch once it is in the log (each decision with its log record), before
# the batch leaves the buffer: the review queue (service/loop/review_queue.py). Raising
# LogUnavailable retries this call, with backoff, without writing the log again.
AfterWrite = Callable[[Sequence[tuple[ScoreResult, LogRecord]]], Awaitable[object]]


@dataclass(frozen=True)
class _Instruments:
    written: Counter
    dropped: Counter
    buffered: Gauge
    up: Gauge


@cache
def _instruments() -> _Instruments:
    return _Instruments(
        written=Counter("fraud_decision_log_written", "Decisions appended to the log"),
        dropped=Counter(
            "fraud_decision_log_dropped", "Decisions dropped because the log's buffer was full"
        ),
        buffered=Gauge(
            "fraud_decision_log_buffered",
            "Decisions waiting for the log",
            multiprocess_mode="livesum",
        ),
        up=Gauge(
            "fraud_decision_log_up",
            "1 while the decision log takes writes, 0 after a failed one",
            multiprocess_mode="livemin",
        ),
    )


@dataclass(frozen=True, slots=True)
class _Pending:
    txn: Transaction
    features: np.ndarray  # the model's input row
    names: Sequence[str]
    result: ScoreResult
    decided_at_us: int


def encode(p: _Pending) -> LogRecord:
    """One decision as a log record keyed by its transaction_id."""
    r = p.result
    body = {
        "transaction_id": r.transaction_id,
        "decided_at": p.decided_at_us,
        "transaction": p.txn,  # serialised by its own pydantic serializer, in JSON mode
        "features": dict(zip(p.names, p.features.tolist(), strict=True)),
        "missing": r.missing,
        "stale": r.stale,
        "score": r.score,
        "model_version": r.model_version,
        "decision": r.decision,
        "reasons": [x.code for x in r.reasons],
        "timing_ms": r.timing_ms,
        "challenger_version": r.challenger_version,
        "challenger_score": r.challenger_score,
        "routed_to": r.routed_to,
        "champion_version": r.champion_version,
        "champion_score": r.champion_score,
    }
    # pydantic-core's encoder: one pass in Rust, ~5x json.dumps of a model_dump here;
    # NaN/inf written as json.dumps writes them.
    return LogRecord(r.transaction_id, to_json(body, inf_nan_mode="constants"))


class DecisionLog:
    """A bounded buffer of decisions and the task that writes them to ``producer``.
    :meth:`start` in the service's lifespan, :meth:`stop` on the way out."""

    def __init__(
        self, producer: Producer, buffer_size: int, after_write: AfterWrite | None = None
    ) -> None:
        self.producer = producer
        self.after_write = after_write
        self.buffer_size = buffer_size
        self.pending: deque[_Pending] = deque()
        self.ins = _instruments()
        self.ins.up.set(1)
        self.last_error: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def submit(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
    ) -> None:
        """Queue one scored micro-batch (``x``: the model's input, one row per txn). Never
        blocks, never raises: past the buffer's bound the rest are dropped and counted."""
        now_us = time.time_ns() // 1000
        room = self.buffer_size - len(self.pending)
        for i in range(min(room, len(results))):
            self.pending.append(_Pending(txns[i], x[i], names, results[i], now_us))
        if len(results) > room:
            self.ins.dropped.inc(len(results) - max(room, 0))
        self.ins.buffered.set(len(self.pending))
        self._wake.set()

    def readiness(self) -> str | None:
        """None while the log takes writes; else why not (for the readiness answer; a
        log outage does not make the service unready, as scoring goes on)."""
        if self.last_error is None:
            return None
        # No error text: /readyz is open and the error names the log's host (it is logged).
        return f"unreachable; {len(self.pending)} decision(s) buffered"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="decision-log")

    async def stop(self, drain_s: float) -> None:
        """Write what is buffered (up to ``drain_s``), then stop; what is left is counted
        as dropped."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained(), timeout=drain_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self.pending:
            log.warning("decision log: %d decision(s) not written at shutdown", len(self.pending))
            self.ins.dropped.inc(len(self.pending))
            self.pending.clear()
        await self.producer.close()

    async def _drained(self) -> None:
        while self.pending and self.last_error is None:
            await asyncio.sleep(0.01)

    async def _run(self) -> None:
        backoff = BACKOFF_S[0]
        batch: list[_Pending] = []
        records: list[LogRecord] = []
        logged = False  # the batch is in the log; what is left is after_write
        while True:
            if not batch:
                if not self.pending:
                    self._wake.clear()
                    await self._wake.wait()
                    if len(self.pending) < MAX_SEND:
                        await asyncio.sleep(LINGER_S)  # gather a few micro-batches
                batch = [self.pending[i] for i in range(min(MAX_SEND, len(self.pending)))]
                records, logged = [], False
                for start in range(0, len(batch), ENCODE_SLICE):
                    records += [encode(p) for p in batch[start : start + ENCODE_SLICE]]
                    await asyncio.sleep(0)  # let requests run between slices
            try:
                if not logged:
                    await self.producer.send(records)
                    logged = True
                if self.after_write is not None:
                    await self.after_write(
                        [(p.result, r) for p, r in zip(batch, records, strict=True)]
                    )
            except LogUnavailable as exc:
                if self.last_error is None:
                    log.warning("decision log unreachable, buffering: %s", exc)
                self.last_error = str(exc)
                self.ins.up.set(0)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            for _ in batch:  # only the writer pops, so these are still the head
                self.pending.popleft()
            self.ins.written.inc(len(batch))
            self.ins.buffered.set(len(self.pending))
            batch = []
            if self.last_error is not None:
                log.info("decision log reachable again")
                self.last_error = None
                self.ins.up.set(1)
            backoff = BACKOFF_S[0]
