"""Every settings group: what the command line reads and hands to the part it runs."""

from __future__ import annotations

from batch_jobs.settings import JobsSettings
from fraud_scoring.settings import read_settings
from service.settings import ServiceSettings
from streaming.settings import StreamSettings


class Settings(ServiceSettings, StreamSettings, JobsSettings):
    """All of the apps' settings (an instance is each app's own class too)."""


def get_settings() -> Settings:
    """All settings from the environment, read once per process."""
    return read_settings(Settings)
