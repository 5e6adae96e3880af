"""Per-card session (second- to hour-level) features, declared once.

Filled in by the streaming work (issue 5): the updater, the scorer and the
training-set builder all use the declarations and pure functions in this module.
Until then no session feature is declared and the model uses none.
"""

from __future__ import annotations

from fraud_scoring.features import Feature

SESSION_FEATURES: tuple[Feature, ...] = ()
