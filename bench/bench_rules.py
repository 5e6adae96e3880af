"""What decision rules cost the scoring path (issue 40, item 6): CPU per transaction of a
micro-batch's decision (:meth:`service.core.scoring.Scorer._decide`, as the service runs
it) with no rules (the baseline: the service without rules), the shipped
``feature_repo/rules.yaml`` (3 rules) and 100 generated shipped-like rules, at
micro-batch 1, 8 and 64, in one run.

Protocol. No world, no server: transactions and feature columns are synthesized with a
fixed seed (the model's feature names, float32 and float64 columns, values like a real
batch's: counts, amounts, rates, flags, the score) and 32 distinct batches per size are
cycled. The 100 rules are generated (``--seed``): allow, decline and review rules, one in
five in shadow mode, list membership (five lists; a list column marks 0.5 % of rows),
string tests (``country != 'US'``, ``mcc in (...)``, ``not (channel == 'pos')``),
comparisons and ratios of features and of the score, joined by and/or; each threshold a
quantile of its column, so that a rule matches 0.1 - 2 % of rows (the share of rows
some rule matches is printed). ``_decide`` is called on a stand-in scorer holding the
rules (its settings and rules holder: what the method reads), the list reads' columns in
``cols`` as the store's reply leaves them. CPU is the process's time
(``time.process_time``) over ``--seconds`` per cell, the cells interleaved, the best of
``--rounds`` rounds; the rules' cost is a cell minus the no-rules cell of its size.
Below, the rules' own steps for the 100 rules (``RuleSet.masks``, ``Verdicts``; the rest
is the rows' reasons and messages in ``_decide``'s loop).

    python -m bench.bench_rules [--seconds 0.3] [--rounds 5] [--sizes 1,8,64]

Goal (issue 40): 100 shipped-like rules add <= 30 us of CPU per transaction at
micro-batch 64.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from fraud_scoring import rules as R
from fraud_scoring.events import Transaction
from fraud_scoring.features import default_model_features
from service.core.decision import Verdicts
from service.core.rules import known_features
from service.core.scoring import Scorer, _Route, policy_for
from service.settings import ServiceSettings

GOAL_US = 30.0
LISTS = {
    "blocked_cards": "card_id",
    "blocked_devices": "device_id",
    "blocked_merchants": "merchant_id",
    "trusted_merchants": "merchant_id",
    "watched_countries": "country",
}
COUNTRIES = ["US"] * 17 + ["CA", "GB", "MX", "FR", "DE", "BR", "NG", "RU"]
MCCS = ["5812", "5411", "4111", "5999", "5732", "7995", "4829", "6051", "5311", "5541"]


def column(name: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """Values like a real batch's for the feature ``name``."""
    if name.startswith(("is_", "has_", "channel_", "card_is_")) or name.endswith(
        ("_changed_24h", "has_snapshot")
    ):
        return (rng.random(n) < 0.15).astype(np.float64)
    if "rate" in name:
        return rng.beta(0.5, 60, n)
    if "seconds_since" in name:
        return rng.exponential(3_000, n)
    if name == "hour_of_day_local":
        return rng.integers(0, 24, n).astype(np.float64)
    if "zscore" in name:
        return rng.normal(0, 1.2, n)
    if "days_since" in name:
        return rng.exponential(200, n)
    if "count" in name or "distinct" in name:
        scale = 40 if "merchant_txn" in name else 3
        return rng.poisson(scale, n).astype(np.float64)
    if name.startswith("amount_to"):
        return rng.lognormal(0, 0.8, n)
    if name == "amount_log":
        return np.log1p(rng.lognormal(3.8, 1.2, n))
    return rng.lognormal(4.0, 1.3, n)  # amounts, sums, means, stds


def transactions(rng: np.random.Generator, n: int) -> list[Transaction]:
    t0 = datetime(2026, 1, 14, tzinfo=UTC)
    return [
        Transaction.model_validate(
            {
                "transaction_id": f"t{i}",
                "card_id": f"c{rng.integers(0, 3000):07d}",
                "merchant_id": f"m{rng.integers(0, 300):05d}",
                "amount": round(float(rng.lognormal(3.8, 1.2)), 2) + 0.01,
                "currency": "USD",
                "event_time": (t0 + timedelta(seconds=i)).isoformat(),
                "country": COUNTRIES[rng.integers(0, len(COUNTRIES))],
                "channel": ("pos", "ecom", "atm")[rng.integers(0, 3)],
                "mcc": MCCS[rng.integers(0, len(MCCS))],
                "device_id": f"d{rng.integers(0, 9000):07d}" if rng.random() < 0.6 else None,
            }
        )
        for i in range(n)
    ]


