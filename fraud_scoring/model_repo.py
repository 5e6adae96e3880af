"""The versioned model repository: ``<repo>/<name>/<version>/{model.onnx,metadata.json}``.

Versions are positive integers (as in Triton's model repository); "latest" is the
highest one whose directory is complete. A version directory is written beside the
repository and renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import errno
import functools
import json
import os
from datetime import date, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from fraud_scoring.storage import staging_dir


class ModelError(RuntimeError):
    """A model cannot be found, read or used; the message says which and why."""


class ModelNotFound(ModelError):
    """No (complete) version of the model exists yet."""


class PublishRefused(ModelError):
    """Training refused to publish the model it built (a publishing gate failed); the
    message names each failed gate. Nothing was written to the repository."""


class FeatureSpec(BaseModel):
    name: str
    dtype: str = "float32"


class Thresholds(BaseModel):
    review: float = Field(ge=0, le=1)
    decline: float = Field(ge=0, le=1)


class DecisionCosts(BaseModel):
    """The money behind the thresholds (in the transaction's currency unit): training
    picks the review/decline thresholds that minimise the holdout's total cost.

    A missed fraud loses ``fraud_loss_share`` of its amount; every review costs
    ``review_cost`` (an analyst's time; a reviewed fraud is assumed stopped); a declined
    legitimate transaction costs ``false_decline_cost`` plus ``false_decline_amount_share``
    of its amount (lost margin and an annoyed customer). At most ``max_review_rate`` of
    all transactions may land in review (the analysts' capacity)."""

    fraud_loss_share: float = Field(default=1.0, ge=0)
    review_cost: float = Field(default=5.0, ge=0)
    false_decline_cost: float = Field(default=10.0, ge=0)
    false_decline_amount_share: float = Field(default=0.05, ge=0)
    max_review_rate: float = Field(default=0.02, ge=0, le=1)


class Calibration(BaseModel):
    """How a variant's raw output (``margin``) became a probability; the step is inside
    its ONNX graph, so the service needs no post-step.

    ``platt``: ``p = sigmoid(a * margin + b)``. ``piecewise``: ``p = sigmoid(z)`` with
    ``z`` piecewise linear in the margin through (``knots``, ``knot_logits``), slopes
    ``slope_below`` and ``slope_above`` beyond the end knots (``a`` when None); ``a``
    and ``b`` are then the pool's Platt fit, which placed the knots."""

    method: str = "platt"
    a: float
    b: float
    # The days of the rows it was fitted on (before the holdout).
    fitted_on: tuple[datetime, datetime]
    rows: float  # weighted rows (sampled negatives count for the ones they stand for)
    positives: int
    # Fields below were added with pooled calibration; older metadata loads without them.
    knots: list[float] = Field(default_factory=list)
    knot_logits: list[float] = Field(default_factory=list)
    slope_below: float | None = None
    slope_above: float | None = None
    # What the pool held (the validation slice and cross-fitted training blocks), and
    # why this method was used (a fallback names what was short).
    source: str = ""
    reason: str = ""


class ReliabilityBin(BaseModel):
    """One row of a reliability table: holdout transactions with ``lo <= p < hi``."""

    lo: float
    hi: float
    rows: float  # weighted
    mean_probability: float
    fraud_rate: float


class LabelAgeDay(BaseModel):
    """One day's labelled fraud rate at training time (labels as of ``labels_as_of``)."""

    day: date
    part: str  # "training", "validation" or "holdout"
    age_days: int  # whole days from the day's end to labels_as_of
    rows: int
    frauds: int
    fraud_rate: float


class LabelCoverage(BaseModel):
    """How complete the labels looked when the model was trained.

    Every day trained on is older than the label delay, so the delay implies its labels
    are in: its labelled fraud rate should be about ``expected_rate`` (the training
    slice's). ``incomplete`` lists each check that failed (empty: the labels were
    trusted); a version published with failed checks was forced."""

    expected_rate: float
    min_fraction: float  # a slice below min_fraction x the expected rate is refused
    label_delay_days: int
    latest_version: str | None = None
    latest_version_rate: float | None = None  # its holdout's labelled fraud rate
    days: list[LabelAgeDay] = Field(default_factory=list)
    incomplete: list[str] = Field(default_factory=list)


class ModelMetadata(BaseModel):
    """What the service needs to know to feed and trust a model."""

    name: str
    version: str
    created_at: datetime
    framework: str
    input_name: str = "input"
    output_name: str = "probabilities"
    features: list[FeatureSpec]
    training_window: tuple[datetime, datetime]
    # Labels (chargebacks) counted were those that had arrived before this instant;
    # later ones would turn some of the holdout's "legitimate" rows into fraud.
    labels_as_of: datetime | None = None
    holdout_window: tuple[datetime, datetime]
    thresholds: Thresholds
    metrics: dict[str, float]
    # Relative importance (gain share) per feature, used to order reason codes.
    feature_importance: dict[str, float] = Field(default_factory=dict)
    # Optional variants: e.g. {"tensor": "model_tensor.onnx"}, an all-tensor-op export
    # whose every node can run on a GPU.
    variants: dict[str, str] = Field(default_factory=dict)
    # A variant's own thresholds (its scores live on another scale than the default
    # model's); a variant without an entry uses ``thresholds``.
    variant_thresholds: dict[str, Thresholds] = Field(default_factory=dict)

    # Fields below were added with calibrated models; older metadata loads without them.
    # Per variant ("default", "tensor"): the calibration inside its ONNX graph.
    calibration: dict[str, Calibration] = Field(default_factory=dict)
    # The costs the thresholds were chosen with (None: thresholds came from an older rule).
    costs: DecisionCosts | None = None
    # Per variant: the served model's reliability table on the holdout.
    reliability: dict[str, list[ReliabilityBin]] = Field(default_factory=dict)
    # Published with ``--force`` despite the gates listed in ``overridden_gates``.
    forced: bool = False
    overridden_gates: list[str] = Field(default_factory=list)
    # Fields below were added with configured training; older metadata loads without them.
    # Every value of the run's ``TrainConfig`` (batch_jobs/train.py), LightGBM's included.
    training_config: dict[str, Any] = Field(default_factory=dict)
    label_coverage: LabelCoverage | None = None
    # Added with out-of-sample thresholds; older metadata loads without it. The slice
    # the thresholds were chosen on, before the holdout: their figures there are the
    # metrics' ``validation_*`` (in-sample), on the holdout ``holdout_*``
    # (out-of-sample). None: an older version, whose thresholds were chosen on the
    # holdout itself.
    thresholds_chosen_on: tuple[datetime, datetime] | None = None

    def thresholds_for(self, variant: str) -> Thresholds:
        return self.variant_thresholds.get(variant, self.thresholds)

    @functools.cached_property
    def feature_names(self) -> list[str]:
        """The model's inputs in order (built once: read per micro-batch)."""
        return [f.name for f in self.features]


def versions(repo: Path, name: str) -> list[int]:
    base = repo / name
    if not base.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in base.iterdir()
        if p.name.isdigit() and (p / "metadata.json").exists() and (p / "model.onnx").exists()
    )


FilesSignature = tuple[tuple[str, int, int], ...]


def files_signature(path: Path) -> FilesSignature:
    """``(relative path, size, mtime_ns)`` of every file under a version's directory,
    sorted: it changes when any file is written, e.g. when a half-copied version's copy
    completes. Empty when the directory is gone."""
    if not path.is_dir():
        return ()
    found = []
    for f in path.rglob("*"):
        try:
            st = f.stat()
        except OSError:  # removed while listing
            continue
        if f.is_file():
            found.append((str(f.relative_to(path)), st.st_size, st.st_mtime_ns))
    return tuple(sorted(found))


def resolve(repo: Path, name: str, version: str = "latest") -> Path:
    """Directory of the requested version; raises ModelError when absent."""
    if version == "latest":
        found = versions(repo, name)
        if not found:
            raise ModelNotFound(
                f"no model versions under {repo / name} (run `fraud-scoring train`)"
            )
        return repo / name / str(found[-1])
    path = repo / name / version
    if not (path / "model.onnx").exists() or not (path / "metadata.json").exists():
        raise ModelNotFound(f"model {name} version {version} not found under {repo / name}")
    return path


def load_metadata(path: Path) -> ModelMetadata:
    meta_file = path / "metadata.json"
    try:
        return ModelMetadata.model_validate_json(meta_file.read_bytes())
    except (OSError, ValidationError) as exc:
        raise ModelError(f"{meta_file}: invalid model metadata: {exc}") from exc


def publish(repo: Path, name: str, files: dict[str, bytes], meta: ModelMetadata) -> ModelMetadata:
    """Write a new version atomically and return its metadata (``files`` maps relative
    paths, which may name a subfolder, to contents). ``meta.version`` is a
    proposal: when another job publishes that number first, the next free one is taken
    (versions are immutable; the directory rename is the commit)."""
    base = repo / name
    with staging_dir(base / meta.version) as tmp:
        for fname, data in files.items():
            (tmp / fname).parent.mkdir(parents=True, exist_ok=True)  # e.g. "evaluation/x.png"
            (tmp / fname).write_bytes(data)
        while True:
            (tmp / "metadata.json").write_text(json.dumps(meta.model_dump(mode="json"), indent=2))
            try:
                os.rename(tmp, base / meta.version)  # fails if that version exists
                return meta
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                meta = meta.model_copy(update={"version": next_version(repo, name)})


def next_version(repo: Path, name: str) -> str:
    found = versions(repo, name)
    taken = {int(p.name) for p in (repo / name).iterdir() if p.name.isdigit()} if found else set()
    return str(max([0, *found, *taken]) + 1)
