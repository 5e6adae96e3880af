"""Declared features (``fraud_scoring/declared.py``): the language refuses what it cannot
compile, naming the field; and for every declared aggregation, served (the real Redis
scripts, events shuffled, duplicated and late) = training (the generated DuckDB) = the
naive reference (``tests/declared_reference.py``), on one Redis and on a Cluster,
including a hot key with thousands of events."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import redis
import yaml
from redis.cluster import RedisCluster

from batch_jobs.declared_sql import (
    backfill_tiles,
    decision_events,
    label_events,
    record_labels,
    training_columns,
)
from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import EmbeddedCluster
from tests.declared_reference import derived_reference, reference

DECL = """
fields:
  - {name: ip_address, type: string}
  - {name: shipping_distance_km, type: number, min: 0}
  - {name: three_ds, type: category, values: [passed, failed, skipped]}
  - {name: is_prepaid, type: bool}
aggregations:
  - entity: ip_address
    windows: [10m, 1d]
    features: {count: ip_count, seconds_since_last: ip_since}
  - entity: card_id
    value: shipping_distance_km
    windows: [1h, 1d]
    features: {count: c_ship_count, mean: c_ship_mean, max: c_ship_max, last: c_ship_last}
  - entity: [ip_address, merchant_id]
    filter: {three_ds: [failed]}
    windows: [1h, 1d]
    features: {count: ipm_3ds_failed}
  - entity: card_id
    value: ip_address
    windows: [1d]
    features: {distinct_count: c_ips, changed: c_ip_changed}
  - entity: merchant_id
    value: log1p(shipping_distance_km)
    filter: {is_prepaid: [true]}
    windows: [1d]
    features: {sum: m_prepaid_ship_log}
  - entity: merchant_id
    value: amount
    windows: [1m, 10m, 1h, 1d, 7d]
    features: {count: m_count, sum: m_sum, mean: m_mean, std: m_std,
               seconds_since_last: m_since, last: m_last, min: m_min, max: m_max}
  - entity: [card_id, merchant_id]
    filter: {channel: [ecom, atm]}
    windows: [10m, 30d]
    features: {count: cm_count, seconds_since_last: cm_since}
  - entity: device_id
    value: amount
    windows: [1h]
    features: {mean: d_mean}
  - entity: card_id
    value: country
    windows: [1h, 1d]
    features: {distinct_count: c_countries, changed: c_country_changed}
  - entity: merchant_id
    value: device_id
    windows: [10m, 1h]
    features: {distinct_count: m_devices}
  - source: labels
    entity: merchant_id
    value: is_fraud
    delay: 2d
    windows: [1d, 7d]
    features: {count: m_labels, sum: m_frauds}
  - source: labels
    entity: card_id
    value: amount
    windows: [7d]
    features: {sum: c_labelled_amount, min: c_labelled_min, max: c_labelled_max}
  - entity: merchant_id
    delay: 2d
    windows: [1d, 7d]
    features: {count: m_count_2d_ago}
  - entity: card_id
    value: log1p(amount)
    windows: [1h, 1d]
    features: {mean: c_log_mean, max: c_log_max, last: c_log_last}
    default: {mean: -1, last: -2}
  - entity: merchant_id
    value: where(amount > 100, 1, 0)
    windows: [1h]
    features: {sum: m_large}
  - entity: device_id
    windows: [1h]
    features: {seconds_since_last: d_since}
    default: -1
  - entity: card_id
    value: amount
    windows: [1h, 1d]
    features: {decayed_sum: {name: c_amount_decayed, half_life: 30m}, count: c_count}
  - entity: merchant_id
    windows: [10m, 1d]
    features:
      decayed_sum: {name: m_decayed_count, half_life: 20m}
  - source: labels
    entity: merchant_id
    value: is_fraud
    delay: 2d
    windows: [7d]
    features: {decayed_sum: {name: m_frauds_decayed, half_life: 1d}}
  - source: labels
    entity: card_id
    value: is_fraud * amount
    windows: [7d]
    features: {sum: c_fraud_amount}
    default: -5
  - source: decisions
    entity: card_id
    filter: {decision: [decline, review]}
    windows: [1d, 7d]
    features: {count: c_flagged}
  - source: decisions
    entity: merchant_id
    value: score
    windows: [7d]
    features: {mean: m_score_mean, max: m_score_max}
    default: {mean: -1}
derived:
  - name: amount_to_m_mean_1d
    expr: where(m_mean_1d > 0, amount / m_mean_1d, 1.0)
  - name: m_burst
    expr: clip(m_count_1m - 2 * m_count_10m / 10, -5, 5)
  - name: local_hour
    expr: hour_of_day(event_time_s + utc_offset_s)
  - name: local_weekend
    expr: where(day_of_week(event_time_s + utc_offset_s) >= 5, 1, 0)
  - name: paris_night
    expr: where(hour_of_day(event_time_s, 'Europe/Paris') < 6, 1, 0)
  - name: m_fraud_rate_7d
    expr: m_frauds_7d / m_count_2d_ago_7d
