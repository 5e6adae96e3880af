"""``fraud-scoring emit``: a simulated live transaction feed for the event log.

It reads ``FRAUD_STREAM_SOURCE``, ``FRAUD_STREAM_NAME``, ``FRAUD_KAFKA_BOOTSTRAP`` and
``REDIS_URL``; flags override them. With ``REDIS_URL`` unset the events go to a private
server that is gone when the command ends, so set it to feed a running updater.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import date

from cli.settings import Settings
from fraud_scoring.commands import Command, iso_date
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import redis_url


def run_emit(args: argparse.Namespace, settings: Settings) -> None:
    from batch_jobs.simulate import SimConfig, live_events

    cfg = SimConfig.from_args(args)
    events = live_events(
        cfg,
        late_fraction=args.late_fraction,
        max_lateness_s=args.max_lateness_s,
        duplicate_rate=args.duplicate_rate,
    )
    payloads = [json.dumps(e).encode() for e in events]
    keys = [str(e["card_id"]).encode() for e in events]
    source_kind = args.source or settings.stream_source
    stream = args.stream or settings.stream_name
    t0 = time.perf_counter()
    if source_kind == "kafka":
        from confluent_kafka import Producer

        from streaming.sources import ensure_topic

        bootstrap = args.kafka_bootstrap or settings.kafka_bootstrap
        ensure_topic(bootstrap, stream, args.partitions)
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})

        def send_kafka(batch: list[int]) -> None:
            for i in batch:
                producer.produce(stream, value=payloads[i], key=keys[i])
            producer.poll(0)

        _paced(len(payloads), args.events_per_s, send_kafka)
        if producer.flush(30):
            raise RuntimeError("kafka: not every event was delivered within 30 s")
    else:  # "redis": the settings and --source admit no other value
        with redis_url(settings.redis_url) as url, sync_client(url) as client:

            def send(batch: list[int]) -> None:
                pipe = client.pipeline(transaction=False)
                for i in batch:
                    pipe.xadd(stream, {"data": payloads[i]})
                pipe.execute()

            _paced(len(payloads), args.events_per_s, send)
    dt = time.perf_counter() - t0
    print(f"emitted {len(payloads):,} events to {source_kind} {stream!r} in {dt:.1f}s")


def _paced(n: int, per_s: float, send: Callable[[list[int]], None]) -> None:
    """Call ``send`` with consecutive index batches, at ``per_s`` events/s (0: at once)."""
    if per_s <= 0:
        for start in range(0, n, 1000):
            send(list(range(start, min(n, start + 1000))))
        return
    t0 = time.perf_counter()
    sent = 0
    while sent < n:
        due = min(n, int((time.perf_counter() - t0) * per_s) + 1)
        if due > sent:
            send(list(range(sent, due)))
            sent = due
        else:
            time.sleep(min(0.001, (sent + 1) / per_s - (time.perf_counter() - t0)))


def configure_emit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=("redis", "kafka"), help="default FRAUD_STREAM_SOURCE")
    p.add_argument("--stream", help="Redis stream / Kafka topic (default FRAUD_STREAM_NAME)")
    p.add_argument("--kafka-bootstrap", help="default FRAUD_KAFKA_BOOTSTRAP")
    p.add_argument("--partitions", type=int, default=3, help="Kafka: partitions if created")
    p.add_argument("--cards", type=int, default=1000, help="number of cards (default 1000)")
    p.add_argument("--merchants", type=int, default=200, help="number of merchants (default 200)")
    p.add_argument("--days", type=int, default=1, help="days of events (default 1)")
    p.add_argument("--start", type=iso_date, default=date(2026, 1, 1), help="first day (UTC)")
    p.add_argument("--rate", type=float, default=3.0, help="mean transactions per card-day")
    p.add_argument("--seed", type=int, default=7, help="random seed (same seed, same feed)")
    p.add_argument(
        "--late-fraction",
        type=float,
        default=0.05,
        help="share of events that arrive late (out of order)",
    )
    p.add_argument(
        "--max-lateness-s",
        type=float,
        default=60.0,
        help="late and repeated events arrive up to this many seconds after their time",
    )
    p.add_argument(
        "--duplicate-rate", type=float, default=0.02, help="share of events delivered a second time"
    )
    p.add_argument("--events-per-s", type=float, default=0.0, help="0: as fast as possible")


COMMAND = Command(
    "emit",
    "publish a simulated live transaction feed to the event log",
    run_emit,
    configure_emit,
    settings=Settings,
)
