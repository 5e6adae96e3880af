"""The versioned model repository: ``<repo>/<name>/<version>/{model.onnx,metadata.json}``.

Versions are positive integers (as in Triton's model repository); "latest" is the
highest one whose directory is complete. A version directory is written beside the
repository and renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import errno
import json
import os
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from fraud_scoring.storage import staging_dir


class ModelError(RuntimeError):
    """A model cannot be found, read or used; the message says which and why."""


class ModelNotFound(ModelError):
    """No (complete) version of the model exists yet."""


class FeatureSpec(BaseModel):
    name: str
    dtype: str = "float32"


class Thresholds(BaseModel):
    review: float = Field(ge=0, le=1)
    decline: float = Field(ge=0, le=1)


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

    def thresholds_for(self, variant: str) -> Thresholds:
        return self.variant_thresholds.get(variant, self.thresholds)

    @property
    def feature_names(self) -> list[str]:
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
    """Write a new version atomically and return its metadata. ``meta.version`` is a
    proposal: when another job publishes that number first, the next free one is taken
    (versions are immutable; the directory rename is the commit)."""
    base = repo / name
    with staging_dir(base / meta.version) as tmp:
        for fname, data in files.items():
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
