"""Daily snapshot views declared as data (``snapshots`` in ``feature_repo/features.yaml``):
the language refuses what it cannot compile, naming the field; every aggregation of the
generated SQL equals a naive pandas reference straight from raw rows; and a view on a
new entity, declared alone, goes through the daily batch into Feast (a new entity and
view) and back out of the online store."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batch_jobs.daily_features import compute_day, snapshot_time
from batch_jobs.simulate import SimConfig, simulate
from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring.storage import partition_days, partition_dir, read_partition

DEVICE_VIEW = {
    "view": "device_7d",
    "entity": "device_id",
    "window": "7d",
    "features": [
        {"name": "dev_txn_count_7d", "agg": "count"},
        {"name": "dev_txn_count_1d", "agg": "count", "window": "1d"},
        {"name": "dev_amount_max_7d", "agg": "max", "value": "amount"},
        {"name": "dev_amount_min_1d", "agg": "min", "value": "amount", "window": "1d"},
        {"name": "dev_amount_std_7d", "agg": "std", "value": "amount"},
        {
            "name": "dev_ecom_sum_7d",
            "agg": "sum",
            "value": "amount",
            "filter": {"channel": "ecom"},
        },
        {"name": "dev_distinct_cards_7d", "agg": "distinct_count", "value": "card_id"},
        {"name": "dev_top_merchant_7d", "agg": "most_frequent", "value": "merchant_id"},
        {"name": "dev_fraud_count_7d", "agg": "fraud_count"},
        {"name": "dev_fraud_rate_1d", "agg": "fraud_rate", "window": "1d"},
        {"name": "dev_days_since_first_seen", "agg": "days_since_first_seen"},
    ],
}


def with_views(*extra: dict[str, object]) -> dict[str, object]:
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["snapshots"] = [*doc["snapshots"], *extra]
    return doc


@pytest.fixture
def declare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Point FRAUD_FEATURES_FILE at a document of the test's (cleared after it)."""

    def use(doc: dict[str, object]) -> Path:
        path = tmp_path / "features.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        monkeypatch.setenv("FRAUD_FEATURES_FILE", str(path))
        F.declarations.cache_clear()
        return path

    yield use
    monkeypatch.delenv("FRAUD_FEATURES_FILE", raising=False)
    F.declarations.cache_clear()


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"agg": "median"}, "snapshots.2.features.0.agg", "Input should be"),
        ({"agg": "max", "value": "country"}, "snapshots.2.features.0.value", "number column"),
        (
            {"agg": "distinct_count", "value": "amount"},
            "snapshots.2.features.0.value",
            "key column",
        ),
        ({"agg": "count", "value": "amount"}, "snapshots.2.features.0.value", "reads no value"),
        ({"agg": "count", "window": "30d"}, "snapshots.2.features.0.window", "longer than"),
        ({"agg": "count", "window": "7x"}, "snapshots.2.features.0.window", "a number and a unit"),
        ({"agg": "snapshot_time", "window": "1d"}, "snapshots.2.features.0", "no window"),
        (
            {"agg": "count", "filter": {"colour": ["red"]}},
            "snapshots.2.features.0.filter",
            "colour",
        ),
        ({"agg": "count", "name": "card_txn_count_30d"}, "card_txn_count_30d", "declared twice"),
        ({"agg": "count", "name": "amount_log"}, "amount_log", "declared twice"),
    ],
)
def test_the_language_refuses_what_it_cannot_compile_naming_the_field(
    tmp_path: Path, change: dict[str, object], field: str, words: str
) -> None:
    feature = {"name": "device_x", **change}
    doc = with_views(
        {"view": "device_7d", "entity": "device_id", "window": "7d", "features": [feature]}
    )
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(D.DeclarationError) as err:
        F.load_declarations(path)
    assert field in str(err.value) and words in str(err.value), err.value


