"""Before/after in one run: the batched service from an earlier commit and from this
checkout, under the same open-loop load, steps alternated.

On a VM whose speed changes from hour to hour, only figures measured side by side
compare. Both services run at once (each from its own git worktree, both pinned to core
0, the generator and Redis to core 1, as in ``bench_http``); for each round and each rate
the baseline (``before``) takes a step, then this checkout (``after``). Printed per step:
p50/p99 from the scheduled send, shed, errors and the service's CPU per request.

    python -m bench.bench_ab --baseline REF [--rates 50,700,1050,1400,2100] [--rounds 2]
        [--after-env KEY=VALUE ...] [--baseline-own-model]

``--baseline-own-model``: for a baseline whose features differ (the model this checkout
trains would not load there), the baseline's own code trains its model on the same
world (into a temporary model repository) and backfills its declared states into the
same Redis first; each service then serves the model of its own code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.bench_http import HEADER, HELD_OUT, Server, open_loop, run, start
from bench.bench_overload import checkout
from bench.world import StoreState, bench_world


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="git ref of the code to compare with")
    p.add_argument("--rates", default="50,700,1050,1400,2100", help="req/s, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="length of each step")
    p.add_argument(
        "--after-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for this checkout's service only (repeatable), e.g. "
        "FRAUD_MODEL_INSTANCES=2 with --baseline HEAD to compare a setting",
    )
    p.add_argument(
        "--baseline-own-model",
        action="store_true",
        help="train the baseline's model with the baseline's code (see above)",
    )
    a = p.parse_args()
    after_env = dict(kv.split("=", 1) for kv in a.after_env)
    rates = [float(r) for r in a.rates.split(",")]
    pin = (os.cpu_count() or 1) >= 2
    if pin:
        os.sched_setaffinity(0, {1})  # the generator and the Redis server it starts
    with (
        bench_world() as world,
        checkout(a.baseline) as before,
        tempfile.TemporaryDirectory() as own_models,
    ):
        bodies = [json.dumps(r).encode() for r in world.held_out(HELD_OUT)]
        before_env: dict[str, str] = {}
        if a.baseline_own_model:
            before_env = {"FRAUD_MODEL_REPO": own_models}
            env = {
                **os.environ,
                "REDIS_URL": world.redis_url,
                "FRAUD_DATA_DIR": str(world.data_dir),
                **before_env,
            }
            for cmd in (
                ["train", "--holdout-days", "3", "--warmup-days", "5", "--force"],
                ["features", "backfill"],
            ):
                print(f"baseline: fraud-scoring {' '.join(cmd)}", flush=True)
                subprocess.run([sys.executable, "-m", "cli", *cmd], cwd=before, env=env, check=True)
        # Every step on the live path: the store put back before each (bench.world.StoreState).
        state = StoreState(world.redis_url)
        servers: dict[str, Server] = {}
        try:
            for name, cwd, env in (("before", before, before_env), ("after", None, after_env)):
                servers[name] = Server(
                    start(world, True, env, "0" if pin else None, cwd), 256, store=state
                )
                run(open_loop(servers[name].service.url, bodies, 200, 2, "warm"))
            print(HEADER)
            for _ in range(a.rounds):
                for rate in rates:
                    for name, server in servers.items():
                        server.step(bodies, rate, a.seconds, name)
                        time.sleep(0.5)  # let a backlog drain
        finally:
            for server in servers.values():
                with contextlib.suppress(Exception):
                    server.service.stop()


if __name__ == "__main__":
    main()
