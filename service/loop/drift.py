"""Score distribution and feature drift of served traffic, for ``/metrics``.

The scorer tells :meth:`DriftMonitor.observe` of every scored micro-batch (the
``on_scored`` hook, beside the decision log) with the exact matrix the model saw; that
only keeps the matrix and the scores aside. Every ``FLUSH_ROWS`` transactions, once a
second and before each ``/metrics`` answer, :meth:`DriftMonitor.flush` bins what was kept
in one vectorised count against the serving version's reference bins
(``fraud_scoring.drift``), one of the scores, and adds those counts to a rolling window:
at a few transactions per micro-batch, binning each batch on its own cost more than the
rest of its bookkeeping (with several workers every micro-batch is counted at once: any
worker's scrape must count every worker's scores). Once a second a task turns the window
into population stability indexes and sets the gauges:

* ``fraud_score`` (histogram, by ``model_version``): every model score served;
* ``fraud_feature_psi{feature}``: PSI of each model input over the last
  ``FRAUD_DRIFT_WINDOW`` scored transactions against the serving version's
  ``reference.json``; ``fraud_score_psi`` the same for the score;
* ``fraud_drift_window_rows``: transactions in the window;
* ``fraud_drift_reference``: 1 when the serving version has a reference, 0 when it has
  none (trained before references were stored; then no PSI gauge is exported).

The PSI gauges appear once the window holds ``MIN_ROWS`` transactions (fewer give noisy
values); a new model version starts a new window. With several workers, each keeps its
own window and ``/metrics`` shows the largest PSI of the live workers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
from prometheus_client import Gauge, Histogram

from fraud_scoring.drift import Binner, expected_shares, load_reference
from fraud_scoring.events import Transaction
from fraud_scoring.model_repo import ModelError
from service.core.model import ModelHolder
from service.core.scoring import ScoreResult
from service.telemetry import keep_at_most, observe_many

log = logging.getLogger(__name__)

MIN_ROWS = 200  # below this the PSI of ten bins is mostly noise
PUBLISH_S = 1.0
# Kept micro-batches are binned together once they hold this many transactions (also
# the window's granularity: it drops whole flushed groups from its old end).
FLUSH_ROWS = 256
# Finer near 0, where almost every transaction's probability lies (as the reliability bins).
SCORE_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class _Instruments:
    score: Histogram
    feature_psi: Gauge
    score_psi: Gauge
    window_rows: Gauge
    reference: Gauge


@cache
def _instruments() -> _Instruments:
    return _Instruments(
        score=Histogram(
            "fraud_score",
            "Model scores (fraud probability) served",
            ("model_version",),
            buckets=SCORE_BUCKETS,
        ),
        feature_psi=Gauge(
            "fraud_feature_psi",
            "Population stability index of a model input over the rolling window of served "
            "transactions against the serving model's reference",
            ("feature",),
            multiprocess_mode="livemax",
        ),
        score_psi=Gauge(
            "fraud_score_psi",
            "Population stability index of the served score against the serving model's reference",
            multiprocess_mode="livemax",
        ),
        window_rows=Gauge(
            "fraud_drift_window_rows",
            "Scored transactions in the drift window",
            multiprocess_mode="livesum",
        ),
        reference=Gauge(
            "fraud_drift_reference",
            "1 when the serving model version has a reference distribution, else 0",
            multiprocess_mode="livemin",
        ),
    )


@dataclass
class _Window:
    """The serving version's bins and the rolling window of counts in them."""

    version: str
    features: list[str]
    binner: Binner  # the features, then the score as the last column
    expected: np.ndarray
    size: int
    batches: deque[tuple[int, np.ndarray]]
    total: np.ndarray
    rows: int = 0

    def add(self, x: np.ndarray, scores: np.ndarray) -> None:
        counts = self.binner.counts(np.column_stack([x, scores]))
        self.batches.append((len(x), counts))
        self.total += counts
        self.rows += len(x)
        # Keep at least ``size`` rows: drop whole batches from the old end.
        while self.batches and self.rows - self.batches[0][0] >= self.size:
            n, old = self.batches.popleft()
            self.total -= old
            self.rows -= n


