"""The rules the service decides by (:mod:`fraud_scoring.rules`), held and reloaded.

:class:`RulesHolder` loads the rules file at start (``FRAUD_RULES_FILE``, or the shipped
``feature_repo/rules.yaml``); :func:`watch_rules` looks at the file every
``FRAUD_RULES_POLL_S`` and swaps in a changed one once it passes its checks. A file that
fails them is refused (logged once, kept in :attr:`RulesHolder.problem` for /readyz) and
the rules before it stay; a bad file at start fails the start (ServiceConfigError-like:
:class:`fraud_scoring.rules.RulesError`). A micro-batch reads :attr:`RulesHolder.current`
once, so it decides by one version throughout.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

from fraud_scoring import features as F
from fraud_scoring import rules as R
from service.settings import ServiceSettings

log = logging.getLogger(__name__)


@functools.cache
def known_features() -> frozenset[str]:
    """The served number features a rule may read, and a team's declared number fields
    (NaN where a transaction has none; the declarations, once per process)."""
    return frozenset(F.producible_features()) | frozenset(F.declarations().number_fields)


@functools.cache
def known_strings() -> tuple[str, ...]:
    """A team's declared string and category fields, which a string test may name beside
    the contract's (the declarations, once per process)."""
    return tuple(n for n, t in F.declarations().fields if t in ("string", "category"))


def rules_path(settings: ServiceSettings) -> Path:
    return settings.rules_file if settings.rules_file is not None else R.DEFAULT_PATH


class RulesHolder:
    """The serving rule set, swapped atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.current: R.RuleSet = R.load(path, set(known_features()), known_strings())
        self.problem: str | None = None  # why the file as it is now was refused
        self._seen = _signature(path)
        self._settling: tuple[float, int] | None = None  # a change seen once, not loaded yet

    @classmethod
    def of(cls, settings: ServiceSettings) -> RulesHolder:
        return cls(rules_path(settings))

    def reload(self) -> bool:
        """Load the file again if it changed and then held still for one look (a file
        read while an editor or a copy writes it, e.g. emptied by the truncation that
        starts a write, is never served); True when new rules serve. A file that fails
        its checks keeps the rules before it (``problem``)."""
        seen = _signature(self.path)
        if seen == self._seen:
            self._settling = None
            return False
        if seen != self._settling:
            self._settling = seen
            return False
        self._seen, self._settling = seen, None
        try:
            new = R.load(self.path, set(known_features()), known_strings())
        except R.RulesError as exc:
            self.problem = f"{exc}; still serving rules {self.current.version}"
            log.error("rules refused: %s", self.problem)
            return False
        self.problem = None
        if new.version == self.current.version:
            return False
        log.info("rules %s -> %s (%s)", self.current.version, new.version, self.path)
        self.current = new
        return True


def _signature(path: Path) -> tuple[float, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def watch_rules(holder: RulesHolder, settings: ServiceSettings) -> asyncio.Task[None]:
    """Look for a changed rules file every ``rules_poll_s`` (cancel the task to stop)."""

    async def watch() -> None:
        while True:
            await asyncio.sleep(settings.rules_poll_s)
            try:
                holder.reload()
            except Exception:  # e.g. the file replaced while read: the next look retries
                log.exception("rules watch failed; keeping the current rules")

    return asyncio.get_running_loop().create_task(watch())