def generated_rules(count: int, seed: int, names: Sequence[str]) -> bytes:
    """``count`` shipped-like rules over ``names`` (thresholds: quantiles of the
    synthesized columns), as a rules file."""
    rng = np.random.default_rng(seed)
    big = {n: column(n, np.random.default_rng(7), 20_000) for n in names}
    numeric = [n for n in names if n != "amount" and np.unique(big[n][:500]).size > 4]
    flags = [n for n in names if np.unique(big[n][:500]).size <= 2]

    def q(name: str, p: float) -> str:
        return f"{float(np.quantile(big[name], p)):.4g}"

    def pick(seq: Sequence[str]) -> str:
        return seq[int(rng.integers(0, len(seq)))]

    lines = ["lists:"]
    lines += [f"  {lst}: {{key: {key}}}" for lst, key in LISTS.items()]
    lines.append("rules:")
    for i in range(count):
        kind = i % 10
        f, g = pick(numeric), pick(numeric)
        action = "review"
        if kind == 0:
            when = (
                "card_id in blocked_cards or device_id in blocked_devices "
                f"and amount > {q('amount', 0.5)}"
            )
            action = "decline"
        elif kind == 1:
            when = f"merchant_id in trusted_merchants and score < 0.{rng.integers(3, 8)}"
            action = "allow"
        elif kind == 2:
            when = f"{f} > {q(f, 0.99)}"
        elif kind == 3:
            when = f"{f} > {q(f, 0.85)} and {g} >= {q(g, 0.9)}"
            action = "decline"
        elif kind == 4:
            when = f"amount > {q('amount', 0.9)} and country != 'US' and {pick(flags)} == 1"
        elif kind == 5:
            when = f"score >= 0.{rng.integers(6, 9)} and ({f} > {q(f, 0.9)} or {g} > {q(g, 0.95)})"
            action = "decline"
        elif kind == 6:
            when = (
                f"not (channel == 'pos') and mcc in ('7995', '4829', '6051') and {f} > {q(f, 0.8)}"
            )
        elif kind == 7:
            when = f"amount / ({f} + 1) > {q('amount', 0.99)} / ({q(f, 0.5)} + 1) * 3"
        elif kind == 8:
            lst = pick(["blocked_merchants", "watched_countries"])
            key = LISTS[lst]
            when = f"{key} in {lst} and ({f} > {q(f, 0.7)} or amount > {q('amount', 0.95)})"
            action = "decline" if lst == "blocked_merchants" else "review"
        else:
            when = f"{f} >= {q(f, 0.995)} or {g} < {q(g, 0.002)} and {pick(flags)} == 0"
        mode = "shadow" if i % 5 == 4 else "active"
        message = (
            f"Amount {{amount:.2f}} and {f} {{{f}:.3g}} (rule {i})."
            if i % 3 == 0 and f in when
            else f"Generated rule {i}."
        )
        lines.append(
            f"  - {{code: GEN_{i:03d}, action: {action}, mode: {mode}, "
            f"when: {when!r}, message: {message!r}}}"
        )
    return ("\n".join(lines) + "\n").encode()


def batch(
    rng: np.random.Generator, n: int, names: Sequence[str], rs: Sequence[R.RuleSet]
) -> tuple[list[Transaction], dict[str, np.ndarray], np.ndarray]:
    txns = transactions(rng, n)
    cols: dict[str, np.ndarray] = {}
    for j, name in enumerate(names):
        v = column(name, rng, n)
        cols[name] = v.astype(np.float32) if j % 2 else v  # the store's float32, derived f64
    cols["amount"] = np.array([t.amount for t in txns])
    for ruleset in rs:  # the list reads' columns, as lists.members leaves them
        for lst, fld in ruleset.list_reads:
            cols[R.member_column(lst, fld)] = rng.random(n) < 0.005
    scores = rng.beta(0.4, 8, n).astype(np.float32)
    return txns, cols, scores


