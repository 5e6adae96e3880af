"""Where a scoring request's CPU goes: py-spy samples the batched service under load.

    python -m bench.profile_http [--rate 1500] [--seconds 6]

Prints the functions with the most samples (self time, and inclusive time for the
service's own stages). Needs py-spy (``pip install py-spy``) and ptrace rights.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bench_http import open_loop, start
from bench.world import bench_world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=1500)
    p.add_argument("--seconds", type=float, default=6)
    a = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(tempfile.mkdtemp()) / "stacks.txt"
    with bench_world() as world:
        bodies = [json.dumps(r).encode() for r in world.held_out(5000)]
        proc, url = start(world, True, {})
        try:
            asyncio.run(open_loop(url, bodies, 200, 1, "warm"))
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
                    "200",
                ],
                stdout=subprocess.DEVNULL,
            )
            res = asyncio.run(open_loop(url, bodies, a.rate, a.seconds, "batched"))
            rec.wait(timeout=60)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(res.line())
    keys = (
        "httptools_impl.py",
        "fastapi/routing.py",
        "_score_one",
        "score_batch",
        "read_features",
        "predict",
        "decide",
        "serialize",
        "_json",
        "solve_dependencies",
        "_collect",
        "record",
    )
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        total += int(n)
        self_t[frames[-1]] += int(n)
        for key in keys:  # each stack counts once per stage
            if any(key in f for f in frames):
                incl[key] += int(n)
    print(f"\n{total} samples; top self time:")
    for f, n in self_t.most_common(15):
        print(f"{n / total:6.1%}  {f[:110]}")
    print("\ninclusive, selected stages:")
    for key in keys:
        print(f"{incl[key] / total:6.1%}  {key}")


if __name__ == "__main__":
    main()
