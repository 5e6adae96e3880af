"""GPU checks for the model executor (run by bench/gpu_check.sh on a machine with a GPU).

1. Node placement: the tensor-op variant loads on CUDA with CPU fallback *disabled*, so
   every node runs on the GPU; the tree model is shown to need the CPU.
2. Same answers: the executor on CUDA (IOBinding, batches padded to fixed buckets)
   returns the CPU scores for every batch size 1..300 (tolerance 1e-5).
3. Speed: rows/s of the tensor model on CPU vs CUDA for a few batch sizes.

Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import onnxruntime as ort

from bench.world import bench_world
from fraud_scoring.features import producible_features
from fraud_scoring.model_repo import resolve
from service.core.model import load_model


def strict_cuda_session(path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return ort.InferenceSession(path, sess_options=so, providers=["CUDAExecutionProvider"])


def rows_per_s(model, x: np.ndarray, seconds: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    model.predict(x)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model.predict(x)
        n += len(x)
    return n / (time.perf_counter() - t0)


def main() -> int:
    print("onnxruntime", ort.__version__, ort.get_available_providers())
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("CUDAExecutionProvider not available: install onnxruntime-gpu (not onnxruntime)")
        return 2
    with bench_world() as world:
        path = resolve(world.model_repo, "fraud")
        strict_cuda_session(str(path / "model_tensor.onnx"))
        print("PASS tensor variant: every node placed on CUDA (CPU fallback disabled)")
        try:
            strict_cuda_session(str(path / "model.onnx"))
            print("NOTE tree model also loaded with CPU fallback disabled")
        except Exception as exc:  # expected: TreeEnsemble has no CUDA kernel
            print(f"OK   tree model needs the CPU as expected ({type(exc).__name__})")
        feats = producible_features()
        gpu = load_model(world.model_repo, "fraud", "latest", feats, provider_setting="cuda")
        cpu = load_model(world.model_repo, "fraud", "latest", feats, provider_setting="cpu")
        cpu_tensor = load_model(world.model_repo, "fraud", "latest", feats, provider_setting="cpu")
        # The CPU reference for the tensor variant: same file, CPU provider.
        cpu_tensor.sessions = [
            ort.InferenceSession(
                str(path / "model_tensor.onnx"), providers=["CPUExecutionProvider"]
            )
        ]
        assert gpu.variant == "tensor" and gpu.on_gpu, (gpu.variant, gpu.providers)
        rng = np.random.default_rng(0)
        worst = 0.0
        for n in range(1, 301):
            x = rng.normal(size=(n, len(gpu.meta.features))).astype(np.float32) * 10
            diff = float(np.max(np.abs(gpu.predict(x) - cpu_tensor.predict(x))))
            worst = max(worst, diff)
        print(
            f"{'PASS' if worst < 1e-5 else 'FAIL'} CUDA vs CPU scores, batch 1..300: "
            f"max |diff| = {worst:.2e}"
        )
        print(
            f"\n{'batch':>6} {'tree CPU rows/s':>16} {'MLP CPU rows/s':>16} {'MLP CUDA rows/s':>16}"
        )
        for b in (1, 8, 64, 256):
            x = rng.normal(size=(b, len(gpu.meta.features))).astype(np.float32)
            print(
                f"{b:>6} {rows_per_s(cpu, x):>16,.0f} {rows_per_s(cpu_tensor, x):>16,.0f} "
                f"{rows_per_s(gpu, x):>16,.0f}"
            )
        return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
