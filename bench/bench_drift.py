"""What the drift gauges cost the hot path: :meth:`service.loop.drift.DriftMonitor.observe` per
micro-batch (the bin count of the model's input, the score histogram, the rolling
window) and the once-a-second :meth:`~service.loop.drift.DriftMonitor.publish`.

A synthetic reference over the default model inputs (no world needed):

    python -m bench.bench_drift [--calls 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import timeit
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from fraud_scoring.drift import REFERENCE_FILE, build_reference
from fraud_scoring.features import default_model_features
from service.core.model import ModelHolder
from service.core.scoring import ScoreResult
from service.loop.drift import DriftMonitor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="observe() calls per batch size")
    args = p.parse_args()
    names = default_model_features()
    rng = np.random.default_rng(0)
    # Columns of mixed kinds: flags, small counts and continuous values.
    ref_x = np.column_stack(
        [
            rng.integers(0, 2, 20_000) if j % 3 == 0 else rng.lognormal(0, 1, 20_000)
            for j in range(len(names))
        ]
    ).astype(np.float32)
    now = datetime.now(UTC)
    ref = build_reference(
        names, ref_x, np.ones(len(ref_x)), {"default": rng.random(len(ref_x))}, "bench", (now, now)
    )
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / REFERENCE_FILE).write_text(ref.model_dump_json())
        model = SimpleNamespace(
            version="1",
            path=Path(tmp),
            variant="default",
            meta=SimpleNamespace(feature_names=names),
        )
        monitor = DriftMonitor(ModelHolder(cast(Any, model)), window=10_000)
        monitor.publish()  # loads the reference
    print(f"{len(names)} model inputs, window 10,000")
    for n in (1, 16, 64, 256):
        x = ref_x[rng.integers(0, len(ref_x), n)]
        res = [ScoreResult("t", "approve", float(s), [], "1", [], []) for s in rng.random(n)]
        t = timeit.timeit(partial(monitor.observe, [], x, names, res), number=args.calls)
        per = t / args.calls * 1e6
        print(f"observe, batch {n:>3}: {per:7.1f} us per batch, {per / n:6.2f} us per transaction")
    t = timeit.timeit(monitor.publish, number=200) / 200
    print(
        f"publish (PSI of every input and the score, gauges set): {t * 1e6:.0f} us, once a second"
    )


if __name__ == "__main__":
    main()
