"""Deterministic transaction simulator with realistic fraud patterns.

Normal traffic: each card has a home country, a spending scale, favourite merchants and
a daily rate; times follow a day/night curve in the local time of the transaction's
country (one fixed UTC offset per country, kept in ``utc_offset_min``). Five fraud
patterns are injected so that 30-day aggregates, minute-level card velocity and
merchant-level windows all carry signal:

* **card testing**: a burst of 5-20 tiny ecom amounts within minutes at a fraud-sink
  merchant, then one to three large ones;
* **account takeover**: a new country and a new device, then several large amounts
  over a few hours;
* **compromised merchant**: cards seen at a breached merchant during its breach
  window turn fraudulent days later (large ecom amounts at fraud-sink merchants);
* **distributed card testing**: one ecom merchant receives a single tiny attempt from
  each of 30-120 different cards within an hour (each card looks quiet; the merchant's
  10-minute count and distinct cards do not);
* **compromised terminal**: for 2-4 weeks, a quarter of an ordinary merchant's own
  transactions are fraudulent, at 1.5-4x its usual ticket (its fraud rate, once the
  chargebacks arrive, and its short-window mean amount carry it).

Fraud labels (chargebacks) arrive 2-20 days after the transaction and are written by
arrival day. All randomness comes from one seeded generator: same arguments, same data.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from fraud_scoring.events import raw_row_to_event
from fraud_scoring.storage import staging_dir, write_partition

log = logging.getLogger(__name__)

COUNTRIES = np.array(["US", "GB", "DE", "FR", "CA", "MX", "BR", "JP", "IN", "NG", "RU", "CN"])
HOME_P = np.array([0.55, 0.1, 0.08, 0.07, 0.06, 0.04, 0.03, 0.03, 0.02, 0.01, 0.005, 0.005])
CURRENCY = {
    "US": "USD",
    "GB": "GBP",
    "DE": "EUR",
    "FR": "EUR",
    "CA": "CAD",
    "MX": "MXN",
    "BR": "BRL",
    "JP": "JPY",
    "IN": "INR",
    "NG": "NGN",
    "RU": "RUB",
    "CN": "CNY",
}
# Standard-time offsets (minutes east of UTC) of each country's main time zone.
UTC_OFFSET_MIN = np.array([-300, 0, 60, 60, -300, -360, -180, 540, 330, 60, 180, 480])
CHANNELS = np.array(["pos", "ecom", "atm"])
# The fraud patterns, in the order of their codes (1, 2, ...) in generate().
PATTERNS = (
    "card_testing",
    "account_takeover",
    "compromised_merchant",
    "distributed_card_testing",
    "compromised_terminal",
)
MCCS = np.array(["5411", "5812", "5541", "5999", "5732", "4111", "7011", "5311", "6011", "5967"])
# Hour-of-day weights for normal spending, in local time.
HOUR_W = np.array(
    [1, 0.5, 0.3, 0.3, 0.3, 0.5, 1, 2, 3, 4, 5, 5, 6, 6, 5, 5, 5, 6, 7, 7, 6, 4, 3, 2]
)


@dataclass(frozen=True)
class SimConfig:
    cards: int = 5000
    merchants: int = 500
    days: int = 30
    start: date = date(2026, 1, 1)
    txns_per_card_day: float = 2.0
    seed: int = 7

    @classmethod
    def from_args(cls, args: object) -> SimConfig:
        """From parsed CLI flags named cards, merchants, days, start, rate and seed."""
        return cls(
            **{
                f: getattr(args, a)
                for f, a in (
                    ("cards", "cards"),
                    ("merchants", "merchants"),
                    ("days", "days"),
                    ("start", "start"),
                    ("txns_per_card_day", "rate"),
                    ("seed", "seed"),
                )
            }
        )


def _table(cols: dict[str, np.ndarray]) -> pa.Table:
    return pa.table(
        {
            "transaction_id": pa.array(cols["transaction_id"], pa.string()),
            "card_id": pa.array(cols["card_id"], pa.string()),
            "merchant_id": pa.array(cols["merchant_id"], pa.string()),
            "amount": pa.array(cols["amount"], pa.float64()),
            "currency": pa.array(cols["currency"], pa.string()),
            "event_time": pa.array(cols["event_time"], pa.timestamp("us", tz="UTC")),
            "utc_offset_min": pa.array(cols["utc_offset_min"], pa.int16()),
            "country": pa.array(cols["country"], pa.string()),
            "channel": pa.array(cols["channel"], pa.string()),
            "mcc": pa.array(cols["mcc"], pa.string()),
            "device_id": pa.array(cols["device_id"], pa.string()),
            "is_fraud": pa.array(cols["is_fraud"], pa.bool_()),
            "fraud_pattern": pa.array(cols["fraud_pattern"], pa.string()),
        }
    )


def generate(cfg: SimConfig) -> dict[str, np.ndarray]:
    """All transactions of the simulation as columns, sorted by event time.

    ``event_time`` is int64 microseconds since the epoch (UTC). ``is_fraud`` is the
    ground truth; ``label_time`` (µs) is when its chargeback arrives (-1: never).
    """
    rng = np.random.default_rng(cfg.seed)
    C, M, D = cfg.cards, cfg.merchants, cfg.days
    t0 = int(datetime.combine(cfg.start, datetime.min.time(), UTC).timestamp() * 1e6)
    day_us = 86_400_000_000

    # --- cards and merchants --------------------------------------------------------
    home = rng.choice(len(COUNTRIES), size=C, p=HOME_P)
    scale = rng.lognormal(0.0, 0.5, size=C)
    rate = rng.gamma(2.0, cfg.txns_per_card_day / 2.0, size=C)
    first_day = np.where(rng.random(C) < 0.8, 0, rng.integers(0, max(D, 1), size=C))
    favs = rng.integers(0, M, size=(C, 8))
    m_channel = rng.choice(3, size=M, p=[0.6, 0.3, 0.1])
    m_mcc = rng.integers(0, len(MCCS), size=M)
    m_scale = rng.lognormal(3.3, 0.6, size=M)  # ~27 typical ticket
    n_sink = max(2, M // 100)
    sinks = rng.choice(M, size=n_sink, replace=False)
    m_channel[sinks] = 1

    # --- normal traffic ---------------------------------------------------------------
    counts = rng.poisson(np.outer(rate, np.ones(D)))  # (C, D)
    counts[np.arange(D)[None, :] < first_day[:, None]] = 0
    n = int(counts.sum())
    card = np.repeat(np.repeat(np.arange(C), D), counts.ravel())
    day = np.repeat(np.tile(np.arange(D), C), counts.ravel())
    hour = rng.choice(24, size=n, p=HOUR_W / HOUR_W.sum())
    t = t0 + day * day_us + hour * 3_600_000_000 + rng.integers(0, 3_600_000_000, size=n)
    zipf = np.array([0.35, 0.2, 0.13, 0.1, 0.08, 0.06, 0.05, 0.03])
    merch = favs[card, rng.choice(8, size=n, p=zipf)]
    travel = rng.random(n) < 0.03
    ctry = np.where(travel, rng.choice(len(COUNTRIES), size=n), home[card])
    t = t - UTC_OFFSET_MIN[ctry].astype(np.int64) * 60_000_000  # local hours -> UTC
    chan = m_channel[merch]
    amt = np.round(rng.lognormal(np.log(m_scale[merch] * scale[card]), 0.7), 2) + 0.01
    # Legitimate look-alikes of fraud signals: rare big-ticket purchases ...
    big_ticket = rng.random(n) < 0.004
    amt = np.where(big_ticket, np.round(amt * rng.uniform(8, 40, size=n), 2), amt)
    amt = np.where(chan == 2, np.round(amt / 20 + 1) * 20, amt)  # ATM: round twenties
    device = np.where(chan == 1, card, -1)  # home device for ecom, none otherwise
    pattern = np.zeros(n, dtype=np.int8)

    parts = [(card, merch, t, amt, ctry, chan, device, pattern)]

    # ... and bursts of small in-person purchases within minutes (transit, vending).
    n_lb = max(1, int(C * D * 0.0015))
    lb_card = rng.integers(0, C, size=n_lb)
    lb_k = rng.integers(3, 7, size=n_lb)
    cb = np.repeat(lb_card, lb_k)
    tb = np.repeat(t0 + rng.integers(0, D * day_us, size=n_lb), lb_k) + rng.integers(
        0, 600_000_000, size=len(cb)
    )
    mb = np.repeat(favs[lb_card, 0], lb_k)
    parts.append(
        (
            cb,
            mb,
            tb,
            np.round(rng.uniform(1.0, 6.0, size=len(cb)), 2),
            home[cb],
            np.zeros(len(cb), int),
            np.full(len(cb), -1),
            np.zeros(len(cb), np.int8),
        )
    )
    n_dev = C  # fresh fraudster device ids start after the cards' own

    # --- card testing -------------------------------------------------------------------
    n_ct = max(1, int(C * D * 0.0004))
    ct_card = rng.integers(0, C, size=n_ct)
    ct_start = t0 + rng.integers(0, D * day_us, size=n_ct)
    sizes = rng.integers(5, 21, size=n_ct)
    big = rng.integers(1, 4, size=n_ct)
    tot = sizes + big
    c1 = np.repeat(ct_card, tot)
    idx = np.concatenate([np.arange(k) for k in tot])
    small = idx < np.repeat(sizes, tot)
    t1 = np.repeat(ct_start, tot) + np.where(
        small,
        idx * rng.integers(5_000_000, 40_000_000, size=len(c1)),
        np.repeat(sizes, tot) * 30_000_000 + rng.integers(60_000_000, 3_600_000_000, size=len(c1)),
    )
    a1 = np.where(
        small,
        np.round(rng.uniform(0.5, 5.0, size=len(c1)), 2),
        np.round(rng.uniform(300, 2500, size=len(c1)), 2),
    )
    # Most testers use a fraud-sink merchant; some a random ordinary one.
    tester = np.where(
        rng.random(n_ct) < 0.7,
        sinks[rng.integers(0, n_sink, size=n_ct)],
        rng.integers(0, M, size=n_ct),
    )
    m1 = tester[np.repeat(np.arange(n_ct), tot)]
    dev1 = n_dev + np.repeat(np.arange(n_ct), tot)
    n_dev += n_ct
    parts.append(
        (c1, m1, t1, a1, home[c1], np.ones(len(c1), int), dev1, np.full(len(c1), 1, np.int8))
    )

    # --- account takeover ---------------------------------------------------------------
    n_ato = max(1, int(C * D * 0.0002))
    ato_card = rng.integers(0, C, size=n_ato)
    ato_start = t0 + rng.integers(0, D * day_us, size=n_ato)
    k = rng.integers(3, 9, size=n_ato)
    c2 = np.repeat(ato_card, k)
    t2 = np.repeat(ato_start, k) + rng.integers(0, 6 * 3_600_000_000, size=len(c2))
    # A new device always; a new country for most (some takeovers stay domestic).
    foreign = np.where(
        rng.random(n_ato) < 0.6,
        (home[ato_card] + rng.integers(1, len(COUNTRIES), size=n_ato)) % len(COUNTRIES),
        home[ato_card],
    )
    a2 = np.round(scale[c2] * rng.uniform(100, 1500, size=len(c2)), 2)
    m2 = rng.integers(0, M, size=len(c2))
    dev2 = n_dev + np.repeat(np.arange(n_ato), k)
    n_dev += n_ato
    parts.append(
        (
            c2,
            m2,
            t2,
            a2,
            np.repeat(foreign, k),
            np.ones(len(c2), int),
            dev2,
            np.full(len(c2), 2, np.int8),
        )
    )

    # --- compromised merchant -------------------------------------------------------------
    n_breach = max(1, M // 50)
    breached = rng.choice(np.setdiff1d(np.arange(M), sinks), size=n_breach, replace=False)
    b_start = t0 + rng.integers(0, max(1, D // 2), size=n_breach) * day_us
    hit = np.zeros(n, bool)
    for bm, bs in zip(breached, b_start, strict=True):
        hit |= (merch == bm) & (t >= bs) & (t < bs + 5 * day_us)
    victims = np.unique(card[hit])
    victims = victims[rng.random(len(victims)) < 0.3]
    first_hit = {int(c): int(ts) for c, ts in zip(card[hit][::-1], t[hit][::-1], strict=True)}
    k3 = rng.integers(2, 6, size=len(victims))
    c3 = np.repeat(victims, k3)
    base = np.array([first_hit[int(v)] for v in victims], dtype=np.int64)
    t3 = np.repeat(base + rng.integers(3, 15, size=len(victims)) * day_us, k3) + rng.integers(
        0, 12 * 3_600_000_000, size=len(c3)
    )
    a3 = np.round(rng.uniform(50, 1200, size=len(c3)), 2)
    m3 = np.where(
        rng.random(len(c3)) < 0.6,
        sinks[rng.integers(0, n_sink, size=len(c3))],
        rng.integers(0, M, size=len(c3)),
    )
    ctry3 = np.where(rng.random(len(c3)) < 0.5, home[c3], rng.integers(0, len(COUNTRIES), len(c3)))
    dev3 = n_dev + np.arange(len(c3))
    n_dev += len(c3)
    parts.append((c3, m3, t3, a3, ctry3, np.ones(len(c3), int), dev3, np.full(len(c3), 3, np.int8)))

    # --- distributed card testing: many cards, one tiny attempt each, one merchant -------
    n_dct = max(1, int(C * D * 0.00008))
    d_merch = np.where(
        rng.random(n_dct) < 0.5,
        sinks[rng.integers(0, n_sink, size=n_dct)],
        rng.integers(0, M, size=n_dct),
    )
    d_start = t0 + rng.integers(0, D * day_us, size=n_dct)
    d_k = rng.integers(30, 121, size=n_dct)
    c4 = rng.integers(0, C, size=int(d_k.sum()))
    burst = np.repeat(np.arange(n_dct), d_k)
    t4 = d_start[burst] + rng.integers(0, 3_600_000_000, size=len(c4))
    a4 = np.round(rng.uniform(0.5, 3.0, size=len(c4)), 2)
    dev4 = n_dev + burst  # one fraudster device per burst
    n_dev += n_dct
    parts.append(
        (
            c4,
            d_merch[burst],
            t4,
            a4,
            home[c4],
            np.ones(len(c4), int),
            dev4,
            np.full(len(c4), 4, np.int8),
        )
    )

    # --- compromised terminal: a share of one merchant's own traffic, for weeks ----------
    n_term = max(1, M // 150)
    terminals = rng.choice(
        np.setdiff1d(np.arange(M), np.concatenate([sinks, breached])), size=n_term, replace=False
    )
    tm_start = t0 + rng.integers(0, max(1, D // 2), size=n_term) * day_us
    tm_len = rng.integers(14, 29, size=n_term) * day_us
    base_pattern = parts[0][7]
    for tm, ts0, tl in zip(terminals, tm_start, tm_len, strict=True):
        inside = (merch == tm) & (t >= ts0) & (t < ts0 + tl) & (rng.random(n) < 0.25)
        base_pattern[inside] = 5
        amt[inside] = np.round(amt[inside] * rng.uniform(1.5, 4.0, size=int(inside.sum())), 2)

    merged: list[np.ndarray] = [np.concatenate([p[i] for p in parts]) for i in range(8)]
    t = merged[2]
    keep = (t >= t0) & (t < t0 + D * day_us)
    order = np.argsort(t[keep], kind="stable")
    card, merch, t, amt, ctry, chan, device, pattern = (a[keep][order] for a in merged)
    n = len(t)
    is_fraud = pattern > 0
    label_time = np.where(is_fraud, t + rng.integers(2, 21, size=n) * day_us, -1)

    card_names = np.array([f"c{i:07d}" for i in range(C)], dtype=object)
    merch_names = np.array([f"m{i:05d}" for i in range(M)], dtype=object)
    dev_names = np.array([f"d{i:08d}" for i in range(n_dev)] + [None], dtype=object)
    cur = np.array([CURRENCY[c] for c in COUNTRIES], dtype=object)
    return {
        "transaction_id": np.array([f"t{cfg.seed}-{i:09d}" for i in range(n)], dtype=object),
        "card_id": card_names[card],
        "merchant_id": merch_names[merch],
        "amount": amt.astype(np.float64),
        "currency": cur[ctry],
        "event_time": t.astype(np.int64),
        "utc_offset_min": UTC_OFFSET_MIN[ctry].astype(np.int16),
        "country": COUNTRIES.astype(object)[ctry],
        "channel": CHANNELS.astype(object)[chan],
        "mcc": MCCS.astype(object)[m_mcc[merch]],
        "device_id": dev_names[device],
        "is_fraud": is_fraud,
        "fraud_pattern": np.array(["", *PATTERNS], dtype=object)[pattern],
        "label_time": label_time.astype(np.int64),
    }


def write(cols: dict[str, np.ndarray], raw_dir: Path, cfg: SimConfig) -> int:
    """Write transactions by event day and labels by arrival day; returns rows written."""
    day_us = 86_400_000_000
    t0 = int(datetime.combine(cfg.start, datetime.min.time(), UTC).timestamp() * 1e6)
    day_idx = (cols["event_time"] - t0) // day_us
    bounds = np.searchsorted(day_idx, np.arange(cfg.days + 1))
    for d in tqdm(range(cfg.days), desc="write days", unit="day", disable=None):
        sl = slice(bounds[d], bounds[d + 1])
        write_partition(
            raw_dir,
            "transactions",
            cfg.start + timedelta(days=d),
            _table({k: v[sl] for k, v in cols.items() if k != "label_time"}),
        )
    fraud = np.flatnonzero(cols["is_fraud"])
    lt = cols["label_time"][fraud]
    lday = (lt - t0) // day_us
    for d in np.unique(lday):
        sel = fraud[lday == d]
        write_partition(
            raw_dir,
            "labels",
            cfg.start + timedelta(days=int(d)),
            pa.table(
                {
                    "transaction_id": pa.array(cols["transaction_id"][sel], pa.string()),
                    "card_id": pa.array(cols["card_id"][sel], pa.string()),
                    "merchant_id": pa.array(cols["merchant_id"][sel], pa.string()),
                    "event_time": pa.array(cols["event_time"][sel], pa.timestamp("us", tz="UTC")),
                    "label_time": pa.array(cols["label_time"][sel], pa.timestamp("us", tz="UTC")),
                    "is_fraud": pa.array(np.ones(len(sel), bool), pa.bool_()),
                }
            ),
        )
    return len(cols["event_time"])


def simulate(cfg: SimConfig, raw_dir: Path) -> int:
    """Generate and write the simulation; returns the number of transactions.

    ``raw_dir`` is replaced as a whole (written beside it, then swapped in): partitions
    of an earlier, longer simulation must not survive next to this one, where their
    labels would attach to this run's transactions of the same id.
    """
    cols = generate(cfg)
    with staging_dir(raw_dir) as tmp:
        n = write(cols, tmp, cfg)
        if raw_dir.exists():
            old = raw_dir.parent / f".old-{raw_dir.name}-{uuid.uuid4().hex}"
            os.rename(raw_dir, old)
            os.rename(tmp, raw_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, raw_dir)
    log.info(
        "simulated %d transactions (%d fraud) into %s", n, int(cols["is_fraud"].sum()), raw_dir
    )
    return n


def live_events(
    cfg: SimConfig,
    *,
    late_fraction: float = 0.05,
    max_lateness_s: float = 60.0,
    duplicate_rate: float = 0.02,
) -> list[dict[str, object]]:
    """The simulation as a live feed: JSON-ready event dicts in *arrival* order.

    Arrival follows event time, except that ``late_fraction`` of the events arrive up
    to ``max_lateness_s`` late (so out of order) and ``duplicate_rate`` of them arrive a
    second time, up to ``max_lateness_s`` after the first. ``event_time`` is RFC 3339
    with microseconds and offset. Same arguments, same feed.
    """
    cols = generate(cfg)
    rng = np.random.default_rng(cfg.seed + 1)
    n = len(cols["event_time"])
    t_us = cols["event_time"]
    delay = np.where(
        rng.random(n) < late_fraction, rng.uniform(0, max_lateness_s * 1e6, size=n), 0
    ).astype(np.int64)
    dup = np.flatnonzero(rng.random(n) < duplicate_rate)
    idx = np.concatenate([np.arange(n), dup])
    arrival = np.concatenate(
        [
            t_us + delay,
            t_us[dup]
            + delay[dup]
            + rng.uniform(0, max_lateness_s * 1e6, size=len(dup)).astype(np.int64),
        ]
    )
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    events = []
    for i in idx[np.argsort(arrival, kind="stable")]:
        row = {k: v[i] for k, v in cols.items()}
        row["amount"] = float(row["amount"])
        row["event_time"] = epoch + timedelta(microseconds=int(t_us[i]))
        events.append(raw_row_to_event(row))
    return events
