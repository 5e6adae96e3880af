"""A model's reference distribution and the population stability index (PSI) against it.

Training stores ``reference.json`` in each model version directory (:class:`Reference`):
for every model input, bins and the share of rows in each, and the same for the served
score of each variant. The service's drift gauges and ``evaluate --served`` both count
served rows into those bins (:class:`Binner`, one vectorised pass over a batch matrix)
and compare shares with :func:`psi`. A version trained before references were stored has
no file: :func:`load_reference` answers None ("no reference") and nothing else changes.

Bins (:func:`reference_bins`): a feature with at most ``MAX_BINS`` distinct values (flags,
channels, small counts) gets one bin per value; any other gets weighted decile edges
(equal edges merged, so a value that holds a tenth of the rows or more, e.g. a default
0, is a bin of its own). Row ``x`` falls into bin ``i`` = the number of edges ``<= x``,
so bin ``i`` is ``[edges[i-1], edges[i])``, open at both ends.

PSI = sum over bins of ``(a - e) * ln(a / e)`` with ``e`` the reference share and ``a``
the served share, both floored at ``EPSILON`` (an empty bin would be infinite). Usual
reading: below 0.1 stable, 0.1-0.25 moderate shift, above 0.25 a shift worth acting on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ValidationError

from fraud_scoring.model_repo import ModelError

REFERENCE_FILE = "reference.json"
MAX_BINS = 10
EPSILON = 1e-4


class Bins(BaseModel):
    """One feature's (or the score's) reference bins: ``len(proportions) == len(edges) + 1``;
    the proportions sum to 1."""

    kind: Literal["discrete", "quantile"]
    edges: list[float]
    proportions: list[float]


class Reference(BaseModel):
    """The distribution a model version was built on, stored as ``reference.json``."""

    format: Literal[1] = 1
    # Which rows: e.g. "validation+holdout", weighted back to every transaction.
    source: str
    window: tuple[datetime, datetime]
    rows: float  # weighted
    features: dict[str, Bins]
    # Per variant ("default", "tensor"): the served score on the same rows.
    scores: dict[str, Bins]


def reference_bins(values: np.ndarray, weights: np.ndarray | None = None) -> Bins:
    """Bins for one column (see the module docstring) and the weighted share in each."""
    v = np.asarray(values, np.float64)
    w = np.ones(len(v)) if weights is None else np.asarray(weights, np.float64)
    if len(v) == 0:
        raise ValueError("no rows to build reference bins from")
    distinct = np.unique(v)
    if len(distinct) <= MAX_BINS:
        kind: Literal["discrete", "quantile"] = "discrete"
        edges = distinct[1:]
    else:
        kind = "quantile"
        qs = np.quantile(v, np.linspace(0, 1, MAX_BINS + 1)[1:-1], weights=w, method="inverted_cdf")
        edges = np.unique(qs)
        edges = edges[edges > distinct[0]]  # a first bin below the minimum would stay empty
    binner = Binner([edges])
    counts = binner.counts(v.reshape(-1, 1), w)
    return Bins(kind=kind, edges=edges.tolist(), proportions=(counts / counts.sum()).tolist())


def build_reference(
    names: Sequence[str],
    x: np.ndarray,
    weights: np.ndarray,
    scores: Mapping[str, np.ndarray],
    source: str,
    window: tuple[datetime, datetime],
) -> Reference:
    """The reference of rows ``x`` (columns in the order of ``names``) weighted by
    ``weights``, with the served ``scores`` of each variant on the same rows."""
    return Reference(
        source=source,
        window=window,
        rows=float(np.sum(weights)),
        features={n: reference_bins(x[:, j], weights) for j, n in enumerate(names)},
        scores={k: reference_bins(p, weights) for k, p in scores.items()},
    )


def load_reference(version_dir: Path) -> Reference | None:
    """The version's reference, or None when it has none (trained before references were
    stored). Raises ModelError for a file that is there but unreadable."""
    path = version_dir / REFERENCE_FILE
    if not path.exists():
        return None
    try:
        return Reference.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise ModelError(f"{path}: invalid reference: {exc}") from exc


class Binner:
    """Counts the rows of a matrix into each column's bins in one vectorised pass.

    ``edges[j]`` are column ``j``'s edges; :meth:`counts` returns one flat vector of every
    column's bin counts, column ``j``'s at ``offsets[j]:offsets[j + 1]``."""

    def __init__(self, edges: Sequence[Sequence[float] | np.ndarray]) -> None:
        widest = max((len(e) for e in edges), default=0)
        # Padded with +inf: no value is >= it, so padding never moves a row.
        self.edges = np.full((len(edges), max(widest, 1)), np.inf)
        for j, e in enumerate(edges):
            self.edges[j, : len(e)] = e
        sizes = np.array([len(e) + 1 for e in edges])
        self.offsets = np.r_[0, np.cumsum(sizes)]
        self.size = int(self.offsets[-1])

    @classmethod
    def of(cls, bins: Sequence[Bins]) -> Binner:
        return cls([b.edges for b in bins])

    def counts(self, x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """Bin counts (weighted when ``weights`` is given) of rows ``x`` (n, columns)."""
        idx = (x[:, :, None] >= self.edges[None, :, :]).sum(axis=2) + self.offsets[:-1]
        w = None if weights is None else np.repeat(np.asarray(weights, np.float64), x.shape[1])
        return np.bincount(idx.ravel(), weights=w, minlength=self.size).astype(np.float64)

    def psi(self, counts: np.ndarray, expected: np.ndarray) -> np.ndarray:
        """PSI per column of ``counts`` (from :meth:`counts`) against ``expected`` (the
        reference proportions, concatenated in the same layout)."""
        totals = np.add.reduceat(counts, self.offsets[:-1])
        share = counts / np.repeat(np.maximum(totals, 1e-12), np.diff(self.offsets))
        return np.add.reduceat(psi_terms(share, expected), self.offsets[:-1])


def psi_terms(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    a = np.maximum(np.asarray(actual, np.float64), EPSILON)
    e = np.maximum(np.asarray(expected, np.float64), EPSILON)
    return (a - e) * np.log(a / e)


def psi(actual: Sequence[float] | np.ndarray, expected: Sequence[float] | np.ndarray) -> float:
    """The population stability index of shares ``actual`` against ``expected``."""
    return float(psi_terms(np.asarray(actual), np.asarray(expected)).sum())


def expected_shares(bins: Sequence[Bins]) -> np.ndarray:
    """The reference proportions of ``bins`` concatenated in :class:`Binner`'s layout."""
    return np.concatenate([np.asarray(b.proportions, np.float64) for b in bins])