def cpu_per_call(fn: Callable[[int], Any], calls: int, seconds: float) -> float:
    """CPU seconds per call of ``fn(k)`` (k cycles over the batches), over ``seconds``."""
    start = time.process_time()
    done = 0
    while True:
        for _ in range(20):
            fn(done % calls)
            done += 1
        spent = time.process_time() - start
        if spent >= seconds:
            return spent / done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=0.3, help="CPU seconds per cell and round")
    p.add_argument("--rounds", type=int, default=5, help="the best of this many rounds")
    p.add_argument("--sizes", default="1,8,64", help="micro-batch sizes")
    p.add_argument("--rules", type=int, default=100, help="generated rules")
    p.add_argument("--seed", type=int, default=40)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [n for n in default_model_features() if n in known_features() or n == "amount"]
    known = set(known_features())
    sets = {
        "no rules": R.parse(b"rules: []\n", "none.yaml", known),
        "shipped": R.load(R.DEFAULT_PATH, known),
        f"{args.rules} generated": R.parse(
            generated_rules(args.rules, args.seed, names), "generated.yaml", known
        ),
    }
    settings = ServiceSettings()
    model = cast(
        Any,
        SimpleNamespace(
            version="bench",
            variant="default",
            meta=SimpleNamespace(
                thresholds_for=lambda _v: SimpleNamespace(review=0.5, decline=0.9),
                feature_importance={n: 1.0 / (1 + j) for j, n in enumerate(names)},
            ),
        ),
    )
    policy = policy_for(model, settings)
    rng = np.random.default_rng(args.seed)
    batches = {n: [batch(rng, n, names, list(sets.values())) for _ in range(32)] for n in sizes}
    big = sets[f"{args.rules} generated"]

    def decide(rs: R.RuleSet, n: int) -> Callable[[int], Any]:
        scorer = SimpleNamespace(settings=settings, rules=SimpleNamespace(current=rs))

        def one(k: int) -> Any:
            txns, cols, scores = batches[n][k % 32]
            return Scorer._decide(
                cast(Any, scorer), txns, model, scores, _Route(), [[]] * n, [[]] * n, cols
            )

        return one

    def masks(n: int) -> Callable[[int], Any]:
        def one(k: int) -> Any:
            txns, cols, scores = batches[n][k % 32]
            numbers: dict[str, Any] = {**cols, "score": scores}
            numbers["review_amount_limit"] = policy.review_amount_limit
            return big.masks(numbers, R.string_columns(txns, big.string_fields), cols, n)

        return one

    def verdicts(n: int) -> Callable[[int], Any]:
        pre = []
        for txns, cols, scores in batches[n]:
            numbers: dict[str, Any] = {**cols, "score": scores}
            numbers["review_amount_limit"] = policy.review_amount_limit
            pre.append(
                (big.masks(numbers, R.string_columns(txns, big.string_fields), cols, n), scores)
            )

        def one(k: int) -> Any:
            m, scores = pre[k % 32]
            return Verdicts(big.rules, m, n, scores, 0.5, 0.9)

        return one

    cells: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for n in sizes:
            for label, rs in sets.items():
                t = cpu_per_call(decide(rs, n), 32, args.seconds) / n * 1e6
                cells[label, n] = min(cells.get((label, n), t), t)
            for label, fn in (("masks", masks(n)), ("Verdicts", verdicts(n))):
                t = cpu_per_call(fn, 32, args.seconds / 2) / n * 1e6
                cells[label, n] = min(cells.get((label, n), t), t)

    hit = []
    for n in sizes:
        m = [masks(n)(k) for k in range(32)]
        hit.append(f"{np.mean([x.any(axis=0).mean() for x in m]):.0%} at {n}")
    print(
        f"{len(names)} feature columns; {args.rules} generated rules "
        f"({sum(r.active for r in big.rules)} active, {len(big.list_reads)} list reads, "
        f"{len(big.tests)} string tests); rows some rule matches: {', '.join(hit)}"
    )
    print(f"CPU per transaction, us (best of {args.rounds} rounds of {args.seconds} s per cell)")
    print(f"{'micro-batch':<24}" + "".join(f"{n:>12}" for n in sizes))
    for label in sets:
        print(f"{'_decide, ' + label:<24}" + "".join(f"{cells[label, n]:12.1f}" for n in sizes))
    for label in list(sets)[1:]:
        added = [cells[label, n] - cells["no rules", n] for n in sizes]
        print(f"{'  added by ' + label:<24}" + "".join(f"{a:12.1f}" for a in added))
    for label in ("masks", "Verdicts"):
        print(f"{'  of which ' + label:<24}" + "".join(f"{cells[label, n]:12.1f}" for n in sizes))
    if 64 in sizes:
        at64 = cells[f"{args.rules} generated", 64] - cells["no rules", 64]
        verdict = "met" if at64 <= GOAL_US else "NOT MET"
        print(
            f"goal: {args.rules} rules add <= {GOAL_US:.0f} us per transaction at 64: "
            f"{at64:.1f} us, {verdict}"
        )


if __name__ == "__main__":
    main()