def test_views_and_request_features_are_checked_as_a_whole(tmp_path: Path) -> None:
    path = tmp_path / "f.yaml"
    doc = with_views({**DEVICE_VIEW, "view": "card_30d"})
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(
        D.DeclarationError, match=r"snapshots\.2\.view: 'card_30d' is declared twice"
    ):
        F.load_declarations(path)
    doc = with_views({**DEVICE_VIEW, "entity": "card_id", "view": "card_7d"})
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(D.DeclarationError, match="'card_id' has a view already"):
        F.load_declarations(path)
    doc = yaml.safe_load(D.DEFAULT_PATH.read_text())
    doc["snapshots"][0]["features"] = [
        f for f in doc["snapshots"][0]["features"] if f["name"] != "card_top_country_30d"
    ]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(D.DeclarationError, match="request features read card_top_country_30d"):
        F.load_declarations(path)


def _reference(raw: Path, day: date, view: dict[str, object]) -> pd.DataFrame:
    """The device view's features as of ``day``'s snapshot, straight from raw rows."""
    snap = pd.Timestamp(snapshot_time(day))
    tx, labels = (
        pd.concat([read_partition(raw, t, d).to_pandas() for d in partition_days(raw, t)])
        for t in ("transactions", "labels")
    )
    tx = tx[(tx["event_time"] < snap) & tx["device_id"].notna() & (tx["device_id"] != "")]
    known = set(labels.loc[(labels["label_time"] < snap) & labels["is_fraud"], "transaction_id"])
    w7 = tx[tx["event_time"] >= snap - pd.Timedelta(days=7)]
    rows = []
    for dev, g in w7.groupby("device_id"):
        d1 = g[g["event_time"] >= snap - pd.Timedelta(days=1)]
        counts = g["merchant_id"].value_counts()
        top = sorted(counts[counts == counts.max()].index)[0]
        fraud1 = d1["transaction_id"].isin(known).sum()
        rows.append(
            {
                "device_id": dev,
                "dev_txn_count_7d": len(g),
                "dev_txn_count_1d": len(d1),
                "dev_amount_max_7d": g["amount"].max(),
                "dev_amount_min_1d": d1["amount"].min() if len(d1) else np.nan,
                "dev_amount_std_7d": g["amount"].std(ddof=0),
                "dev_ecom_sum_7d": g.loc[g["channel"] == "ecom", "amount"].sum(),
                "dev_distinct_cards_7d": g["card_id"].nunique(),
                "dev_top_merchant_7d": top,
                "dev_fraud_count_7d": g["transaction_id"].isin(known).sum(),
                "dev_fraud_rate_1d": fraud1 / len(d1) if len(d1) else np.nan,
                "dev_days_since_first_seen": (
                    snap - tx.loc[tx["device_id"] == dev, "event_time"].min()
                ).total_seconds()
                / 86400,
            }
        )
    assert len(view["features"]) == len(rows[0]) - 1  # type: ignore[arg-type]
    return pd.DataFrame(rows).sort_values("device_id").reset_index(drop=True)


@pytest.fixture(scope="module")
def raw_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("snapshots")
    simulate(
        SimConfig(cards=300, merchants=30, days=12, start=date(2026, 3, 1), seed=7), root / "raw"
    )
    return root


def test_every_snapshot_aggregation_equals_a_reference_from_raw_rows(
    raw_world: Path, declare: object
) -> None:
    declare(with_views(DEVICE_VIEW))  # type: ignore[operator]
    day = date(2026, 3, 11)
    got = compute_day(raw_world / "raw", day)["device_7d"].to_pandas()
    want = _reference(raw_world / "raw", day, DEVICE_VIEW)
    assert list(got["device_id"]) == list(want["device_id"]) and len(want) > 50
    assert (got["event_timestamp"] == datetime(2026, 3, 12, tzinfo=UTC)).all()
    assert want["dev_fraud_count_7d"].sum() > 0  # the labels count
    for col in want.columns[1:]:
        if want[col].dtype == object:
            assert list(got[col]) == list(want[col]), col
            continue
        # float32 columns: the reference's float64, rounded the same way
        np.testing.assert_allclose(
            got[col].to_numpy(float), want[col].to_numpy(float), rtol=2e-7, atol=1e-6, err_msg=col
        )