"""
# Labels reach the store this long after the midnight that follows their arrival.
LABEL_AFTER_S = 5400.0
T0 = pd.Timestamp("2026-03-02T00:00:00Z")


def history(seed: int = 3) -> pd.DataFrame:
    """Transactions of 3 merchants (one hot: ~3,000 events in the last hour), 20 cards,
    devices on some; a few with the same event time."""
    rng = np.random.default_rng(seed)
    n = 6000
    offs = np.concatenate(
        [rng.uniform(-8 * 86400, 0, n - 3000), rng.uniform(-3600, 0, 3000)]
    ).round(3)
    offs[5:10] = offs[4]  # ties
    merchant = np.where(np.arange(n) >= n - 3000, "m-hot", rng.choice(["m1", "m2"], n))
    return pd.DataFrame(
        {
            "transaction_id": [f"t{i}" for i in range(n)],
            "card_id": rng.choice([f"c{i}" for i in range(20)], n),
            "merchant_id": merchant,
            # The hot merchant's events come from ~300 devices (its distinct count
            # saturates), the others' from 3.
            "device_id": np.where(
                rng.random(n) < 0.5,
                np.where(
                    merchant == "m-hot",
                    [f"d{k}" for k in rng.integers(0, 300, n)],
                    rng.choice(["d1", "d2", "d3"], n),
                ),
                None,
            ),
            "amount": rng.lognormal(3, 1, n).round(2),
            "channel": rng.choice(["pos", "ecom", "atm"], n),
            "country": rng.choice(["US", "US", "GB", "FR"], n),
            "event_time": T0 + pd.to_timedelta(offs, unit="s"),
            # The declared fields (DECL's), each absent on some rows.
            "ip_address": np.where(
                rng.random(n) < 0.9, [f"10.0.0.{k}" for k in rng.integers(0, 40, n)], None
            ),
            "shipping_distance_km": np.where(
                rng.random(n) < 0.8, rng.lognormal(2, 1.5, n).round(3), np.nan
            ),
            "three_ds": np.where(
                rng.random(n) < 0.9, rng.choice(["passed", "failed", "skipped"], n), None
            ),
            "is_prepaid": np.where(rng.random(n) < 0.9, rng.random(n) < 0.3, None),
        }
    ).sort_values("event_time", ignore_index=True)


def labels(hist: pd.DataFrame, seed: int = 8) -> pd.DataFrame:
    """Raw labels of ~8 % of ``hist``: arriving 6 hours to 5 days after the transaction
    (some after the 2-day delay), mostly fraud; a few transactions labelled twice; half
    recorded by the service as they arrived (``live``: counted from their arrival)."""
    rng = np.random.default_rng(seed)
    picked = hist.sample(frac=0.08, random_state=seed)
    lab = pd.DataFrame(
        {
            "transaction_id": picked["transaction_id"].to_numpy(),
            "label_time": picked["event_time"]
            + pd.to_timedelta(rng.uniform(0.25, 5, len(picked)), unit="D"),
            "is_fraud": rng.random(len(picked)) < 0.9,
            "live": rng.random(len(picked)) < 0.5,
        }
    )
    again = lab.head(20).assign(
        label_time=lambda d: d["label_time"] + pd.Timedelta(days=1), live=False
    )
    return pd.concat([lab, again], ignore_index=True)


def decisions(hist: pd.DataFrame, seed: int = 9) -> pd.DataFrame:
    """The service's decisions on ~15 % of ``hist`` (rows of the decision log's
    partitions), decided 10 ms to 2 s after the event; a few logged twice (a later
    entry with another decision: the first counts)."""
    rng = np.random.default_rng(seed)
    picked = hist.sample(frac=0.15, random_state=seed)
    score = rng.random(len(picked))
    dec = picked.assign(
        decided_at=picked["event_time"] + pd.to_timedelta(rng.uniform(0.01, 2, len(picked)), "s"),
        score=score,
        decision=np.select([score > 0.8, score > 0.5], ["decline", "review"], "approve"),
    )
    again = dec.head(20).assign(
        decided_at=lambda d: d["decided_at"] + pd.Timedelta(seconds=5), decision="decline"
    )
    return pd.concat([dec, again], ignore_index=True)


def arrivals(hist: pd.DataFrame) -> pd.DataFrame:
    """The label and decision events of ``hist`` (``declared_sql.labels_for``'s frame)."""
    return pd.concat(
        [
            label_events(labels(hist), hist, LABEL_AFTER_S).assign(source="labels"),
            decision_events(decisions(hist), LABEL_AFTER_S).assign(source="decisions"),
        ],
        ignore_index=True,
    )


def test_the_language_names_the_field_it_refuses() -> None:
    cases = {
        "aggregations: [{entity: shoe, windows: [1h], features: {count: x}}]": (
            "aggregations.0.entity",
            "unknown column 'shoe'",
        ),
        "aggregations: [{entity: card_id, windows: [90s2], features: {count: x}}]": (
            "aggregations.0.windows",
            "expected a number and a unit",
        ),
        "aggregations: [{entity: card_id, windows: [200d], features: {count: x}}]": (
            "aggregations.0.windows",
            "from 1m to 180d",
        ),
        "aggregations: [{entity: card_id, windows: [1h], features: {median: x}}]": (
            "aggregations.0.features.median",
            "",
        ),
        "aggregations: [{entity: card_id, windows: [1h], features: {decayed_sum: x}}]": (
            "aggregations.0",
            "decayed_sum: needs half_life",
        ),
        "aggregations: [{entity: card_id, windows: [1h], "
        "features: {count: {name: x, half_life: 1h}}}]": ("aggregations.0", "takes no half_life"),
        "aggregations: [{entity: card_id, windows: [30d], "
        "features: {decayed_sum: {name: x, half_life: 1m}}}]": ("aggregations.0", "too short"),
        "aggregations: [{entity: card_id, windows: [1h], "
        "features: {decayed_sum: {name: x, half_life: 30s}}}]": (
            "aggregations.0.features.decayed_sum.half_life",
            "from 1m to 180d",
        ),
        "aggregations: [{entity: card_id, value: country, windows: [1h], "
        "features: {decayed_sum: {name: x, half_life: 1h}}}]": (
            "aggregations.0.value",
            "decayed_sum needs a number",
        ),
        "aggregations: [{entity: card_id, windows: [1h], features: {mean: x}}]": (
            "aggregations.0.value",
            "need a number column",
        ),
        "aggregations: [{entity: card_id, value: amount, windows: [1h], "
        "features: {distinct_count: x}}]": ("aggregations.0.value", "need a categorical"),
        "aggregations: [{entity: card_id, value: colour, windows: [1h], features: {changed: x}}]": (
            "aggregations.0.value",
            "unknown column 'colour'",
        ),
        "aggregations: [{entity: card_id, value: is_fraud, windows: [1h], features: {sum: x}}]": (
            "aggregations.0.value",
            "declare source: labels",
        ),
        "aggregations: [{source: labels, entity: card_id, value: score, windows: [1h], "
        "features: {max: x}}]": ("aggregations.0.value", "declare source: decisions"),
        "aggregations: [{entity: card_id, filter: {decision: decline}, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0.filter", "declare source: decisions"),
        "aggregations: [{entity: card_id, filter: {verdict: decline}, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0.filter", "unknown column 'verdict'"),
        "aggregations: [{source: decisions, entity: card_id, windows: [1h], "
        "features: {seconds_since_last: x}}]": ("aggregations.0.features", "whole tiles"),
        "aggregations: [{source: labels, entity: card_id, windows: [1h], "
        "features: {seconds_since_last: x}}]": ("aggregations.0.features", "whole tiles"),
        "aggregations: [{source: chargebacks, entity: card_id, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0.source", ""),
        "aggregations: [{entity: card_id, delay: soon, windows: [1h], features: {count: x}}]": (
            "aggregations.0.delay",
            "expected a number and a unit",
        ),
        "aggregations: [{entity: card_id, value: 'amount +', windows: [1h], features: {sum: x}}]": (
            "aggregations.0.value",
            "not an expression",
        ),
        "aggregations: [{entity: card_id, value: 'log1p(colour)', windows: [1h], "
        "features: {sum: x}}]": ("aggregations.0.value", "unknown name 'colour'"),
        "aggregations: [{entity: card_id, value: 'is_fraud * 2', windows: [1h], "
        "features: {sum: x}}]": ("aggregations.0.value", "declare source: labels"),
        "aggregations: [{entity: card_id, windows: [1h], features: {count: x}, default: 0.5}]": (
            "aggregations.0",
            "whole number",
        ),
        "aggregations: [{entity: card_id, windows: [1h], features: {count: x}, "
        "default: {mean: 1}}]": ("aggregations.0", "not one of"),
        "derived: [{name: r, expr: 'amount / nope'}]": ("derived.0.expr", "unknown name 'nope'"),
        "derived: [{name: r, expr: '__import__(1)'}]": ("derived.0.expr", "only these functions"),
        "aggregations: [{entity: card_id, windows: [1h], features: {count: card_txn_count}}]": (
            "card_txn_count_1h",
            "declared twice",
        ),
    }
    # A team's declared fields: their types decide what a declaration may do with them.
    fields = (
        "fields: [{name: ip, type: string}, {name: km, type: number}, "
        "{name: seen, type: timestamp}]\n"
    )
    cases |= {
        fields + "aggregations: [{entity: km, windows: [1h], features: {count: x}}]": (
            "aggregations.0.entity",
            "'km' is a number field: a key is a string or category or bool field",
        ),
        fields + "aggregations: [{entity: card_id, filter: {seen: [x]}, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0.filter", "'seen' is a timestamp field"),
        fields + "aggregations: [{entity: card_id, value: ip, windows: [1h], "
        "features: {sum: x}}]": ("aggregations.0.value", "need a number column (amount, km)"),
        fields + "aggregations: [{entity: card_id, value: 'log1p(ip)', windows: [1h], "
        "features: {sum: x}}]": ("aggregations.0.value", "'ip' is a string field"),
        fields + "aggregations: [{entity: card_id, value: km, windows: [1h], "
        "features: {distinct_count: x}}]": ("aggregations.0.value", "need a categorical"),
        fields + "aggregations: [{entity: card_id, value: seen, windows: [1h], "
        "features: {max: x}}]": ("aggregations.0.value", "'seen' is a timestamp field"),
        fields + "aggregations: [{entity: nope, windows: [1h], features: {count: x}}]": (
            "aggregations.0.entity",
            "unknown column 'nope'",
        ),
        fields + "aggregations: [{source: labels, entity: ip, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0", "ip: a declared field is read by"),
        "fields: [{name: tds, type: category, values: [passed, failed]}]\n"
        "aggregations: [{entity: card_id, filter: {tds: [faild]}, windows: [1h], "
        "features: {count: x}}]": (
            "aggregations.0.filter",
            "tds: 'faild' is not one of its values (passed, failed)",
        ),
        "fields: [{name: pre, type: bool}]\n"
        "aggregations: [{entity: card_id, filter: {pre: [maybe]}, windows: [1h], "
        "features: {count: x}}]": ("aggregations.0.filter", "'maybe' is not one of its values"),
    }
    for text, (where, what) in cases.items():
        with pytest.raises(D.DeclarationError) as err:
            D.parse(yaml.safe_load(text), "features.yaml", taken=["card_txn_count_1h"])
        assert where in str(err.value) and what in str(err.value), (text, str(err.value))


