"""The columnar micro-batch read (``fraud_scoring/declared/columnar.py``) equals the
row-by-row definition (``declared.parse_batch``, itself checked against training and a
naive reference in tests/test_declared.py) on every row and feature: live rows, bursts
of one key inside a micro-batch (recorded or not), replays behind a key's present
(tiles and newest events ahead of ``t``), hot keys, keys absent from the batch, empty
categorical values, whole-tile (delayed) states, min/max, declared defaults; with the
test file's declarations and the shipped ones, on a real Redis-protocol server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.declared import columnar as C
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import embedded_redis
from tests.test_declared import DECL, T0, history

HORIZON_S = 300.0 + D.HORIZON_S
US = D.US


@pytest.fixture(scope="module")
def store() -> Iterator[Any]:
    """A store holding the test history in the test file's and the shipped states."""
    with embedded_redis() as url:
        client = sync_client(url)
        for script in D.SCRIPTS:
            client.script_load(script)
        hist = history()
        rows = hist.assign(mcc="5411").to_dict("records")
        ts = [int(t.value // 1000) for t in hist["event_time"]]
        for decl in (_test_decl(), F.declarations()):
            for at in range(0, len(rows), 1000):
                pipe = client.pipeline(transaction=False)
                D.queue_batch(
                    pipe,
                    decl,
                    rows[at : at + 1000],
                    ts[at : at + 1000],
                    [True] * len(rows[at : at + 1000]),
                    HORIZON_S,
                    read=False,
                )
                pipe.execute()
        yield client
        client.close()


def _test_decl() -> D.Declarations:
    return D.parse(yaml.safe_load(DECL), "test")


def _batch(seed: int, n: int) -> tuple[list[dict[str, Any]], list[int], list[bool]]:
    """A micro-batch: live rows just after the history, replays inside it, bursts of
    one card or merchant, rows without a device or a country, some not recorded."""
    rng = np.random.default_rng(seed)
    rows, ts = [], []
    end = int(T0.value // 1000)
    for i in range(n):
        kind = rng.choice(["live", "replay", "deep"], p=[0.6, 0.3, 0.1])
        if kind == "live":
            t = end + int(rng.integers(1, 120 * US))
        elif kind == "replay":
            t = end - int(rng.integers(1, 600 * US))
        else:
            t = end - int(rng.integers(3600 * US, 3 * 86_400 * US))
        rows.append(
            {
                "transaction_id": f"b{seed}-{i}",
                "card_id": f"c{rng.integers(0, 4 if i % 3 else 20)}",
                "merchant_id": str(rng.choice(["m1", "m2", "m-hot", "m-new"])),
                "device_id": None if rng.random() < 0.3 else f"d{rng.integers(1, 4)}",
                "amount": round(float(rng.lognormal(3, 1)), 2),
                "channel": str(rng.choice(["pos", "ecom", "atm"])),
                "country": "" if rng.random() < 0.1 else str(rng.choice(["US", "GB", "FR"])),
                "mcc": "5411",
                # the declared fields (DECL's), absent on some rows
                "ip_address": None if rng.random() < 0.2 else f"10.0.0.{rng.integers(0, 6)}",
                "shipping_distance_km": None
                if rng.random() < 0.2
                else round(float(rng.lognormal(2, 1)), 3),
                "three_ds": None if rng.random() < 0.1 else str(rng.choice(["passed", "failed"])),
                "is_prepaid": None if rng.random() < 0.1 else bool(rng.random() < 0.5),
            }
        )
        ts.append(t)
    if n > 3:  # two attempts at one time (ties) in a burst
        ts[2] = ts[1]
        rows[2]["card_id"] = rows[1]["card_id"]
    record = [bool(r) for r in rng.random(n) < 0.8]
    return rows, ts, record


def _both(client: Any, decl: D.Declarations, seed: int, n: int, *, per_key: bool = False) -> None:
    rows, ts, record = _batch(seed, n)
    pipe = client.pipeline(transaction=False)
    cols = D.BatchColumns(rows, ts)
    plan = C.queue_batch(pipe, decl, cols, record, HORIZON_S, per_key=per_key)
    replies = pipe.execute(raise_on_error=False)
    nreads = plan.read_commands
    reads, writes = replies[:nreads], replies[nreads:]
    read = C.parse_batch(plan, reads, writes, ts)
    got, inexact = read.columns, read.inexact_reads
    reference = D.BatchPlan(
        [(s, i, s.key_value(r)) for s in decl.specs for i, r in enumerate(rows)], plan.writes
    )
    want, inexact_ref = D.parse_batch(reference, reads, writes, rows, ts)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(
            np.asarray(got[name], dtype=np.float64),
            np.asarray(want[name], dtype=np.float64),
            rtol=1e-12,
            atol=1e-9,
            err_msg=f"{name} (seed {seed}, {n} rows)",
        )
    assert inexact == inexact_ref
    flagged = sum(len(v) for v in read.inexact.values())
    assert (flagged > 0) == (inexact > 0)
    for i, names in read.inexact.items():  # a flagged row's features: its inexact states'
        assert set(names) <= set(want) and 0 <= i < n
    if not C.needs_writes(plan):  # the reads alone give the same columns (the scorer
        early = C.parse_batch(plan, reads, None, ts)  # parses them before the writes end)
        assert set(early.columns) == set(got)
        for name, col in got.items():
            np.testing.assert_array_equal(early.columns[name], col, err_msg=name)
        assert (early.inexact_reads, early.inexact) == (inexact, read.inexact)


def test_the_reads_alone_unless_a_key_repeats(store: Any) -> None:
    """A batch whose recorded rows all have keys of their own parses from its reads alone,
    as with its writes' replies; a key recorded twice (a burst) needs the writes."""
    client, decl = store, F.declarations()
    rows, ts, _ = _batch(11, 4)
    for i, r in enumerate(rows):  # every key its own
        r.update(card_id=f"solo-c{i}", merchant_id=f"solo-m{i}", device_id=f"solo-d{i}")
        r.update(country=["US", "GB", "FR", "DE"][i], channel=["pos", "ecom", "atm", "moto"][i])
        r["mcc"] = str(5000 + i)
        ts[i] = int(T0.value // 1000) + (i + 1) * US
    pipe = client.pipeline(transaction=False)
    plan = C.queue_batch(pipe, decl, D.BatchColumns(rows, ts), [True] * 4, HORIZON_S)
    replies = pipe.execute(raise_on_error=False)
    reads, writes = replies[: plan.read_commands], replies[plan.read_commands :]
    assert not C.needs_writes(plan)
    early, late = C.parse_batch(plan, reads, None, ts), C.parse_batch(plan, reads, writes, ts)
    for name, col in late.columns.items():
        np.testing.assert_array_equal(early.columns[name], col, err_msg=name)

    rows[1]["card_id"] = rows[0]["card_id"]  # a burst: the second attempt counts the first
    pipe = client.pipeline(transaction=False)
    plan = C.queue_batch(pipe, decl, D.BatchColumns(rows, ts), [True] * 4, HORIZON_S)
    replies = pipe.execute(raise_on_error=False)
    assert C.needs_writes(plan)
    with pytest.raises(ValueError, match="writes"):
        C.parse_batch(plan, replies[: plan.read_commands], None, ts)


@pytest.mark.parametrize("n", [1, 2, 8, 64])
@pytest.mark.parametrize("seed", range(6))
def test_the_columns_equal_the_row_by_row_definition(store: Any, seed: int, n: int) -> None:
    _both(store, _test_decl(), seed * 100 + n, n)


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("seed", range(4))
def test_the_shipped_declarations_too(store: Any, seed: int, n: int) -> None:
    _both(store, F.declarations(), 7_000 + seed * 100 + n, n)


@pytest.mark.parametrize("seed", range(3))
def test_one_recording_call_per_key_as_on_a_cluster(store: Any, seed: int) -> None:
    _both(store, _test_decl(), 9_000 + seed, 32, per_key=True)
    _both(store, F.declarations(), 9_100 + seed, 32, per_key=True)


def test_a_batch_of_keys_the_store_never_saw(store: Any) -> None:
    rows, ts, _ = _batch(11, 16)
    for r in rows:
        r["card_id"], r["merchant_id"] = "c-unseen-" + r["transaction_id"], "m-unseen"
        r["device_id"] = "d-unseen" if r["device_id"] else None
    pipe = store.pipeline(transaction=False)
    decl = F.declarations()
    plan = C.queue_batch(pipe, decl, D.BatchColumns(rows, ts), [False] * 16, HORIZON_S)
    replies = pipe.execute(raise_on_error=False)
    read = C.parse_batch(plan, replies, [], ts)
    got, inexact = read.columns, read.inexact_reads
    assert inexact == 0
    for f in decl.specs[0].features:
        assert len(got[f.name]) == 16
    assert pd.Series(got["card_txn_count_1h"]).eq(0).all()


def test_the_warm_up_compiles_what_serving_runs(store: Any) -> None:
    """``C.warm`` (the service runs it as it starts) compiles every kernel for the
    array types a served micro-batch passes: live rows, bursts and replays compile
    nothing more, so no request pays a compilation (a second or more)."""
    from fraud_scoring.declared import kernels as K

    kernels = [K.sum_windows, K.newest_events, K.last_events, K.kept_values, K.values]
    for decl in (_test_decl(), F.declarations()):
        C.warm(decl)
        compiled = [len(k.signatures) for k in kernels]
        assert all(compiled)
        for seed, n in ((1, 1), (2, 8), (3, 64)):
            _both(store, decl, 12_000 + seed, n)
        assert [len(k.signatures) for k in kernels] == compiled


def test_packed_reads_are_the_commands_hiredis_packs(store: Any) -> None:
    """On the service's one-server round trip each declared read goes out packed from its
    state's fixed parts (``Commands.packed``): the same bytes as hiredis packs from the
    arguments (keys with non-ASCII values too), and the same replies."""
    import hiredis

    from fraud_scoring.redis_clients import _pack
    from service.core.in_flight import Commands

    decl = F.declarations()
    rows, ts, _ = _batch(21, 8)
    rows[0]["card_id"], rows[1]["merchant_id"] = "carte-é-☃", "商户"

    class ByArguments(Commands):
        packed = None  # type: ignore[assignment]  # as a pipe without packed commands

    fast, slow = Commands(), ByArguments()
    C.queue_reads(fast, decl, D.BatchColumns(rows, ts))
    C.queue_reads(slow, decl, D.BatchColumns(rows, ts))
    assert all(isinstance(c, bytes) for c in fast)
    assert all(isinstance(c, tuple) and c[0] == "HMGET" for c in slow)
    assert _pack(fast) == [hiredis.pack_command(c) for c in slow]
    pipe = store.pipeline(transaction=False)
    for c in slow:
        pipe.execute_command(*c)
    assert pipe.execute() == [store.execute_command(*c) for c in slow]
