"""The ``fraud-scoring`` command: one subcommand per job.

Every subcommand reads the same settings (``fraud_scoring.settings``); flags override
them. When ``REDIS_URL`` is unset a private Redis-protocol server is started for the
duration of the command (data in it is gone when the command ends).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta

from pydantic import ValidationError

from fraud_scoring.settings import Settings, get_settings

log = logging.getLogger("fraud_scoring")


class UsageError(Exception):
    """Bad command-line input; the message says which flag and why."""


def _date(s: str) -> date:
    try:
        return date.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {s!r}") from None


@contextlib.contextmanager
def _redis(settings: Settings) -> Iterator[str]:
    from fraud_scoring.redis_server import redis_url

    with redis_url(settings.redis_url) as url:
        yield url


def cmd_simulate(args: argparse.Namespace, settings: Settings) -> None:
    import time

    from batch_jobs.simulate import SimConfig, simulate

    cfg = SimConfig.from_args(args)
    t0 = time.perf_counter()
    n = simulate(cfg, settings.data_dir / "raw")
    print(
        f"simulated {n:,} transactions over {cfg.days} days into "
        f"{settings.data_dir / 'raw'} in {time.perf_counter() - t0:.1f}s"
    )


def cmd_batch(args: argparse.Namespace, settings: Settings) -> None:
    from batch_jobs.batch import day_range, run_batch

    if args.date and (args.from_ or args.to):
        raise UsageError("--date cannot be combined with --from/--to")
    if args.from_ or args.to:
        if not (args.from_ and args.to):
            raise UsageError("--from and --to go together")
        days = day_range(args.from_, args.to)
    else:
        days = [args.date or (datetime.now(UTC).date() - timedelta(days=1))]
    # Parquet only (--no-materialize) needs no Redis: start none.
    with contextlib.nullcontext("") if args.no_materialize else _redis(settings) as url:
        r = run_batch(
            settings.data_dir,
            days,
            url,
            settings.feature_store_yaml,
            materialize=not args.no_materialize,
        )
    print(
        f"batch: {r.days} day(s), {r.rows_written:,} feature rows in {r.compute_s:.1f}s; "
        f"materialized {r.materialized_rows:,} rows in {r.materialize_s:.1f}s "
        f"({r.materialize_rows_per_s:,.0f} rows/s)"
    )


def cmd_train(args: argparse.Namespace, settings: Settings) -> None:
    from batch_jobs.train import TrainConfig, train

    cfg = TrainConfig(holdout_days=args.holdout_days, model_name=settings.model_name)
    with _redis(settings) as url:
        meta = train(settings.data_dir, url, settings.model_repo, cfg, settings.feature_store_yaml)
    print(
        f"model {meta.name} version {meta.version}: "
        + ", ".join(f"{k}={v:.4f}" for k, v in meta.metrics.items())
    )
    print(
        f"thresholds: review >= {meta.thresholds.review:.4g}, "
        f"decline >= {meta.thresholds.decline:.4g}"
    )


def cmd_serve(args: argparse.Namespace, settings: Settings) -> None:
    from service.server import serve

    serve(settings)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> None:
    from service.demo import run_demo

    run_demo(settings, cards=args.cards, days=args.days, keep_serving=args.keep_serving)


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace, Settings], None], str]] = {
    "simulate": (cmd_simulate, "write simulated raw transaction history (parquet)"),
    "batch": (cmd_batch, "compute daily batch features and materialize them into Redis"),
    "train": (cmd_train, "train the model on a Feast point-in-time training set"),
    "serve": (cmd_serve, "run the scoring API (FastAPI + uvicorn)"),
    "demo": (cmd_demo, "simulate, batch, train, serve and score a few transactions"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fraud-scoring", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {
        name: sub.add_parser(name, help=h, description=h) for name, (_, h) in COMMANDS.items()
    }

    s = parsers["simulate"]
    s.add_argument("--cards", type=int, default=5000, help="number of cards (default 5000)")
    s.add_argument("--merchants", type=int, default=500, help="number of merchants")
    s.add_argument("--days", type=int, default=30, help="days of history")
    s.add_argument("--start", type=_date, default=date(2026, 1, 1), help="first day (UTC)")
    s.add_argument("--rate", type=float, default=2.0, help="mean transactions per card-day")
    s.add_argument("--seed", type=int, default=7, help="random seed (same seed, same data)")

    b = parsers["batch"]
    b.add_argument("--date", type=_date, help="the day to compute (default: yesterday, UTC)")
    b.add_argument("--from", dest="from_", type=_date, help="first day of a backfill range")
    b.add_argument("--to", type=_date, help="last day of a backfill range (inclusive)")
    b.add_argument("--no-materialize", action="store_true", help="write parquet only")

    t = parsers["train"]
    t.add_argument("--holdout-days", type=int, default=5, help="last days held out by time")

    d = parsers["demo"]
    d.add_argument("--cards", type=int, default=3000, help="cards to simulate")
    d.add_argument("--days", type=int, default=21, help="days to simulate (at least 12)")
    d.add_argument("--keep-serving", action="store_true", help="leave the API running")

    extra = _extra_commands()
    for name, (fn, h, configure) in extra.items():
        configure(sub.add_parser(name, help=h, description=h))
        COMMANDS[name] = (fn, h)
    return p


def _extra_commands() -> dict[
    str,
    tuple[
        Callable[[argparse.Namespace, Settings], None],
        str,
        Callable[[argparse.ArgumentParser], None],
    ],
]:
    """Subcommands contributed by other packages (the streaming updater)."""
    try:
        from streaming.cli import COMMANDS as streaming_commands
    except ImportError:
        return {}
    return dict(streaming_commands)


def _positive(args: argparse.Namespace) -> None:
    for name in ("cards", "merchants", "days", "holdout_days"):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {v}")
    rate = getattr(args, "rate", None)
    if rate is not None and rate <= 0:
        raise UsageError(f"--rate must be positive, got {rate}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("feast", "dask", "distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from fraud_scoring.model_repo import ModelError
    from fraud_scoring.redis_server import RedisStartError
    from fraud_scoring.storage import DataError
    from service.server import ServiceStartError

    try:
        settings = get_settings()
        _positive(args)
        COMMANDS[args.command][0](args, settings)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        log.error("invalid configuration: %s", errs)
        return 2
    except (UsageError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    except (DataError, ModelError, RedisStartError, ServiceStartError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
