"""The write side of session state: apply validated transactions to Redis.

One pipelined round trip per batch: one Lua script call for the cards' histories
(:data:`fraud_scoring.session.APPLY_MANY_LUA`, which the scoring service also runs for
the transactions it scores; on a Redis Cluster one
:data:`~fraud_scoring.session.APPLY_LUA` call per card), then the declared states
(:func:`fraud_scoring.declared.queue_batch`). Each card's update is atomic, so a crash
leaves a card either fully updated for the batch or untouched, and replaying the batch
after a restart changes nothing (idempotent on ``transaction_id``, see the ``:ids``
hash in ``fraud_scoring.session``).

**Late events.** Every event applies at its own event time. An event whose time is more
than ``allowed_lateness`` behind the newest event already stored for its card is
*late*: it is still applied and counted (``late``). State is trimmed to
``RETENTION = 24 h + 900 s + allowed_lateness`` behind the card's newest event, so an event
older than that is dropped on arrival and counted (``dropped``); it could only change
features as of times more than ``allowed_lateness`` in the card's past, which nothing
scores any more. Idle cards also expire by wall clock (``ttl_s``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from fraud_scoring import declared as D
from fraud_scoring.events import Transaction
from fraud_scoring.features import declarations
from fraud_scoring.session import (
    APPLY_LUA,
    SessionEvent,
    SessionLimits,
    events_key,
    ids_key,
    queue_apply_many,
    to_session_event,
)
from fraud_scoring.session import SCRIPTS as SESSION_SCRIPTS

__all__ = [
    "ApplyResult",
    "CardEvent",
    "NotReplicated",
    "SessionWriter",
    "card_event",
    "to_session_event",
]


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


class NotReplicated(redis.TimeoutError):
    """Fewer replicas than asked confirmed a batch's writes in time (``WAIT``): the batch
    is not acknowledged and is applied again (harmless, idempotent)."""


class SessionWriter:
    """Applies batches of events to Redis: one pipelined round trip per batch (on a
    Redis Cluster one pipeline per node, all written before any is read).

    With ``wait_replicas`` > 0 each batch also waits (``WAIT``, on every node it wrote)
    until that many replicas hold its writes, at most ``wait_timeout_ms``; fewer raises
    :class:`NotReplicated`. Replication is asynchronous, so without it a primary that
    dies right after a batch can take the batch's effect with it although the events
    were acknowledged; with it, a failover to a confirmed replica loses nothing.
    """

    def __init__(
        self,
        client: Any,
        allowed_lateness_s: float,
        ttl_s: float | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.client = client
        self.limits = SessionLimits(allowed_lateness_s, ttl_s)
        self.wait_replicas, self.wait_timeout_ms = wait_replicas, wait_timeout_ms
        self.script = client.register_script(APPLY_LUA)  # for apply_unpipelined
        self.horizon_s = allowed_lateness_s + D.HORIZON_S
        self._cluster = isinstance(client, RedisCluster)  # one call per slot

    def _args(self, events: Sequence[SessionEvent]) -> list[str | int]:
        return self.limits.args(events)

    def apply(
        self, events: Sequence[CardEvent], rows: Sequence[Mapping[str, Any]] | None = None
    ) -> ApplyResult:
        """Apply (card_id, event) pairs (any order, duplicates allowed) in one round trip,
        and ``rows`` (the same transactions' fields,
        :func:`fraud_scoring.declared.transaction_row`) to the declared aggregations' keys
        in the same round trip (None: none).

        Raises ``redis.RedisError`` (or, on a cluster, ``RedisClusterException``) when
        Redis fails; then some cards may already be updated, and applying the same batch
        again is safe. A server without the script (restarted, flushed, or a replica
        just promoted: scripts are not replicated) is sent it and the batch again.
        """
        by_card: dict[str, list[SessionEvent]] = defaultdict(list)
        for card, e in events:
            by_card[card].append(e)
        if not by_card:
            return ApplyResult()
        ts = [e.ts_us for _, e in events]
        replies, n, waits = self._send(by_card, rows or [], ts)
        if any(isinstance(r, NoScriptError) for r in replies):
            for script in (*SESSION_SCRIPTS, *D.SCRIPTS):  # on a cluster: on every primary
                self.client.script_load(script)
            replies, n, waits = self._send(by_card, rows or [], ts)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        for confirmed in replies[len(replies) - waits :]:
            if int(confirmed) < self.wait_replicas:
                raise NotReplicated(
                    f"{confirmed} of {self.wait_replicas} replicas confirmed the batch "
                    f"within {self.wait_timeout_ms} ms"
                )
        per_card = replies[:n] if self._cluster else replies[0]
        total = ApplyResult()
        for added, dup, late, dropped in per_card:
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total

    def _send(
        self,
        by_card: dict[str, list[SessionEvent]],
        rows: Sequence[Mapping[str, Any]],
        ts_us: Sequence[int],
    ) -> tuple[list[Any], int, int]:
        """One pipeline: the cards' script call (on a cluster one per card), one per
        declared state (on a cluster one per key), then a WAIT per written node. Returns
        the replies, how many are the cards' (the first) and how many the WAITs' (the
        last)."""
        pipe = self.client.pipeline(transaction=False)
        n_cards = queue_apply_many(pipe, by_card, self.limits, per_card=self._cluster)
        if rows:
            D.queue_batch(
                pipe,
                declarations(),
                rows,
                ts_us,
                [True] * len(rows),
                self.horizon_s,
                per_key=self._cluster,
                read=False,
            )
        n_before_wait = len(pipe)
        if self.wait_replicas:
            wait = ("WAIT", self.wait_replicas, self.wait_timeout_ms)
            if self._cluster:
                nodes = {}
                for card in by_card:
                    node = self.client.get_node_from_key(events_key(card))
                    nodes[node.name] = node
                for node in nodes.values():  # after that node's writes in its pipeline
                    pipe.execute_command(*wait, target_nodes=node)
            else:
                pipe.execute_command(*wait)
        waits = len(pipe) - n_before_wait
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies, n_cards, waits

    def apply_unpipelined(self, events: Sequence[CardEvent]) -> ApplyResult:
        """Baseline for the benchmark: one script call (one round trip) per event."""
        total = ApplyResult()
        for card, e in events:
            added, dup, late, dropped = self.script(
                keys=[events_key(card), ids_key(card)], args=self._args([e])
            )
            total += ApplyResult(int(added), int(dup), int(late), int(dropped))
        return total
