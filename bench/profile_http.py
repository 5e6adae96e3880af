"""Where a scoring request's CPU goes: py-spy samples the batched service under load.

    python -m bench.profile_http [--rate 1500] [--seconds 6] [--naive]

The service is pinned to core 0 and the generator to core 1 (as in ``bench_http``) when
the machine has two cores. Only the event loop's thread is counted (idle pool threads
waiting on their queues are not CPU). Prints self time by package, then the inclusive
share of each stage of the request path (a sample counts once, for the innermost stage
on its stack), then the hottest functions by self time. Needs py-spy (the ``bench``
extra) and ptrace rights.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_http import HELD_OUT, open_loop, run, start
from bench.world import StoreState, bench_world

# Stages of the request path, innermost first: a sample counts for the first of these
# found walking its stack from the leaf up ("function (file" prefixes of py-spy frames).
STAGES: tuple[tuple[str, str], ...] = (
    ("declared reads: parse + features", "parse_batch (fraud_scoring/declared/columnar.py"),
    ("declared reads + writes: queue", "queue_batch (fraud_scoring/declared/columnar.py"),
    ("card history (EVALSHA) queue", "queue_apply_many (fraud_scoring/session.py"),
    (
        "feast replies: parse + defaults",
        "OnlineFeatureReader.parse (service/core/online_features.py",
    ),
    ("feast reads: queue (HMGET)", "OnlineFeatureReader.queue (service/core/online_features.py"),
    ("redis: send + read replies", "HeldConnections.round_trip (fraud_scoring/redis_clients.py"),
    ("redis: send + read replies", "Pipeline.execute (redis/"),
    ("request features + assembly", "build_features (fraud_scoring/features.py"),
    ("ONNX inference", "LoadedModel.predict (service/core/model.py"),
    ("decision policy", "Policy.decide (service/core/decision.py"),
    ("decision log: submit", "DecisionLog.submit (service/loop/decision_log.py"),
    ("decision log: encode + write", "DecisionLog._run (service/loop/decision_log.py"),
    ("scorer: rest", "Scorer.score_batch (service/core/scoring.py"),
    ("batcher + metrics", "Batcher."),
    ("response: ScoreOut + JSON", "ScoreOut.wire (service/edge/schemas.py"),
    ("response: ScoreOut + JSON", "_json (service/edge/routes.py"),
    ("parse + validate body", "model_validate_json"),
    ("route handler: rest", "score (service/edge/routes.py"),
    ("auth", "(service/edge/auth.py"),
    ("admission", "AdmissionLimit.__call__ (service/edge/admission.py"),
    ("FastAPI / Starlette", "(fastapi/"),
    ("FastAPI / Starlette", "(starlette/"),
    ("uvicorn (HTTP)", "(uvicorn/"),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=1500)
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument("--naive", action="store_true", help="profile FRAUD_BATCHING=false")
    p.add_argument("--stacks", type=Path, help="keep py-spy's raw stacks in this file")
    a = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = a.stacks or Path(tempfile.mkdtemp()) / "stacks.txt"
    pin = (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})
    with bench_world() as world:
        bodies = [json.dumps(r).encode() for r in world.held_out(HELD_OUT)]
        state = StoreState(world.redis_url)
        service = start(world, not a.naive, {}, "0" if pin else None)
        proc, url = service.proc, service.url
        try:
            run(open_loop(url, bodies, 200, 1, "warm"))
            state.restore()  # the profiled run on the live path, not behind the warm-up's
            rec = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--format",
                    "raw",
                    "-o",
                    str(out),
                    "--duration",
                    str(int(a.seconds)),
                    "--rate",
                    "250",
                ],
                stdout=subprocess.DEVNULL,
            )
            res = run(open_loop(url, bodies, a.rate, a.seconds, "naive" if a.naive else "batched"))
            rec.wait(timeout=60)
        finally:
            service.stop()
    print(res.line())
    report(out.read_text().splitlines())


def report(lines: list[str]) -> None:
    by_package: collections.Counter[str] = collections.Counter()
    by_stage: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any("Runner.run (asyncio/runners.py" in f for f in frames):
            continue  # not the event loop's thread
        n = int(count)
        total += n
        by_package[package_of(frames[-1])] += n
        by_function[frames[-1].split(" (")[0] + " " + short(frames[-1])] += n
        by_stage[stage_of(frames)] += n
    print(f"\n{total} samples of the event loop's thread; self time by package:")
    for pkg, n in by_package.most_common(14):
        print(f"{n / total:6.1%}  {pkg}")
    print("\ninclusive, by stage of the request path (innermost stage wins):")
    for stage, n in by_stage.most_common():
        print(f"{n / total:6.1%}  {stage}")
    print("\nhottest functions (self time):")
    for fn, n in by_function.most_common(20):
        print(f"{n / total:6.1%}  {fn}")


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, marker in STAGES:
            if marker in frame:
                return name
    return "event loop, other tasks"


def short(frame: str) -> str:
    path = frame.rpartition("(")[2].rstrip(")")
    return path.split("site-packages/")[-1]


def package_of(frame: str) -> str:
    """'func (path:line)' -> the top-level package (or stdlib module) of the code."""
    path = frame.rpartition("(")[2].rpartition(":")[0]
    if "site-packages/" in path:
        path = path.split("site-packages/")[1]
    elif "/lib/python3" in path:
        path = path.split("/lib/python3")[1].split("/", 1)[-1]
    top = path.lstrip("/").split("/")[0]
    return top.removesuffix(".py") or frame


if __name__ == "__main__":
    main()
