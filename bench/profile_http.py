"""Where a scoring request's CPU goes: py-spy samples the batched service under load.

    python -m bench.profile_http [--rate 1500] [--seconds 6]

Prints where the samples' leaf frames are, grouped by package (self time). Needs py-spy
(``pip install py-spy``) and ptrace rights.
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
        service = start(world, True, {})
        proc, url = service.proc, service.url
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
            service.stop()
    print(res.line())
    by_package: collections.Counter[str] = collections.Counter()
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        leaf = stack.split(";")[-1]
        total += int(count)
        by_package[package_of(leaf)] += int(count)
    print(f"\n{total} samples of the service's threads; self time by package:")
    for pkg, n in by_package.most_common(16):
        print(f"{n / total:6.1%}  {pkg}")


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
