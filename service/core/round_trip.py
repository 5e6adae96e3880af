"""A micro-batch's store round trip, the scorer's read side: the batch features, the
declared keys and the lists read in one pipelined round trip bounded by
``FRAUD_REDIS_TIMEOUT_S`` (on a Redis Cluster one pipeline per node, sent at once), with
the ids' claims (service/core/idempotency.py); then, on the same connection once those
replies are in, the transactions' recording, which runs on the server while the batch is
parsed, scored and decided (a server answers a pipeline only after running all of it).
:class:`StoreRoundTrip` is the part of :class:`service.core.scoring.Scorer` that talks to
the store; the decisions are in scoring.py.

**Read-your-writes.** The scoring request is the first place a transaction is seen, so
each scored transaction joins its card's history and every declared state as part of
scoring: after the batch's reads, the same connection carries the updater's own scripts
(:data:`fraud_scoring.session.APPLY_LUA` for the card's history,
:data:`fraud_scoring.declared.APPLY_LUA` for the declared keys; idempotent on
``transaction_id``), so the next attempt of a burst counts it even while the event log
lags, and the updater's later copy is a duplicate. A transaction never counts in its own
features (its read is queued before the write, and counts only what is before its time).
Attempts of one key in the *same* micro-batch see each other in event-time order
(:func:`fraud_scoring.declared.columnar.parse_batch`). Off with ``FRAUD_RECORD_SCORED=false`` or
per request (``X-Fraud-Record: false``, for what-if and replay calls). A live
transaction stamped more than ``FRAUD_MAX_FUTURE_SKEW_S`` ahead of this host's clock is
refused at the door (service/edge/routes.py), as the updater dead-letters it; one far in
the past is dropped by the script itself without trimming the card's real history (see
``streaming/state.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import NoScriptError

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring import rules as R
from fraud_scoring import session
from fraud_scoring.declared import columnar as C
from fraud_scoring.events import Transaction
from fraud_scoring.redis_clients import STORE_ERRORS, HeldConnections, Rest, is_cluster_pipeline
from service.core import idempotency, lists
from service.core.challenger import Challenger
from service.core.decision import features_read
from service.core.in_flight import Batch, Commands, Layout, Pending, PipelineRest
from service.core.model import LoadedModel, ModelHolder
from service.core.online_features import OnlineFeatureReader
from service.core.rules import RulesHolder
from service.core.store_health import FeatureStoreUnavailable, StoreHealth, write_refused
from service.core.turns import Turns
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

# A failed store call, or one past FRAUD_REDIS_TIMEOUT_S (the scorer's own bound).
STORE_OR_TIMEOUT: tuple[type[Exception], ...] = (*STORE_ERRORS, TimeoutError)


# Declared keys accept an event up to this long behind their newest (plus the allowed
# lateness); the updater uses the same (streaming/state.py).
DECLARED_HORIZON_S = D.HORIZON_S


@functools.cache
def _inexact_declared() -> Counter:
    """Declared-feature reads that were not exact: the transaction lay NEWEST or more
    events behind its key's present (a replay; see fraud_scoring/declared.py)."""
    return Counter(
        "fraud_declared_reads_inexact", "Declared-feature reads that were not exact (replays)"
    )


@functools.cache
def _writes_refused() -> Counter:
    return Counter(
        "fraud_store_writes_refused_total",
        "Writes the online store refused (OOM at maxmemory, READONLY): the id claims or "
        "the recording of scored transactions; the decisions stand, not recorded.",
        ["what"],
    )


@functools.cache
def _backdated() -> Counter:
    """Transactions stamped earlier than their card's newest recorded event: read and
    recorded at their effective time instead (fraud_scoring.session.effective_us)."""
    return Counter(
        "fraud_backdated_transactions",
        "Transactions stamped before their card's newest recorded event (moved after it)",
    )


@functools.cache
def id_reused() -> Counter:
    return Counter(
        "fraud_id_reused", "Requests refused 409: their transaction_id was used for another"
    )


