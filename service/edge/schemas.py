"""The API's bodies: the batch endpoint's request, every scoring response, the probes'
answers, and the request schema and examples the OpenAPI document shows.

A single transaction's request body is :class:`fraud_scoring.events.Transaction`; its
documented schema is :func:`transaction_schema`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fraud_scoring.events import ID_MAX_LEN, Transaction, country_codes, currency_codes
from service.core.scoring import ScoreResult

# service.core.decision.DECISIONS as a type (a test keeps the two equal).
Decision = Literal["approve", "review", "decline"]

# The documented request. Its event_time is long past, so a live service (event times
# within FRAUD_MAX_EVENT_SKEW_S of its clock) answers it 200 only in replay mode: the
# routes document `X-Fraud-Record: false` as the header's example, and the examples are
# sent to a live service in tests/test_openapi.py.
TXN_EXAMPLE: dict[str, Any] = {
    "transaction_id": "t-000123",
    "card_id": "c-42",
    "merchant_id": "m-7",
    "amount": 129.90,
    "currency": "EUR",
    "event_time": "2026-11-30T07:00:00+00:00",
    "country": "DE",
    "channel": "ecom",
    "mcc": "5732",
    "device_id": "d-9",
}

SCORE_EXAMPLE: dict[str, Any] = {
    "transaction_id": "t-000123",
    "decision": "review",
    "score": 0.41,
    "reasons": [
        {
            "code": "MODEL_SCORE_REVIEW",
            "message": "Model score 0.41 is at or above the review threshold 0.0054.",
        },
        {"code": "VELOCITY_1H", "message": "9 transactions on this card in the last hour."},
    ],
    "model_version": "3",
    "decided_by": "model",
    "rules_version": "bd85ca5deba1",
    "shadow_rules": [],
    "features": {"missing": [], "stale": ["merchant_fraud_rate_90d"], "inexact": []},
    "timing": {
        "queue_ms": 1.2,
        "feature_read_ms": 0.8,
        "inference_ms": 0.3,
        "decision_ms": 0.05,
        "total_ms": 2.4,
        "batch_size": 8,
    },
}


# The epoch numbers event_time takes (pydantic: 0001-01-01 to the end of 9999, in ms).
EPOCH_MS_MIN, EPOCH_MS_END = -62_135_596_800_000, 253_402_300_800_000
# The bodies' strings lose surrounding whitespace before they are checked (pydantic's
# str_strip_whitespace strips Unicode's White_Space: _STRIPPED), so what an id must be,
# 1 to ID_MAX_LEN characters and no control character (fraud_scoring.events), holds for
# what is left: the documented pattern says so, its length bound included (a maxLength
# would count the whitespace too). tests/test_openapi.py holds it to the validator.
_STRIPPED = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_EDGE = r"[^\x00-\x1f\x7f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
ID_WIRE_PATTERN = (
    rf"^[{_STRIPPED}]*{_EDGE}(?:[^\x00-\x1f\x7f]{{0,{ID_MAX_LEN - 2}}}{_EDGE})?[{_STRIPPED}]*$"
)
ID_FIELDS = ("transaction_id", "card_id", "merchant_id", "device_id")


def wire_ids(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a model's JSON schema) with :data:`ID_WIRE_PATTERN` for its ids, in
    place of their pattern and length bounds."""
    for name in ID_FIELDS:
        prop = schema["properties"].get(name)
        for branch in prop.get("anyOf", [prop]) if prop is not None else []:
            if "pattern" in branch:
                branch.pop("minLength", None)
                branch.pop("maxLength", None)
                branch["pattern"] = ID_WIRE_PATTERN
    return schema


def transaction_schema(model: type[Transaction] = Transaction) -> dict[str, Any]:
    """:class:`Transaction`'s JSON schema as the API documents it (``model``: with a
    team's declared fields, ``fraud_scoring.fields``): ``currency`` and
    ``country`` list the codes their validators accept (``currency_codes()`` and
    ``country_codes()``, the same lists), and ``event_time`` is also epoch seconds or
    milliseconds, as the model reads it. Ids: :func:`wire_ids`."""
    schema = wire_ids(model.model_json_schema())
    schema["description"] += " Strings lose surrounding whitespace before they are checked."
    props = schema["properties"]
    props["currency"] |= {
        "enum": sorted(currency_codes()),
        "description": "an ISO 4217 alpha-3 code (pycountry's list)",
    }
    props["country"] |= {
        "enum": sorted(country_codes()),
        "description": "an ISO 3166-1 alpha-2 code (pycountry's list)",
    }
    props["event_time"] = {
        "title": props["event_time"].get("title", "Event Time"),
        "description": "RFC 3339 with a UTC offset (the offset gives the local hour), or "
        "epoch seconds or milliseconds (UTC). Live scoring refuses (422) a time more than "
        "FRAUD_MAX_EVENT_SKEW_S (600 s) from the server clock; replay mode "
        "(X-Fraud-Record: false) has no bound.",
        "anyOf": [
            {"type": "string", "format": "date-time"},
            # Seconds, or milliseconds beyond ±2e10: years 1 to 9999.
            {"type": "number", "minimum": EPOCH_MS_MIN, "exclusiveMaximum": EPOCH_MS_END},
        ],
    }
    return schema


