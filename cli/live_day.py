"""``fraud-scoring demo --live``: a day of live traffic through the decision loop.

After the demo has built everything and started the service, the held-out day is played
as live traffic, compressed into ``seconds`` of wall time, in event-time order:

1. the streaming updater runs (``fraud-scoring stream``, its own process) on the event log;
2. each transaction is scored over HTTP when its (compressed) time comes, then appended
   to the event log, where the updater applies it (a duplicate of what scoring recorded);
3. an analyst labels every transaction sent to ``review`` through ``POST /v1/feedback``
   (the simulator's truth stands in for the analyst);
4. the decision log is compacted into ``raw/decisions`` (and the feedback into
   ``raw/labels``), each UTC day the run touched;
5. ``evaluate --served`` runs on those days, with the simulator's chargebacks and the
   feedback as labels, and the path of its report is printed with the drift gauges the
   service shows.

Decisions are dated by the wall clock (the day the log stored them), while the replayed
transactions keep their simulated event times; the simulator's chargebacks for that day
carry simulated arrival times, already past, so they all count as arrived.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import zlib
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from cli.settings import Settings
from fraud_scoring.events import raw_row_to_event
from fraud_scoring.redis_clients import async_client
from fraud_scoring.redis_server import free_port
from fraud_scoring.storage import read_partition

CONCURRENCY = 16  # requests in flight at most


def _metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _wait(cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def start_updater(settings: Settings, url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``fraud-scoring stream`` on ``url``'s event log; returns it and its metrics URL once
    it answers /readyz."""
    port = free_port()
    # As service.edge.server.spawn: not the metrics directory Feast set in this process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    env.update({"REDIS_URL": url, "FRAUD_UPDATER_METRICS_PORT": str(port)})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "stream"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the updater exited with {proc.returncode}; see {log}")
        try:
            return httpx.get(base + "/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    _wait(ready, 60, "the updater")
    return proc, base


async def _play(
    rows: list[dict], base: str, url: str, stream: str, seconds: float
) -> list[dict[str, Any]]:
    """Score ``rows`` (event-time order) as live traffic compressed into ``seconds``, each
    appended to the event log after its decision; analyst feedback for each review.
    Returns the answers (with the truth beside them)."""
    t_first = rows[0]["event_time"]
    day_s = max((rows[-1]["event_time"] - t_first).total_seconds(), 1.0)
    gate = asyncio.Semaphore(CONCURRENCY)
    answers: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=10, limits=limits) as client:
        log = async_client(url)

        async def one(row: dict) -> None:
            async with gate:
                body = raw_row_to_event(row)
                r = await client.post("/v1/score", json=body)
                await log.xadd(stream, {"data": json.dumps(body)})
                if r.status_code != 200:
                    detail = r.json().get("detail") or [{}]
                    why = f"{r.status_code} {detail[0].get('code', '')}".strip()
                    answers.append({"status": r.status_code, "why": why, "truth": row["is_fraud"]})
                    return
                a = r.json()
                answers.append({**a, "status": 200, "truth": row["is_fraud"]})
                if a["decision"] == "review":
                    fb = {
                        "transaction_id": a["transaction_id"],
                        "label": "fraud" if row["is_fraud"] else "legitimate",
                        "source": "analyst",
                        "time": datetime.now(UTC).isoformat(),
                    }
                    await client.post("/v1/feedback", json=fb)

        t0 = time.monotonic()
        tasks = []
        for row in rows:
            due = (row["event_time"] - t_first).total_seconds() / day_s * seconds
            if (wait := due - (time.monotonic() - t0)) > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(row)))
        await asyncio.gather(*tasks)
        await log.aclose()
    return answers


