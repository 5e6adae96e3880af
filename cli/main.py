"""The ``fraud-scoring`` command: one subcommand per job.

Every subcommand reads the same settings (``fraud_scoring.settings``); flags override
them. The subcommands come from each app folder's ``commands`` module (batch_jobs,
service, streaming) plus the demo, the simulated feed and Feast's CLI (``feast``) here.
Short jobs (simulate, batch, train, demo, emit, feast) start a private Redis-protocol
server for their own duration when ``REDIS_URL`` is unset; the long-running ``serve`` and
``stream`` refuse to unless given ``--embedded-redis``.

Exit status: 0 done (``serve``: also stopped by SIGTERM after a clean drain), 1 the job
failed (missing data, bad model, Redis or service would not start), 2 bad input or
configuration (``serve``: also a port taken or a TLS file unreadable; or a job subcommand
where the training stack is not installed: the serving image), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import re
import sys
from typing import Any

from pydantic import AliasChoices, ValidationError

import batch_jobs.commands
import service.commands
import streaming.commands
from cli import demo, emit, feast_tools, lists, rules, score_stream
from cli.settings import Settings
from fraud_scoring.commands import Command, UsageError
from fraud_scoring.model_repo import ModelError
from fraud_scoring.redis_server import RedisNotConfigured, RedisStartError
from fraud_scoring.settings import read_settings
from fraud_scoring.storage import DataError
from service.edge.server import ServiceConfigError, ServiceStartError

log = logging.getLogger("fraud_scoring")

# The import names of the `train` extra's packages (pyproject.toml; tests/test_packaging.py
# checks that they agree) and Spark's: what the job subcommands import and the serving
# image lacks.
JOB_MODULES = frozenset(
    {
        "duckdb",
        "lightgbm",
        "onnxmltools",
        "onnx",
        "skl2onnx",
        "sklearn",
        "scipy",
        "tqdm",
        "matplotlib",
        "pyspark",
    }
)

COMMANDS: list[Command[Any]] = [
    *batch_jobs.commands.COMMANDS,
    *service.commands.COMMANDS,
    *streaming.commands.COMMANDS,
    score_stream.COMMAND,
    demo.COMMAND,
    emit.COMMAND,
    feast_tools.COMMAND,
    lists.COMMAND,
    rules.COMMAND,
]


# Inline code in the texts --help shows (docstrings are reST, ``code``; some help strings
# Markdown, `code`): a terminal shows the marks as they are.
_RST_LITERAL = re.compile(r"``(.+?)``")
_MD_CODE = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` as --help shows it: reST's double backticks taken out, Markdown's single
    ones made quotes."""
    return _MD_CODE.sub(r"'\1'", _RST_LITERAL.sub(r"\1", text))


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Every text of ``parser`` and its subcommands' parsers through :func:`plain`."""
    if parser.description:
        parser.description = plain(parser.description)
    for action in parser._actions:
        if action.help and action.help != argparse.SUPPRESS:
            action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for listed in action._choices_actions:  # the subcommand list's lines
                if listed.help:
                    listed.help = plain(listed.help)
            for sub in set(action.choices.values()):
                _plain_help(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fraud-scoring", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {importlib.metadata.version('fraud-scoring')}",
        help="print the installed version and exit",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in COMMANDS:
        cp = sub.add_parser(c.name, help=c.help, description=c.help)
        c.configure(cp)
        # main() finds the chosen command and the settings class it reads in the parsed args
        cp.set_defaults(run=c.run, settings_class=c.settings)
    _plain_help(p)
    return p


def _positive(args: argparse.Namespace) -> None:
    for name in ("cards", "merchants", "days", "holdout_days"):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {v}")
    rate = getattr(args, "rate", None)
    if rate is not None and rate <= 0:
        raise UsageError(f"--rate must be positive, got {rate}")


def env_name(loc: tuple[int | str, ...]) -> str:
    """The environment variable a Settings validation error is about (``port`` ->
    ``FRAUD_PORT``, ``redis_url`` -> ``REDIS_URL``); ``settings`` for a cross-field one."""
    if not loc:
        return "settings"
    field = Settings.model_fields.get(str(loc[0]))
    if field is None:  # pydantic reports an aliased field under its alias already
        return str(loc[0])
    alias = field.validation_alias
    if isinstance(alias, str):
        return alias
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    return f"{Settings.model_config.get('env_prefix', '')}{loc[0]}".upper()


def _settings_errors(exc: ValidationError) -> str:
    if exc.title in {c.__name__ for c in Settings.__mro__}:  # one of the apps' settings
        return "; ".join(f"{env_name(tuple(e['loc']))}: {e['msg']}" for e in exc.errors())
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
    )


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return its exit status (errors are logged, not raised)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("feast", "dask", "distributed", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if getattr(args, "embedded_redis", False):
        # Through the environment, not only this process's settings object: the
        # scoring API's app factory (and any uvicorn worker process) reads it there.
        os.environ["FRAUD_EMBEDDED_REDIS"] = "true"
        read_settings.cache_clear()
    try:
        settings = read_settings(args.settings_class)
        _positive(args)
        args.run(args, settings)
    except ValidationError as exc:
        log.error("invalid configuration: %s", _settings_errors(exc))
        return 2
    except (UsageError, RedisNotConfigured, ServiceConfigError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    except (DataError, ModelError, RedisStartError, ServiceStartError, FileNotFoundError) as exc:
        log.error("%s", exc)
        return 1
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in JOB_MODULES:
            raise
        log.error(
            "fraud-scoring %s needs %r, which is not installed: this installation (the "
            "serving image) serves only; the batch jobs need the `train` extra "
            "(pip install 'fraud-scoring[cpu,train]') or the jobs image",
            args.command,
            exc.name,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
