"""The streaming updater's settings: the groups it reads (``fraud_scoring/settings.py``),
the same ``FRAUD_`` variables."""

from __future__ import annotations

from fraud_scoring.settings import (
    EventLogSettings,
    FieldSettings,
    StoreSettings,
    TimeSettings,
    UpdaterSettings,
)


class StreamSettings(StoreSettings, TimeSettings, EventLogSettings, UpdaterSettings, FieldSettings):
    """What ``fraud-scoring stream`` reads."""
