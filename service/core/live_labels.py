"""Labels that count when they arrive: the label states of a label the service receives.

A label sent to ``POST /v1/feedback`` (or marked on the review page) for a transaction the
service still holds (*matched*: its claim or its review item gives the transaction's
columns) is recorded in every declared state of ``source: labels`` at once, at its
arrival (or its transaction's time plus the state's delay, if later), with the same
script and limits as the daily batch (:func:`batch_jobs.declared_sql.record_labels`).
The feedback log keeps ``live: true`` with it; the compaction writes that into the
label's source row (``raw/label_sources``), so training counts the label from its
arrival too and the daily batch does not record it again
(``declared_sql.load_label_events``, ``batch.record_day_labels``). Without this a label
reached the states only with the next daily batch (the UTC midnight after its arrival).

Only a transaction's **first** label is recorded live, as training counts one event per
labelled transaction (its first label): ``fraud:labelled:{<id>}`` (``SET NX``) says
whether an earlier label was, and lives as long as a transaction can still be matched.
A later label of the transaction (another source) records nothing here; its row says
``live: false``. A label that arrived first through a file (``ingest``: the service
never saw it) and then through the API is counted at both arrivals online and once in
training. A store that fails part of the way leaves ``live: false`` (the batch records
the label again: states the live call had reached count it twice); an answer the log
could not take (503) must be sent again, as every 503: the retry finds its label
recorded and logs ``live: true``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from redis.exceptions import NoScriptError

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.redis_clients import STORE_ERRORS, is_cluster_pipeline

log = logging.getLogger(__name__)

# The value of a transaction's fraud:labelled key: its first label (``label``, the feedback
# log's key of it) is being recorded, was recorded (live), or was not (the batch will).
PENDING, RECORDED, NOT_RECORDED = "pending", "1", "0"
_FAILED: tuple[type[Exception], ...] = (*STORE_ERRORS, TimeoutError, OSError)


def labelled_key(transaction_id: str) -> str:
    return "fraud:labelled:{" + transaction_id + "}"


def label_states(decl: D.Declarations) -> list[D.Spec]:
    return [s for s in decl.specs if s.source == "labels"]


async def record_label(
    client: Any,
    transaction: Mapping[str, Any],
    is_fraud: bool,
    arrived_us: int,
    label: str,
    *,
    horizon_s: float,
    ttl_s: float,
    timeout_s: float,
) -> bool:
    """Record the label of ``transaction`` (its columns: the key columns, ``amount``,
    ``transaction_id`` and ``event_us``) that arrived at ``arrived_us`` in the label
    states, when it is the transaction's first; whether it is recorded, now or by an
    earlier call for the same label (``label``: its key in the feedback log, so a retry
    of the first label is told True, a later label False). Never raises for the store: a
    label that could not be recorded goes to the daily batch (False)."""
    specs = label_states(F.declarations())
    if not specs:
        return False
    tid = str(transaction["transaction_id"])
    key = labelled_key(tid)
    row = {
        **transaction,
        "is_fraud": 1.0 if is_fraud else 0.0,
        "source": "labels",
        "available_us": arrived_us,
    }
    try:
        async with asyncio.timeout(timeout_s):
            held = await client.set(
                key, f"{PENDING} {label}", nx=True, get=True, ex=max(1, round(ttl_s))
            )
            if held is not None:  # an earlier call took the first label: this one again?
                return bytes(held).decode() == f"{RECORDED} {label}"
            recorded = await _apply(client, specs, row, horizon_s)
            state = RECORDED if recorded else NOT_RECORDED
            await client.set(key, f"{state} {label}", xx=True, keepttl=True)
            return recorded
    except _FAILED as exc:
        log.warning("label of %s not recorded live (the batch will): %s", tid, exc)
        return False


async def _apply(client: Any, specs: list[D.Spec], row: dict[str, Any], horizon_s: float) -> bool:
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        per_key = is_cluster_pipeline(pipe)
        queued = 0
        for spec in specs:
            by_key = D.label_events_for(spec, [row])
            if by_key:
                D.queue_apply(
                    pipe, spec, by_key, D.Limits.for_spec(spec, horizon_s), per_key=per_key
                )
                queued += 1
        if not queued:  # outside every label state's filter: nothing to record
            return True
        replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
            for script in D.SCRIPTS:  # the server lost them (restart, flush)
                await client.script_load(script)
            continue
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            log.warning("label of %s not recorded live: %s", row["transaction_id"], failed[0])
        return not failed
    return False