@pytest.mark.slow  # a server of its own
def test_a_view_on_a_new_entity_goes_through_batch_feast_and_the_online_store(
    raw_world: Path, declare: object
) -> None:
    """Declared alone: the batch writes its table, Feast registers an entity and a view
    for it and materializes it, Feast's own client and the service's reader read it back,
    and training's point-in-time join joins it. On a Redis of its own: the session's
    holds the world's snapshots, which these cards' (same ids, later days) would
    replace."""
    from fraud_scoring.redis_server import embedded_redis

    with embedded_redis() as url:
        _new_entity_round_trip(raw_world, declare, url)


def _new_entity_round_trip(raw_world: Path, declare: object, redis_server: str) -> None:
    from batch_jobs.batch import run_batch
    from batch_jobs.training_set import point_in_time_join
    from fraud_scoring.events import Transaction
    from fraud_scoring.feast_store import open_store
    from fraud_scoring.redis_clients import sync_client
    from service.core.online_features import OnlineFeatureReader

    declare(with_views(DEVICE_VIEW))  # type: ignore[operator]
    data = raw_world
    days = [date(2026, 3, 1) + timedelta(days=i) for i in range(11)]
    run_batch(data, days, redis_server)
    table = pq.read_table(
        partition_dir(data / "features", "device_7d", days[-1]) / "part-0.parquet"
    )
    snap = table.to_pandas().sample(20, random_state=2)
    # A card and a merchant with snapshots (Feast's file join fails when no row of a
    # view matches at all).
    card = (
        pq.read_table(partition_dir(data / "features", "card_30d", days[-1])).column(0)[0].as_py()
    )
    merchant = pq.read_table(partition_dir(data / "features", "merchant_90d", days[-1]))
    merchant_id = merchant.column(0)[0].as_py()
    store = open_store(data, redis_server)
    assert {e.name for e in store.list_entities()} >= {"card", "merchant", "device"}
    names = [f.name for f in F.views()[-1].features]
    online = store.get_online_features(
        features=[f"device_7d:{n}" for n in names],
        entity_rows=[{"device_id": d} for d in snap["device_id"]],
    ).to_df()
    for n in names:
        if snap[n].dtype == object:
            assert list(online[n]) == list(snap[n]), n
        else:
            np.testing.assert_allclose(
                online[n].to_numpy(float), snap[n].to_numpy(float), err_msg=n
            )
    # The service's reader: one transaction per sampled device, just after the snapshot.
    reader = OnlineFeatureReader(store.project)
    at = snapshot_time(days[-1]) + timedelta(hours=1)
    txns = [
        Transaction(
            transaction_id=f"x{i}",
            card_id=card,
            merchant_id=merchant_id,
            amount=10.0,
            currency="EUR",
            country="DE",
            channel="pos",
            mcc="5411",
            device_id=d,
            event_time=at,
        )
        for i, d in enumerate(snap["device_id"])
    ]
    client = sync_client(redis_server)
    for script in reader.scripts:
        client.script_load(script)
    pipe = client.pipeline(transaction=False)
    reader.queue(pipe, txns)
    rows = reader.parse(pipe.execute(), txns)
    np.testing.assert_allclose(
        np.asarray(rows.columns["dev_txn_count_7d"], float),
        snap["dev_txn_count_7d"].to_numpy(float),
    )
    # Training's join: a transaction an hour after the snapshot gets its values.
    sample = pd.DataFrame(
        {
            "transaction_id": [t.transaction_id for t in txns],
            "event_timestamp": [pd.Timestamp(at)] * len(txns),
            "card_id": card,
            "merchant_id": merchant_id,
            "device_id": list(snap["device_id"]),
        }
    )
    # Transactions without a device, and a device no snapshot knows, get nulls (the
    # caller's defaults), the others their values.
    extra = sample.head(2).assign(transaction_id=["y0", "y1"], device_id=[None, "d-unknown"])
    joined = point_in_time_join(store, pd.concat([sample, extra], ignore_index=True))
    np.testing.assert_allclose(
        joined["dev_amount_max_7d"].to_numpy(float)[:-2],
        snap["dev_amount_max_7d"].to_numpy(float),
    )
    assert joined["dev_amount_max_7d"].tail(2).isna().all()
    # None of them known: all null, not Feast's error.
    alone = point_in_time_join(store, extra.assign(device_id=["d-a", "d-b"]))
    assert alone["dev_amount_max_7d"].isna().all() and alone["card_txn_count_30d"].notna().all()


