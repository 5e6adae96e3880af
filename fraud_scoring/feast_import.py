"""Feast without typeguard's instrumentation at import.

Feast decorates its data sources, feature views and feature services with typeguard's
``@typechecked``, which re-reads and recompiles each decorated module's source when it
is imported: ~5 of the ~7 s that ``import feast`` takes, in every process (each CLI
job, each service worker, each test subprocess), and a type check on every call
after. The checks guard Feast's own arguments against a caller's mistakes; this
project's calls are fixed and covered by its tests (the Feast CLI, materialization
and training-set tests run real Feast). :func:`skip_typechecks` replaces
``typeguard.typechecked`` with a decorator that returns its target unchanged, before
Feast imports it (Feast binds it with ``from typeguard import typechecked``).
``FRAUD_FEAST_TYPECHECKS=1`` keeps the checks (to debug a call into Feast). Pinned:
typeguard's minor version (pyproject.toml); ``tests/test_seams.py`` fails when Feast
no longer binds the name at import.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def unchecked(target: Any = None, **_: Any) -> Any:
    """``typeguard.typechecked`` that instruments nothing (with or without options)."""
    return (lambda t: t) if target is None else target


def skip_typechecks() -> bool:
    """Replace ``typeguard.typechecked`` before Feast is imported. Returns whether it
    did (not when Feast was imported already, or FRAUD_FEAST_TYPECHECKS=1)."""
    if "feast" in sys.modules or os.environ.get("FRAUD_FEAST_TYPECHECKS") == "1":
        return False
    try:
        import typeguard
    except ImportError:  # Feast without typeguard: nothing to skip
        return False
    typeguard.typechecked = unchecked  # type: ignore[assignment]
    return True
