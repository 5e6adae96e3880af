"""Scoring one micro-batch of transactions, top to bottom:

read (features and the ids' claims in one pipelined round trip, the transactions'
recording sent after it: :mod:`service.core.round_trip`, which :class:`Scorer` extends) →
assemble (every feature column, then the vector in the model's order) → predict (ONNX
Runtime, off the event loop) → route (the challenger's canary) → decide (the policy and
the rules) → observe (drift, decision log); one method each in :meth:`Scorer.score_batch`.
The decisions are given once the batch's writes are confirmed.

The dynamic batcher calls :meth:`Scorer.score_batch` with whatever micro-batch it formed;
the naive path (batching off) calls it with one transaction per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from fraud_scoring import features as F
from fraud_scoring import rules as R
from fraud_scoring.events import Transaction
from service.core import idempotency
from service.core.challenger import Challenger
from service.core.decision import (
    NO_CARD_HISTORY,
    STALE_CARD_HISTORY,
    Policy,
    Verdicts,
    declared_reasons,
    degraded_reason,
    features_read,
    fired,
    indicators,
    model_reason,
    rules_only_rules,
)
from service.core.model import LoadedModel, ModelHolder
from service.core.online_features import OnlineFeatureReader
from service.core.results import (
    OnScored,
    OnShadow,
    ScoreRequest,
    ScoreResult,
    StageClock,
)
from service.core.round_trip import (
    STORE_OR_TIMEOUT,
    Pending,
    StoreRoundTrip,
    id_reused,
)
from service.core.rules import RulesHolder
from service.core.store_health import (
    FeatureStoreUnavailable,
    NoBatchFeatures,
    StoreHealth,
)
from service.core.turns import Turns
from service.settings import ServiceSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Route:
    """The challenger's part in a micro-batch (service/core/challenger.py): none loaded,
    loaded but not run yet (shadow later), or run (``scores``; ``canary`` marks the rows
    it decides)."""

    challenger: LoadedModel | None = None
    matrix: np.ndarray | None = None
    scores: np.ndarray | None = None
    canary: np.ndarray | None = None


def policy_for(model: LoadedModel, settings: ServiceSettings, *, overrides: bool = True) -> Policy:
    """The decision policy for ``model``: its own thresholds, or the settings' threshold
    overrides when ``overrides`` (the serving model; a challenger keeps its own)."""
    th = model.meta.thresholds_for(model.variant)
    return Policy(
        review_threshold=settings.review_threshold
        if overrides and settings.review_threshold is not None
        else th.review,
        decline_threshold=settings.decline_threshold
        if overrides and settings.decline_threshold is not None
        else th.decline,
        review_amount_limit=settings.review_amount_limit,
        importance=model.meta.feature_importance,
    )


@functools.cache
def card_snapshot_probe() -> str | None:
    """A feature of the card's snapshot view (entity ``card_id``): missing or stale, the
    card has no usable batch history (reason ``NO_CARD_HISTORY``). None: no such view."""
    views = [v for v in F.views() if v.join_key == "card_id" and v.features]
    return views[0].features[0].name if views else None


class Scorer(StoreRoundTrip):
    def __init__(
        self,
        redis: Any,
        reader: OnlineFeatureReader,
        models: ModelHolder,
        settings: ServiceSettings,
        pool: ThreadPoolExecutor,
        on_scored: OnScored | None = None,
        health: StoreHealth | None = None,
        challenger: Challenger | None = None,
        on_shadow: OnShadow | None = None,
        rules: RulesHolder | None = None,
    ) -> None:
        # The decision rules (service/core/rules.py); without a holder, the configured file.
        rules = rules if rules is not None else RulesHolder.of(settings)
        super().__init__(redis, reader, models, settings, health, challenger, rules)
        self.on_scored = on_scored
        self.on_shadow = on_shadow
        self.pool = pool
        self._keeping: set[asyncio.Task[None]] = set()

    def _rules_only(
        self,
        txns: Sequence[Transaction],
        cols: dict[str, np.ndarray] | None,
        cause: str,
        t0: float,
    ) -> list[ScoreResult]:
        """Degraded decisions: the active rules whose inputs are available (the request's
        fields and, when read (``cols``), the session features; never the score nor a
        list) and the declared reasons over streaming features. Handed to ``on_scored``
        like every decision, with the rules' inputs as the vector (the decision log
        records them; drift skips them)."""
        ruleset = self.rules.current
        limit = self.settings.review_amount_limit
        inds = [i for i in indicators() if i.rules]
        have = set(cols) if cols is not None else set()
        applied = rules_only_rules(ruleset, have)
        # The rules' inputs that were read: one matrix, the rules' and the log's.
        wanted = dict.fromkeys(
            [*(f for i in inds for f in i.reads), *(f for r in applied for f in r.numbers)]
        )
        names = [n for n in wanted if n in have and n not in ("amount", "review_amount_limit")]
        x = np.zeros((len(txns), len(names)))
        for j, n in enumerate(names):
            x[:, j] = cols[n]  # type: ignore[index]  # names is empty without cols
        given: dict[str, Any] = {n: x[:, j] for j, n in enumerate(names)}
        given["amount"] = np.array([t.amount for t in txns], dtype=np.float64)
        fires = fired(given, len(txns), rules=True)
        strings = R.string_columns(txns, ruleset.string_fields)
        inputs = {**given, "review_amount_limit": limit}
        masks = ruleset.masks(inputs, strings, {}, len(txns), applied)
        verdicts = Verdicts(applied, masks, len(txns))
        out = []
        for i, t in enumerate(txns):
            sess = dict(zip(names, x[i].tolist(), strict=True))
            values = {**sess, "amount": t.amount, "review_amount_limit": limit}
            values |= {f: v[i] for f, v in strings.items()}
            head = [degraded_reason(bool(sess))]
            tail = [ind.reason(values) for ind in fires[i]]
            v = verdicts.row(i, values, (), tail)
            decision = v.decision
            if decision == "approve" and tail and v.decided_by == "model":
                decision = "review"  # a declared reason over streaming features: review
            out.append(
                ScoreResult(
                    transaction_id=t.transaction_id,
                    decision=decision,
                    score=None,
                    reasons=[*head, *v.reasons],
                    model_version="rules-only",
                    missing=[],
                    stale=[],
                    degraded=cause,
                    decided_by="rule" if v.decided_by == "model" else v.decided_by,
                    rules_version=ruleset.version,
                    fired_rules=v.fired,
                    shadow_rules=v.shadow,
                )
            )
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        for r in out:
            r.timing_ms = {
                "feature_read": elapsed_ms,
                "inference": 0.0,
                "decision": 0.0,
                "batch_size": float(len(txns)),
            }
        if self.on_scored is not None:
            self.on_scored(txns, x, names, out)
        return out

    async def score_requests(self, items: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """:meth:`score_batch` for the micro-batcher's items."""
        return await self.score_batch([i.txn for i in items], [i.record for i in items])

    async def score_batch(
        self, txns: Sequence[Transaction], record: Sequence[bool] | None = None
    ) -> list[ScoreResult]:
        """Decisions for one micro-batch, in input order; ``record`` as in
        :meth:`read_features`. Raises Rejected(no_model) when no model is loaded. When the
        store is unreachable (FeatureStoreUnavailable) or holds no batch features
        (NoBatchFeatures), ``settings.degraded_policy`` 'refuse' raises, 'rules' returns
        rules-only decisions (:func:`service.core.decision.rules_only`, ``degraded`` set).

        The steps, one call each: read → assemble → predict → route → decide → observe.
        The server runs the batch's writes while the model and the policy run here; the
        decisions are given once the writes are confirmed (a failed write fails the
        batch's round trip, as before it was split)."""
        clock = StageClock()
        refuse = self.settings.degraded_policy == "refuse"
        turn = self._turns.take()  # before any await: turns go in the order batches form
        pending: Pending | None = None
        try:
            (cols, missing, stale, inexact), pending, claims = await self._read(
                txns, record, turn, claim=True
            )
        except FeatureStoreUnavailable:
            if refuse:
                raise
            return self._rules_only(txns, None, "feature_store", clock.t0)
        finally:
            if pending is None:
                Turns.done(turn)  # a batch that failed or was cancelled passes it on too
        try:
            # The markers this read carried: an emptied or un-backfilled store is refused
            # (or decided by rules) from its first read, and served again from the first
            # read after the batch job.
            absent = (
                [*(self.health.absent_views or []), *self.health.absent_states]
                if (self.health is not None)
                else []
            )
            if absent and refuse:
                raise NoBatchFeatures(absent)
            clock.mark("feature_read")
            if absent:
                decided = None
            else:
                model = self.models.require()  # one model for the batch, even during a swap
                x = F.assemble(model.meta.feature_names, cols)
                scores = await self._predict(model, x)
                route = await self._route(txns, model, x, cols)
                clock.mark("inference")
                out = self._decide(txns, model, scores, route, missing, stale, cols)
                for i, names in inexact.items():  # a model input that is not exact: degraded
                    out[i].inexact = names
                clock.mark("decision")
                decided = (model, x, route, out)
            waited = time.perf_counter()
            await self._written(pending)
        except FeatureStoreUnavailable:  # the writes failed: the round trip did
            if refuse:
                raise
            return self._rules_only(txns, None, "feature_store", clock.t0)
        finally:
            pending.release()  # a batch that failed here passes the turn on all the same
        if decided is None:
            return self._rules_only(txns, cols, "no_batch_features", clock.t0)
        model, x, route, out = decided
        # Waiting for the writes is the store round trip's time (the feature_read stage).
        clock.ms["feature_read"] += (time.perf_counter() - waited) * 1e3
        clock.stamp(out, len(txns))
        if claims is not None:
            out = self._settle(out, claims)
        self._observe(txns, model, x, cols, route, out)
        return out

    def _settle(
        self, out: list[ScoreResult], claims: list[idempotency.Claimed | None]
    ) -> list[ScoreResult]:
        """Retries get their original answer (or, before it is stored, this one, marked
        a repeat); reused ids their refusal; new claims keep their answer for retries
        (written after the answers, off the answer's path)."""
        settled, ids, contents, answers = [], [], [], []
        for r, c in zip(out, claims, strict=True):
            if c is None:
                settled.append(r)
            elif c.claim.reused is not None:
                id_reused().inc()
                settled.append(dataclasses.replace(r, refused=c.claim.reused))
            elif not c.claim.new:
                if c.claim.answer is None:
                    settled.append(dataclasses.replace(r, repeat=True))
                else:  # the original answer, with this batch's timings
                    again = ScoreResult.repeated(r.transaction_id, c.claim.answer)
                    settled.append(
                        dataclasses.replace(again, timing_ms=r.timing_ms, spans_ns=r.spans_ns)
                    )
            else:
                settled.append(r)
                ids.append(r.transaction_id)
                contents.append(c.content)
                answers.append(r.answer())
        if ids:
            task = asyncio.get_running_loop().create_task(self._keep(ids, contents, answers))
            self._keeping.add(task)
            task.add_done_callback(self._keeping.discard)
        return settled

    async def _keep(self, ids: list[str], contents: list[str], answers: list[Any]) -> None:
        pipe = self._pipeline()
        idempotency.queue_answers(pipe, ids, contents, answers)
        try:
            async with asyncio.timeout(self.settings.redis_timeout_s):
                await self._execute(pipe)
        except STORE_OR_TIMEOUT as exc:  # a retry is then scored again, recording nothing
            log.warning("keeping answers for retries failed: %s", exc)

    async def _predict(self, model: LoadedModel, x: np.ndarray) -> np.ndarray:
        """The champion's scores: inline for small CPU batches (cheaper than the thread
        handoff, see settings), else on the executor's pool, off the event loop."""
        if len(x) <= self.settings.inline_inference_max_batch and not model.on_gpu:
            return model.predict(x)
        return await asyncio.get_running_loop().run_in_executor(self.pool, model.predict, x)

    async def _route(
        self,
        txns: Sequence[Transaction],
        model: LoadedModel,
        x: np.ndarray,
        cols: dict[str, np.ndarray],
    ) -> _Route:
        """Which rows the challenger decides (canary). A routed card waits for its
        decider: the challenger runs now, on the whole batch (its shadow scores come with
        it). Failed or late: the champion decides every row."""
        if self.challenger is None or (ch := self.challenger.current) is None:
            return _Route()
        canary = self.challenger.canary([t.card_id for t in txns])
        if canary is None:
            return _Route(ch)
        ch_x = self._challenger_matrix(ch, model, x, cols)
        ch_scores = await self.challenger.run(ch, ch_x)
        if ch_scores is None:
            return _Route(ch, ch_x)
        return _Route(ch, ch_x, ch_scores, canary)

    def _decide(
        self,
        txns: Sequence[Transaction],
        model: LoadedModel,
        scores: np.ndarray,
        route: _Route,
        missing: list[list[str]],
        stale: list[list[str]],
        cols: dict[str, np.ndarray],
    ) -> list[ScoreResult]:
        """The decision of each row by the rules and the thresholds of the model that
        decides it (:class:`service.core.decision.Verdicts`, one pass over the batch), and
        its result."""
        ch, canary = route.challenger, route.canary
        policy = policy_for(model, self.settings)
        ch_policy = (
            policy_for(ch, self.settings, overrides=False)
            if ch is not None and canary is not None
            else policy
        )
        n = len(txns)
        champion = scores.tolist()
        challenger = route.scores.tolist() if route.scores is not None else None
        routed = (
            np.asarray(canary, dtype=bool)
            if canary is not None and challenger is not None
            else np.zeros(n, dtype=bool)
        )
        decider = np.where(routed, route.scores, scores) if route.scores is not None else scores
        ruleset = self.rules.current
        strings = R.string_columns(txns, ruleset.string_fields)
        numbers: dict[str, Any] = {**cols, "score": decider}
        numbers["review_amount_limit"] = policy.review_amount_limit
        verdicts = Verdicts(
            ruleset.rules,
            ruleset.masks(numbers, strings, cols, n),
            n,
            decider,
            np.where(routed, ch_policy.review_threshold, policy.review_threshold),
            np.where(routed, ch_policy.decline_threshold, policy.decline_threshold),
        )
        # Python scalars, converted once per batch: the messages read a few features.
        wanted = features_read() | ruleset.features
        read = {n: cols[n].tolist() for n in wanted if n in cols}
        fires = fired(cols, n)
        probe = card_snapshot_probe()
        out = []
        for i, t in enumerate(txns):
            row = {n: v[i] for n, v in read.items()}
            r = bool(routed[i])
            score = challenger[i] if r and challenger is not None else champion[i]
            p = ch_policy if r else policy
            card = (
                [NO_CARD_HISTORY]
                if probe is not None and probe in missing[i]
                else [STALE_CARD_HISTORY]
                if probe is not None and probe in stale[i]
                else []
            )
            tail = card + declared_reasons(fires[i], row, p)
            if verdicts.hit[i]:
                row |= {"score": score, "review_amount_limit": p.review_amount_limit}
                row |= {f: v[i] for f, v in strings.items()}
            v = verdicts.row(i, row, model_reason(score, p), tail)
            out.append(
                ScoreResult(
                    transaction_id=t.transaction_id,
                    decision=v.decision,
                    score=score,
                    reasons=v.reasons,
                    model_version=ch.version if r and ch is not None else model.version,
                    missing=missing[i],
                    stale=stale[i],
                    routed_to="challenger" if r else "champion",
                    champion_version=model.version,
                    champion_score=champion[i],
                    challenger_version=ch.version
                    if ch is not None and challenger is not None
                    else None,
                    challenger_score=challenger[i] if challenger is not None else None,
                    decided_by=v.decided_by,
                    rules_version=ruleset.version,
                    fired_rules=v.fired,
                    shadow_rules=v.shadow,
                )
            )
        return out

    def _observe(
        self,
        txns: Sequence[Transaction],
        model: LoadedModel,
        x: np.ndarray,
        cols: dict[str, np.ndarray],
        route: _Route,
        out: list[ScoreResult],
    ) -> None:
        """Hand the batch to the sinks (drift, decision log) at once; when the
        challenger has not run yet, its shadow run follows the answers and its scores go
        to ``on_shadow`` (only the decision log takes them: without one, no shadow run).
        The decisions are in the log's spool before the answers either way."""
        if self.on_scored is None:
            return
        ch, ch_x = route.challenger, route.matrix
        shadow = self.settings.decision_log != "off" and self.on_shadow is not None
        if ch is not None and ch_x is None and self.challenger is not None and shadow:
            self._log(txns, x, model, None, None, out, shadow=True)
            self.challenger.later(self._shadow(ch, model, x, cols, out))
        else:
            self._log(txns, x, model, ch_x, ch, out)

    @staticmethod
    def _challenger_matrix(
        ch: LoadedModel, model: LoadedModel, x: np.ndarray, cols: dict[str, np.ndarray]
    ) -> np.ndarray:
        """The challenger's input: the champion's own matrix when both list the same
        features, else one assembled in the challenger's order from the same columns
        (its features are producible: checked at load)."""
        if ch.meta.feature_names == model.meta.feature_names:
            return x
        return F.assemble(ch.meta.feature_names, cols)

    async def _shadow(
        self,
        ch: LoadedModel,
        model: LoadedModel,
        x: np.ndarray,
        cols: dict[str, np.ndarray],
        out: list[ScoreResult],
    ) -> None:
        """After the answers: the challenger's scores on the batch, to ``on_shadow``
        (copies of the results: the answers already went out with the originals; the
        results as they are when the run is dropped)."""
        assert self.challenger is not None and self.on_shadow is not None
        scores = None
        try:
            scores = await self.challenger.run(ch, self._challenger_matrix(ch, model, x, cols))
        finally:  # also when cancelled at shutdown: the log ships the decisions as they are
            if scores is not None:
                out = [
                    dataclasses.replace(r, challenger_version=ch.version, challenger_score=float(s))
                    for r, s in zip(out, scores, strict=True)
                ]
            self.on_shadow(out)

    def _log(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        model: LoadedModel,
        ch_x: np.ndarray | None,
        ch: LoadedModel | None,
        out: Sequence[ScoreResult],
        shadow: bool = False,
    ) -> None:
        """Hand the batch to ``on_scored``, each row with the vector of the model that
        decided it (the champion's rows and the canary's rows as two calls)."""
        assert self.on_scored is not None
        routed = [i for i, r in enumerate(out) if r.routed_to == "challenger"]
        if not routed or ch is None or ch_x is None:
            self.on_scored(txns, x, model.meta.feature_names, out, shadow)
            return
        kept = [i for i, r in enumerate(out) if r.routed_to != "challenger"]
        for rows, m, names in (
            (kept, x, model.meta.feature_names),
            (routed, ch_x, ch.meta.feature_names),
        ):
            if rows:
                self.on_scored([txns[i] for i in rows], m[rows], names, [out[i] for i in rows])
