"""The decision log: every answered decision, with the exact feature vector the model saw,
appended to a durable log (``fraud_scoring.event_log``) without slowing or failing scoring.

The scorer hands each micro-batch to :meth:`DecisionLog.submit`, which only keeps it aside;
the batcher then says which of its items are answered (:meth:`DecisionLog.answered`, just
before the answers leave), and those decisions, and only those, are written to the local
spool (``service/loop/spool.py``: one ``write`` per micro-batch, so a crash after the
answer loses none) and queued in a bounded in-memory buffer. A request answered 503 (its
deadline passed while its batch ran), a retry and a refused id are not new decisions and
are not logged; a decision whose caller timed out is logged when a retry of its id is
answered with it. One background task ships the buffer, one producer call (one Redis round
trip) per up to ``MAX_SEND`` decisions, and deletes a spool segment once all its decisions
are in the log. When the log is slow or unreachable the buffer waits and the writer retries
with backoff; past the buffer's bound decisions go to the spool only, and are shipped from
it when the log is back, as are the segments a previous process left (at start). Without a
spool, past the bound new decisions are dropped and counted. On shutdown the writer gets
the drain time; what is left stays in the spool for the next start.

State on ``/metrics``: ``fraud_decision_log_written``, ``fraud_decision_log_dropped``,
``fraud_decision_log_replayed`` (shipped from the spool's files),
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
``champion_version`` and ``champion_score``, ``degraded`` (null, or why rules decided:
such an entry has ``score`` null, ``model_version`` "rules-only" and the rules' inputs as
``features``), ``inexact`` (declared features whose read was not exact: a replay),
``decided_by`` (``rule`` | ``list`` | ``model``), ``rules_version``, ``fired_rules`` (the
active rules that matched, the decider first) and ``shadow_rules`` (codes; docs/rules.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from prometheus_client import Counter, Gauge
from pydantic_core import from_json, to_json

from fraud_scoring.event_log import LogRecord, LogUnavailable, Producer
from fraud_scoring.events import Transaction
from service.core.decision import Reason
from service.core.scoring import ScoreResult
from service.loop.spool import Spool, SpoolRecord, read_segment

log = logging.getLogger(__name__)

MAX_SEND = 512  # decisions per producer call
# After the first decision of a quiet spell the writer gathers for this long before its
# call: one producer call per ~50 ms under load instead of one per micro-batch. A call
# costs far more than its records (on the 2-core VM ~0.2 ms hot, ~1 ms when it is the
# only work in a while); with a 10 ms linger the log was 15-25 % of the service's CPU at
# 50-300 req/s (`bench_ab --after-env FRAUD_DECISION_LOG=off`). A decision reaches the
# log about this much later; a backlog of MAX_SEND or more is written without waiting.
LINGER_S = 0.05
# Decisions kept for a retry of their id after their caller timed out (see answered()).
UNANSWERED_KEPT = 1_000
BACKOFF_S = (0.1, 5.0)  # first and longest wait between failed writes

# Told of each batch once it is in the log (each decision with its log record), before
# the batch leaves the buffer: the review queue (service/loop/review_queue.py). Raising
# LogUnavailable retries this call, with backoff, without writing the log again.
AfterWrite = Callable[[Sequence[tuple[ScoreResult, LogRecord]]], Awaitable[object]]


@dataclass(frozen=True)
class _Instruments:
    written: Counter
    dropped: Counter
    replayed: Counter
    buffered: Gauge
    up: Gauge


@cache
def _instruments() -> _Instruments:
    return _Instruments(
        written=Counter("fraud_decision_log_written", "Decisions appended to the log"),
        dropped=Counter(
            "fraud_decision_log_dropped", "Decisions dropped because the log's buffer was full"
        ),
        replayed=Counter(
            "fraud_decision_log_replayed", "Decisions shipped to the log from the spool's files"
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
    shadow: bool = False  # a challenger's shadow score is still to come (shadow_scored)


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
        "degraded": r.degraded,
        "inexact": r.inexact,
        "challenger_version": r.challenger_version,
        "challenger_score": r.challenger_score,
        "routed_to": r.routed_to,
        "champion_version": r.champion_version,
        "champion_score": r.champion_score,
        "decided_by": r.decided_by,
        "rules_version": r.rules_version,
        "fired_rules": r.fired_rules,
        "shadow_rules": [x.code for x in r.shadow_rules],
    }
    # pydantic-core's encoder: one pass in Rust, ~5x json.dumps of a model_dump here;
    # NaN/inf written as json.dumps writes them.
    return LogRecord(r.transaction_id, to_json(body, inf_nan_mode="constants"))


@dataclass(frozen=True, slots=True)
class _Entry:
    result: ScoreResult
    record: LogRecord
    segment: Path | None  # the spool segment holding it (None: not spooled)


def _spooled(e: _Entry) -> SpoolRecord:
    # The review queue shows each reason's message: kept beside a review decision.
    extra = b""
    if e.result.decision == "review":
        extra = to_json([r.message for r in e.result.reasons])
    return SpoolRecord(e.record.key, e.record.payload, extra)


def _replayed(r: SpoolRecord) -> _Entry:
    """A decision read back from the spool, with the result after_write reads."""
    body = from_json(r.payload)
    messages = from_json(r.extra) if r.extra else [""] * len(body["reasons"])
    result = ScoreResult(
        transaction_id=body["transaction_id"],
        decision=body["decision"],
        score=body["score"],
        reasons=[Reason(c, m) for c, m in zip(body["reasons"], messages, strict=True)],
        model_version=body["model_version"],
        missing=body["missing"],
        stale=body["stale"],
    )
    return _Entry(result, LogRecord(r.key, r.payload), None)


class DecisionLog:
    """A bounded buffer of decisions, the spool under it (None: memory only), and the task
    that writes them to ``producer``. :meth:`start` in the service's lifespan,
    :meth:`stop` on the way out."""

    def __init__(
        self,
        producer: Producer,
        buffer_size: int,
        after_write: AfterWrite | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.producer = producer
        self.after_write = after_write
        self.buffer_size = buffer_size
        self.spool = spool
        self.pending: deque[_Entry] = deque()
        self.ins = _instruments()
        self.ins.up.set(1)
        self.last_error: str | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # The running micro-batch's decisions, between submit() and answered().
        self._staged: dict[str, _Pending] = {}
        # Spooled decisions whose challenger shadow score is still to come: buffered with
        # it by shadow_scored() (or without it at stop); each counts in its segment.
        self._awaiting: dict[str, tuple[_Pending, Path | None]] = {}
        # Decided, but the caller was gone: logged if a retry is answered with it.
        self._unanswered: dict[str, _Pending] = {}
        # Spool segments and how many of their decisions the buffer still holds.
        self._unshipped: dict[Path, int] = {}
        self._backlog: list[Path] = []  # segments shipped from their files, oldest first
        self._spilling: Path | None = None  # the backlog segment new decisions go to
        self._spool_error: str | None = None

    # -- the scoring side: no I/O but the spool's one write, no await, never raises ------
    def submit(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
        shadow: bool = False,
    ) -> None:
        """Keep one scored micro-batch (``x``: the model's input, one row per txn) until
        :meth:`answered` says which of it was answered. ``shadow``: a challenger's shadow
        run scores it after the answers; the decisions are spooled when answered, like any
        (a crash then loses only the shadow score), and shipped with the score once
        :meth:`shadow_scored` brings it."""
        now_us = time.time_ns() // 1000
        for i, r in enumerate(results):
            self._staged[r.transaction_id] = _Pending(txns[i], x[i], names, r, now_us, shadow)

    def shadow_scored(self, results: Sequence[ScoreResult]) -> None:
        """The shadow run's results for decisions :meth:`submit` had with ``shadow``
        (each with its challenger score, or null when the run was dropped): those that
        were answered go to the buffer, in place of the copy the spool holds."""
        for r in results:
            held = self._awaiting.pop(r.transaction_id, None)
            if held is not None:
                p, segment = held
                p = dataclasses.replace(p, result=r, shadow=False)
                self.pending.append(_Entry(r, encode(p), segment))
        self.ins.buffered.set(len(self.pending))
        self._wake.set()

    def answered(self, results: Sequence[ScoreResult], delivered: Sequence[bool]) -> None:
        """The micro-batch's results, and which of them go to a waiting caller (the rest
        timed out or were cancelled while it ran): log the answered new decisions, before
        the answers leave. Called by the batcher (or, batching off, after the scorer)."""
        out = []
        for r, answered in zip(results, delivered, strict=True):
            p = self._staged.pop(r.transaction_id, None)
            if not answered:
                if p is not None:
                    self._unanswered[r.transaction_id] = p
                    if len(self._unanswered) > UNANSWERED_KEPT:
                        del self._unanswered[next(iter(self._unanswered))]
            elif r.logged:
                if p is not None:
                    out.append(p)
            elif r.repeat and (q := self._unanswered.pop(r.transaction_id, None) or p):
                out.append(q)  # the first attempt's decision, else the one answered now
        self._staged.clear()  # submitted for no one
        if out:
            self._commit(out)

    def _commit(self, decisions: Sequence[_Pending]) -> None:
        """Spool, then buffer (or, past the buffer's bound, spool only)."""
        n = len(decisions)
        entries = [_Entry(p.result, encode(p), None) for p in decisions]
        segment = None
        spill = self._spilling is not None or len(self.pending) + n > self.buffer_size
        if self.spool is not None:
            try:
                if spill and self._spilling is None:
                    self.spool.rotate()  # the spilled decisions in a segment of their own
                segment = self.spool.append([_spooled(e) for e in entries])
                self._spool_error = None
            except OSError as exc:  # said once per spell, not per micro-batch
                if self._spool_error is None:
                    log.error("decision spool not writable, decisions in memory only: %s", exc)
                self._spool_error = str(exc)
        if segment is not None and spill:
            if segment != self._spilling:
                self._spilling = segment
                self._backlog.append(segment)
        else:
            room = max(self.buffer_size - len(self.pending), 0)
            kept = 0
            for p, e in zip(decisions[:room], entries[:room], strict=True):
                if p.shadow:  # buffered when its shadow score comes
                    self._awaiting[p.result.transaction_id] = (p, segment)
                else:
                    self.pending.append(_Entry(e.result, e.record, segment))
                kept += 1
            if segment is not None:
                self._unshipped[segment] = self._unshipped.get(segment, 0) + kept
            if n > room:
                self.ins.dropped.inc(n - room)
        self.ins.buffered.set(len(self.pending))
        self._wake.set()

    def readiness(self) -> str | None:
        """None while the log takes writes; else why not (for the readiness answer; a
        log outage does not make the service unready, as scoring goes on)."""
        if self.last_error is None:
            return None
        # No error text: /readyz is open and the error names the log's host (it is logged).
        spooled = f", {len(self._backlog)} spool file(s)" if self._backlog else ""
        return f"unreachable; {len(self.pending)} decision(s) buffered{spooled}"

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer; a previous process's spool files are shipped first."""
        loop = asyncio.get_running_loop()
        if self.spool is not None:
            self._backlog = self.spool.orphans()
            if self._backlog:
                log.info("decision spool: %d file(s) left to replay", len(self._backlog))
                self._wake.set()
            self._tasks.append(loop.create_task(self.spool.run_sync(), name="decision-spool"))
        self._tasks.insert(0, loop.create_task(self._run(), name="decision-log"))

    async def stop(self, drain_s: float) -> None:
        """Write what is waiting (up to ``drain_s``, or until the log fails: it is in the
        spool), then stop. What the spool does not hold is counted as dropped."""
        if not self._tasks:
            return
        # Shadow runs that never finished (the challenger stops first): as spooled.
        for p, segment in self._awaiting.values():
            self.pending.append(_Entry(p.result, encode(p), segment))
        self._awaiting.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained(), timeout=drain_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        lost = sum(1 for e in self.pending if e.segment is None)
        if self.spool is not None:
            self._release_shipped()
            await asyncio.to_thread(self.spool.close)
            if self.pending or self._backlog:
                log.warning(
                    "decision log: %d buffered decision(s) and %d spool file(s) left in %s "
                    "for the next start",
                    len(self.pending) - lost,
                    len(self._backlog),
                    self.spool.directory,
                )
        if lost:
            log.warning("decision log: %d decision(s) not written at shutdown", lost)
            self.ins.dropped.inc(lost)
        self.pending.clear()
        await self.producer.close()

    async def _drained(self) -> None:
        while self.pending or self._backlog:
            if self.last_error is not None and self.spool is not None:
                return  # all of it is in the spool
            await asyncio.sleep(0.01)

    # -- the writer -------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self.pending and not self._backlog:
                self._wake.clear()
                await self._wake.wait()
                if len(self.pending) < MAX_SEND and not self._backlog:
                    await asyncio.sleep(LINGER_S)  # gather a few micro-batches
            if self._backlog:
                await self._replay(self._backlog[0])
                continue
            batch = [self.pending[i] for i in range(min(MAX_SEND, len(self.pending)))]
            await self._ship(batch)
            for _ in batch:  # only the writer pops, so these are still the head
                e = self.pending.popleft()
                if e.segment is not None:
                    self._unshipped[e.segment] -= 1
            self.ins.buffered.set(len(self.pending))
            self._release_shipped()

    async def _replay(self, segment: Path) -> None:
        """Ship one backlog segment from its file, then delete it."""
        assert self.spool is not None
        if segment == self._spilling:  # new decisions go elsewhere from now on
            self.spool.rotate()
            self._spilling = None
        entries = await asyncio.to_thread(lambda: [_replayed(r) for r in read_segment(segment)])
        for start in range(0, len(entries), MAX_SEND):
            await self._ship(entries[start : start + MAX_SEND])
            self.ins.replayed.inc(len(entries[start : start + MAX_SEND]))
        self._backlog.remove(segment)
        self.spool.release(segment)

    def _release_shipped(self) -> None:
        """Delete the spool segments whose decisions are all in the log (the current one
        too, once the buffer is empty: a restart then has nothing to replay)."""
        spool = self.spool
        if spool is None:
            return
        for segment, left in list(self._unshipped.items()):
            if left == 0 and (segment != spool.current or not self.pending):
                del self._unshipped[segment]
                spool.release(segment)

    async def _ship(self, batch: Sequence[_Entry]) -> None:
        """Write ``batch`` to the log and tell after_write, retrying with backoff until
        both succeed (the log is written once)."""
        backoff = BACKOFF_S[0]
        logged = False  # the batch is in the log; what is left is after_write
        while True:
            try:
                if not logged:
                    await self.producer.send([e.record for e in batch])
                    logged = True
                if self.after_write is not None:
                    await self.after_write([(e.result, e.record) for e in batch])
            except Exception as exc:  # the writer must not die: kept, retried
                if self.last_error is None:
                    # Anything but LogUnavailable is a fault of ours or of the client:
                    # its traceback, once, as an error.
                    known = isinstance(exc, LogUnavailable)
                    log.log(
                        logging.WARNING if known else logging.ERROR,
                        "decision log unreachable, buffering: %s",
                        exc if known else f"{type(exc).__name__}: {exc}",
                        exc_info=not known,
                    )
                self.last_error = str(exc) or type(exc).__name__
                self.ins.up.set(0)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            self.ins.written.inc(len(batch))
            if self.last_error is not None:
                log.info("decision log reachable again")
                self.last_error = None
                self.ins.up.set(1)
            return
