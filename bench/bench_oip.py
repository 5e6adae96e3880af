"""The Open Inference Protocol's infer over REST and over gRPC: what one call costs.

One service (``fraud-scoring serve`` with ``FRAUD_GRPC_PORT``, one uvicorn worker) pinned
with ``taskset`` to the first core; the generator (this process, asyncio, its garbage
collector off) on the second. The same model, the same rows, batch 1 and batch 8, each
through three clients in turn, closed loop (``--concurrency`` calls always in flight,
each sent as soon as the previous one is answered; REST on raw keep-alive HTTP/1.1
connections, gRPC on one channel, requests encoded once) for ``--seconds``:

* ``rest-json``: ``POST /v2/models/fraud/infer`` with the tensor as a JSON list (the
  protocol's plain form);
* ``rest-binary``: the same with the binary-data extension (tritonclient.http's default:
  a JSON header, the raw little-endian FP32 bytes after it, the output binary too);
* ``grpc``: ``ModelInfer`` with ``raw_input_contents`` (tritonclient.grpc's form).

Printed per (batch, client): calls/s and rows/s, p50/p99 latency, and the service's CPU
(user + system) per call, with the REST JSON client's figures as the baseline of each
batch size. The machine is a shared 2-core VM: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import numpy as np
import psutil
from grpc import aio

from bench.bench_http import Conn, start
from bench.world import bench_world
from fraud_scoring.model_repo import ModelMetadata, load_metadata, resolve
from fraud_scoring.redis_server import free_port
from service.edge.proto import grpc_predict_v2_pb2 as pb

MODEL = "fraud"
INFER = "/inference.GRPCInferenceService/ModelInfer"
CLIENTS = ("rest-json", "rest-binary", "grpc")


@dataclass
class Step:
    client: str
    batch: int
    calls: int
    errors: int
    seconds: float
    latencies_ms: np.ndarray
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def line(self, base: Step | None) -> str:
        p50, p99 = np.percentile(self.latencies_ms, [50, 99]) if self.calls else (0.0, 0.0)
        cpu_us = self.cpu_s * 1e6 / max(self.calls, 1)
        vs = ""
        if base is not None and base is not self and base.calls:
            base_cpu = base.cpu_s * 1e6 / base.calls
            vs = f"  ({self.rate / base.rate:4.2f}x calls/s, {cpu_us / base_cpu:4.2f}x CPU/call)"
        return (
            f"batch {self.batch:>2}  {self.client:<11}  {self.rate:7.0f} calls/s "
            f"{self.rate * self.batch:8.0f} rows/s  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  "
            f"CPU {cpu_us:6.0f} us/call  errors {self.errors}{vs}"
        )


def rows(meta: ModelMetadata, n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    return rng.uniform(0, 50, size=(n, len(meta.features))).astype("<f4")


def rest_json(meta: ModelMetadata, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    tensor = {
        "name": meta.input_name,
        "shape": list(x.shape),
        "datatype": "FP32",
        "data": x.ravel().tolist(),
    }
    return json.dumps({"inputs": [tensor]}).encode(), {"content-type": "application/json"}


def rest_binary(meta: ModelMetadata, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    raw = x.tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": meta.input_name,
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": meta.output_name, "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + raw, {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def grpc_request(meta: ModelMetadata, x: np.ndarray) -> bytes:
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=meta.input_name, datatype="FP32", shape=list(x.shape)
    )
    request = pb.ModelInferRequest(
        model_name=MODEL, inputs=[tensor], raw_input_contents=[x.tobytes()]
    )
    return request.SerializeToString()


async def closed_loop(
    call: Callable[[], Awaitable[bool]], concurrency: int, seconds: float
) -> tuple[list[float], int]:
    """``concurrency`` callers, each calling again as soon as answered, for ``seconds``:
    the latencies (ms) of the calls answered OK and the number that failed."""
    latencies: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal errors
        while (t0 := time.perf_counter()) < end:
            if await call():
                latencies.append((time.perf_counter() - t0) * 1e3)
            else:
                errors += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies, errors


async def measure(
    client: str,
    batch: int,
    meta: ModelMetadata,
    url: str,
    grpc_address: str,
    server: psutil.Process,
    concurrency: int,
    seconds: float,
) -> Step:
    x = rows(meta, batch)
    async with contextlib.AsyncExitStack() as stack:
        if client == "grpc":
            channel = await stack.enter_async_context(aio.insecure_channel(grpc_address))
            stub = channel.unary_unary(INFER)  # bytes in, bytes out: no decode here
            request = grpc_request(meta, x)

            async def call() -> bool:
                try:
                    await stub(request)
                except grpc.RpcError:
                    return False
                return True

        else:
            # One raw keep-alive connection per caller (bench_http's Conn): far cheaper per
            # call than a general client, so the generator is not what is measured.
            host, http_port = url.removeprefix("http://").split(":")
            body, headers = (rest_json if client == "rest-json" else rest_binary)(meta, x)
            head = f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: {host}\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            wire = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
            idle: list[Conn] = []
            for _ in range(concurrency):
                reader, writer = await asyncio.open_connection(host, int(http_port))
                stack.callback(writer.close)
                idle.append(Conn(reader, writer))

            async def call() -> bool:
                conn = idle.pop()
                try:
                    return await conn.post(wire) == 200
                finally:
                    idle.append(conn)

        await closed_loop(call, concurrency, 1.0)  # warm: connections, the model's path
        cpu0 = sum(server.cpu_times()[:2])
        t0 = time.perf_counter()
        latencies, errors = await closed_loop(call, concurrency, seconds)
        elapsed = time.perf_counter() - t0
        cpu = sum(server.cpu_times()[:2]) - cpu0
    return Step(client, batch, len(latencies), errors, elapsed, np.asarray(latencies), cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="length of each step")
    p.add_argument("--concurrency", type=int, default=8, help="calls in flight at once")
    p.add_argument("--batches", default="1,8", help="rows per call, comma-separated")
    p.add_argument("--no-pin", action="store_true", help="let server and generator share cores")
    a = p.parse_args()
    pin = not a.no_pin and (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the generator (this process) on the other core
    gc.disable()
    with bench_world() as world:
        meta = load_metadata(resolve(world.model_repo, MODEL))
        port = free_port()
        service = start(
            world,
            True,
            {"FRAUD_GRPC_PORT": str(port), "FRAUD_REQUEST_TIMEOUT_MS": "1000"},
            cpus="0" if pin else None,
        )
        try:
            server = psutil.Process(service.proc.pid)
            print(
                f"one worker on core {'0' if pin else 'any'}; {a.concurrency} calls in flight, "
                f"{a.seconds:g} s per step; baseline: rest-json of the same batch",
                flush=True,
            )
            for batch in (int(b) for b in a.batches.split(",")):
                base: Step | None = None
                for client in CLIENTS:
                    step = asyncio.run(
                        measure(
                            client,
                            batch,
                            meta,
                            service.url,
                            f"127.0.0.1:{port}",
                            server,
                            a.concurrency,
                            a.seconds,
                        )
                    )
                    base = base or step
                    print(step.line(base), flush=True)
        finally:
            service.stop()


if __name__ == "__main__":
    main()