def document_declared_fields(doc: dict[str, Any], model: type[Transaction]) -> None:
    """The OpenAPI document ``doc`` with ``model`` (the contract's fields and a team's
    declared ones) as the scoring routes' request body, one transaction and the batch's
    items; a field not declared in a body is ignored, as the description says."""
    schema = transaction_schema(model)
    schema["description"] += (
        " Besides the contract's fields, the fields the declarations file declares "
        "(docs/data-contract.md, Your own fields); a field declared nowhere is ignored."
    )
    for path in ("/v1/score", "/v1/score/batch"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        if path == "/v1/score":
            body["schema"] = schema
        else:
            body["schema"]["properties"]["transactions"]["items"] = schema


class HealthzOut(BaseModel):
    """``GET /healthz``: the process answers."""

    status: Literal["alive"]


class ReadyzOut(BaseModel):
    """``GET /readyz``, 200. The optional entries are absent (not null) when they have
    nothing to say."""

    status: Literal["ready"]
    model_version: str
    providers: list[str] = Field(description="ONNX Runtime's execution providers, in order")
    decision_log: str | None = Field(
        default=None, description="the decision log's problem; scoring goes on"
    )
    challenger: str | None = Field(
        default=None, description="the challenger's problem; the serving model decides alone"
    )
    store_writes: str | None = Field(
        default=None,
        description="the online store refuses writes (OOM at maxmemory, READONLY): decisions "
        "go on, not recorded in velocity and without the id check, until it writes again",
    )
    degraded: dict[str, str] | None = Field(
        default=None,
        description="FRAUD_DEGRADED_POLICY=rules: the store's problems (keys as in the 503), "
        "deciding by rules only while they last",
    )
    rules_version: str = Field(
        description="the serving rules file's version (its SHA-256's first 12 hex digits)"
    )
    rules: str | None = Field(
        default=None,
        description="the rules file as it is now was refused (why); the rules before it serve",
    )


class ReadyzProblemsOut(BaseModel):
    """``GET /readyz``, 503 (with ``Retry-After``): one entry per part that is not ready,
    saying why. The probe's own body, not the problem list: a probe, not a refusal."""

    status: Literal["not ready"]
    model: str | None = Field(default=None, description='e.g. "not loaded: <why>"')
    redis: str | None = Field(
        default=None, description="feature store unreachable, or the circuit breaker open"
    )
    batch_features: str | None = Field(
        default=None, description="the store holds no batch features for these views"
    )
    declared_features: str | None = Field(
        default=None, description="declared states the models read, not backfilled"
    )


class ReasonOut(BaseModel):
    code: str
    message: str


class FeatureStatus(BaseModel):
    missing: list[str] = Field(description="features with no value; defaults were used")
    stale: list[str] = Field(
        description="features older than their TTL (or newer than the "
        "transaction); defaults were used"
    )
    inexact: list[str] = Field(
        default_factory=list,
        description="declared features the store could not compute exactly as of the "
        "transaction's time (a replay far behind its key's present, docs/features.md); "
        "the decision is then marked degraded",
    )


class Timing(BaseModel):
    queue_ms: float
    feature_read_ms: float
    inference_ms: float
    decision_ms: float
    total_ms: float
    batch_size: int = Field(description="transactions in the micro-batch this one ran in")


class ScoreOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [SCORE_EXAMPLE]})

    transaction_id: str
    decision: Decision
    score: float | None = Field(
        description="the model's probability; null for a rules-only (degraded) decision"
    )
    reasons: list[ReasonOut]
    model_version: str = Field(description='"rules-only" for a degraded decision')
    decided_by: Literal["rule", "list", "model"] = Field(
        default="model",
        description="what decided: a rule (its reason, RULE_<CODE>, is the first), a rule "
        "that looks up a list, or the model's thresholds (docs/rules.md)",
    )
    rules_version: str | None = Field(
        default=None, description="the version of the rules file that decided"
    )
    shadow_rules: list[ReasonOut] = Field(
        default_factory=list,
        description="shadow rules that matched: logged, never deciding",
    )
    features: FeatureStatus
    timing: Timing
    degraded: bool = Field(
        default=False,
        description="true: the online store had no batch features or did not answer, and "
        "FRAUD_DEGRADED_POLICY=rules decided on request and session features by rules only "
        "(model_version 'rules-only'); or the model decided on features that are not exact "
        "(features.inexact)",
    )

    @staticmethod
    def wire(res: ScoreResult, total_ms: float) -> dict[str, Any]:
        """The response for one scored transaction, as the plain dict that is serialised
        (this model's fields and shape; tests validate it against the model): built
        without a validation pass, serialised once by :func:`pydantic_core.to_json`.
        ``total_ms`` is the handler's own time, so whatever the micro-batch's stages do
        not explain was queueing."""
        tm = res.timing_ms
        queue_ms = max(total_ms - tm["feature_read"] - tm["inference"] - tm["decision"], 0.0)
        return {
            "transaction_id": res.transaction_id,
            "decision": res.decision,
            "score": res.score,
            "reasons": [{"code": r.code, "message": r.message} for r in res.reasons],
            "model_version": res.model_version,
            "decided_by": res.decided_by,
            "rules_version": res.rules_version,
            "shadow_rules": [{"code": r.code, "message": r.message} for r in res.shadow_rules],
            "features": {"missing": res.missing, "stale": res.stale, "inexact": res.inexact},
            "timing": {
                "queue_ms": queue_ms,
                "feature_read_ms": tm["feature_read"],
                "inference_ms": tm["inference"],
                "decision_ms": tm["decision"],
                "total_ms": total_ms,
                "batch_size": int(tm["batch_size"]),
            },
            "degraded": res.degraded is not None or bool(res.inexact),
        }

    @classmethod
    def of(cls, res: ScoreResult, total_ms: float) -> ScoreOut:
        """:meth:`wire` as a validated model."""
        return cls.model_validate(cls.wire(res, total_ms))


class BatchIn(BaseModel):
    """The batch endpoint's body: the client's own batch (each one joins micro-batches)."""

    transactions: list[Transaction]


class BatchOut(BaseModel):
    results: list[ScoreOut]
