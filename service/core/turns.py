"""The order of a worker's micro-batch round trips (:class:`Turns`): each batch's reads
see every earlier batch's recording, however many batches are in flight."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from fraud_scoring.redis_clients import Rest

# Per turn (its own future), the writes it sent on a held connection, once sent (None:
# not on one, or failed first): what the next batch may follow (Turns.wait).
_SENT: weakref.WeakKeyDictionary[asyncio.Future[None], asyncio.Future[Rest | None]] = (
    weakref.WeakKeyDictionary()
)
# The turns a later batch waits on to follow (Turns.wait): their batch lets it run once sent.
_AWAITED: weakref.WeakSet[asyncio.Future[None]] = weakref.WeakSet()


class Turns:
    """The order of the micro-batches' store round trips. Batches in flight at once
    (``FRAUD_BATCHES_IN_FLIGHT``) send their round trips one after another in the order
    they formed: a batch's reads see every earlier batch's recording, so a burst split
    across two batches counts its earlier attempts, as with one batch at a time. On one
    server a batch sends its round trip as soon as the previous batch has sent its
    writes, on the same connection behind them (:meth:`Rest.follow`: the server runs
    one connection's commands in order), while that batch is still deciding; otherwise
    (a Cluster, a failed batch, writes whose replies were read already) it waits for the
    previous batch to have read its writes' replies (which it does after its decisions:
    :meth:`Scorer._written`)."""

    def __init__(self) -> None:
        self._last: asyncio.Future[None] | None = None

    def take(self) -> tuple[asyncio.Future[None] | None, asyncio.Future[None]]:
        """This batch's turn: (the previous batch's, to wait for; its own, to pass on)."""
        loop = asyncio.get_running_loop()
        prev, mine = self._last, loop.create_future()
        _SENT[mine] = loop.create_future()
        self._last = mine
        return prev, mine

    @staticmethod
    async def wait(prev: asyncio.Future[None] | None) -> Rest | None:
        """Until this batch may send its round trip: the previous batch's turn passed
        (None), or its writes sent on a held connection (their :class:`Rest`, to follow)."""
        if prev is None or prev.done():
            return None
        sent = _SENT.get(prev)
        if sent is not None:  # asyncio.wait cancels neither when we are cancelled
            _AWAITED.add(prev)
            await asyncio.wait((sent, prev), return_when=asyncio.FIRST_COMPLETED)
            if not prev.done() and sent.done() and sent.result() is not None:
                return sent.result()
        await Turns.passed(prev)
        return None

    @staticmethod
    async def passed(prev: asyncio.Future[None] | None) -> None:
        """Until the previous batch's turn has passed on."""
        if prev is not None and not prev.done():
            await asyncio.shield(prev)  # our cancellation must not end theirs

    @staticmethod
    def sent(turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]], rest: Any) -> bool:
        """This batch's writes are sent (``rest``: their replies to come; followed only
        on a held connection). Returns whether a later batch waits to follow them."""
        got = _SENT.get(turn[1])
        if got is None or got.done():
            return False
        waiting = isinstance(rest, Rest) and turn[1] in _AWAITED
        got.set_result(rest if isinstance(rest, Rest) else None)
        return waiting

    @staticmethod
    def done(turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]]) -> None:
        """Pass the turn on: now, or (a batch that failed or was cancelled before its
        round trip) once the previous batch's has passed it on."""
        prev, mine = turn
        Turns.sent(turn, None)  # a batch that never sent its writes: nothing to follow
        if mine.done():
            return
        if prev is None or prev.done():
            mine.set_result(None)
        else:
            prev.add_done_callback(lambda _: None if mine.done() else mine.set_result(None))
