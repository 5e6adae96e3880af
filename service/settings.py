"""The scoring service's settings: the groups it reads (``fraud_scoring/settings.py``),
the same ``FRAUD_`` variables."""

from __future__ import annotations

from pydantic import model_validator

from fraud_scoring.settings import (
    BatchingSettings,
    DecisionLogSettings,
    EdgeSettings,
    EventLogSettings,
    FieldSettings,
    ModelSettings,
    RulesSettings,
    ScoringSettings,
    StoreSettings,
    TimeSettings,
    read_settings,
)


class ServiceSettings(
    StoreSettings,
    ModelSettings,
    TimeSettings,
    EdgeSettings,
    BatchingSettings,
    ScoringSettings,
    RulesSettings,
    EventLogSettings,
    DecisionLogSettings,
    FieldSettings,
):
    """What ``fraud-scoring serve`` reads."""

    @property
    def admission_capacity(self) -> int:
        """Transactions admitted at once: ``max_inflight``, or when it is 0, two full
        micro-batches per model instance."""
        return self.max_inflight or 2 * self.max_batch_size * self.model_instances

    @property
    def batch_request_limit(self) -> int:
        """Most transactions per batch call: ``max_batch_request``, or half the capacity
        (a call that large fits a key's fair share while one other key calls)."""
        return self.max_batch_request or max(1, self.admission_capacity // 2)

    @model_validator(mode="after")
    def _batch_fits_capacity(self) -> ServiceSettings:
        if self.max_batch_request > self.admission_capacity:
            raise ValueError(
                f"FRAUD_MAX_BATCH_REQUEST ({self.max_batch_request}) is above the admission "
                f"capacity ({self.admission_capacity}, FRAUD_MAX_INFLIGHT or two micro-batches "
                "per model instance): lower it, or raise FRAUD_MAX_INFLIGHT"
            )
        return self


def get_settings() -> ServiceSettings:
    """The service's settings from the environment, read once per process."""
    return read_settings(ServiceSettings)