def run_live_day(
    settings: Settings,
    url: str,
    base: str,
    day: date,
    seconds: float,
    share: float,
    workdir: Path,
) -> Path:
    """Play ``day`` (raw history; the transactions of ``share`` of the cards, chosen by a
    stable hash) through the running service at ``base`` with the updater, compact the
    log, run the served-traffic report; returns its folder."""
    from batch_jobs.decisions import compact_day
    from batch_jobs.served_report import served_report, write_served_report
    from fraud_scoring.event_log import read_redis_day

    raw = settings.data_dir / "raw"
    rows = sorted(
        (
            r
            for r in read_partition(raw, "transactions", day).to_pylist()
            if zlib.crc32(r["card_id"].encode()) % 1000 < share * 1000
        ),
        key=lambda r: r["event_time"],
    )
    updater, updater_url = start_updater(settings, url, workdir / "updater.log")
    started = datetime.now(UTC)
    try:
        t0 = time.perf_counter()
        answers = asyncio.run(_play(rows, base, url, settings.stream_name, seconds))
        took = time.perf_counter() - t0
        ok = [a for a in answers if a["status"] == 200]
        mix = {d: sum(a["decision"] == d for a in ok) for d in ("approve", "review", "decline")}
        frauds = sum(a["truth"] for a in answers)
        caught = sum(a["truth"] and a["decision"] != "approve" for a in ok)
        refused = Counter(a["why"] for a in answers if a["status"] != 200)
        print(
            f"{len(rows):,} transactions of {day} in {took:.0f}s ({len(rows) / took:,.0f}/s): "
            f"{mix['approve']:,} approved, {mix['review']:,} to review (each labelled by an "
            f"analyst), {mix['decline']:,} declined; {caught} of {frauds} frauds flagged"
            + (f"; refused: {dict(refused)}" if refused else "")
        )
        _wait(
            lambda: (
                _metric_sum(httpx.get(updater_url + "/metrics").text, "fraud_stream_events_total")
                >= len(rows)
            ),
            120,
            "the updater to apply the day",
        )
        print(f"updater: applied the day's {len(rows):,} events (duplicates of scoring's own)")
        text = _wait_logged(base, len(ok))
    finally:
        updater.terminate()
        updater.wait(timeout=30)
    psi = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^fraud_feature_psi\{feature="([^"]+)"\} (\S+)$', text, re.M)
    }
    if psi:
        top = sorted(psi.items(), key=lambda kv: -kv[1])[:3]
        print("drift gauges (PSI, /metrics): " + ", ".join(f"{n} {v:.3f}" for n, v in top))
    else:
        print("drift gauges: none (the model has no reference, or too few decisions)")
    first, last = started.date(), datetime.now(UTC).date()
    for d in [first + timedelta(days=k) for k in range((last - first).days + 1)]:
        r = compact_day(
            raw,
            d,
            (p for _, p in read_redis_day(url, settings.decision_log_stream, d)),
            (p for _, p in read_redis_day(url, settings.feedback_stream, d)),
        )
        print(f"compacted {d}: {r.decisions:,} decisions, {r.labels:,} feedback labels")
    data = served_report(
        raw, first, last, datetime.now(UTC), settings.model_repo, settings.model_name
    )
    folder = settings.data_dir / "reports" / f"served-{first}_{last}"
    write_served_report(folder, data)
    for v, vd in data["versions"].items():
        a = vd["as_decided"]
        print(
            f"served report, model v{v}: {vd['rows']:,} decisions, {vd['frauds']} known "
            f"frauds; flagged precision {a['flagged_precision']:.1%}, recall "
            f"{a['flagged_recall']:.1%}; ECE {vd['metrics']['ece']:.4f}"
        )
    return folder


def _wait_logged(base: str, n: int) -> str:
    """/metrics once the decision log has written ``n`` decisions and holds none back."""
    text = ""

    def done() -> bool:
        nonlocal text
        text = httpx.get(base + "/metrics").text
        written = _metric_sum(text, "fraud_decision_log_written_total")
        return written >= n and _metric_sum(text, "fraud_decision_log_buffered") == 0

    _wait(done, 60, "the decision log to be written")
    return text
