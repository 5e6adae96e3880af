"""The training set's batch half: Feast's point-in-time join, one feature view at a time.

Feast's file offline store drops an entity row outright when one of its entities has
snapshots but none within ``[t - TTL, t]`` (e.g. a card's first transactions, before its
first snapshot exists). Joined with every view at once, such a row also loses the
*other* views' values: a new card's transaction came back with no merchant features,
while the service reads each view on its own and serves them. Joining each view alone
keeps every view's own point-in-time answer, exactly as the service reads it.

Feast's join also keeps one entity row per (join key, event time): of two transactions
of one card (or merchant) at the same instant, one came back and the other was dropped,
i.e. null features, while the service reads the snapshot for both (with 1-second
timestamps, 8 card rows and 36 merchant rows of the 3,000-card test world). Each view is
therefore asked once per distinct (join key, event time) and the answer is given to
every row that shares it. Rows without the key (no device id, say) and rows whose key no
snapshot holds are not asked: their features are null (Feast's file join fails outright
when none of the rows it is given matches a snapshot).
"""

from __future__ import annotations

import logging

import pandas as pd
import pyarrow.parquet as pq
from feast import FeatureStore

from fraud_scoring.features import view_features, views
from fraud_scoring.storage import DataError

log = logging.getLogger(__name__)


def point_in_time_join(store: FeatureStore, sample: pd.DataFrame) -> pd.DataFrame:
    """``sample`` (one row per ``transaction_id``, with ``event_timestamp`` and each view's
    join key) plus every batch feature as of each row's own event time, in ``sample``'s
    row order. A view with no usable snapshot for a row (none at or before ``t`` within
    the view's TTL) leaves that view's features null (the caller applies defaults); the
    other views are unaffected. No row is lost."""
    if sample["transaction_id"].duplicated().any():
        raise DataError("the sample holds a transaction twice")
    out = sample
    for view in views():
        refs = [f"{view.name}:{f.name}" for f in view_features(view)]
        feats = [f.name for f in view_features(view)]
        tie = [view.join_key, "event_timestamp"]
        # One entity row per (key, time), named by its first transaction; every row
        # sharing that key and time takes that one's answer.
        keys = sample[["transaction_id", *tie]].assign(
            _asked=sample.groupby(tie, sort=False, dropna=False)["transaction_id"].transform(
                "first"
            )
        )
        asked = keys[keys["transaction_id"] == keys["_asked"]][["transaction_id", *tie]]
        stored = _stored_keys(store, view.name, view.join_key)
        if stored is not None:
            asked = asked[asked[view.join_key].isin(stored)]
        if asked.empty:
            joined = pd.DataFrame(columns=["transaction_id", *feats])
        else:
            joined = store.get_historical_features(entity_df=asked, features=refs).to_df()
        if joined["transaction_id"].duplicated().any():
            raise DataError(f"the point-in-time join of {view.name} returned a row twice")
        lost = len(asked) - len(joined)
        if lost:
            log.info("%s: %d rows had no snapshot within the TTL: kept, null", view.name, lost)
        answers = joined[["transaction_id", *feats]].rename(columns={"transaction_id": "_asked"})
        per_row = keys[["transaction_id", "_asked"]].merge(answers, on="_asked", how="left")
        out = out.merge(per_row.drop(columns="_asked"), on="transaction_id", how="left")
    return out


def _stored_keys(store: FeatureStore, view: str, join_key: str) -> pd.Series | None:
    """The keys any snapshot of ``view`` holds (its file source's key column); None when
    its source is not a file (every row is asked)."""
    path = getattr(store.get_feature_view(view).batch_source, "path", None)
    if path is None:
        return None
    try:
        return pq.read_table(path, columns=[join_key]).column(0).unique().to_pandas()
    except OSError as exc:
        raise DataError(f"{view}: cannot read its snapshots at {path}: {exc}") from None
