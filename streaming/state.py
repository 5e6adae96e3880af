"""The write side of session state: apply validated transactions to Redis.

One Lua script per card and batch (:data:`fraud_scoring.session.APPLY_LUA`, which the
scoring service also runs for each transaction it scores) makes each card's update
atomic, so a crash leaves a card either fully updated for the batch or untouched, and
replaying the batch after a restart changes nothing (idempotent on ``transaction_id``,
see the ``:ids`` hash in ``fraud_scoring.session``).

**Late events.** Every event applies at its own event time. An event whose time is more
than ``allowed_lateness`` behind the newest event already stored for its card is
*late*: it is still applied and counted (``late``). State is trimmed to
``RETENTION = 24 h + allowed_lateness`` behind the card's newest event, so an event
older than that is dropped on arrival and counted (``dropped``); it could only change
features as of times more than ``allowed_lateness`` in the card's past, which nothing
scores any more. Idle cards also expire by wall clock (``ttl_s``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from fraud_scoring.events import Transaction
from fraud_scoring.session import (
    APPLY_LUA,
    SessionEvent,
    SessionLimits,
    events_key,
    ids_key,
    to_session_event,
)

__all__ = ["ApplyResult", "CardEvent", "SessionWriter", "card_event", "to_session_event"]


@dataclass
class ApplyResult:
    added: int = 0
    duplicates: int = 0
    late: int = 0
    dropped: int = 0

    def __iadd__(self, other: ApplyResult) -> ApplyResult:
        self.added += other.added
        self.duplicates += other.duplicates
        self.late += other.late
        self.dropped += other.dropped
        return self


CardEvent = tuple[str, SessionEvent]  # (card_id, event)


def card_event(txn: Transaction) -> CardEvent:
    return txn.card_id, to_session_event(txn)


class SessionWriter:
    """Applies batches of events to Redis: one pipelined round trip per batch."""

    def __init__(
        self, client: redis.Redis, allowed_lateness_s: float, ttl_s: float | None = None
    ) -> None:
        self.client = client
        self.limits = SessionLimits(allowed_lateness_s, ttl_s)
        # A registered script reloads itself after NOSCRIPT (a restarted Redis).
        self.script = client.register_script(APPLY_LUA)

    def _args(self, events: Sequence[SessionEvent]) -> list[str | int]:
        return self.limits.args(events)

    def apply(self, events: Sequence[CardEvent]) -> ApplyResult:
        """Apply (card_id, event) pairs (any order, duplicates allowed) in one round trip.

        Raises ``redis.RedisError`` when Redis fails; then some cards may already be
        updated, and applying the same batch again is safe.
        """
        by_card: dict[str, list[SessionEvent]] = defaultdict(list)
        for card, e in events:
            by_card[card].append(e)
        if not by_card:
            return ApplyResult()
        pipe = self.client.pipeline(transaction=False)
        for card, evs in by_card.items():
            self.script(keys=[events_key(card), ids_key(card)], args=self._args(evs), client=pipe)
        total = ApplyResult()
        for added, dup, late, dropped in pipe.execute():
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total

    def apply_unpipelined(self, events: Sequence[CardEvent]) -> ApplyResult:
        """Baseline for the benchmark: one script call (one round trip) per event."""
        total = ApplyResult()
        for card, e in events:
            added, dup, late, dropped = self.script(
                keys=[events_key(card), ids_key(card)], args=self._args([e])
            )
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total
