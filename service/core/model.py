"""The model executor: ONNX Runtime sessions for one model version, swapped atomically.

CUDA is used when ``onnxruntime-gpu`` is installed and a GPU is visible (setting
``execution_provider``: auto | cuda | cpu). On CUDA, inputs are padded to a few fixed
batch-size buckets and bound with IOBinding so each bucket keeps one shape (the
precondition for CUDA graphs, which are not enabled yet: that needs fixed device
buffers per bucket and a GPU to test on). On CPU the batch runs as is; the bucketed
path also runs on CPU (``bucketed=True``), which is how the tests check it.

:class:`ModelHolder` holds the serving model (or why none serves) and
:func:`watch_models` keeps it current from the model repository.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import (
    FilesSignature,
    ModelError,
    ModelMetadata,
    ModelNotFound,
    files_signature,
    load_metadata,
    resolve,
    versions,
)
from service.errors import Rejected, RejectReason
from service.settings import ServiceSettings

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def choose_providers(setting: str) -> list[str]:
    """ONNX Runtime providers for ``setting`` (auto | cuda | cpu)."""
    available = ort.get_available_providers()
    if setting not in ("auto", "cuda", "cpu"):
        raise ModelError(f"FRAUD_EXECUTION_PROVIDER must be auto, cuda or cpu, got {setting!r}")
    if setting == "cuda" and "CUDAExecutionProvider" not in available:
        raise ModelError(
            "execution_provider=cuda but CUDAExecutionProvider is not available "
            f"(have {available}); install onnxruntime-gpu instead of onnxruntime"
        )
    if setting != "cpu" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def bucket_for(n: int) -> int:
    for b in BUCKETS:
        if n <= b:
            return b
    return n


@dataclass
class LoadedModel:
    meta: ModelMetadata
    path: Path
    sessions: list[ort.InferenceSession]
    providers: list[str]
    variant: str
    bucketed: bool | None = None  # pad to BUCKETS + IOBinding; None: only on CUDA

    def __post_init__(self) -> None:
        self._rr = itertools.cycle(range(len(self.sessions)))
        self._lock = threading.Lock()
        self.on_gpu = self.providers[0] == "CUDAExecutionProvider"
        if self.bucketed is None:
            self.bucketed = self.on_gpu

    @property
    def version(self) -> str:
        return self.meta.version

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Fraud probability per row of ``x`` (float32, shape (n, n_features)).

        Safe to call from several threads: sessions are used round-robin and an ONNX
        Runtime session's ``run`` is thread-safe.
        """
        with self._lock:
            sess = self.sessions[next(self._rr)]
        n = x.shape[0]
        if self.bucketed:
            return self._predict_bucketed(sess, x)[:n]
        out = sess.run([self.meta.output_name], {self.meta.input_name: x})[0]
        return np.asarray(out)[:, 1]

    def _predict_bucketed(self, sess: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
        b = bucket_for(x.shape[0])
        if b != x.shape[0]:
            x = np.concatenate([x, np.zeros((b - x.shape[0], x.shape[1]), np.float32)])
        binding = sess.io_binding()
        binding.bind_cpu_input(self.meta.input_name, np.ascontiguousarray(x))
        binding.bind_output(self.meta.output_name, "cpu")
        sess.run_with_iobinding(binding)
        return np.asarray(binding.copy_outputs_to_cpu()[0])[:, 1]


def load_model(
    repo: Path,
    name: str,
    version: str,
    producible: set[str],
    *,
    provider_setting: str = "auto",
    instances: int = 1,
    intra_op_threads: int = 1,
) -> LoadedModel:
    """Load and validate a model version; raises ModelError with the reason.

    The model is refused when it needs a feature the service cannot produce (``producible``:
    the names of numeric features), when an input is not float32, when its ONNX input does
    not match the metadata, or when a warm-up run fails.
    """
    path = resolve(repo, name, version)
    meta = load_metadata(path)
    unknown = [f for f in meta.feature_names if f not in producible]
    if unknown:
        raise ModelError(
            f"model {name} v{meta.version} needs features the service cannot produce: "
            f"{', '.join(unknown)}"
        )
    not_float = [f"{f.name} ({f.dtype})" for f in meta.features if f.dtype != "float32"]
    if not_float:
        raise ModelError(
            f"model {name} v{meta.version}: every input must be float32, got {', '.join(not_float)}"
        )
    providers = choose_providers(provider_setting)
    on_gpu = providers[0] == "CUDAExecutionProvider"
    # Tree ensembles run only on CPU in ONNX Runtime: on a GPU prefer the tensor variant.
    variant = "tensor" if on_gpu and "tensor" in meta.variants else "default"
    onnx_file = path / (meta.variants[variant] if variant != "default" else "model.onnx")
    sessions = []
    for _ in range(instances):
        so = ort.SessionOptions()
        so.intra_op_num_threads = intra_op_threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            sess = ort.InferenceSession(str(onnx_file), sess_options=so, providers=providers)
        except Exception as exc:  # ORT raises its own exception types for bad files
            raise ModelError(f"{onnx_file}: ONNX Runtime cannot load it: {exc}") from exc
        sessions.append(sess)
    inp = sessions[0].get_inputs()[0]
    if inp.name != meta.input_name or inp.shape[-1] != len(meta.features):
        raise ModelError(
            f"{onnx_file}: input {inp.name}{inp.shape} does not match metadata "
            f"({meta.input_name}, {len(meta.features)} features)"
        )
    model = LoadedModel(meta, path, sessions, providers, variant)
    try:
        probe = model.predict(np.zeros((2, len(meta.features)), np.float32))
    except Exception as exc:
        raise ModelError(f"{onnx_file}: warm-up inference failed: {exc}") from exc
    if probe.shape != (2,) or not np.all(np.isfinite(probe)):
        raise ModelError(f"{onnx_file}: warm-up output is not one finite score per row")
    log.info("loaded model %s v%s (%s) on %s", name, meta.version, variant, providers[0])
    return model


def load_configured(settings: ServiceSettings) -> LoadedModel:
    """:func:`load_model` for the version the settings name (e.g. 'latest'), refusing a
    model that needs a feature this service cannot produce; raises ModelError. A model
    trained for another snapshot schedule is loaded with a warning
    (:func:`snapshot_schedule_skew`)."""
    model = load_model(
        settings.model_repo,
        settings.model_name,
        settings.model_version,
        producible=producible_features(),
        provider_setting=settings.execution_provider,
        instances=settings.model_instances,
        intra_op_threads=settings.intra_op_threads,
    )
    skew = snapshot_schedule_skew(model.meta, settings.batch_available_after_s)
    if skew:
        log.warning("%s", skew)
    return model


def snapshot_schedule_skew(meta: ModelMetadata, available_after_s: float) -> str | None:
    """Why ``meta``'s model is skewed where day snapshots reach the online store
    ``available_after_s`` after midnight UTC (``FRAUD_BATCH_AVAILABLE_AFTER_S``: the
    deployment's batch schedule), or None. Training joins each transaction to the snapshot
    available at its time by its own value of the setting (kept in its training config);
    with another one, part of every day is served with older or newer snapshots than the
    model learned from. None also for a model that did not record it."""
    trained = meta.training_config.get("batch_available_after_s")
    if trained is None or float(trained) == available_after_s:
        return None
    return (
        f"model {meta.name} v{meta.version} was trained with day snapshots available "
        f"{float(trained):.0f} s after midnight UTC, this service's "
        f"FRAUD_BATCH_AVAILABLE_AFTER_S is {available_after_s:.0f} s: from "
        f"{min(float(trained), available_after_s):.0f} to "
        f"{max(float(trained), available_after_s):.0f} s after every midnight it is served "
        "other snapshots than it was trained on; train with the deployment's value "
        f"(FRAUD_BATCH_AVAILABLE_AFTER_S={available_after_s:.0f}; the chart: "
        "batchAvailableAfterSeconds)"
    )


class ModelHolder:
    """Holds the serving model; ``swap`` replaces it atomically or keeps the old one.

    While no model serves, ``problem`` says why the last load failed (None: no model has
    been published yet)."""

    def __init__(self, model: LoadedModel | None = None) -> None:
        self.current = model
        self.problem: str | None = None

    def swap(self, load: Callable[[], LoadedModel]) -> LoadedModel:
        """Load a new model with ``load()`` and serve it; if ``load`` raises (ModelError),
        nothing changes and the old model keeps serving."""
        try:
            new = load()
        except ModelError as exc:
            if self.current is None:
                self.problem = None if isinstance(exc, ModelNotFound) else str(exc)
            raise
        self.current = new  # one reference assignment: in-flight batches keep the old one
        self.problem = None
        return new

    def require(self) -> LoadedModel:
        """The serving model; raises Rejected (no_model, retry in 5 s) when none serves."""
        model = self.current
        if model is None:
            detail = "no model loaded yet" + (f": {self.problem}" if self.problem else "")
            raise Rejected(RejectReason.NO_MODEL, detail, retry_after_s=5)
        return model

    def readiness(self) -> str | None:
        """None when a model serves, else the not-ready reason for ``/readyz``."""
        if self.current is not None:
            return None
        return "not loaded" + (f": {self.problem}" if self.problem else "")


def watch_models(models: ModelHolder, settings: ServiceSettings) -> asyncio.Task[None]:
    """Look for a model every ``model_poll_s`` (a task on the running loop; cancel it to
    stop): until the first one loads (the training job has not run yet, or the only
    version cannot load: each poll tries again, and a new problem is logged once) and,
    with version 'latest', for newer versions, which are swapped in atomically. While a
    model serves, a newer version that fails to load or validate is logged once and
    skipped, the serving model stays, and it is tried again when its files change (size
    or mtime of any file: e.g. a version that was half-copied when first seen)."""

    base = settings.model_repo / settings.model_name

    async def watch() -> None:
        # Versions that failed while a model served, with their files' signature then.
        failed: dict[int, FilesSignature] = {}
        while True:
            await asyncio.sleep(settings.model_poll_s)
            try:
                await look(failed)
            except Exception:  # e.g. the repository changing under the scan: try again
                log.exception("model watch failed; keeping the current model")

    async def look(failed: dict[int, FilesSignature]) -> None:
        found = versions(settings.model_repo, settings.model_name)
        newest = found[-1] if found else None
        # Taken before loading: files that change during the attempt count as changed.
        signature = files_signature(base / str(newest)) if newest is not None else ()
        current = models.current
        if current is not None and (
            settings.model_version != "latest"
            or newest is None
            or newest <= int(current.version)
            or failed.get(newest) == signature  # failed before, files unchanged since
        ):
            return
        if current is None and settings.model_version == "latest" and not found:
            return
        before = models.problem
        try:
            new = await asyncio.to_thread(models.swap, lambda: load_configured(settings))
            log.info("now serving model %s v%s", new.meta.name, new.version)
        except ModelNotFound:
            return
        except ModelError:
            if current is None:
                if models.problem != before:
                    log.error("no model can serve: %s; trying again", models.problem)
                return
            log.exception(
                "cannot serve the new model; keeping the current one (tried again when "
                "its files change)"
            )
            if newest is not None:
                failed[newest] = signature

    return asyncio.get_running_loop().create_task(watch(), name="model-watch")
