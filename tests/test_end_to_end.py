"""The whole loop on real parts: events on a Redis stream → the ``fraud-scoring stream``
updater (a subprocess) → session state in Redis → the scoring service's one pipelined
read → a decision whose reasons show the velocity the updater computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from tests.conftest import Server, World, wait_until
from tests.test_service import TXN


def test_stream_to_updater_to_decision(server: Server, world: World, tmp_path: Path) -> None:
    card, stream = "burst-card-1", "e2e-transactions"
    day = world.last_day.isoformat()
    burst = [
        {
            **TXN,
            "transaction_id": f"burst-{i}",
            "card_id": card,
            "amount": 1.0 + i,
            "channel": "ecom",
            "event_time": f"{day}T10:0{i}:00+00:00",
        }
        for i in range(5)
    ]
    client = redis.Redis.from_url(world.redis_url)
    for e in [*burst, burst[2]]:  # one duplicate: applied once
        client.xadd(stream, {"data": json.dumps(e)})
    client.xadd(stream, {"data": b"{not json"})  # goes to the dead letter, not in the way

    env = {**os.environ, "REDIS_URL": world.redis_url}
    log = tmp_path / "updater.log"
    with open(log, "wb") as out:
        updater = subprocess.run(
            [
                sys.executable,
                "-m",
                "cli",
                "stream",
                "--stream",
                stream,
                "--consumer",
                "e2e",
                "--metrics-port",
                "0",
                "--idle-exit-s",
                "1",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=60,
        )
    assert updater.returncode == 0, log.read_text()[-2000:]
    wait_until(
        lambda: client.xlen(f"{stream}:dead-letter") == 1,
        timeout=10,
        what="the malformed event in the dead letter",
    )

    scored = {
        **TXN,
        "transaction_id": "after-burst",
        "card_id": card,
        "amount": 2.5,
        "channel": "ecom",
        "event_time": f"{day}T10:05:00+00:00",
    }
    with server.client() as c:
        body = c.post("/v1/score", json=scored).json()
        velocity = [r for r in body["reasons"] if r["code"] == "VELOCITY_10M"]
        assert velocity, body["reasons"]
        assert velocity[0]["message"].startswith("5 transactions")  # duplicate not counted
        # As of a time before the burst, none of it counts (strictly before t). A what-if
        # call: not recorded, so it does not join the card's history itself.
        early = {**scored, "transaction_id": "before-burst", "event_time": f"{day}T09:59:00+00:00"}
        what_if = {"X-Fraud-Record": "false"}
        reasons = c.post("/v1/score", json=early, headers=what_if).json()["reasons"]
        assert not [r for r in reasons if r["code"].startswith("VELOCITY")]
        # A burst member scored again never counts itself: 4 earlier ones at 10:04.
        again = c.post("/v1/score", json=burst[4]).json()["reasons"]
        assert [r["message"] for r in again if r["code"] == "VELOCITY_10M"] == [
            "4 transactions on this card in the last 10 minutes."
        ]
