"""``POST /v1/rules/test``: what a rules document would have done to the logged
decisions, the figures of ``fraud-scoring rules test --json`` (docs/rules.md#testing-a-rules-file),
so that a UI can offer the test before a rule acts. The ``admin`` scope (the app
includes the router behind it).

The body is a rules document as JSON (``rules``; ``lists``, else the lists the serving
rules file declares) and the days (``since``, ``until`` | ``days``, ``as_of``), checked
by the rules loader (a 422 naming the field, as the file's checks name it). The log is
read as the CLI reads it (:mod:`service.core.rule_log`); where the decision log reader
cannot be loaded (the serving image has no DuckDB) the answer is 501 naming what is
missing. The work runs in a thread, one test at a time per process."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, date, datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from fraud_scoring import rules as R
from fraud_scoring.commands import UsageError
from fraud_scoring.storage import partition_file
from service.core import lists
from service.core.rule_impact import Evaluation, InputNotLogged, evaluate
from service.core.rule_log import (
    ReaderUnavailable,
    day_range,
    list_lookups,
    list_members_from,
    log_reader,
    logged_columns,
    report_doc,
)
from service.core.rules import known_features, known_strings
from service.edge.lists_api import _body
from service.edge.routes import json_model
from service.errors import Invalid, NotAvailable, error_responses
from service.resources import resources

# The app includes it behind the ``admin`` scope (service/edge/app.py).
router = APIRouter(prefix="/v1/rules", tags=["rules"])
SOURCE = "body"  # the rules' source in messages and in the answer's ``rules``
_ONE_AT_A_TIME = asyncio.Lock()


class _Days(BaseModel):
    since: date | None = Field(default=None, description="first UTC decision day")
    until: date | None = Field(
        default=None, description="last UTC decision day (default: the log's last)"
    )
    days: int | None = Field(
        default=None,
        ge=1,
        le=366,
        description="the N days ending `until` (default 7; not with `since`)",
    )
    as_of: AwareDatetime | None = Field(
        default=None,
        description="labels that had arrived before, and the label delay's reference "
        "(RFC 3339; default now)",
    )


class RulesTestIn(_Days):
    """What is parsed: the rules as plain objects, checked by the rules loader."""

    model_config = ConfigDict(extra="forbid")

    lists: dict[str, dict[str, Any]] | None = None
    rules: list[dict[str, Any]] = Field(min_length=1, max_length=1000)


class RulesTestDoc(_Days):
    """What is documented: the rules file's shape (feature_repo/rules.yaml)."""

    model_config = ConfigDict(extra="forbid")

    lists: dict[str, R.ListDecl] | None = Field(
        default=None, description="the lists the rules read; absent: the serving rules file's"
    )
    rules: list[R.RuleDecl] = Field(min_length=1, max_length=1000)


def _checked(body: RulesTestIn, serving: R.RuleSet) -> R.RuleSet:
    """The body's rules through the rules loader; its refusal as a 422 naming the field
    (``rules.0.when`` and so on)."""
    declared = (
        body.lists
        if body.lists is not None
        else {k: v.model_dump() for k, v in serving.lists.items()}
    )
    doc = json.dumps({"lists": declared, "rules": body.rules}, sort_keys=True).encode()
    try:
        return R.parse(doc, SOURCE, set(known_features()), known_strings())
    except R.RulesError as exc:
        where, _, why = str(exc).removeprefix(f"{SOURCE}: ").partition(": ")
        raise Invalid(why or str(exc), where if why else None) from None


@router.post(
    "/test",
    responses=error_responses(401, 403, 408, 413, 415, 422, 501),
    openapi_extra=_body(RulesTestDoc),
)
async def rules_test(request: Request) -> dict[str, Any]:
    """What the rules would have decided on the logged decisions of the days asked: the
    JSON of ``fraud-scoring rules test --json`` (per rule: matched, of them fraud, false
    positives (legitimate, or unlabelled past the label delay), unlabelled within the
    delay, and their volume; the decisions it makes and changes; an allow
    rule's overrides; the inputs some decisions lack; and the whole file's)."""
    body = await json_model(request, RulesTestIn)
    res = resources(request)
    settings = res.settings
    ruleset = _checked(body, res.scorer.rules.current)
    raw = settings.data_dir / "raw"
    as_of = body.as_of or datetime.now(UTC)
    async with _ONE_AT_A_TIME:
        try:
            read_log = await asyncio.to_thread(log_reader)
            days = day_range(raw, body.since, body.until, body.days)

            def read() -> Any:
                table = read_log(raw, days[0], days[-1], as_of)
                if table.num_rows == 0:
                    files = ", ".join(str(partition_file(raw, "decisions", d)) for d in days)
                    raise UsageError(
                        f"no decisions logged {days[0]}..{days[-1]} ({files} hold none)"
                    )
                return logged_columns(table, ruleset, settings, as_of)

            logged = await asyncio.to_thread(read)
            lookups = list_lookups(ruleset, dict(logged.strings))
            got = [await res.redis.hmget(lists.items_key(n), v) if v else [] for n, v, _ in lookups]
            members, lists_read = list_members_from(ruleset, lookups, got)

            def run() -> Evaluation:
                return evaluate(ruleset, logged, members, settings.review_amount_limit)

            ev = await asyncio.to_thread(run)
        except ReaderUnavailable as exc:
            raise NotAvailable(str(exc)) from None
        except (UsageError, InputNotLogged) as exc:
            raise Invalid(str(exc), "rules" if isinstance(exc, InputNotLogged) else None) from None
    return report_doc(ev.report, ruleset, days, as_of, lists_read)
