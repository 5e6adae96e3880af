"""``/v1/lists/{name}/items`` and ``/v1/lists/{name}/audit``: the analysts' block and
allow lists (the ``lists`` scope; ``admin`` implies it). Thin: the layout, the checks and
the audit trail are :mod:`service.core.lists`'; the key id of the caller is who changed
an item. The GETs answer pages: ``limit`` rows (:data:`lists.PAGE_DEFAULT`, at most
:data:`lists.PAGE_MAX`) and ``next_cursor``, given back as ``cursor`` for the next page."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from service.core import lists
from service.edge import auth
from service.edge.routes import json_model
from service.errors import Invalid, NotFound, error_responses
from service.resources import resources

# The app includes it behind the ``lists`` scope (service/edge/app.py).
router = APIRouter(prefix="/v1/lists", tags=["lists"])


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str = Field(min_length=1, max_length=128, description="checked as the list's column")
    reason: str = Field(min_length=1, max_length=500, description="why it is on the list")
    expires_at: AwareDatetime | None = Field(
        default=None, description="RFC 3339 with offset; absent: never expires"
    )


class ItemsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ItemIn] = Field(min_length=1, max_length=10_000)


class RemoveIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    values: list[str] = Field(min_length=1, max_length=10_000)
    reason: str = Field(min_length=1, max_length=500)


class ItemOut(BaseModel):
    value: str
    added_by: str | None
    reason: str | None
    added_at: datetime | None
    expires_at: datetime | None
    expired: bool = Field(description="past its expiry: no longer decides; shown until removed")


_NEXT = "the next page's `cursor`; null: this is the last page"
Limit = Annotated[
    int,
    Query(
        ge=1,
        le=lists.PAGE_MAX,
        description=f"rows per page (default {lists.PAGE_DEFAULT}, at most {lists.PAGE_MAX})",
    ),
]
Cursor = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=1024,
        description="the previous page's `next_cursor` (opaque); absent: the first page",
    ),
]


class ItemsOut(BaseModel):
    name: str = Field(description="the list")
    key: str = Field(description="the transaction field the list holds values of")
    items: list[ItemOut] = Field(description="by value")
    next_cursor: str | None = Field(description=_NEXT)


class ChangeOut(BaseModel):
    name: str = Field(description="the list")
    changed: int = Field(description="values added (new ones) or removed")
    by: str


class AuditEntry(BaseModel):
    id: str
    op: str
    value: str | None
    key_id: str | None
    reason: str | None
    at: datetime | None
    expires_at: datetime | None


class AuditOut(BaseModel):
    name: str = Field(description="the list")
    entries: list[AuditEntry] = Field(description="oldest first")
    next_cursor: str | None = Field(description=_NEXT)


def _refused(exc: lists.ListError) -> Exception:
    if isinstance(exc, lists.UnknownList):
        return NotFound(str(exc))
    if isinstance(exc, lists.BadCursor):
        return Invalid(str(exc), "query.cursor")  # as FastAPI names a query parameter
    return Invalid(str(exc))


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inlined(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inlined(v, defs) for v in node]
    return node


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """The documented JSON body (parsed by :func:`json_model`, as the other routes')."""
    full = model.model_json_schema()
    schema = _inlined(full, full.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@router.get("/{name}/items", response_model=ItemsOut, responses=error_responses(401, 403, 404, 422))
async def show_items(
    name: str, request: Request, limit: Limit = lists.PAGE_DEFAULT, cursor: Cursor = None
) -> dict[str, Any]:
    """A page of the list's items by value, with who added each, why, and its expiry."""
    res = resources(request)
    rules = res.scorer.rules.current
    try:
        page = await lists.show(res.redis, rules, name, limit, cursor)
    except lists.ListError as exc:
        raise _refused(exc) from None
    key = rules.lists[name].key
    return {"name": name, "key": key, "items": page.rows, "next_cursor": page.next_cursor}


@router.put(
    "/{name}/items",
    response_model=ChangeOut,
    responses=error_responses(401, 403, 404, 408, 413, 415, 422),
    openapi_extra=_body(ItemsIn),
)
async def put_items(name: str, request: Request) -> dict[str, Any]:
    """Add items (or renew them: their reason and expiry are replaced), as the caller's
    key; every value is checked before anything changes; each change is audited."""
    body = await json_model(request, ItemsIn)
    who = auth.principal(request)
    res = resources(request)
    items = [lists.Item(i.value, i.reason, i.expires_at) for i in body.items]
    try:
        n = await lists.add(
            res.redis,
            res.scorer.rules.current,
            name,
            items,
            who.key_id,
            res.settings.list_max_items,
        )
    except lists.ListError as exc:
        raise _refused(exc) from None
    return {"name": name, "changed": n, "by": who.key_id}


@router.delete(
    "/{name}/items",
    response_model=ChangeOut,
    responses=error_responses(401, 403, 404, 408, 413, 415, 422),
    openapi_extra=_body(RemoveIn),
)
async def delete_items(name: str, request: Request) -> dict[str, Any]:
    """Remove values (those not on the list are ignored), as the caller's key, audited."""
    body = await json_model(request, RemoveIn)
    who = auth.principal(request)
    res = resources(request)
    try:
        n = await lists.remove(
            res.redis, res.scorer.rules.current, name, body.values, body.reason, who.key_id
        )
    except lists.ListError as exc:
        raise _refused(exc) from None
    return {"name": name, "changed": n, "by": who.key_id}


@router.get("/{name}/audit", response_model=AuditOut, responses=error_responses(401, 403, 404, 422))
async def show_audit(
    name: str, request: Request, limit: Limit = lists.PAGE_DEFAULT, cursor: Cursor = None
) -> dict[str, Any]:
    """A page of the list's changes (append-only), oldest first."""
    res = resources(request)
    try:
        page = await lists.audit(res.redis, res.scorer.rules.current, name, limit, cursor)
    except lists.ListError as exc:
        raise _refused(exc) from None
    return {"name": name, "entries": page.rows, "next_cursor": page.next_cursor}
