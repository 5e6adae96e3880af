"""The batch subcommands: ``simulate``, ``ingest``, ``batch``, ``train``, ``evaluate``,
``decisions``, ``replay``.

``batch`` and ``train`` check the raw partitions they read against the input contract
(``fraud_scoring/contract.py``) before they write anything.

The heavy modules (DuckDB, Feast, LightGBM) are imported inside each command so that
``fraud-scoring --help`` and the other subcommands start without them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from batch_jobs.settings import JobsSettings
from fraud_scoring.commands import Command, UsageError, iso_date
from fraud_scoring.contract import check_raw
from fraud_scoring.redis_server import redis_url

log = logging.getLogger(__name__)


def configure_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cards", type=int, default=5000, help="number of cards (default 5000)")
    p.add_argument("--merchants", type=int, default=500, help="number of merchants")
    p.add_argument("--days", type=int, default=30, help="days of history")
    p.add_argument("--start", type=iso_date, default=date(2026, 1, 1), help="first day (UTC)")
    p.add_argument("--rate", type=float, default=2.0, help="mean transactions per card-day")
    p.add_argument("--seed", type=int, default=7, help="random seed (same seed, same data)")


def run_simulate(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.simulate import SimConfig, simulate

    cfg = SimConfig.from_args(args)
    t0 = time.perf_counter()
    n = simulate(cfg, settings.data_dir / "raw")
    print(
        f"simulated {n:,} transactions over {cfg.days} days into "
        f"{settings.data_dir / 'raw'} in {time.perf_counter() - t0:.1f}s"
    )


def configure_ingest(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "mapping",
        type=Path,
        help="the mapping file (YAML): your files and columns -> the contract "
        "(docs/data-contract.md); file paths in it are relative to it",
    )
    p.add_argument(
        "--rejects",
        type=Path,
        help="where refused rows go, with their reason (default: "
        "FRAUD_DATA_DIR/ingest/rejects.csv; a manifest.json lands beside it)",
    )


def run_ingest(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.ingest import ingest
    from fraud_scoring.fields import door_for

    t0 = time.perf_counter()
    report = ingest(args.mapping, settings.data_dir, args.rejects, door_for(settings))
    print(report.text())
    print(f"into {settings.data_dir / 'raw'} in {time.perf_counter() - t0:.1f}s")


def configure_batch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--date", type=iso_date, help="the day to compute (default: yesterday, UTC)")
    p.add_argument("--from", dest="from_", type=iso_date, help="first day of a backfill range")
    p.add_argument("--to", type=iso_date, help="last day of a backfill range (inclusive)")
    p.add_argument("--no-materialize", action="store_true", help="write parquet only")
    p.add_argument(
        "--engine",
        choices=["duckdb", "spark"],
        help="engine of the daily features (default: FRAUD_BATCH_ENGINE, duckdb)",
    )


def run_batch(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs import batch

    if args.date and (args.from_ or args.to):
        raise UsageError("--date cannot be combined with --from/--to")
    if args.from_ or args.to:
        if not (args.from_ and args.to):
            raise UsageError("--from and --to go together")
        days = batch.day_range(args.from_, args.to)
    else:
        days = [args.date or (datetime.now(UTC).date() - timedelta(days=1))]
    # Every partition the days read (all earlier ones: first-seen dates), before writing.
    check_raw(settings.data_dir / "raw", until=max(days), need=days)
    engine = args.engine or settings.batch_engine
    with contextlib.ExitStack() as stack:
        compute: batch.DayCompute = batch.compute_day
        if engine == "spark":
            from batch_jobs.spark_engine import compute_day_spark, spark_run

            spark = stack.enter_context(spark_run(settings.spark_master))
            compute = functools.partial(compute_day_spark, spark)
        # Parquet only (--no-materialize) needs no Redis: start none.
        url = "" if args.no_materialize else stack.enter_context(redis_url(settings.redis_url))
        r = batch.run_batch(
            settings.data_dir,
            days,
            url,
            settings.feature_store_yaml,
            materialize=not args.no_materialize,
            compute=compute,
            materializer=settings.materializer,
            allowed_lateness_s=settings.allowed_lateness_s,
            label_available_after_s=settings.batch_available_after_s,
        )
    print(
        f"batch: {r.days} day(s), {r.rows_written:,} feature rows in {r.compute_s:.1f}s; "
        f"materialized {r.materialized_rows:,} rows in {r.materialize_s:.1f}s "
        f"({r.materialize_rows_per_s:,.0f} rows/s); declared states in {r.declared_s:.1f}s"
    )
    # The decision loop's step: only where a log exists to read (a configured server).
    if settings.decision_log == "kafka" or (
        settings.decision_log == "redis" and (settings.decision_log_url or settings.redis_url)
    ):
        for day in days:
            _compact(day, settings)
        if settings.redis_url and not args.no_materialize:
            # The feedback labels compaction just added to the days' raw labels.
            batch.record_day_labels(
                settings.data_dir / "raw",
                days,
                settings.redis_url,
                settings.allowed_lateness_s,
                settings.batch_available_after_s,
            )


def _log_reader(settings: JobsSettings) -> tuple[Callable[[str, date], Iterator[bytes]], str]:
    """Payloads of one stream/topic of the configured log for a UTC day, and where the log
    is (for messages)."""
    from fraud_scoring.event_log import read_kafka_day, read_redis_day
    from fraud_scoring.redis_server import redact_url

    if settings.decision_log == "kafka":
        bootstrap = settings.kafka_bootstrap
        return (
            lambda name, day: (p for _, p in read_kafka_day(bootstrap, name, day)),
            f"Kafka {bootstrap}",
        )
    url = settings.decision_log_url or settings.redis_url
    if settings.decision_log != "redis" or url is None:
        raise UsageError(
            "decisions compact reads the decision log: needs FRAUD_DECISION_LOG=redis with "
            "FRAUD_DECISION_LOG_URL or REDIS_URL, or FRAUD_DECISION_LOG=kafka"
        )
    return (lambda name, day: (p for _, p in read_redis_day(url, name, day))), redact_url(url)


def _compact(day: date, settings: JobsSettings) -> None:
    import redis

    from batch_jobs.decisions import compact_day
    from fraud_scoring.event_log import LogUnavailable
    from fraud_scoring.storage import DataError

    read, where = _log_reader(settings)
    try:
        r = compact_day(
            settings.data_dir / "raw",
            day,
            read(settings.decision_log_stream, day),
            read(settings.feedback_stream, day),
        )
    except (redis.RedisError, LogUnavailable) as exc:
        raise DataError(f"reading the decision log at {where}: {exc}") from exc
    print(
        f"decisions {day}: {r.decisions:,} written to {settings.data_dir / 'raw' / 'decisions'} "
        f"({r.duplicates:,} repeated ids dropped), {r.labels:,} feedback label(s) merged"
    )


def configure_decisions(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser(
        "compact",
        help="write a day of the decision log to raw/decisions and its feedback to raw/labels",
    )
    c.add_argument(
        "--date", type=iso_date, help="the UTC day the log stored (default: yesterday, UTC)"
    )


def run_decisions(args: argparse.Namespace, settings: JobsSettings) -> None:
    _compact(args.date or (datetime.now(UTC).date() - timedelta(days=1)), settings)


def _aware_time(v: str) -> datetime:
    t = datetime.fromisoformat(v)
    if t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{v!r} has no time zone (e.g. +00:00)")
    return t


def _lgbm_param(s: str) -> tuple[str, str]:
    key, eq, value = s.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE: {s!r}")
    return key.strip(), value.strip()


# Flags of ``train`` that set a TrainConfig field of the same name (dest, type, help).
_TRAIN_FLAGS: tuple[tuple[str, Callable[[str], object], str], ...] = (
    (
        "labels_as_of",
        _aware_time,
        "labels known up to this instant (RFC 3339, with a zone; default: now)",
    ),
    (
        "label_delay_days",
        int,
        "days until a transaction's chargeback is taken as in "
        "(default 20): the holdout ends this long before --labels-as-of",
    ),
    ("warmup_days", int, "first days skipped: no batch history yet (default 7)"),
    ("valid_days", int, "validation days, fitting the calibration (default 2)"),
    ("holdout_days", int, "last days held out by time (default 3)"),
    (
        "calibration_blocks",
        int,
        "training blocks cross-fitted for the calibration pool, each one more fit "
        "per variant (default 8; 0: the validation slice alone)",
    ),
    ("max_train_negatives", int, "legitimate rows sampled for training (default 60000)"),
    (
        "max_holdout_negatives",
        int,
        "legitimate rows sampled per validation and holdout slice, weighted back (default 60000)",
    ),
    (
        "min_label_coverage",
        float,
        "refuse when the holdout's labelled fraud rate is below "
        "this fraction of the training slice's or the latest version's (default 0.5)",
    ),
    ("seed", int, "random seed (default 7)"),
)


def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help="training config (YAML: the fields of batch_jobs.train.TrainConfig, "
        "docs/model-quality.md); flags override it",
    )
    for dest, typ, text in _TRAIN_FLAGS:
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, type=typ, help=text)
    p.add_argument(
        "--lgbm",
        type=_lgbm_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a LightGBM parameter, e.g. --lgbm num_leaves=63 (repeatable; "
        "TrainConfig.lightgbm lists them)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="publish even when a quality gate or the label-coverage check fails "
        "(recorded in the metadata); a window without enough frauds is refused all the same",
    )
    p.add_argument(
        "--engine",
        choices=["duckdb", "spark"],
        help="engine of the point-in-time join (default: FRAUD_BATCH_ENGINE, duckdb: "
        "Feast's local offline store)",
    )


def run_train(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.train import load_train_config, train

    overrides: dict[str, object] = {
        "model_name": settings.model_name,
        "batch_available_after_s": settings.batch_available_after_s,
    }
    overrides.update(
        {d: getattr(args, d) for d, _, _ in _TRAIN_FLAGS if getattr(args, d) is not None}
    )
    if args.lgbm:
        overrides["lightgbm"] = dict(args.lgbm)
    if args.force:
        overrides["force"] = True
    cfg = load_train_config(args.config, overrides)
    check_raw(settings.data_dir / "raw")
    with contextlib.ExitStack() as stack:
        pit_join = declared_columns = None
        if (args.engine or settings.batch_engine) == "spark":
            from batch_jobs.declared_spark import spark_training_columns
            from batch_jobs.spark_engine import point_in_time_join_spark, spark_run

            spark = stack.enter_context(spark_run(settings.spark_master))
            pit_join = functools.partial(
                point_in_time_join_spark, spark, settings.data_dir / "features"
            )
            declared_columns = functools.partial(spark_training_columns, spark)
        url = stack.enter_context(redis_url(settings.redis_url))
        meta = train(
            settings.data_dir,
            url,
            settings.model_repo,
            cfg,
            settings.feature_store_yaml,
            pit_join=pit_join,
            declared_columns=declared_columns,
        )
    print(
        f"model {meta.name} version {meta.version}: "
        + ", ".join(f"{k}={v:.4f}" for k, v in meta.metrics.items())
    )
    print(
        f"thresholds: review >= {meta.thresholds.review:.4g}, "
        f"decline >= {meta.thresholds.decline:.4g}"
    )
    print(f"evaluation report: {settings.model_repo / meta.name / meta.version / 'evaluation'}")


def configure_evaluate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", default="latest", help="model version (default: latest)")
    p.add_argument(
        "--refresh-labels",
        action="store_true",
        help="count the chargebacks that arrived since training (from FRAUD_DATA_DIR)",
    )
    logged = p.add_argument_group("on the decision log (docs/decision-loop.md)")
    logged.add_argument(
        "--served",
        action="store_true",
        help="report on the compacted decisions instead: quality, calibration, decision mix "
        "and drift of every model version in them",
    )
    logged.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="compare two model versions on the logged decisions both scored (a challenger "
        "in shadow or canary) over --from..--to, labels as of now",
    )
    logged.add_argument(
        "--from",
        dest="from_",
        type=iso_date,
        help="first UTC day of the log (--served: default --to)",
    )
    logged.add_argument(
        "--to",
        type=iso_date,
        help="last UTC day of the log, inclusive (--served: default --from, else yesterday)",
    )
    logged.add_argument(
        "--as-of",
        type=_aware_time,
        help="--served: count the labels that had arrived before this time (RFC 3339; "
        "default: now)",
    )
    logged.add_argument(
        "--out",
        type=Path,
        help="--served: report folder (default: FRAUD_DATA_DIR/reports/served-D1_D2)",
    )


def run_evaluate(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.evaluate import REPORT_DIR
    from batch_jobs.evaluation_report import evaluate_version
    from fraud_scoring.model_repo import resolve

    if args.served and args.compare:
        raise UsageError("--served and --compare are two reports: one at a time")
    if args.compare:
        return _compare(args, settings)
    if args.served:
        return _evaluate_served(args, settings)
    if args.from_ or args.to or args.as_of or args.out:
        raise UsageError(
            "--from and --to go with --served or --compare; --as-of, --out with --served"
        )

    data_dir = settings.data_dir if args.refresh_labels else None
    evaluate_version(settings.model_repo, settings.model_name, args.version, data_dir)
    path = resolve(settings.model_repo, settings.model_name, args.version) / REPORT_DIR
    print(f"evaluation report: {path / 'report.md'}")


def _evaluate_served(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.served_report import served_report, write_served_report

    if args.refresh_labels or args.version != "latest":
        raise UsageError("--served reports every version in the log, with labels as of --as-of")
    last = args.to or args.from_ or (datetime.now(UTC).date() - timedelta(days=1))
    first = args.from_ or last
    if first > last:
        raise UsageError(f"--from {first} is after --to {last}")
    folder = args.out or settings.data_dir / "reports" / f"served-{first}_{last}"
    data = served_report(
        settings.data_dir / "raw",
        first,
        last,
        args.as_of or datetime.now(UTC),
        settings.model_repo,
        settings.model_name,
    )
    write_served_report(folder, data)
    for v, vd in data["versions"].items():
        a, drift = vd["as_decided"], vd["drift"]
        psi = (
            f"score PSI {drift['score_psi']:.3f}, shifted: {', '.join(drift['shifted']) or 'none'}"
            if drift["reference"]
            else "no reference"
        )
        print(
            f"model v{v}: {vd['rows']:,} decisions, {vd['frauds']} known frauds; flagged "
            f"precision {a['flagged_precision']:.1%} recall {a['flagged_recall']:.1%}; "
            f"ECE {vd['metrics']['ece']:.4f}; {psi}"
        )
    print(f"served-traffic report: {folder / 'report.md'}")


def _compare(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.compare import compare, table_text, write_report

    if not (args.from_ and args.to):
        raise UsageError("--compare needs --from and --to (the days of the decision log)")
    if args.from_ > args.to:
        raise UsageError("--from must not be after --to")
    a, b = args.compare
    report = compare(
        settings.data_dir / "raw",
        settings.model_repo,
        settings.model_name,
        a,
        b,
        args.from_,
        args.to,
        as_of=datetime.now(UTC),
    )
    print(table_text(report))
    print(f"comparison: {write_report(settings.data_dir / 'reports', report)}")


def configure_features(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser(
        "plan",
        help="what the declarations add and remove, and which states need a backfill",
        description="Compare feature_repo/features.yaml (or FRAUD_FEATURES_FILE) with the "
        "last applied declarations and the published model versions. Writes nothing.",
    )
    b = sub.add_parser(
        "backfill",
        help="record the raw history into the declared states the plan lists as new",
        description="Record the raw history's transactions into the declared aggregations' "
        "Redis state (idempotent), then mark the declarations applied.",
    )
    b.add_argument("--all", action="store_true", help="every state, not only new ones")


def run_features(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs import feature_plan
    from fraud_scoring import features as F
    from fraud_scoring.fields import declared_fields

    decl = F.declarations()
    # The same file's own fields, checked too (a bad one refuses, naming it).
    fields = declared_fields(F.declarations_path())
    the_plan = feature_plan.plan(
        decl, settings.data_dir, settings.model_repo, settings.model_name, F.producible_features()
    )
    print(the_plan.text(decl))
    if fields:
        kinds = (f"{f.name} ({f.type}{', pii' if f.pii else ''})" for f in fields)
        print(f"declared fields: {', '.join(kinds)}")
    if args.action == "plan":
        return
    from batch_jobs.declared_sql import backfill_tiles, labels_for
    from batch_jobs.train import load_transactions
    from fraud_scoring.redis_clients import sync_client
    from fraud_scoring.storage import partition_days

    states = list(decl.specs) if args.all else the_plan.new_states
    if states:
        raw = settings.data_dir / "raw"
        check_raw(raw)
        days = partition_days(raw, "transactions")
        if not days:
            raise UsageError(f"no raw transactions under {raw / 'transactions'}")
        first = max(days[0], days[-1] - feature_plan.history_days(states))
        history = load_transactions(raw, first, days[-1])
        labels = labels_for(states, raw, settings.batch_available_after_s)
        only = dataclasses.replace(decl, specs=tuple(states))  # the new states only
        with redis_url(settings.redis_url) as url:
            client = sync_client(url)
            n = backfill_tiles(
                client,
                only,
                history,
                settings.allowed_lateness_s + F.declared.HORIZON_S,
                progress=lambda m: print(f"  {m}", flush=True),
                labels=labels,
            )
        print(
            f"backfill: {n:,} events recorded into {len(states)} state(s) from {first}..{days[-1]}"
        )
    feature_plan.record_applied(settings.data_dir, decl, states)
    print(f"applied: {feature_plan.applied_path(settings.data_dir)}")


def configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--day", type=iso_date, required=True, help="the UTC day to replay (YYYY-MM-DD)")
    p.add_argument(
        "--model-version",
        help="model version to score with (default: FRAUD_MODEL_VERSION, 'latest': the "
        "version a service with the same settings serves)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="the parquet file to write (default: "
        "FRAUD_DATA_DIR/replay/<model>/v<version>/day=YYYY-MM-DD.parquet)",
    )


def run_replay(args: argparse.Namespace, settings: JobsSettings) -> None:
    from batch_jobs.replay import replay_day, replay_model, require_day
    from fraud_scoring.settings import ScoringSettings, read_settings

    raw = settings.data_dir / "raw"
    version = args.model_version or settings.model_version
    # Bad input is refused before any work (exit 2): the day, the version.
    require_day(raw, args.day)
    replay_model(settings.model_repo, settings.model_name, version)
    check_raw(raw, until=args.day)
    policy = read_settings(ScoringSettings)  # the service's threshold overrides, amount rule
    with redis_url(settings.redis_url) as url:
        r = replay_day(
            settings.data_dir,
            url,
            settings.model_repo,
            settings.model_name,
            args.day,
            version=version,
            review_amount_limit=policy.review_amount_limit,
            review_threshold=policy.review_threshold,
            decline_threshold=policy.decline_threshold,
            batch_available_after_s=settings.batch_available_after_s,
            feature_store_yaml=settings.feature_store_yaml,
            out=args.out,
        )
    print(r.text())


COMMANDS: list[Command[Any]] = [
    Command(
        "simulate",
        "write simulated raw transaction history (parquet)",
        run_simulate,
        configure_simulate,
        settings=JobsSettings,
    ),
    Command(
        "ingest",
        "read your CSV or parquet export through a mapping file into the raw daily partitions",
        run_ingest,
        configure_ingest,
        settings=JobsSettings,
    ),
    Command(
        "batch",
        "compute daily batch features and materialize them into Redis",
        run_batch,
        configure_batch,
        settings=JobsSettings,
    ),
    Command(
        "train",
        "train the model on a Feast point-in-time training set",
        run_train,
        configure_train,
        settings=JobsSettings,
    ),
    Command(
        "evaluate",
        "re-run a model version's evaluation report (ONNX Runtime on its stored holdout), "
        "or --served: report on the logged decisions",
        run_evaluate,
        configure_evaluate,
        settings=JobsSettings,
    ),
    Command(
        "features",
        "declared features: plan a change of feature_repo/features.yaml, backfill new state",
        run_features,
        configure_features,
        settings=JobsSettings,
    ),
    Command(
        "decisions",
        "the decision log: compact a day into the offline store (with feedback labels)",
        run_decisions,
        configure_decisions,
        settings=JobsSettings,
    ),
    Command(
        "replay",
        "exact feature vectors, scores and decisions of a past day's transactions through "
        "the training join (parquet)",
        run_replay,
        configure_replay,
        settings=JobsSettings,
    ),
]
