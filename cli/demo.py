"""``fraud-scoring demo``: the whole product on one machine, end to end.

simulate → daily features (+ Feast materialization) → train → serve → score a handful of
held-out transactions (some fraudulent) over HTTP and print the decisions with reasons.
The last simulated day is held out: its features are computed offline but the online
store holds snapshots only up to the day before, as it would in production. The API
listens on 127.0.0.1, on ``--port`` (default 0: a free port, printed).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import httpx

from cli.settings import Settings
from fraud_scoring.commands import Command, UsageError
from fraud_scoring.events import Transaction, raw_row_to_event
from fraud_scoring.redis_clients import sync_client
from fraud_scoring.redis_server import redis_url
from fraud_scoring.storage import read_partition

if TYPE_CHECKING:
    from service.edge.server import ServiceProcess

HOST = "127.0.0.1"


def _step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def _pick(rows: list[dict], n_fraud: int = 4, n_normal: int = 4) -> list[dict]:
    chosen: list[dict] = []
    testing = [r for r in rows if r["fraud_pattern"] == "card_testing" and r["amount"] < 10]
    chosen += testing[len(testing) // 2 :][:1]  # mid-burst: velocity is what gives it away
    for pattern in ("account_takeover", "compromised_merchant"):
        chosen += [r for r in rows if r["fraud_pattern"] == pattern][-1:]
    chosen += [r for r in rows if r["is_fraud"] and r not in chosen][: n_fraud - len(chosen)]
    chosen += [r for r in rows[:: max(len(rows) // 50, 1)] if not r["is_fraud"]][:n_normal]
    return chosen


def run_demo(
    settings: Settings,
    cards: int,
    days: int,
    keep_serving: bool = False,
    live_seconds: float | None = None,
    live_share: float = 0.5,
    port: int = 0,
) -> None:
    # Imported here: they take seconds, and every other subcommand (and --help) would
    # pay for them when the entry point imports this module.
    from batch_jobs.batch import day_range, run_batch
    from batch_jobs.simulate import SimConfig, simulate
    from batch_jobs.train import TrainConfig, train
    from streaming.state import SessionWriter, card_event

    cfg = SimConfig(cards=cards, merchants=max(cards // 10, 20), days=days)
    last = cfg.start + timedelta(days=days - 1)
    with redis_url(settings.redis_url) as url:
        _step(f"simulate {cards} cards x {days} days")
        t0 = time.perf_counter()
        n = simulate(cfg, settings.data_dir / "raw")
        print(f"{n:,} transactions in {time.perf_counter() - t0:.1f}s")

        _step("daily batch features + Feast materialization")
        r = run_batch(
            settings.data_dir,
            day_range(cfg.start, last - timedelta(days=1)),
            url,
            settings.feature_store_yaml,
            allowed_lateness_s=settings.allowed_lateness_s,
            label_available_after_s=settings.batch_available_after_s,
        )
        run_batch(settings.data_dir, [last], url, settings.feature_store_yaml, materialize=False)
        print(
            f"{r.days} days, {r.rows_written:,} feature rows; materialized "
            f"{r.materialized_rows:,} rows at {r.materialize_rows_per_s:,.0f} rows/s"
        )

        _step("train (Feast point-in-time join -> LightGBM -> ONNX)")
        meta = train(
            settings.data_dir,
            url,
            settings.model_repo,
            TrainConfig(
                model_name=settings.model_name, holdout_days=3, warmup_days=min(7, days - 6)
            ),
            settings.feature_store_yaml,
        )
        print(
            f"model v{meta.version}: holdout PR-AUC {meta.metrics['holdout_pr_auc']:.3f}, "
            f"ROC-AUC {meta.metrics['holdout_roc_auc']:.3f}, calibration error "
            f"{meta.metrics['holdout_ece']:.4f}; probability thresholds: review >= "
            f"{meta.thresholds.review:.3g}, decline >= {meta.thresholds.decline:.3g}"
        )
        report = settings.model_repo / meta.name / meta.version / "evaluation" / "report.md"
        print(f"evaluation report (PR curve, reliability, per-pattern recall): {report}")

        _step("serve and score held-out transactions")
        service = serve_on(
            {
                "REDIS_URL": url,
                "FRAUD_DATA_DIR": str(settings.data_dir),
                "FRAUD_MODEL_REPO": str(settings.model_repo),
                # The demo replays simulated history: no bound on event time vs the clock.
                "FRAUD_MAX_EVENT_SKEW_S": "0",
            },
            port,
        )
        base = service.url
        print(f"serving at {base}")
        try:
            # The streaming updater's job, done inline: before each scored transaction,
            # every earlier event of the last two days is applied to the session state.
            rows = [
                r
                for d in (last - timedelta(days=1), last)
                for r in read_partition(settings.data_dir / "raw", "transactions", d).to_pylist()
            ]
            rows.sort(key=lambda r: r["event_time"])
            writer = SessionWriter(sync_client(url), settings.allowed_lateness_s)
            events = [card_event(Transaction.model_validate(r)) for r in rows]
            applied = 0
            todays = [r for r in rows if r["event_time"].date() == last]
            with httpx.Client(base_url=base, timeout=10) as client:
                for row in sorted(_pick(todays), key=lambda r: r["event_time"]):
                    start = applied
                    while applied < len(rows) and rows[applied]["event_time"] < row["event_time"]:
                        applied += 1
                    writer.apply(events[start:applied])
                    truth = row["fraud_pattern"] or "legit"
                    body = raw_row_to_event(row)
                    res = client.post("/v1/score", json=body).json()
                    print(
                        f"\n{row['transaction_id']}  {row['amount']:>9.2f} {row['currency']} "
                        f"{row['channel']:<4} {row['country']}  truth={truth:<20} -> "
                        f"{res['decision'].upper():<7} score={res['score']:.3g} "
                        f"({res['timing']['total_ms']:.1f} ms)"
                    )
                    for reason in res["reasons"][:3]:
                        print(f"    {reason['code']}: {reason['message']}")
                    if res["features"]["missing"] or res["features"]["stale"]:
                        print(
                            f"    defaults used: missing={len(res['features']['missing'])} "
                            f"stale={len(res['features']['stale'])}"
                        )
            if live_seconds is not None:
                from cli.live_day import run_live_day

                _step(f"a day of live traffic in {live_seconds:g}s: updater, log, labels, report")
                report = run_live_day(
                    settings, url, base, last, live_seconds, live_share, settings.data_dir
                )
                print(f"served-traffic report (evaluate --served): {report / 'report.md'}")
            if keep_serving:
                print(f"\nserving at {base} (Ctrl-C to stop)")
                service.proc.wait()
        finally:
            service.stop()


def check_port(port: int) -> None:
    """:class:`UsageError` (exit 2, before minutes of simulating and training) when
    ``port`` is outside 0-65535 or taken on 127.0.0.1."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0-65535 (0: a free port), got {port}")
    if port == 0:
        return
    with socket.socket() as probe:
        # As uvicorn binds: a port left in TIME_WAIT by an earlier run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise UsageError(f"--port {port}: {HOST}:{port} is {why}") from None


