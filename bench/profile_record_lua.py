"""Where the declared recording script's time goes: ``apply_states.lua`` by section.

    python -m bench.profile_record_lua [--sizes 1,16] [--batches 600] [--passes 2]

The script the service sends for a micro-batch's read-your-writes
(:data:`fraud_scoring.declared.APPLY_STATES_LUA`) is copied with ``os.clock()`` probes
around its sections (Redis 7 / Valkey: a script sees one frozen ``TIME``, but
``os.clock()`` is the server's CPU clock) and replayed on the bench world's store, put
back before each pass (:class:`bench.world.StoreState`): the held-out transactions as the
service records them, each after its keys' newest. Prints, per transaction, the CPU the
server spent in each section. A probe costs ~1-2 us, and the per-key sections hold two to
four of them per key (the rings' one per width): read those as upper bounds and the
per-call ones as they are.

The probes go in by text replacement: a change to the script that moves a line it
anchors on stops this benchmark with the line it could not find (fix the anchors here).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import redis

from bench.world import StoreState, pinned_world
from fraud_scoring import declared as D
from fraud_scoring import features as F
from fraud_scoring import session
from fraud_scoring.events import Transaction

# (name, per call (True) or per key); each accumulates into PROF[its place].
SECTIONS = (
    ("function definitions", True),
    ("arguments (ids, times, values)", True),
    ("settings of the states (config)", True),
    ("the markers' HMGET", True),
    ("each key: its HMGET", False),
    ("each key: the events loop", False),
    ("each key: the rings (add_one, trims)", False),
    ("each key: newest events' cut, kept values", False),
    ("each key: its HSET", False),
    ("the markers' HSET", True),
)

_CLOCK = "local PROF = {0,0,0,0,0,0,0,0,0,0}\nlocal function now() return os.clock() * 1e6 end\n"
_REPLY = "for k = 1, #PROF do result[#result + 1] = tostring(PROF[k]) end\n"


def instrumented(src: str) -> str:
    """``src`` (APPLY_STATES_LUA) with the probes; its reply carries the sections' totals
    (us) after the states' results."""
    # (a line of the script, the probe put before it, the probe put after it)
    probes = [
        # per call
        ("local function config(pos)\n", "local T0 = now()\n", ""),
        ("local n = tonumber(ARGV[1])\n", "local Ta = now(); PROF[1] = Ta - T0\n", ""),
        ("local nstatekeys = #KEYS - #order\n", "local Tb = now(); PROF[2] = Tb - Ta\n", ""),
        ("local seen, added, markttl = {}, {}, 0\n", "local Tc = now(); PROF[3] = Tc - Tb\n", ""),
        ("local code = {[1] = '1', [0] = '0', [-1] = '-'}\n", "PROF[4] = now() - Tc\n", ""),
        ("for j, id in ipairs(order) do\n  if #added[id] > 0", "local Tm = now()\n", ""),
        ("return result\n", "PROF[10] = now() - Tm\n" + _REPLY, ""),
        # per key (record)
        ("  local held = redis.call('HMGET', kt, unpack(fields))\n", "  local ta = now()\n",
         "  local tb = now(); PROF[5] = PROF[5] + tb - ta\n"),
        ("  if added then\n    local set, ns = SET, 0\n",
         "  local tc = now(); PROF[6] = PROF[6] + tc - tb\n", ""),
        ("    if #recent > 16 * keep then\n", "    local td = now(); PROF[7] = PROF[7] + td - tc\n",
         ""),
        ("    redis.call('HSET', kt, unpack(set, 1, ns))\n",
         "    local te = now(); PROF[8] = PROF[8] + te - td\n",
         "    PROF[9] = PROF[9] + now() - te\n"),
    ]  # fmt: skip
    out = _CLOCK + src
    for line, before, after in probes:
        if out.count(line) != 1:
            raise SystemExit(f"apply_states.lua changed: no single line {line.strip()!r}")
        out = out.replace(line, before + line + after)
    return out


class _Queued:
    """Takes the one EVALSHA :func:`fraud_scoring.declared.redis_tiles.queue_states` queues."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> None:
        self.commands.append(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16", help="micro-batch sizes")
    ap.add_argument("--batches", type=int, default=600, help="most micro-batches a size")
    ap.add_argument("--passes", type=int, default=2, help="passes over them, store restored")
    a = ap.parse_args()
    with pinned_world() as (world, _):
        client = redis.Redis.from_url(world.redis_url)
        state = StoreState(world.redis_url)
        decl = F.declarations()
        txns = [Transaction.model_validate(x) for x in world.held_out(5000)]
        sha = client.script_load(instrumented(D.APPLY_STATES_LUA))
        for size in (int(s) for s in a.sizes.split(",")):
            calls = []
            for at in range(0, min(len(txns), a.batches * size) - size + 1, size):
                part = txns[at : at + size]
                queued = _Queued()
                D.queue_states(
                    queued,
                    decl.specs,
                    D.BatchColumns(
                        D.transaction_rows(part), [session.to_us(t.event_time) for t in part]
                    ),
                    D.HORIZON_S,
                )
                calls.append(queued.commands[0][2:])  # after EVALSHA and its sha
            n = len(calls) * size
            print(f"micro-batch {size} ({len(calls)} calls, us of server CPU a transaction):")
            print(f"  {'section':<56}" + "".join(f"{f'pass {p + 1}':>10}" for p in range(a.passes)))
            totals = []
            for _ in range(a.passes):
                state.restore()
                time.sleep(1.0)  # the restore's frees settle
                tot = [0.0] * len(SECTIONS)
                for args in calls:
                    reply = client.execute_command("EVALSHA", sha, *args)
                    for k, v in enumerate(reply[-len(SECTIONS) :]):
                        tot[k] += float(v)
                totals.append(tot)
            for k, (name, per_call) in enumerate(SECTIONS):
                what = f"{name} ({'a call' if per_call else 'all keys'})"
                print(f"  {what:<56}" + "".join(f"{t[k] / n:>10.1f}" for t in totals))
            print(f"  {'all sections':<56}" + "".join(f"{sum(t) / n:>10.1f}" for t in totals))
        state.restore()


if __name__ == "__main__":
    main()
