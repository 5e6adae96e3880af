"""A micro-batch's store round trip in flight (service/core/round_trip.py): what it
reads and records (:class:`Batch`), where each part of its replies lies
(:class:`Layout`), and its writes' replies still to come (:class:`Pending`, which passes
the batch's turn on once they are in)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fraud_scoring import session
from fraud_scoring.declared import columnar as C
from fraud_scoring.events import Transaction
from fraud_scoring.redis_clients import Rest, drain_in_background
from service.core import lists
from service.core.turns import Turns


@dataclass(frozen=True)
class Batch:
    """A micro-batch's transactions as the round trip reads and records them (their
    times: effective, :func:`fraud_scoring.session.effective_times`)."""

    txns: Sequence[Transaction]
    recorded: list[bool]
    ts_us: list[int]
    by_card: dict[str, list[session.SessionEvent]]
    rows: list[dict[str, Any]]  # the fields declared features read ([]: none is read)

    @classmethod
    def of(
        cls, txns: Sequence[Transaction], recorded: list[bool], rows: list[dict[str, Any]]
    ) -> Batch:
        by_card: dict[str, list[session.SessionEvent]] = {}
        for t, r in zip(txns, recorded, strict=True):
            if r:
                by_card.setdefault(t.card_id, []).append(session.to_session_event(t))
        return cls(txns, recorded, [session.to_us(t.event_time) for t in txns], by_card, rows)


@dataclass(frozen=True)
class Layout:
    """Where each part of a round trip's replies lies: the reader's reads, then the
    declared reads (to ``reads_end``), the session writes (to ``session_end``), then the
    declared writes."""

    markers: int  # the batch views' markers, then the read declared states'
    reader: int
    reads_end: int
    session_end: int
    plan: C.Plan  # what the declared reads and writes were queued for
    states: list[tuple[str, str]]  # the declared states' markers read (StoreHealth)
    list_reads: lists.ListReads = lists.NO_READS  # the rules' list lookups, after the reader's

    @property
    def declared_start(self) -> int:
        return self.reader + len(self.list_reads)

    def declared_writes(self, replies: list[Any]) -> list[Any]:
        return replies[self.session_end :]


@dataclass
class Pending:
    """A micro-batch's round trip whose reads are in (``head``) and whose writes' replies
    are still to come (``tail``); ``replies``: all of them, once checked. The turn passes
    on when the writes are done (:meth:`release`), so the next batch's reads see them."""

    lay: Layout
    head: list[Any]
    tail: Rest | PipelineRest  # the writes' replies, read once (Scorer._settled)
    deadline: float  # the event loop's time the whole round trip is bounded by
    turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]]
    batch: Batch  # what the round trip read and recorded
    replies: list[Any] | None = None
    read: bool = False  # the tail was read (or its reading failed)
    released: bool = False

    def release(self) -> None:
        """Pass the turn on: now if the writes' replies were read; a batch that failed
        before reading them leaves them to be read in the background, by the round
        trip's deadline, and the turn passes then."""
        if self.released:
            return
        self.released = True
        if self.read:
            Turns.done(self.turn)
        else:
            left = self.deadline - asyncio.get_running_loop().time()
            self.tail.abandon(left, lambda: Turns.done(self.turn))


class PipelineRest:
    """The writes of a micro-batch on a Redis Cluster: redis-py's pipeline, sent when
    read (:class:`fraud_scoring.redis_clients.Rest`'s interface)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    async def replies(self) -> list[Any]:
        return list(await self._pipe.execute(raise_on_error=False)) if len(self._pipe) else []

    def abandon(self, timeout_s: float, then: Callable[[], None]) -> None:
        drain_in_background(self.replies, timeout_s, then)


class Commands(list[tuple[Any, ...] | bytes]):
    """A micro-batch's commands as the queueing helpers add them (``execute_command``,
    as on a pipeline, or ``packed``: one command already in the protocol), for
    :meth:`HeldConnections.round_trip`."""

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.append(args)

    def packed(self, command: bytes) -> None:
        self.append(command)