def serve_on(env: dict[str, str], port: int, timeout_s: float = 60.0) -> ServiceProcess:
    """``fraud-scoring serve`` with ``env`` on ``HOST:port``, once ``/readyz`` answers
    200 (``port`` 0: a free one, :func:`service.edge.server.spawn`'s way)."""
    from service.edge.server import ServiceProcess, ServiceStartError, spawn

    if port == 0:
        return spawn(env, timeout_s=timeout_s)
    # As spawn does, but on the asked port (spawn always picks one).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve"],
        env={**inherited, **env, "FRAUD_HOST": HOST, "FRAUD_PORT": str(port)},
    )
    service = ServiceProcess(proc, f"http://{HOST}:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServiceStartError(f"the scoring service exited with {proc.returncode}")
        try:
            if httpx.get(service.url + "/readyz", timeout=1).status_code == 200:
                return service
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            service.stop()
            raise ServiceStartError(f"/readyz did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.05)


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cards", type=int, default=3000, help="cards to simulate")
    p.add_argument("--days", type=int, default=21, help="days to simulate (at least 12)")
    p.add_argument("--keep-serving", action="store_true", help="leave the API running")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="the API's port on 127.0.0.1 (default 0: a free port, printed)",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="then play the held-out day as live traffic with the updater, compact the "
        "decision log, join labels and write the served-traffic report",
    )
    p.add_argument(
        "--live-seconds",
        type=float,
        default=60.0,
        help="wall-clock seconds the live day is compressed into (default 60)",
    )
    p.add_argument(
        "--live-share",
        type=float,
        default=0.5,
        help="share of the cards whose transactions the live day plays (default 0.5)",
    )


def _run(args: argparse.Namespace, settings: Settings) -> None:
    if args.live_seconds <= 0:
        raise UsageError(f"--live-seconds must be positive, got {args.live_seconds:g}")
    if not 0 < args.live_share <= 1:
        raise UsageError(f"--live-share must be in (0, 1], got {args.live_share:g}")
    check_port(args.port)
    run_demo(
        settings,
        cards=args.cards,
        days=args.days,
        keep_serving=args.keep_serving,
        live_seconds=args.live_seconds if args.live else None,
        live_share=args.live_share,
        port=args.port,
    )


COMMAND = Command(
    "demo",
    "simulate, batch, train, serve and score a few transactions (--live: then a day of "
    "live traffic through the decision loop)",
    _run,
    configure_demo,
    settings=Settings,
)