# A micro-batch's features: the columns, per row the missing and stale batch features,
# and per row with any the declared features not read exactly.
_Features = tuple[dict[str, np.ndarray], list[list[str]], list[list[str]], dict[int, list[str]]]


def declared_reads(
    decl: D.Declarations, models: set[str], reasons: Iterable[str]
) -> tuple[tuple[D.Spec, ...], tuple[D.Spec, ...]]:
    """The declared states the scorer reads for the features ``models`` read and those
    the declared reasons read (``reasons``), derived features followed to what they read;
    and those of them that must be backfilled before serving: the models' only (a reason
    added with a new state does not stop serving)."""
    for_models = decl.needed(models)
    needed = for_models | decl.needed(set(reasons))
    specs = tuple(s for s in decl.specs if needed & set(s.feature_names()))
    return specs, tuple(s for s in specs if for_models & set(s.feature_names()))


class StoreRoundTrip:
    """The store side of a scorer: a micro-batch's round trip (:meth:`_read`, then
    :meth:`_written`), the declared states it reads (:meth:`_declared_read`) and the
    scripts it loads."""

    def __init__(
        self,
        redis: Any,
        reader: OnlineFeatureReader,
        models: ModelHolder,
        settings: ServiceSettings,
        health: StoreHealth | None,
        challenger: Challenger | None,
        rules: RulesHolder,
    ) -> None:
        self.redis = redis
        self.reader = reader
        self.models = models
        self.settings = settings
        self.health = health
        self.challenger = challenger
        self.rules = rules
        self.limits = session.SessionLimits(settings.allowed_lateness_s)
        self._held = HeldConnections(redis) if isinstance(redis, aioredis.Redis) else None
        # Exported at 0 from the start: alerts on rate() see the first event.
        _backdated(), _inexact_declared(), id_reused()
        for what in ("claim", "record"):
            _writes_refused().labels(what=what)
        self._turns = Turns()
        C.warm(F.declarations())  # the kernels compiled now, not in the first request
        self._declared_for: tuple[
            LoadedModel | None, LoadedModel | None, D.Declarations, R.RuleSet | None
        ] = (None, None, D.EMPTY, None)

    def _to_record(self, txns: Sequence[Transaction], record: Sequence[bool] | None) -> list[bool]:
        """Per transaction, whether it joins the session and declared state: asked to be
        recorded and not stamped too far into the future (the updater's bound; the HTTP
        door refuses such a live transaction, so this only guards other callers)."""
        if not self.settings.record_scored:
            return [False] * len(txns)
        latest_us = session.to_us(time.time() + self.settings.max_future_skew_s)
        return [
            (record is None or record[i]) and session.to_us(t.event_time) <= latest_us
            for i, t in enumerate(txns)
        ]

    async def read_features(
        self,
        txns: Sequence[Transaction],
        record: Sequence[bool] | None = None,
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]] | None = None,
    ) -> tuple[dict[str, np.ndarray], list[list[str]], list[list[str]], dict[int, list[str]]]:
        """All feature columns (batch, declared, request and derived) for ``txns``, the
        missing and stale batch features per row, and per row with any the declared
        features whose read was not exact (a replay behind its key's present),
        assembled by :func:`fraud_scoring.features.build_features`,
        in one round trip that also records the transactions (``record[i]`` False: not
        that one; None: all). ``turn`` (:class:`Turns`): the round trip waits for the
        previous batch's and passes the turn on once its writes are done."""
        got, pending, _ = await self._read(txns, record, turn, claim=False)
        await self._written(pending)
        return got

    async def _read(
        self,
        txns: Sequence[Transaction],
        record: Sequence[bool] | None,
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]] | None,
        *,
        claim: bool,
    ) -> tuple[_Features, Pending, list[idempotency.Claimed | None] | None]:
        """:meth:`read_features`, returning once the reads' replies are in and parsed,
        with the batch's writes still running on the server (:class:`Pending`:
        :meth:`_written` waits for them and passes the turn on). ``claim``: the same round
        trip claims the ids of the transactions it records (:func:`idempotency.claimed`; returned,
        None when nothing was claimed), and only those it records. A batch whose features
        need the writes' replies (attempts of one key in it) waits for them first."""
        if self.health is not None:
            self.health.admit()  # an open breaker answers now, not after a timeout
        turn = turn if turn is not None else self._turns.take()
        try:
            follow = await Turns.wait(turn[0])
            pending, claims = await self._round_trip(txns, record, turn, claim, follow=follow)
            head, lay = pending.head, pending.lay
            if any(isinstance(r, NoScriptError) for r in head[lay.markers : lay.reads_end]):
                # The server lost the scripts (restart, flush): load them and run the batch
                # again (its writes are idempotent; its claims are its own now).
                await self._settled(pending)
                await self._load_scripts()
                pending, claims = await self._round_trip(txns, record, turn, claim, again=claims)
                head, lay = pending.head, pending.lay
        except BaseException:
            Turns.done(turn)
            raise
        batch = pending.batch
        try:
            if self.health is not None:
                self.health.succeeded()
            for r in head[: lay.reads_end]:
                if isinstance(r, Exception):
                    log.warning("feature read failed: %s", r)
                    raise FeatureStoreUnavailable("feature store unavailable: a read failed")
            if self.health is not None:
                self.health.observed(head[: lay.markers], lay.states)
            writes = None
            if C.needs_writes(lay.plan):  # attempts of one key see each other
                writes = lay.declared_writes(await self._written(pending))
            rows = self.reader.parse(head[lay.markers : lay.reader], batch.txns)
            read = C.parse_batch(
                lay.plan, head[lay.declared_start : lay.reads_end], writes, batch.ts_us
            )
        except BaseException:
            pending.release()
            raise
        if read.inexact_reads:
            _inexact_declared().inc(read.inexact_reads)
        txns = batch.txns
        request = F.RequestColumns(
            amount=[t.amount for t in txns],
            event_us=batch.ts_us,
            utc_offset_s=[t.utc_offset_s for t in txns],
            country=[t.country for t in txns],
            channel=[t.channel for t in txns],
            has_device=[t.device_id is not None for t in txns],
            fields={n: [getattr(t, n, None) for t in txns] for n in self._field_reads()},
        )
        cols = F.build_features(rows.columns, request, read.columns)
        cols.update(lists.members(lay.list_reads, head[lay.reader : lay.declared_start]))
        return (cols, rows.missing, rows.stale, read.inexact), pending, claims

    def _field_reads(self) -> tuple[str, ...]:
        """The declared number fields the derived features, the reasons and the serving
        rules read: the request columns passed beside the contract's (none unless the
        declarations have number fields)."""
        decl = F.declarations()
        if not decl.number_fields:
            return ()
        ruled = self.rules.current.features.intersection(decl.number_fields)
        return (*decl.field_reads, *sorted(ruled.difference(decl.field_reads)))

    async def _written(self, pending: Pending) -> list[Any]:
        """Wait for a round trip's writes (bounded by what is left of its deadline), check
        them and pass the turn on; returns all the round trip's replies. Their failure is
        the round trip's (FeatureStoreUnavailable); a store that refuses writes (full)
        still decides, not recorded; a server that lost the scripts gets them and the
        writes again."""
        if pending.replies is not None:
            return pending.replies
        try:
            tail = await self._settled(pending)
            lay = pending.lay
            if any(isinstance(r, NoScriptError) for r in lay.declared_writes(pending.head + tail)):
                # The server lost the scripts between the reads and the writes: load them
                # and send the writes again (idempotent; a batch that went after the
                # failed ones may have missed them: once, after a restart or a flush).
                await self._load_scripts()
                again, _ = self._queue_writes(pending.batch, lay.plan, self._declared_read())
                tail = await self._bounded(again, "recording")
            pending.replies = replies = pending.head + tail
        finally:
            pending.release()
        writes = [*replies[lay.reads_end : lay.session_end], *lay.declared_writes(replies)]
        if refused := [r for r in writes if write_refused(r)]:
            self._refused("record", refused[0], len(refused))
        elif writes and self.health is not None:
            self.health.write_succeeded()
        if pending.batch.by_card and not refused:
            await self._recorded(pending.batch.by_card, replies[lay.reads_end : lay.session_end])
        return replies

    async def _settled(self, pending: Pending) -> list[Any]:
        """The writes' replies of ``pending``'s round trip (read here, once); failed or
        late (past the round trip's deadline), FeatureStoreUnavailable."""
        pending.read = True  # read or failed: either way nobody reads them again
        try:
            async with asyncio.timeout_at(pending.deadline):
                return await pending.tail.replies()
        except STORE_OR_TIMEOUT as exc:
            log.warning("recording failed: %s", exc)
            if self.health is not None:
                self.health.failed()
            raise FeatureStoreUnavailable("feature store unavailable") from exc

    def _declared_read(self) -> D.Declarations:
        """The declared states the serving models read (champion and challenger): only
        those are read, and recorded for read-your-writes, here; the updater keeps them
        all. Without a model (tests reading features): all."""
        decl = F.declarations()
        champion = self.models.current
        if champion is None:
            return decl
        challenger = self.challenger.current if self.challenger is not None else None
        held = self._declared_for  # the models and rules change seldom: decide once each
        ruleset = self.rules.current
        if held[0] is not champion or held[1] is not challenger or held[3] is not ruleset:
            names = set(champion.meta.feature_names)
            if challenger is not None:
                names.update(challenger.meta.feature_names)
            specs, required = declared_reads(decl, names, features_read() | ruleset.features)
            self._declared_for = (
                champion,
                challenger,
                dataclasses.replace(decl, specs=specs),
                ruleset,
            )
            if self.health is not None:  # their markers are checked with the views'
                self.health.states = [
                    (f"declared state {s.id} ({', '.join(s.feature_names())})", s.backfilled_key())
                    for s in required
                ]
        return self._declared_for[2]

    async def _round_trip(
        self,
        txns: Sequence[Transaction],
        record: Sequence[bool] | None,
        turn: tuple[asyncio.Future[None] | None, asyncio.Future[None]],
        claim: bool,
        *,
        again: list[idempotency.Claimed | None] | None = None,
        follow: Rest | None = None,
    ) -> tuple[Pending, list[idempotency.Claimed | None] | None]:
        """The batch's round trip: the reads (batch features, declared keys, lists) and
        the claims, then, on the same connection once their replies are in, the writes
        (the card's history, the declared keys) of the transactions it records: a retry
        of an answered id or a reused one records nothing, and a backdated attempt
        records at its effective time (:func:`fraud_scoring.session.effective_times`).
        Returns once the reads' replies (errors in place) are in, with where each part
        lies and the writes' replies to come, and the claims (``again``: this batch's own,
        from a first try); a failed or late round trip is FeatureStoreUnavailable (and a
        failure for the breaker)."""
        pipe = self._pipeline()
        decl = self._declared_read()
        # The markers first: an emptied store is refused on this very read, not a
        # watcher's check later. On one server one MGET (its reply spliced back below);
        # on a Cluster they lie in other slots: one GET each.
        markers = self.health.all_markers() if self.health is not None else []
        together = len(markers) > 1 and not is_cluster_pipeline(pipe)
        if together:
            pipe.execute_command("MGET", *markers)
        else:
            for m in markers:
                pipe.execute_command("GET", m)
        spliced = len(markers) - 1 if together else 0  # replies the MGET's one stands for
        self.reader.queue(pipe, txns)
        n_reader = len(pipe) + spliced
        list_reads = lists.queue_reads(pipe, self.rules.current, txns)
        rows = D.transaction_rows(txns) if decl.specs else []
        ts_us = [session.to_us(t.event_time) for t in txns]
        plan = C.queue_reads(pipe, decl, D.BatchColumns(rows, ts_us if decl.specs else []))
        reads_end = len(pipe) + spliced
        recorded = self._to_record(txns, record)
        claiming = None
        if claim and again is None:
            claiming = idempotency.queue_claims(
                pipe,
                txns,
                recorded,
                self.settings.idempotency_ttl_s,
                bounded=self.settings.max_event_skew_s > 0,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.redis_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                head, then = await self._execute_then(pipe, follow, turn[0])
        except STORE_OR_TIMEOUT as exc:
            log.warning("feature read failed: %s", exc)
            if self.health is not None:
                self.health.failed()
            raise FeatureStoreUnavailable("feature store unavailable") from exc
        if together:  # the markers' values where their GETs' replies would lie
            got = head[0]
            head[:1] = [got] * len(markers) if isinstance(got, Exception) else got
        try:
            claims, newest = again, dict[str, int]()
            if claiming is not None:
                claims, newest, refused = idempotency.claimed(claiming, head[reads_end:], recorded)
                if refused:
                    self._refused("claim", refused[0], len(refused))
            if claims is not None:
                # A reused id records nothing, nor does a retry of an answered one. A retry
                # whose answer is not kept yet records again (idempotent on the id): its
                # first attempt may have died between the claim and the recording.
                recorded = [
                    c is not None
                    and c.claim.reused is None
                    and (c.claim.new or c.claim.answer is None)
                    for c in claims
                ]
            timed = list(txns)
            if claim and (skew := self.settings.max_event_skew_s) > 0:  # off: any order
                timed = session.effective_times(txns, recorded, newest, session.to_us(2 * skew))
                if moved := sum(a is not b for a, b in zip(timed, txns, strict=True)):
                    _backdated().inc(moved)
                recorded = self._to_record(timed, recorded)  # moved: still within the bound
            batch = Batch.of(timed, recorded, rows)
            writes, n_session = self._queue_writes(batch, plan, decl)
        except BaseException:
            then(self._pipeline()).abandon(0.0, lambda: None)  # the connection goes back
            raise
        tail = then(writes)  # sent now (one server), read after the batch's decisions
        if Turns.sent(turn, tail):  # the next batch may send its round trip behind them:
            await asyncio.sleep(0)  # let it, before this one parses and decides
        states = list(self.health.states) if self.health is not None else []
        lay = Layout(
            len(markers), n_reader, reads_end, reads_end + n_session, plan, states, list_reads
        )
        return Pending(lay, head[:reads_end], tail, deadline, turn, batch), claims

    async def _bounded(self, pipe: Any, what: str) -> list[Any]:
        """One round trip bounded by ``FRAUD_REDIS_TIMEOUT_S`` as a whole (the client has
        no per-reply socket timeout, service/resources.py: one timer per micro-batch);
        failed or late, it is FeatureStoreUnavailable and a failure for the breaker."""
        try:
            async with asyncio.timeout(self.settings.redis_timeout_s):
                return await self._execute(pipe)
        except STORE_OR_TIMEOUT as exc:
            # The cause (it names Redis's host:port) goes to the log, not to callers.
            log.warning("%s failed: %s", what, exc)
            if self.health is not None:
                self.health.failed()
            raise FeatureStoreUnavailable("feature store unavailable") from exc

    # One server: every command goes out on a held connection (HeldConnections, which
    # keep their connections out of the client's pool); a cluster: redis-py's pipeline,
    # split by node, and its script loading on every primary.
    def _pipeline(self) -> Any:
        return Commands() if self._held is not None else self.redis.pipeline(transaction=False)

    async def _execute(self, pipe: Any) -> list[Any]:
        if self._held is not None:
            return await self._held.round_trip(pipe)
        return list(await pipe.execute(raise_on_error=False))

    def _queue_writes(self, batch: Batch, plan: C.Plan, decl: D.Declarations) -> tuple[Any, int]:
        """A pipeline of the batch's writes: its cards' histories (how many commands:
        returned), then the declared states (``plan``'s writes)."""
        writes = self._pipeline()
        per_key = is_cluster_pipeline(writes)
        session.queue_apply_many(writes, batch.by_card, self.limits, per_card=per_key)
        n_session = len(writes)
        C.queue_writes(
            writes,
            plan,
            decl,
            batch.recorded if decl.specs else [],
            self.settings.allowed_lateness_s + DECLARED_HORIZON_S,
            cols=plan.cols.at_times(batch.ts_us if decl.specs else []),
            per_key=per_key,
        )
        return writes, n_session

    async def _execute_then(
        self,
        pipe: Any,
        follow: Rest | None = None,
        prev: asyncio.Future[None] | None = None,
    ) -> tuple[list[Any], Callable[[Any], Rest | PipelineRest]]:
        """:meth:`_execute`, and a function that sends more commands after these (on the
        same held connection, at once; on a Cluster, a pipeline of its own, sent when
        read) and returns their replies to come. It is called once on every path, and
        what it returns is read or abandoned once. ``follow``: the previous batch's writes
        to send behind, on their connection; when that is no longer possible, it waits
        for the previous batch's turn (``prev``) first."""
        if self._held is not None:
            followed = follow.follow(pipe) if follow is not None else None
            if followed is not None:
                replies, then = await followed.replies_then()
                return replies, then.send
            if follow is not None:
                await Turns.passed(prev)
            replies, then = await self._held.round_trip_then(pipe)
            return replies, then.send
        return list(await pipe.execute(raise_on_error=False)), PipelineRest

    async def _load(self, scripts: Sequence[str]) -> None:
        if self._held is None:
            for script in scripts:
                await self.redis.script_load(script)
            return
        for reply in await self._held.round_trip([("SCRIPT", "LOAD", s) for s in scripts]):
            if isinstance(reply, Exception):
                raise reply

    async def _load_scripts(self) -> None:
        try:
            async with asyncio.timeout(self.settings.redis_timeout_s):
                await self._load([*self.reader.scripts, *session.SCRIPTS, *D.SCRIPTS])
        except STORE_OR_TIMEOUT as exc:
            log.warning("loading the store's scripts failed: %s", exc)
            if self.health is not None:
                self.health.failed()
            raise FeatureStoreUnavailable("feature store unavailable") from exc

    async def _recorded(
        self, writes: dict[str, list[session.SessionEvent]], replies: Sequence[Any]
    ) -> None:
        """Check the writes' replies. A server that lost the script (restart, flush)
        answers NOSCRIPT: load it and write again (harmless, idempotent). A write that
        still fails is logged, not fatal: the decision stands on the reads, and the
        updater's copy of the event will arrive."""
        if any(isinstance(r, NoScriptError) for r in replies):
            try:
                async with asyncio.timeout(self.settings.redis_timeout_s):
                    await self._load(session.SCRIPTS)
                    pipe = self._pipeline()
                    cluster = is_cluster_pipeline(pipe)
                    session.queue_apply_many(pipe, writes, self.limits, per_card=cluster)
                    replies = await self._execute(pipe)
            except STORE_OR_TIMEOUT as exc:
                replies = [exc]
        for r in replies:
            if isinstance(r, Exception):
                log.warning("recording scored transactions in the card history failed: %s", r)
                return

    def _refused(self, what: str, reply: Any, n: int) -> None:
        """The store refused ``n`` writes of ``what``: counted; logged and shown on
        /readyz through the health (once per interval, not per micro-batch)."""
        _writes_refused().labels(what=what).inc(n)
        if self.health is not None:
            self.health.write_refused(what, reply, n)
        else:
            log.warning("the online store refused %d writes (%s): %s", n, what, reply)
