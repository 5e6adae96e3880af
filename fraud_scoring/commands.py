"""How an app folder offers subcommands to the ``fraud-scoring`` entry point.

Each app folder (``batch_jobs``, ``service``, ``streaming``) has a ``commands`` module
with ``COMMANDS: list[Command]``; the entry point (``cli/main.py``) composes them. The
type lives here, in the shared package, because the app folders may import it but must
never import the entry point above them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Generic, TypeVar

from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


class UsageError(Exception):
    """Bad command-line input; the message says which flag and why (exit status 2)."""


def _no_options(parser: argparse.ArgumentParser) -> None:
    """A subcommand without options of its own."""


@dataclass(frozen=True)
class Command(Generic[S]):
    """One ``fraud-scoring`` subcommand.

    ``configure`` adds the subcommand's options to its parser; ``run`` does the work
    with the parsed options and the settings of class ``settings`` (its app's groups,
    read from the environment; flags override them). ``run`` reports
    failure by raising: :class:`UsageError` or ``ValueError`` for bad input (exit 2),
    the project's data, model and Redis errors for failures (exit 1).
    """

    name: str
    help: str
    run: Callable[[argparse.Namespace, S], None]
    configure: Callable[[argparse.ArgumentParser], None] = _no_options
    settings: type[S] = field(kw_only=True)


def iso_date(s: str) -> date:
    """argparse type for a YYYY-MM-DD option."""
    try:
        return date.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD): {s!r}") from None


def aware_time(text: str) -> datetime:
    """argparse type for an RFC 3339 time with its UTC offset."""
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an RFC 3339 time: {text!r}") from None
    if t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no UTC offset")
    return t


def add_embedded_redis(parser: argparse.ArgumentParser) -> None:
    """The ``--embedded-redis`` flag of the long-running commands (serve, stream)."""
    parser.add_argument(
        "--embedded-redis",
        action="store_true",
        help="with REDIS_URL unset, start a private, empty Redis-protocol server for "
        "this process instead of refusing (FRAUD_EMBEDDED_REDIS); for local trials only",
    )