def _live(
    client: Any,
    decl: D.Declarations,
    hist: pd.DataFrame,
    queries: set[str],
    seed: int,
    label_events: pd.DataFrame | None = None,
) -> dict[str, dict[str, float]]:
    """Events as a live system sees them: each arrives 0-5 s after its event time, 5 %
    twice; a query transaction arrives 5 s after its event time and is read as of that
    time before its own event is recorded (the scorer's order), in micro-batches of the
    events that arrive together (a burst sees itself inside one). Returns the served
    features by transaction id. ``label_events`` are recorded in the label states as
    the daily batch does: once the clock passes their ``available_us``."""
    pending = (
        label_events.sort_values("available_us").to_dict("records")
        if label_events is not None
        else []
    )
    rng = np.random.default_rng(seed)
    rows = hist.to_dict("records")
    ts = [int(pd.Timestamp(r["event_time"]).value // 1000) for r in rows]
    delay = rng.uniform(0, 5e6, len(rows))
    delay[[r["transaction_id"] in queries for r in rows]] = 5e6
    arrivals = [(t + d, i) for i, (t, d) in enumerate(zip(ts, delay, strict=True))]
    arrivals += [(ts[i] + 30e6, i) for i in rng.choice(len(rows), len(rows) // 20, replace=False)]
    order = [i for _, i in sorted(arrivals)]
    served: dict[str, dict[str, float]] = {}
    for start in range(0, len(order), 16):  # a micro-batch: read, then record
        batch = order[start : start + 16]
        clock = max(ts[i] for i in batch)
        due = [r for r in pending if r["available_us"] <= clock]
        if due:
            record_labels(client, decl, pd.DataFrame(due), horizon_s=10 * 86400)
            pending = pending[len(due) :]
        asked = [i for i in batch if rows[i]["transaction_id"] in queries]
        pipe = client.pipeline(transaction=False)
        reads = []
        for spec in decl.specs:
            for i in asked:
                key = spec.key_value(rows[i])
                if key is not None:
                    D.queue_read(pipe, spec, key, ts[i])
                reads.append((spec, i, key))
        n_reads = len(pipe)
        writes = []
        for spec in decl.specs:
            limits = D.Limits.for_spec(spec, horizon_s=10 * 86400)
            evs = D.events_for(spec, [rows[i] for i in batch], [ts[i] for i in batch])
            for key, es in evs.items():
                D.queue_apply(pipe, spec, {key: es}, limits)
                writes.append((spec, key, es))
        replies = pipe.execute()
        fresh: dict[tuple[str, str], list[D.Event]] = {}
        for (spec, key, es), (added,) in zip(writes, replies[n_reads:], strict=True):
            fresh[(spec.id, key)] = [e for e, a in zip(es, added, strict=True) if int(a) == 1]
        got = iter(_states(decl, reads, replies[:n_reads], ts))
        for spec, i, key in reads:
            state = next(got) if key is not None else None
            mates = [
                e
                for e in fresh.get((spec.id, key), [])
                if key is not None
                if e.transaction_id != rows[i]["transaction_id"]
            ]
            feats, exact = D.online_row(spec, state, ts[i], mates, spec.own_code(rows[i]))
            assert exact, (spec.feature_names(), rows[i])
            served.setdefault(rows[i]["transaction_id"], {}).update(feats)
    return served


def _states(
    decl: D.Declarations,
    reads: list[tuple[D.Spec, int, str | None]],
    replies: list[Any],
    ts: list[int],
) -> list[D.KeyState]:
    """The states of ``reads`` (queued spec by spec) from their replies, in order."""
    out: list[D.KeyState] = []
    pos = 0
    for spec in decl.specs:
        keyed = [i for s, i, key in reads if s is spec and key is not None]
        n = len(keyed)
        out += D.parse_reads(spec, replies[pos : pos + n], [ts[i] for i in keyed])
        pos += n
    return out


def _assert_equal(
    q: pd.DataFrame,
    served: dict[str, list[float]],
    trained: dict[str, np.ndarray],
    ref: dict[str, list[float]],
    rows: dict[str, np.ndarray] | None = None,
) -> None:
    """served = training = reference for every feature (on ``rows[name]`` only, when
    given); a failure names the feature, the row and the three values."""
    bad = {}
    for name in served:
        on, off, rf = (np.asarray(x[name], dtype=np.float64) for x in (served, trained, ref))
        ok = np.isclose(on, off, rtol=1e-9, atol=1e-6) & np.isclose(off, rf, rtol=1e-9, atol=1e-6)
        if rows is not None:
            ok |= ~rows[name]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            bad[name] = (
                f"{(~ok).sum()} rows, e.g. {q['transaction_id'][i]}: served {on[i]}, "
                f"training {off[i]}, reference {rf[i]}"
            )
    assert not bad, bad


@pytest.fixture(params=["redis", "cluster"])
def store(request: pytest.FixtureRequest, redis_server: str) -> Callable[[], Any]:
    if request.param == "redis":
        url = redis_server.rsplit("/", 1)[0] + "/7"
        client = redis.Redis.from_url(url)
        client.flushdb()
        return lambda: client
    cluster: EmbeddedCluster = request.getfixturevalue("redis_cluster")
    client = sync_client(cluster.url)
    for node in client.get_primaries():
        client.flushdb(target_nodes=node)
    return lambda: client


def _apply_shuffled(client: Any, decl: D.Declarations, hist: pd.DataFrame, seed: int) -> None:
    """The whole history in random order (many events late), 5 % twice, 400 at a time."""
    rng = np.random.default_rng(seed)
    rows = hist.to_dict("records")
    rows += [rows[i] for i in rng.choice(len(rows), len(rows) // 20, replace=False)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    ts = [int(pd.Timestamp(r["event_time"]).value // 1000) for r in rows]
    for spec in decl.specs:
        limits = D.Limits.for_spec(spec, horizon_s=10 * 86400)
        for i in range(0, len(rows), 400):
            pipe = client.pipeline(transaction=False)
            by_key = D.events_for(spec, rows[i : i + 400], ts[i : i + 400])
            D.queue_apply(pipe, spec, by_key, limits, per_key=isinstance(client, RedisCluster))
            pipe.execute()


def test_late_shuffled_and_duplicated_events_land_at_their_own_time(
    store: Callable[[], Any],
) -> None:
    """The whole history applied in random order, then read as of each query's time:
    equal wherever the read is exact, and a read is inexact only where the docs say (a
    replay behind the key's present: at least NEWEST of the key's events lie at or after
    the query's time, or its newest lies past the tiles the key's ring keeps)."""
    client = store()
    raw = yaml.safe_load(DECL)
    decl = D.parse(raw, "test")
    hist = history(seed=4)
    for script in D.SCRIPTS:
        client.script_load(script)
    _apply_shuffled(client, decl, hist, seed=5)
    q = hist.tail(500).rename(columns={"event_time": "event_timestamp"}).reset_index(drop=True)
    rows = q.to_dict("records")
    t_us = [int(pd.Timestamp(r["event_timestamp"]).value // 1000) for r in rows]
    hist_us = np.asarray(hist["event_time"].astype("int64") // 1000)
    served: dict[str, list[float]] = {}
    exact_rows: dict[str, np.ndarray] = {}
    for spec in decl.specs:
        pipe = client.pipeline(transaction=False)
        keys = [spec.key_value(r) for r in rows]
        for key, t in zip(keys, t_us, strict=True):
            if key is not None:
                D.queue_read(pipe, spec, key, t)
        states = iter(
            D.parse_reads(
                spec, pipe.execute(), [t for k, t in zip(keys, t_us, strict=True) if k is not None]
            )
        )
        flags = []
        for row, key, t in zip(rows, keys, t_us, strict=True):
            state = next(states) if key is not None else None
            feats, exact = D.online_row(spec, state, t, own=spec.own_code(row))
            if not exact:  # the documented conditions, counted from the history
                same = np.ones(len(hist), bool)
                for c in spec.entity:
                    same &= hist[c].to_numpy() == row[c]
                for c, allowed in spec.row_filter:
                    same &= hist[c].isin(allowed).to_numpy()
                newest = int(hist_us[same].max()) + spec.delay_us
                dropped = any(  # the ring's top past the slots it keeps
                    newest // w.width_us - spec.widths[w.width_us] >= t // w.width_us - w.tiles
                    for w in spec.windows
                )
                many = (same & (hist_us >= t)).sum() >= D.NEWEST
                # min/max: later events share t's finest tile and the key's newest
                # events no longer reach back to its edge, or a finer ring dropped the
                # tiles that split a coarser one
                ws = sorted(spec.widths)
                f = ws[0]
                later_in_tile = (same & (hist_us >= t) & (hist_us // f == t // f)).any()
                edge_gone = (same & (hist_us >= t // f * f)).sum() >= D.NEWEST
                finer_dropped = any(
                    t // u * u // v <= newest // v - spec.widths[v]
                    for v, u in itertools.pairwise(ws)
                )
                squeezed = spec.keeps_extremes and ((later_in_tile and edge_gone) or finer_dropped)
                assert many or dropped or squeezed, (spec.feature_names(), row)
            flags.append(exact)
            for k, v in feats.items():
                served.setdefault(k, []).append(v)
        for k in spec.feature_names():
            exact_rows[k] = np.asarray(flags)
    trained = training_columns(decl, q, hist)
    ref = reference(raw, q, hist, "event_timestamp")
    _assert_equal(q, served, trained, ref, exact_rows)
    assert min(int(v.sum()) for v in exact_rows.values()) >= 25  # it compared something


def test_a_read_behind_the_tiles_a_key_keeps_says_it_is_not_exact(
    store: Callable[[], Any],
) -> None:
    """A key's ring keeps the tiles its windows read near its present; read as of a time
    further behind (a replay), the dropped tiles are not counted, and the read says so
    instead of answering a low count as exact (with delayed, whole-tile states the
    newest-events list that flags other replays is not read)."""
    client = store()
    decl = D.parse(
        yaml.safe_load(
            "aggregations:\n  - entity: merchant_id\n    delay: 1d\n    windows: [1d]\n"
            "    features: {count: m_lagged}\n"
        ),
        "test",
    )
    (spec,) = decl.specs
    for script in D.SCRIPTS:
        client.script_load(script)
    hour = 3600 * D.US
    t0 = int(T0.value // 1000)
    limits = D.Limits.for_spec(spec, 10 * 86_400)  # accepts the early events late
    events = [D.Event(f"t{i}", t0 + i * hour + spec.delay_us, 1.0) for i in range(24)]

    def read(t: int) -> tuple[dict[str, float], bool]:
        pipe = client.pipeline(transaction=False)
        D.queue_read(pipe, spec, "m1", t)
        (state,) = D.parse_reads(spec, pipe.execute(), [t])
        return D.online_row(spec, state, t)

    pipe = client.pipeline(transaction=False)
    D.queue_apply(pipe, spec, {"m1": events}, limits)
    pipe.execute()
    t = t0 + 2 * 86_400 * D.US  # the whole day, 1 day later
    assert read(t) == ({"m_lagged_1d": 24.0}, True)
    late = D.Event("late", t0 + 10 * 86_400 * D.US + spec.delay_us, 1.0)
    pipe = client.pipeline(transaction=False)
    D.queue_apply(pipe, spec, {"m1": [late]}, limits)
    pipe.execute()
    assert read(t)[1] is False  # its tiles were dropped: not a silent 0
    assert read(t0 + 12 * 86_400 * D.US) == ({"m_lagged_1d": 1.0}, True)


@pytest.mark.parametrize("source", ["test", "project"])
def test_every_declared_aggregation_served_equals_training_equals_reference(
    store: Callable[[], Any], source: str
) -> None:
    """``project``: the declarations the project ships (feature_repo/features.yaml, or
    FRAUD_FEATURES_FILE): a feature a user declares is checked here without a test of
    its own."""
    client = store()
    if source == "test":
        raw = yaml.safe_load(DECL)
        decl = D.parse(raw, "test")
    else:
        decl = F.declarations()
        raw = yaml.safe_load(Path(decl.source).read_text())
    hist = history()
    for script in D.SCRIPTS:
        client.script_load(script)
    # Queries: 400 transactions of the last day, the hot merchant's among them.
    q = (
        hist[hist["event_time"] >= T0 - pd.Timedelta(days=1)]
        .sample(400, random_state=2)
        .rename(columns={"event_time": "event_timestamp"})
        .reset_index(drop=True)
    )
    events = arrivals(hist)
    by_id = _live(client, decl, hist, set(q["transaction_id"]), seed=1, label_events=events)
    served = {n: [by_id[t][n] for t in q["transaction_id"]] for n in decl.aggregate_names()}
    trained = training_columns(decl, q, hist, labels=events)
    ref = reference(raw, q, hist, "event_timestamp", labels(hist), LABEL_AFTER_S, decisions(hist))
    assert set(served) == set(trained) == set(ref) == set(decl.aggregate_names())
    _assert_equal(q, served, trained, ref)
    # The check means something: the hot key's windows hold thousands of events.
    if source == "test":
        assert max(trained["m_count_1h"]) > 2500 and max(trained["cm_count_30d"]) > 10
        assert max(trained["m_frauds_7d"]) > 10 and max(trained["m_count_2d_ago_1d"]) > 10
        assert max(trained["c_flagged_7d"]) > 5 and 0 < max(trained["m_score_mean_7d"]) < 1
        # decayed sums: the hot merchant's decayed count lies between its 10-minute
        # count's share of a half-life and its whole count
        hot = int(np.argmax(trained["m_count_10m"]))
        assert 0.3 * trained["m_count_10m"][hot] < trained["m_decayed_count_10m"][hot]
        assert trained["m_decayed_count_10m"][hot] < trained["m_count_10m"][hot]
        assert max(trained["c_amount_decayed_1d"]) > 0 and max(trained["m_frauds_decayed_7d"]) > 0
        # declared fields: a key (an IP, with rows without one), a number value absent
        # on some events, a category filter, a categorical value and a bool filter
        assert max(trained["ip_count_1d"]) > 50 and min(trained["ip_since_10m"]) < 600
        assert q["ip_address"].isna().any() and 0 in trained["ip_count_1d"]
        assert 0 < min(trained["c_ship_count_1d"]) < min(trained["c_count_1d"])
        assert max(trained["ipm_3ds_failed_1d"]) > 5 and max(trained["c_ips_1d"]) > 20
        assert max(trained["c_ip_changed_1d"]) == 1 and max(trained["m_prepaid_ship_log_1d"]) > 10

    # Derived features: the shared evaluator = the reference's on every row.
    from fraud_scoring.declared import derived_columns

    cols = {
        **{k: np.asarray(v) for k, v in trained.items()},
        **{k: np.full(len(q), 100.0) for k in F.hand_written_names()},
        **{f.name: np.full(len(q), 100.0) for f in F.batch_features()},
        "amount": q["amount"].to_numpy(),
        "event_time_s": q["event_timestamp"].astype("int64").to_numpy() / 1e9,
        "utc_offset_s": np.resize([0.0, -18_000.0, 19_800.0], len(q)),
    }
    got = derived_columns(decl, cols, len(q))
    for d in decl.derived:
        want = [
            derived_reference(d.expr, {k: float(v[i]) for k, v in cols.items()})
            for i in range(len(q))
        ]
        assert np.allclose(got[d.name], want), d.name

    # Backfill records the same state: the whole history again changes nothing.
    keys = sorted(client.keys("{agg:*"))
    before = {k: client.dump(k) for k in keys if not k.endswith(b":ids")}
    # (the labels the live run recorded: those the store had by its last event)
    seen = events[events["available_us"] <= int(hist["event_time"].max().value // 1000)]
    assert backfill_tiles(client, decl, hist, horizon_s=10 * 86400, labels=seen) == 0
    assert {k: client.dump(k) for k in keys if not k.endswith(b":ids")} == before


def test_a_backfill_after_live_traffic_counts_the_whole_history_once(
    store: Callable[[], Any],
) -> None:
    """Live traffic reached the keys first (the last hours, recorded by the updater's
    script); the backfill of the whole history, days behind those keys' newest events,
    is still recorded, each transaction once: the reads equal those of a store that was
    backfilled first, and the state's backfilled marker is set."""
    client = store()
    decl = D.parse(yaml.safe_load(DECL), "test")
    hist = history(seed=6)
    for script in D.SCRIPTS:
        client.script_load(script)
    live = hist[hist["event_time"] >= hist["event_time"].max() - pd.Timedelta(hours=6)]
    rows = live.to_dict("records")
    ts = [int(pd.Timestamp(r["event_time"]).value // 1000) for r in rows]
    for spec in decl.specs:
        pipe = client.pipeline(transaction=False)
        limits = D.Limits.for_spec(spec, D.HORIZON_S)
        D.queue_apply(pipe, spec, D.events_for(spec, rows, ts), limits, per_key=True)
        pipe.execute()
    assert all(not client.exists(s.backfilled_key()) for s in decl.specs)
    assert backfill_tiles(client, decl, hist, D.HORIZON_S) > 0
    assert all(client.exists(s.backfilled_key()) for s in decl.specs)
    assert backfill_tiles(client, decl, hist, D.HORIZON_S) == 0  # once, however often run
    t = int(hist["event_time"].max().value // 1000) + 1
    q = hist.tail(300).rename(columns={"event_time": "event_timestamp"}).reset_index(drop=True)
    q["event_timestamp"] = pd.Timestamp(t * 1000, tz="UTC")
    served: dict[str, list[float]] = {}
    q_rows = q.to_dict("records")
    for spec in decl.specs:
        keys = [spec.key_value(r) for r in q_rows]
        pipe = client.pipeline(transaction=False)
        for key in keys:
            if key is not None:
                D.queue_read(pipe, spec, key, t)
        states = iter(D.parse_reads(spec, pipe.execute(), [t] * sum(k is not None for k in keys)))
        for key, row in zip(keys, q_rows, strict=True):
            state = next(states) if key is not None else None
            feats, _ = D.online_row(spec, state, t, own=spec.own_code(row))
            for k, v in feats.items():
                served.setdefault(k, []).append(v)
    trained = training_columns(decl, q, hist)
    ref = reference(yaml.safe_load(DECL), q, hist, "event_timestamp")
    _assert_equal(q, served, trained, ref)


def test_min_and_max_of_a_tile_that_also_holds_later_events(store: Callable[[], Any]) -> None:
    """A min cannot be taken back out of a tile: read as of a time whose tile also holds
    later events (a replay, a late transaction), a window's min and max come from the
    key's newest events when they reach back to the tile's edge, else from the state's
    finer tiles; when neither holds the tile's earlier events the read says it is not
    exact (the scorer counts it in fraud_declared_reads_inexact)."""
    client = store()
    for script in D.SCRIPTS:
        client.script_load(script)
    t0 = int(T0.value // 1000)  # an hour's edge
    s = D.US
    early = [D.Event(f"e{i}", t0 + i * s, 50.0 + i % 7) for i in range(40)]
    later = [D.Event("small", t0 + 50 * s, 1.0), D.Event("big", t0 + 51 * s, 1000.0)]
    t = t0 + 45 * s

    def read(windows: str, key: str, events: list[D.Event]) -> tuple[dict[str, float], bool]:
        text = (
            "aggregations:\n  - entity: merchant_id\n    value: amount\n"
            f"    windows: {windows}\n    features: {{min: lo, max: hi, count: n}}\n"
        )
        (spec,) = D.parse(yaml.safe_load(text), "test").specs
        pipe = client.pipeline(transaction=False)
        # one transaction, one key: each key's events are transactions of their own
        events = [D.Event(f"{key}-{e.transaction_id}", e.ts_us, e.value) for e in events]
        D.queue_apply(pipe, spec, {key: events}, D.Limits.for_spec(spec, D.HORIZON_S))
        pipe.execute()
        D.queue_read(pipe, spec, key, t)
        (state,) = D.parse_reads(spec, pipe.execute(), [t])
        return D.online_row(spec, state, t)

    # Fewer events than the key keeps: the tile's part before t from its newest events.
    assert read("[1h]", "m-few", early[:10] + later) == (
        {"lo_1h": 50.0, "hi_1h": 56.0, "n_1h": 10.0},
        True,
    )
    # The newest events no longer reach the 5-minute tile's edge: its 5-second tiles do.
    feats, exact = read("[1m, 1h]", "m-split", early + later)
    assert exact and (feats["lo_1h"], feats["hi_1h"], feats["n_1h"]) == (50.0, 56.0, 40.0)
    assert (feats["lo_1m"], feats["hi_1m"]) == (50.0, 56.0)
    # No finer tiles: the tile's earlier events are gone, and the read says so.
    assert read("[1h]", "m-gone", early + later)[1] is False


def test_decision_states_read_the_compacted_decision_log(tmp_path: Path) -> None:
    """``source: decisions`` reads what ``fraud-scoring decisions compact`` writes: the
    decision log's entries (the service's format), compacted per UTC day, load as the
    same arrivals as the frames the tests above use, first entry per transaction."""
    import json

    from batch_jobs.decisions import compact_day
    from batch_jobs.declared_sql import labels_for, load_decision_events

    hist = history().tail(300)
    dec = decisions(hist)
    by_day: dict[Any, list[bytes]] = {}
    for r in dec.to_dict("records"):
        entry = {
            "transaction_id": r["transaction_id"],
            "decided_at": r["decided_at"].isoformat(),
            "transaction": {
                "event_time": r["event_time"].isoformat(),
                "currency": "USD",
                "mcc": None,
                **{k: r[k] for k in ("card_id", "merchant_id", "amount", "country", "channel")},
                "device_id": r["device_id"],
            },
            "score": r["score"],
            "decision": r["decision"],
            "model_version": "v1",
            **{k: [] for k in ("reasons", "missing", "stale")},
            "features": {},
            "timing_ms": {},
        }
        by_day.setdefault(r["decided_at"].date(), []).append(json.dumps(entry).encode())
    raw = tmp_path / "raw"
    for day in sorted(by_day):
        compact_day(raw, day, by_day[day], [])
    got = load_decision_events(raw, LABEL_AFTER_S)
    want = decision_events(dec, LABEL_AFTER_S)
    cols = ["transaction_id", "event_us", "label_us", "available_us", "score", "decision"]
    cols += ["card_id", "merchant_id", "device_id", "amount"]
    assert len(got) == len(hist.merge(dec[["transaction_id"]]).drop_duplicates()) > 30
    pd.testing.assert_frame_equal(
        got[cols].reset_index(drop=True), want[cols].reset_index(drop=True), check_dtype=False
    )
    decl = D.parse(yaml.safe_load(DECL), "test")
    both = labels_for(decl.specs, raw, LABEL_AFTER_S)
    assert both is not None and set(both["source"]) == {"decisions"}  # no label partitions
    no_decisions = [s for s in decl.specs if s.source != "decisions"]
    assert set(labels_for(no_decisions, raw, LABEL_AFTER_S)["source"]) <= {"labels"}


def test_a_model_reads_only_the_states_its_features_need() -> None:
    """The scorer reads (and requires backfilled) only the states a serving model's
    features come from, derived ones followed to what they read: a declaration added
    for a later model does not stop today's from serving."""
    decl = D.parse(yaml.safe_load(DECL), "test")
    need = decl.needed({"amount_to_m_mean_1d"})
    assert {"amount_to_m_mean_1d", "m_mean_1d", "amount"} <= need
    assert [s.feature_names()[0] for s in decl.specs if need & set(s.feature_names())] == [
        "m_count_1m"
    ]
    assert decl.needed({"cm_count_10m"}) == {"cm_count_10m"}


def test_a_backfill_counts_every_event_of_one_time(store: Callable[[], Any]) -> None:
    """Events of one key at the same time in one backfill call all count (labels made
    available at one midnight share their time; so do transactions stamped to the
    second): each is recorded, once."""
    client = store()
    decl = D.parse(
        yaml.safe_load(
            "aggregations: [{entity: merchant_id, windows: [1h], features: {count: n}}]"
        ),
        "test",
    )
    for script in D.SCRIPTS:
        client.script_load(script)
    at = T0 - pd.Timedelta(minutes=10)
    hist = pd.DataFrame(
        {
            "transaction_id": [f"s{i}" for i in range(7)],
            "merchant_id": "m-same",
            "amount": 1.0,
            "event_time": [at] * 5 + [at + pd.Timedelta(seconds=1)] * 2,
        }
    )
    assert backfill_tiles(client, decl, hist, D.HORIZON_S) == 7
    assert backfill_tiles(client, decl, hist, D.HORIZON_S) == 0
    (spec,) = decl.specs
    t = int(T0.value // 1000)
    pipe = client.pipeline(transaction=False)
    D.queue_read(pipe, spec, "m-same", t)
    (state,) = D.parse_reads(spec, pipe.execute(), [t])
    assert D.online_row(spec, state, t)[0]["n_1h"] == 7


def test_the_documented_example_declares_what_it_says() -> None:
    """docs/features.md's example is a valid declaration (read beside the project's own
    features, which its derived expressions read)."""
    import re
    import textwrap

    text = (Path(__file__).parents[1] / "docs" / "features.md").read_text()
    blocks = [
        textwrap.dedent(b)
        for b in re.findall(r"```yaml\n(.*?) *```", text, re.S)
        if "aggregations:" in b
    ]
    (block,) = [b for b in blocks if "source: labels" in b]
    doc = yaml.safe_load(block)
    own = D.parse({"aggregations": doc["aggregations"]}, "docs").aggregate_names()
    own += [d["name"] for d in doc.get("derived", [])]
    decl = D.parse(doc, "docs/features.md", taken=sorted(set(F.all_features()) - set(own)))
    assert {s.source for s in decl.specs} == {"transactions", "labels", "decisions"}
    # "Over your own fields": features over declared fields
    (block,) = [b for b in blocks if "ip_address" in b]
    decl = D.parse(yaml.safe_load(block), "docs/features.md")
    assert {n for s in decl.specs for n, _ in s.fields} == {
        "ip_address",
        "three_ds",
        "shipping_distance_km",
    }
    # "impossible travel": last over declared coordinates, then distance and speed
    (block,) = [b for b in blocks if "card_jump_kmh" in b]
    doc = yaml.safe_load(block) | {
        "fields": [{"name": "lat", "type": "number"}, {"name": "lon", "type": "number"}]
    }
    decl = D.parse(doc, "docs/features.md")
    paris, london = (48.8566, 2.3522), (51.5074, -0.1278)
    cols = {
        "card_prev_lat_1d": np.array([paris[0], 0.0]),
        "card_prev_lon_1d": np.array([paris[1], 0.0]),
        "card_gap_1d": np.array([1800.0, 86400.0]),  # the second: no earlier transaction
        "lat": np.array([london[0], london[0]]),
        "lon": np.array([london[1], london[1]]),
    }
    got = D.derived_columns(decl, cols, 2)
    assert abs(got["card_jump_km"][0] - 343.5) < 0.5 and got["card_jump_km"][1] == 0
    assert abs(got["card_jump_kmh"][0] - 687.1) < 1 and got["card_jump_kmh"][1] == 0


def test_the_shipped_declarations_say_what_their_names_do_not() -> None:
    """What an analyst would not read from a name is said where the feature is declared
    (docs/features.md, "What the names do not say"), with figures the plan gives."""
    decl = F.load_declarations(D.DEFAULT_PATH)
    spec_of = {f.name: s for s in decl.specs for f in s.features}
    window_of = {f.name: f.window for s in decl.specs for f in s.features}
    hour, day = 3600 * D.US, 86_400 * D.US

    # A window's start snaps back a tile: a _24h count reaches back up to 25 h.
    w = window_of["card_txn_count_24h"]
    assert w.us + w.width_us == 25 * hour
    assert "24 to 25 h" in spec_of["card_txn_count_24h"].description

    # A label on 1-day tiles shows up to 48 h after it arrived: it counts from the
    # midnight after its arrival and a whole-tile window reads its tile once it has ended.
    arrived = 10 * day + 1  # just after a midnight
    for name in ("card_fraud_count_30d", "merchant_fraud_count_lag7d_30d"):
        spec, w = spec_of[name], window_of[name]
        assert spec.whole_tiles and w.width_us == day
        shown = (D.label_available_us(arrived, 0.0) // w.width_us + 1) * w.width_us
        assert 47 * hour < shown - arrived <= 48 * hour
        assert "48 h" in spec.description, name

    # "30d" is three windows, each said.
    assert "newest snapshot" in decl.views[0].description  # card_30d's _30d features
    assert "30 to 31 days" in spec_of["merchant_amount_mean_30d"].description
    assert "ended 7 days ago" in spec_of["merchant_txn_count_lag7d_30d"].description

    # changed reads 0 after a quiet day, as it does without a change.
    assert "quiet day" in spec_of["card_country_changed_24h"].description


def test_distance_and_calendar_functions() -> None:
    """The expression language's geo and time functions on known values, and the same
    on the reference's Python floats."""
    paris, london = (48.8566, 2.3522), (51.5074, -0.1278)
    cols = {
        "lat1": np.array([paris[0], 0.0, 10.0, np.nan]),
        "lon1": np.array([paris[1], 0.0, 20.0, 0.0]),
        "lat2": np.array([london[0], 0.0, 10.0, 0.0]),
        "lon2": np.array([london[1], 180.0, 20.0, 0.0]),
    }
    km = D.evaluate("distance_km(lat1, lon1, lat2, lon2)", cols)
    assert abs(km[0] - 343.5) < 0.5  # Paris to London
    assert abs(km[1] - np.pi * 6371.0088) < 1e-6  # half the equator
    assert km[2] == 0.0 and np.isnan(km[3])
    for i in range(3):
        row = {k: float(v[i]) for k, v in cols.items()}
        want = derived_reference("distance_km(lat1, lon1, lat2, lon2)", row)
        assert km[i] == pytest.approx(want, rel=1e-12, abs=1e-9)
    # 2026-12-06 is a Sunday; 23:30 UTC is 04:30 the next day (a Monday) at UTC+5
    t = pd.Timestamp("2026-12-06T23:30:00Z").value / 1e9
    got = D.evaluate(
        "hour_of_day(t + off) * 10 + day_of_week(t + off)",
        {"t": np.array([t, t]), "off": np.array([0.0, 5 * 3600.0])},
    )
    assert list(got) == [236.0, 40.0]
    # In a declared zone, its daylight saving time included: 23:30 UTC is 00:30 on
    # Monday in Paris in December (UTC+1) and 01:30 on Tuesday in July (UTC+2); a
    # missing time stays missing.
    summer = pd.Timestamp("2026-07-06T23:30:00Z").value / 1e9
    zoned = "hour_of_day(t, 'Europe/Paris') * 10 + day_of_week(t, 'Europe/Paris')"
    times = np.array([t, summer, np.nan])
    got = D.evaluate(zoned, {"t": times})
    assert got[:2].tolist() == [0.0, 11.0] and np.isnan(got[2])
    for i in range(2):
        assert derived_reference(zoned, {"t": float(times[i])}) == got[i]
    # The implied speed from the previous transaction ("impossible travel").
    speed = "speed_kmh(distance_km(lat1, lon1, lat2, lon2), gap)"
    cols["gap"] = np.array([1800.0, 0.0, 60.0, 60.0])
    got = D.evaluate(speed, cols)
    assert abs(got[0] - 687.1) < 1 and got[1] == km[1] * 3600 and got[2] == 0.0
    for i in range(3):
        want = derived_reference(speed, {k: float(v[i]) for k, v in cols.items()})
        assert got[i] == pytest.approx(want, rel=1e-12)
    # Checked at load, naming what is wrong.
    for expr, said in {
        "hour_of_day(t, 'Mars/Olympus')": "unknown time zone 'Mars/Olympus'",
        "hour_of_day(t, 1, 2)": "hour_of_day takes 1 or 2 arguments",
        "distance_km(t, t, t)": "distance_km takes 4 arguments",
        "where(t > 'a', 1, 0)": "constants must be numbers",
        "log1p('Europe/Paris')": "constants must be numbers",
    }.items():
        with pytest.raises(D.DeclarationError, match=re.escape(said)):
            D.parse({"derived": [{"name": "x", "expr": expr}]}, "t", taken=["t"])


def test_a_busy_key_keeps_no_ids_and_counts_each_transaction_once(redis_server: str) -> None:
    """Live recording (the service's and the updater's one call per micro-batch) keeps
    no id set per key: one marker per transaction says which states recorded it, so a
    key's bytes do not grow with its traffic. 3,000 events of one merchant, shuffled,
    then all of them again (the updater after the service): each counted once, the key's
    hash under 64 KB, and one marker per transaction with a field per state."""
    client = redis.Redis.from_url(redis_server.rsplit("/", 1)[0] + "/7")
    client.flushdb()
    decl = D.parse(
        yaml.safe_load(
            "aggregations:\n"
            "  - {entity: merchant_id, value: amount, windows: [10m, 1h], "
            "features: {count: n, sum: s}}\n"
            "  - {entity: card_id, windows: [1h], features: {count: c}}\n"
        ),
        "test",
    )
    for script in D.SCRIPTS:
        client.script_load(script)
    t0 = int(T0.value // 1000)
    rng = np.random.default_rng(1)
    rows = [
        {"transaction_id": f"b{i}", "merchant_id": "busy", "card_id": f"c{i % 50}", "amount": 1.0}
        for i in range(3000)
    ]
    ts = [t0 - int(x) for x in rng.integers(0, 20 * 60 * D.US, len(rows))]

    def record(order: np.ndarray) -> list[bytes]:
        out = []
        for lo in range(0, len(order), 64):  # micro-batches of 64
            idx = order[lo : lo + 64]
            cols = D.BatchColumns([rows[i] for i in idx], [ts[i] for i in idx])
            pipe = client.pipeline(transaction=False)
            D.queue_states(pipe, decl.specs, cols, D.HORIZON_S)
            (reply,) = pipe.execute()
            out += reply
        return out

    first = record(rng.permutation(len(rows)))
    again = record(rng.permutation(len(rows)))
    assert sum(r.count(b"1") for r in first) == 2 * len(rows)
    assert all(set(r) <= {ord("0")} for r in again)  # every one a duplicate
    merchant, card = decl.specs
    assert not client.exists(merchant.prefix("busy") + ":ids")
    assert int(client.memory_usage(merchant.prefix("busy") + ":t")) < 64 * 1024
    got = client.hgetall(D.marker("b7"))
    assert got == {merchant.id.encode(): b"1", card.id.encode(): b"1"}
    assert 0 < client.pttl(D.marker("b7")) <= D.Limits.for_spec(merchant, D.HORIZON_S).mark_ttl_ms
    pipe = client.pipeline(transaction=False)
    D.queue_read(pipe, merchant, "busy", t0)
    (state,) = D.parse_reads(merchant, pipe.execute(), [t0])
    feats, exact = D.online_row(merchant, state, t0)
    assert exact and feats["n_1h"] == len(rows)


def test_a_derived_feature_or_reason_reads_a_declared_number_field() -> None:
    """A declared number field is a request field of the derived features and reasons
    (NaN where a transaction has none); a declared string field is not a number."""
    text = (
        "fields: [{name: km, type: number}, {name: ip, type: string}]\n"
        "derived: [{name: far, expr: 'where(km > 100, 1, 0)'}]\n"
        "reasons: [{code: FAR, when: 'km > 500', message: '{km:.0f} km away'}]\n"
    )
    decl = D.parse(yaml.safe_load(text), "t")
    assert decl.number_fields == decl.field_reads == ("km",)
    got = D.derived_columns(decl, {"km": np.array([50.0, 150.0, np.nan])}, 3)
    assert got["far"].tolist() == [0.0, 1.0, 0.0]
    assert D.parse(yaml.safe_load(DECL), "t").field_reads == ()  # none read: none passed
    bad = "fields: [{name: ip, type: string}]\nderived: [{name: x, expr: 'ip + 1'}]\n"
    with pytest.raises(D.DeclarationError, match=r"derived\.0\.expr: unknown name 'ip'"):
        D.parse(yaml.safe_load(bad), "t")