class DriftMonitor:
    """Counts served batches into the serving version's reference bins (:meth:`observe`)
    and publishes the gauges (:meth:`start` a task on the running loop; cancel it to
    stop). ``window``: transactions in the rolling window; 0 turns the PSI gauges off
    (the score histogram stays)."""

    def __init__(self, models: ModelHolder, window: int) -> None:
        self.models = models
        self.window_size = window
        self.ins = _instruments()
        self.window: _Window | None = None
        self._version: str | None = None  # the version whose reference was looked for
        self._exported: set[str] = set()  # features given a PSI gauge so far
        # Scored micro-batches not binned yet: (model version, model input, scores).
        self._kept: list[tuple[str, np.ndarray, list[float]]] = []
        self._kept_rows = 0
        # With several workers nothing is kept: any worker's scrape counts every score.
        self._flush_rows = FLUSH_ROWS if keep_at_most() > 1 else 1

    def observe(
        self,
        txns: Sequence[Transaction],
        x: np.ndarray,
        names: Sequence[str],
        results: Sequence[ScoreResult],
    ) -> None:
        """One scored micro-batch (the scorer's ``on_scored``); ``x``: the model's input.
        Kept until the next :meth:`flush` (done here past ``FLUSH_ROWS``, and at once with
        several workers)."""
        if not results:
            return
        self._kept.append((results[0].model_version, x, [r.score or 0.0 for r in results]))
        self._kept_rows += len(results)
        if self._kept_rows >= self._flush_rows:
            self.flush()

    def flush(self) -> None:
        """Count the kept micro-batches into the score histogram and the window, each
        model version's rows in one pass."""
        kept, self._kept, self._kept_rows = self._kept, [], 0
        for version, group in itertools.groupby(kept, key=lambda k: k[0]):
            batches = list(group)
            x = batches[0][1] if len(batches) == 1 else np.concatenate([b[1] for b in batches])
            scores = np.fromiter(
                itertools.chain.from_iterable(b[2] for b in batches), np.float64, len(x)
            )
            observe_many(self.ins.score.labels(model_version=version), scores)
            w = self.window
            if w is not None and w.version == version:  # else a swap: publish() catches up
                w.add(x, scores)

    def _switch(self) -> None:
        """Follow the serving version: load its reference (a small file, once per version)
        and start an empty window."""
        model = self.models.current
        version = model.version if model is not None else None
        if version == self._version:
            return
        self._version = version
        self.window = None
        if model is None or self.window_size <= 0:
            return
        names = model.meta.feature_names
        try:
            ref = load_reference(model.path)
        except ModelError as exc:
            log.warning("drift gauges off for model v%s: %s", version, exc)
            ref = None
        score_bins = ref.scores.get(model.variant) if ref is not None else None
        if ref is None or score_bins is None or not set(names) <= set(ref.features):
            log.info("model v%s has no reference distribution: no PSI gauges", version)
            return
        bins = [ref.features[n] for n in names] + [score_bins]
        binner = Binner.of(bins)
        self.window = _Window(
            version=model.version,
            features=list(names),
            binner=binner,
            expected=expected_shares(bins),
            size=self.window_size,
            batches=deque(),
            total=np.zeros(binner.size),
        )

    def publish(self) -> None:
        """Set the gauges from the current window (first following a model swap)."""
        self._switch()
        w = self.window
        self.ins.reference.set(1 if w is not None else 0)
        self.ins.window_rows.set(w.rows if w is not None else 0)
        if w is None or w.rows < MIN_ROWS:
            # No value: NaN, which an alert's comparison never matches. (Not clear(): it
            # does nothing in multiprocess mode.)
            for name in self._exported:
                self.ins.feature_psi.labels(feature=name).set(float("nan"))
            self.ins.score_psi.set(float("nan"))
            return
        values = w.binner.psi(w.total, w.expected)
        for name in self._exported.difference(w.features):  # an earlier version's input
            self.ins.feature_psi.labels(feature=name).set(float("nan"))
        for name, v in zip(w.features, values[:-1], strict=True):
            self.ins.feature_psi.labels(feature=name).set(float(v))
        self._exported.update(w.features)
        self.ins.score_psi.set(float(values[-1]))

    def start(self) -> asyncio.Task[None]:
        """The task that flushes and publishes once a second (PSI gauges only when the
        window is on)."""

        async def run() -> None:
            while True:
                self.flush()
                if self.window_size > 0:
                    self.publish()
                await asyncio.sleep(PUBLISH_S)

        return asyncio.get_running_loop().create_task(run(), name="drift-gauges")
