"""The served probability's calibration: fitted on out-of-sample margins of the model.

Training (``batch_jobs.train``) builds a :class:`CalibrationPool` (the validation slice
and cross-fitted blocks of training days, each scored in ONNX Runtime by a model that
did not see it) and fits on it Platt scaling (:func:`fit_platt`) or, with frauds enough,
a monotone piecewise-linear logit through knots placed at fixed Platt probabilities
(:func:`fit_piecewise`); :func:`fit_calibration` picks one and says why.
:func:`calibrated_logit` is the fitted map in float64, the one the ONNX graph of
``batch_jobs.onnx_export.with_calibration`` computes in float32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING

import numpy as np
from sklearn.linear_model import LogisticRegression

from fraud_scoring.model_repo import Calibration

if TYPE_CHECKING:
    from batch_jobs.train import TrainConfig

log = logging.getLogger(__name__)


def _utc(d: date) -> datetime:
    return datetime.combine(d, datetime.min.time(), UTC)


def fit_platt(margin: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Platt scaling: ``a, b`` with ``P(fraud) = sigmoid(a * margin + b)``, fitted by
    weighted log loss on the validation slice (practically unregularised)."""
    lr = LogisticRegression(C=1e6, max_iter=1000)
    lr.fit(margin.reshape(-1, 1), y, sample_weight=w)
    return float(lr.coef_[0, 0]), float(lr.intercept_[0])


@dataclass(frozen=True)
class CalibrationPool:
    """Out-of-sample margins of one variant with their labels and weights, and what
    they came from (``source``; the days ``first``..``end``)."""

    margin: np.ndarray
    label: np.ndarray
    weight: np.ndarray
    first: date
    end: date
    source: str


def fit_calibration(pool: CalibrationPool, cfg: TrainConfig) -> Calibration:
    """Platt scaling on the pool, then, when ``cfg.calibration_method`` asks for it or,
    with "auto", once the pool holds ``cfg.min_piecewise_positives`` frauds, the
    piecewise-linear logit (:func:`fit_piecewise`); ``reason`` says which and why (a
    fallback to Platt names the shortfall)."""
    frauds = int(pool.label.sum())
    a, b = fit_platt(pool.margin, pool.label, pool.weight)
    need = cfg.min_piecewise_positives
    if a <= 0:
        piecewise = False
        reason = f"Platt: its slope {a:.3g} is not positive, so no knots can be placed"
    elif cfg.calibration_method == "platt":
        piecewise, reason = False, "Platt: configured (calibration_method: platt)"
    elif cfg.calibration_method == "piecewise":
        piecewise, reason = True, "piecewise: configured (calibration_method: piecewise)"
    elif frauds >= need:
        piecewise, reason = True, f"piecewise: the pool holds {frauds} frauds (at least {need})"
    else:
        piecewise = False
        reason = (
            f"Platt, not piecewise: the pool holds {frauds} frauds, fewer than the {need} "
            "the piecewise fit needs (min_piecewise_positives)"
        )
    if not piecewise and cfg.calibration_method != "platt":
        log.warning("calibration: %s", reason)
    pw = fit_piecewise(pool.margin, pool.label, pool.weight, a, b) if piecewise else None
    return Calibration(
        method="piecewise" if pw else "platt",
        a=a,
        b=b,
        fitted_on=(_utc(pool.first), _utc(pool.end)),
        rows=float(pool.weight.sum()),
        positives=frauds,
        knots=pw.knots if pw else [],
        knot_logits=pw.logits if pw else [],
        slope_below=pw.below if pw else None,
        slope_above=pw.above if pw else None,
        source=pool.source,
        reason=reason,
    )


# The piecewise calibration's knots: where the pool's Platt fit gives these
# probabilities (the decision bands lie between them).
PIECEWISE_AT = (0.001, 0.01, 0.1, 0.5)


# Ridge on the change of slope between neighbouring segments (per unit of weighted
# log loss over the pool's rows, normalised to mean weight 1): tiny; it only keeps a
# segment without data near its neighbours.
PIECEWISE_RIDGE = 0.1


@dataclass(frozen=True)
class Piecewise:
    """A monotone piecewise-linear logit: ``z`` through (``knots``, ``logits``),
    slopes ``below`` and ``above`` beyond the end knots."""

    knots: list[float]
    logits: list[float]
    below: float
    above: float


def fit_piecewise(
    margin: np.ndarray, y: np.ndarray, w: np.ndarray, a: float, b: float
) -> Piecewise:
    """Platt scaling with hinges: the logit is linear in the margin between knots at
    the margins where Platt (``a``, ``b``) gives :data:`PIECEWISE_AT`, each segment
    (and each tail) with its own slope, every slope >= 0 (monotone: ranking is kept),
    fitted by weighted log loss (L-BFGS-B) from Platt's line. One slope reads the whole
    range; out of sample the frauds between 0.001 and 0.1 (the rarer, quieter patterns)
    follow a flatter line than the obvious ones above."""
    from scipy.optimize import minimize
    from scipy.special import expit

    k = np.asarray([(np.log(q / (1 - q)) - b) / a for q in PIECEWISE_AT])

    def basis(m: np.ndarray) -> np.ndarray:
        cols = [np.minimum(m - k[0], 0)]
        cols += [np.clip(m - k[j - 1], 0, k[j] - k[j - 1]) for j in range(1, len(k))]
        cols.append(np.maximum(m - k[-1], 0))
        return np.stack(cols, 1)

    x, ww = basis(margin), w / w.mean()

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        slopes = theta[1:]
        z = theta[0] + x @ slopes
        p = expit(z)
        # log(1 + exp(-z)) and log(1 + exp(z)), stably
        ll = float((ww * (np.logaddexp(0, -z) * y + np.logaddexp(0, z) * (1 - y))).sum())
        d = np.diff(slopes)
        grad_pen = np.zeros_like(slopes)
        grad_pen[1:] += 2 * PIECEWISE_RIDGE * d
        grad_pen[:-1] -= 2 * PIECEWISE_RIDGE * d
        r = ww * (p - y)
        return ll + PIECEWISE_RIDGE * float((d**2).sum()), np.r_[r.sum(), x.T @ r + grad_pen]

    start = np.r_[a * k[0] + b, np.full(len(k) + 1, a)]
    bounds = [(None, None)] + [(0.0, None)] * (len(k) + 1)
    fit = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds)
    c, slopes = float(fit.x[0]), fit.x[1:]
    logits = c + np.r_[0.0, np.cumsum(slopes[1:-1] * np.diff(k))]
    return Piecewise(
        knots=[float(v) for v in k],
        logits=[float(v) for v in logits],
        below=float(slopes[0]),
        above=float(slopes[-1]),
    )


def calibrated_logit(cal: Calibration, margin: np.ndarray) -> np.ndarray:
    """The logit of the served probability for ``margin`` under ``cal`` (float64; the
    ONNX graph of :func:`with_calibration` computes the same in float32)."""
    if not cal.knots:
        return cal.a * margin + cal.b
    k = np.asarray(cal.knots)
    z = np.interp(margin, k, np.asarray(cal.knot_logits))
    below = cal.a if cal.slope_below is None else cal.slope_below
    above = cal.a if cal.slope_above is None else cal.slope_above
    return z + below * np.minimum(margin - k[0], 0) + above * np.maximum(margin - k[-1], 0)
