"""``fraud-scoring feast ARGS...``: Feast's CLI on ``feature_repo/`` with the project's settings.

``feature_repo/feature_store.yaml`` keeps two placeholders for the ``feast`` CLI, which
expands them from the environment: ``${FRAUD_DATA_DIR}`` (must be absolute, or Feast
resolves it inside ``feature_repo/``) and ``${FRAUD_FEAST_REDIS}`` (Feast's
``host:port,password=...,db=N`` form, not a URL). This command sets both from the
settings every other subcommand reads (``FRAUD_DATA_DIR``, resolved against the working
directory; ``REDIS_URL`` and ``FRAUD_REDIS_CA_FILE``), adds ``-c <feature_repo>`` (and
``-f`` when ``FRAUD_FEATURE_STORE_YAML`` is set), and runs Feast's CLI in this process,
so ``fraud-scoring feast plan`` is ``feast -c feature_repo plan`` with nothing to set up.

It reads the declarations the product applied to the registry (the feature service's
tag, written by ``batch`` and ``train``): with ``FRAUD_FEATURES_FILE`` unset it uses that
file, and it refuses (exit 2) when the file is not here or ``FRAUD_FEATURES_FILE`` names
another, since Feast's ``plan``/``apply`` would then delete or change the views the
product declared (and ``apply`` their online data).

With ``REDIS_URL`` unset, like the other short commands, a private Redis-protocol server
lives for the command's duration. On a Redis Cluster (``FRAUD_REDIS_CLUSTER``) Feast is
given a copy of the yaml with ``redis_type: redis_cluster``. The exit status is Feast's.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

import yaml

from cli.settings import Settings
from fraud_scoring.commands import Command, UsageError
from fraud_scoring.redis_clients import is_cluster
from fraud_scoring.redis_server import feast_connection_string, redis_url

log = logging.getLogger(__name__)


def feast_environment(settings: Settings, url: str) -> dict[str, str]:
    """The variables ``feature_store.yaml`` and ``feature_repo/definitions.py`` read,
    for the data dir in ``settings`` and the Redis at ``url``."""
    return {
        "FRAUD_DATA_DIR": str(settings.data_dir.resolve()),
        "FRAUD_FEAST_REDIS": feast_connection_string(url),
    }


def feast_argv(
    settings: Settings, feast_args: list[str], yaml_path: Path | None = None
) -> list[str]:
    """Feast's command line: the repository (and the yaml: ``yaml_path``, else the
    configured one, if any) first."""
    from fraud_scoring.feast_store import REPO_DIR  # imports Feast: only for this command

    argv = ["--chdir", str(REPO_DIR)]
    yaml_path = yaml_path or settings.feature_store_yaml
    if yaml_path is not None:
        argv += ["--feature-store-yaml", str(yaml_path.resolve())]
    # argparse keeps a leading "--" in the remainder; it only separated our options.
    return argv + (feast_args[1:] if feast_args[:1] == ["--"] else feast_args)


def run_feast(args: argparse.Namespace, settings: Settings) -> None:
    # Imported here: Feast's CLI module pulls in much more than the other commands need.
    from feast.cli.cli import cli as feast_cli

    with redis_url(settings.redis_url) as url, tempfile.TemporaryDirectory() as tmp:
        # Through the environment: Feast expands the yaml's ${...} and imports
        # definitions.py itself; this process runs nothing else afterwards.
        os.environ.update(feast_environment(settings, url))
        use_product_declarations(settings, url)
        yaml_path = cluster_yaml(settings, Path(tmp)) if is_cluster(url) else None
        argv = feast_argv(settings, args.feast_args, yaml_path)
        if not _materializes(args.feast_args):
            # standalone_mode: Feast's own error messages and exit status (SystemExit).
            feast_cli.main(args=argv, prog_name="feast")
            return
        from batch_jobs.progress import phase  # the jobs' stack, as _mark's

        # Feast prints each view's name and nothing while it writes: a live line on a
        # terminal, and the duration in the log.
        done = SystemExit(0)  # click's standalone mode ends in SystemExit in any case
        # Feast's CLI sets the level of every logger with "feast" in its name (--log-level,
        # default warning): this module's too.
        level = log.level
        with phase("feast materialize", log):
            try:
                feast_cli.main(args=argv, prog_name="feast")
            except SystemExit as exc:
                done = exc
            finally:
                log.setLevel(level)
        if done.code in (0, None):
            _mark(settings, url)
        raise done


def use_product_declarations(settings: Settings, url: str) -> None:
    """Make this process read the declarations the registry was applied from (see the
    module docstring); UsageError when it cannot. Nothing to check without a registry."""
    from feast.errors import FeatureServiceNotFoundException

    from feature_repo.definitions import DECLARATIONS_TAG, SERVICE_NAME
    from fraud_scoring import features as F
    from fraud_scoring.feast_store import open_store

    store = open_store(settings.data_dir, url, settings.feature_store_yaml)
    try:
        applied = store.get_feature_service(SERVICE_NAME).tags.get(DECLARATIONS_TAG)
    except FeatureServiceNotFoundException:
        return
    here = F.declarations_source()
    if applied is None or applied == here:
        return
    named = os.environ.get("FRAUD_FEATURES_FILE")
    if not named and applied != F.SHIPPED_DECLARATIONS and Path(applied).is_file():
        os.environ["FRAUD_FEATURES_FILE"] = applied
        F.declarations.cache_clear()
        log.info("reading the declarations the registry was applied from: %s", applied)
        return
    shipped = "the shipped feature_repo/features.yaml"
    ours = applied == F.SHIPPED_DECLARATIONS
    missing = "" if ours or Path(applied).is_file() else " (not found here)"
    fix = (
        "Unset FRAUD_FEATURES_FILE"
        if ours
        else f"Set FRAUD_FEATURES_FILE to {applied} (or a copy of it)"
    )
    raise UsageError(
        f"the Feast registry was applied from {shipped if ours else applied}{missing}, and "
        f"this command would read {f'FRAUD_FEATURES_FILE {named}' if named else shipped}: "
        "Feast's plan and apply would delete or change the views the product declared. "
        f"{fix}, or run `fraud-scoring batch` with the new file first (it applies its "
        "views and deletes none)"
    )


def cluster_yaml(settings: Settings, workdir: Path) -> Path:
    """A copy of the feature_store.yaml in use (``${...}`` kept for Feast to expand) with
    ``online_store.redis_type: redis_cluster``, written into ``workdir``: the yaml cannot
    take the type from a placeholder without breaking a plain ``feast`` call that does
    not set it."""
    from fraud_scoring.feast_store import REPO_DIR

    source = settings.feature_store_yaml or REPO_DIR / "feature_store.yaml"
    raw = yaml.safe_load(source.read_text())
    raw["online_store"] = {**raw["online_store"], "redis_type": "redis_cluster"}
    out = workdir / "feature_store.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def _materializes(feast_args: list[str]) -> bool:
    return any(a in ("materialize", "materialize-incremental") for a in feast_args)


def _mark(settings: Settings, url: str) -> None:
    """After Feast's own materialize, set the per-view markers the batch job sets: without
    them the scoring service reads the store as holding no batch features (degraded)."""
    from batch_jobs.batch import mark_materialized
    from fraud_scoring.feast_store import open_store

    project = open_store(settings.data_dir, url, settings.feature_store_yaml).project
    mark_materialized(url, project)


def configure_feast(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "feast_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="Feast's arguments, e.g. plan, apply, materialize START END, serve, ui "
        "(`fraud-scoring feast -- --help` for Feast's help)",
    )


COMMAND = Command(
    "feast",
    "run Feast's CLI on feature_repo/ with this project's data dir and Redis",
    run_feast,
    configure_feast,
    settings=Settings,
)