OWN_FIELDS = [
    {"name": "basket_items", "type": "number", "min": 0},
    {"name": "wallet", "type": "category", "values": ["apple", "google", "none"]},
]
OWN_VIEW = {
    "view": "device_own_7d",
    "entity": "device_id",
    "window": "7d",
    "features": [
        {"name": "dev_basket_mean_7d", "agg": "mean", "value": "basket_items"},
        {"name": "dev_basket_max_1d", "agg": "max", "value": "basket_items", "window": "1d"},
        {"name": "dev_wallets_7d", "agg": "distinct_count", "value": "wallet"},
        {"name": "dev_top_wallet_7d", "agg": "most_frequent", "value": "wallet"},
        {"name": "dev_apple_count_7d", "agg": "count", "filter": {"wallet": ["apple"]}},
    ],
}


def test_a_snapshot_view_reads_declared_fields_as_values_and_filters(
    raw_world: Path, declare: object, tmp_path: Path
) -> None:
    """A view's value (a number field, absent on some transactions: not in the mean) and
    its categorical value and filter (a category field), on raw partitions that keep the
    declared columns, equal a reference from the raw rows."""
    rng = np.random.default_rng(4)
    raw = tmp_path / "raw"
    for table in ("transactions", "labels"):
        for d in partition_days(raw_world / "raw", table):
            t = read_partition(raw_world / "raw", table, d)
            if table == "transactions":
                n = t.num_rows
                basket = np.where(rng.random(n) < 0.8, rng.integers(1, 9, n), np.nan)
                t = t.append_column(
                    "basket_items", pa.array(basket, pa.float64(), from_pandas=True)
                )
                wallet = np.where(rng.random(n) < 0.9, rng.choice(["apple", "google"], n), None)
                t = t.append_column("wallet", pa.array(wallet.tolist(), pa.string()))
            out = partition_dir(raw, table, d)
            out.mkdir(parents=True)
            pq.write_table(t, out / "part-0.parquet")
    declare(with_views(OWN_VIEW) | {"fields": OWN_FIELDS})  # type: ignore[operator]
    day = date(2026, 3, 11)
    got = compute_day(raw, day)["device_own_7d"].to_pandas().set_index("device_id")
    snap = pd.Timestamp(snapshot_time(day))
    tx = pd.concat(
        [
            read_partition(raw, "transactions", d).to_pandas()
            for d in partition_days(raw, "transactions")
        ]
    )
    tx = tx[(tx["event_time"] < snap) & tx["device_id"].notna() & (tx["device_id"] != "")]
    w7 = tx[tx["event_time"] >= snap - pd.Timedelta(days=7)]
    assert len(got) == w7["device_id"].nunique() > 50
    for dev, g in w7.groupby("device_id"):
        d1 = g[g["event_time"] >= snap - pd.Timedelta(days=1)]
        counts = g["wallet"].value_counts()
        want = {
            "dev_basket_mean_7d": g["basket_items"].mean(),  # NaN: skipped
            "dev_basket_max_1d": d1["basket_items"].max(),
            "dev_wallets_7d": g["wallet"].nunique(),
            "dev_top_wallet_7d": sorted(counts[counts == counts.max()].index)[0]
            if len(counts)
            else None,
            "dev_apple_count_7d": (g["wallet"] == "apple").sum(),
        }
        row = got.loc[dev]
        for name, v in want.items():
            if isinstance(v, str) or v is None:
                assert row[name] == v, (dev, name)
            else:
                np.testing.assert_allclose(float(row[name]), float(v), rtol=2e-7, err_msg=name)
    with pytest.raises(D.DeclarationError, match="needs a number column"):
        bad = {**OWN_VIEW, "features": [{"name": "x", "agg": "sum", "value": "wallet"}]}
        F.load_declarations(declare(with_views(bad) | {"fields": OWN_FIELDS}))  # type: ignore[operator]
