"""The batch jobs' settings: the groups they read (``fraud_scoring/settings.py``), the
same ``FRAUD_`` variables."""

from __future__ import annotations

from fraud_scoring.settings import (
    DecisionLogSettings,
    EventLogSettings,
    FieldSettings,
    JobSettings,
    ModelSettings,
    StoreSettings,
    TimeSettings,
)


class JobsSettings(
    StoreSettings,
    ModelSettings,
    TimeSettings,
    JobSettings,
    EventLogSettings,
    DecisionLogSettings,
    FieldSettings,
):
    """What ``fraud-scoring simulate/ingest/batch/decisions/train/evaluate/features``
    read."""
