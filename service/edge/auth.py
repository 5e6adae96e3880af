"""API keys with scopes: who may call what.

A key is ``<id>.<secret>`` (``fraud-scoring keys create`` makes one: a 256-bit random
secret); the service only ever holds its SHA-256, in the keys file
(``FRAUD_API_KEYS_FILE``), one JSON object a line::

    {"id": "ops-2026-11", "sha256": "<hex of sha256(whole key)>", "scopes": ["score"]}

An optional ``"share"`` (default 1, in (0, 1000]) is the key's weight in admission's fair
shares under overload (:class:`service.edge.admission.WorkShares`): a key with share 3 gets
three times the capacity of a key with share 1 while both are calling.

Callers send ``Authorization: Bearer <key>`` (or ``X-API-Key: <key>``). A route states
what it needs with ``Depends(require_scope(Scope.SCORE))``; :func:`check_scope` does the
same inside a handler (e.g. replay mode needs ``admin`` only when asked for).

Why a plain SHA-256 and not a slow KDF (bcrypt, scrypt): slow hashes protect *guessable*
secrets (passwords) when the hash file leaks. A 256-bit random secret cannot be guessed,
so one fast hash is as safe, and it keeps the check a few microseconds on every request.

The file is re-read when it changes (checked at most once a second), so keys rotate
without a restart: add the new key's line, move the callers, remove the old line. A
file that turns unreadable or invalid keeps the last good keys (and says so in the log).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from fastapi import Request
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.settings import ServiceSettings

log = logging.getLogger(__name__)

# Lifespan-state key of the running service's :class:`KeyRing` (None: auth is off).
STATE_KEY = "fraud_scoring.keyring"
# Scope key of the request's authenticated :class:`Principal` (set by admission or here).
PRINCIPAL_KEY = "fraud_scoring.principal"
KEY_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
RELOAD_CHECK_S = 1.0


class Scope(StrEnum):
    """What a key may do. A key lists each scope it needs; the one implication is
    ``admin`` → ``label`` and ``lists`` (:data:`IMPLIED`)."""

    SCORE = "score"  # POST /v1/score, /v1/score/batch, /v2 metadata and inference
    # POST /v1/feedback and /v1/review/* (the analysts' page, chargeback feeds): labels
    # steer training and the review queue, so a payment system's score key cannot.
    LABEL = "label"
    # POST /v1/models/reload, replay-mode scoring (X-Fraud-Record: false)
    ADMIN = "admin"
    METRICS = "metrics"  # GET /metrics (the Prometheus scraper's key)
    # GET/PUT/DELETE /v1/lists/*: block and allow lists decide, so neither a score key
    # nor a label key can change them (docs/rules.md).
    LISTS = "lists"


# The review queue needed ``admin`` before ``label`` existed, the lists came after: admin
# keys keep their reach.
IMPLIED: dict[Scope, frozenset[Scope]] = {Scope.ADMIN: frozenset({Scope.LABEL, Scope.LISTS})}


def held_scopes(listed: frozenset[Scope]) -> frozenset[Scope]:
    """The scopes a key holds: those it lists and those they imply (:data:`IMPLIED`)."""
    return listed.union(*(IMPLIED.get(s, frozenset()) for s in listed))


class KeyEntry(BaseModel):
    """One line of the keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=KEY_ID_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    scopes: frozenset[Scope] = Field(min_length=1)
    # Weight in admission's fair shares under overload (1: an equal share).
    share: float = Field(default=1.0, gt=0, le=1000)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id (safe to log), the scopes it holds (implied ones
    included) and its admission share."""

    key_id: str
    scopes: frozenset[Scope]
    share: float = 1.0


ANONYMOUS = Principal("anonymous", frozenset(Scope))  # auth off: everything allowed


class KeysFileError(ValueError):
    """The keys file is missing or a line is not a valid key entry (names file and line)."""


class AuthError(Exception):
    """401 (no or unknown key) or 403 (known key without the scope); ``detail`` says which
    and ``headers`` are the answer's (``WWW-Authenticate`` on a 401, RFC 6750)."""

    def __init__(self, status: int, detail: str, error: str | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail
        challenge = 'Bearer realm="fraud-scoring"' + (f', error="{error}"' if error else "")
        self.headers = {"WWW-Authenticate": challenge} if status == 401 else {}


def new_key(key_id: str) -> tuple[str, str]:
    """A fresh key for ``key_id`` and its SHA-256 hex: ``(key, sha256)``. Show the key to
    its owner once; store only the hash."""
    if not re.match(KEY_ID_PATTERN, key_id):
        raise ValueError(f"key id must match {KEY_ID_PATTERN}, got {key_id!r}")
    key = f"{key_id}.{secrets.token_urlsafe(32)}"
    return key, hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: Path) -> dict[str, KeyEntry]:
    """The keys file's entries by id. Blank lines and lines starting with ``#`` are
    skipped. Raises :class:`KeysFileError` naming the line of the first problem."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeysFileError(f"keys file {path}: {exc.strerror or exc}") from None
    entries: dict[str, KeyEntry] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            entry = KeyEntry.model_validate_json(line)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise KeysFileError(f"keys file {path}, line {n}: {problems}") from None
        if entry.id in entries:
            raise KeysFileError(f"keys file {path}, line {n}: duplicate id {entry.id!r}")
        entries[entry.id] = entry
    return entries


def append_key(path: Path, entry: KeyEntry) -> None:
    """Add ``entry`` to the keys file (created, mode 0600, if absent); refuses an id the
    file already has."""
    if path.exists() and entry.id in read_keys(path):
        raise KeysFileError(f"keys file {path} already has a key with id {entry.id!r}")
    fields: dict[str, object] = {"id": entry.id, "sha256": entry.sha256}
    fields["scopes"] = sorted(entry.scopes)
    if entry.share != 1.0:
        fields["share"] = entry.share
    line = json.dumps(fields)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")


@functools.cache
def _rejected_reads() -> Counter:
    return Counter(
        "fraud_keys_file_rejected_reads",
        "Re-reads of the keys file that were refused (empty, unreadable or invalid): "
        "the keys read before stay in force",
    )


class KeyRing:
    """The valid keys, from the keys file, re-read when the file changes.

    :meth:`authenticate` is the per-request check: split the id off the key, one dict
    lookup, one SHA-256 and a constant-time comparison of the digests. Raises
    :class:`KeysFileError` at construction if the file cannot be used."""

    def __init__(self, path: Path) -> None:
        _rejected_reads()  # exported at 0 from the start
        self.path = path
        self._stamp = self._stat()
        self._entries = read_keys(path)
        self._next_check = time.monotonic() + RELOAD_CHECK_S

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + RELOAD_CHECK_S
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            if stamp is not None and stamp[2] == 0:
                # An editor that truncates, then writes, shows an empty file for a
                # moment: that is a write in progress, not "no keys" (to revoke every
                # key on purpose, leave a comment line in the file).
                raise KeysFileError(f"keys file {self.path} is empty (being written?)")
            entries = read_keys(self.path)
        except KeysFileError as exc:
            _rejected_reads().inc()
            log.error("%s; keeping the %d keys read before", exc, len(self._entries))
            return
        log.info("keys file %s re-read: %d keys", self.path, len(entries))
        self._entries = entries

    def authenticate(self, key: str | None) -> Principal:
        """The principal of ``key``; :class:`AuthError` 401 if absent or not valid."""
        if not key:
            raise AuthError(401, "missing API key: send 'Authorization: Bearer <key>'")
        self._maybe_reload()
        key_id, _, _ = key.partition(".")
        entry = self._entries.get(key_id)
        digest = hashlib.sha256(key.encode()).hexdigest()
        if entry is None or not hmac.compare_digest(digest, entry.sha256):
            raise AuthError(401, "invalid API key", "invalid_token")
        return Principal(entry.id, held_scopes(entry.scopes), entry.share)


def keyring_for(settings: ServiceSettings) -> KeyRing | None:
    """The keys the service checks, or None when ``settings.auth`` is 'off'. Raises
    :class:`KeysFileError` if the keys file cannot be used."""
    if settings.auth == "off":
        return None
    if settings.api_keys_file is None:  # ServiceSettings refuses this too; kept for mypy
        raise KeysFileError("FRAUD_AUTH=required needs FRAUD_API_KEYS_FILE")
    return KeyRing(settings.api_keys_file)


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, value = auth.partition(" ")
        return value.strip() if scheme.lower() == "bearer" else None
    return headers.get("x-api-key")


def principal(request: Request) -> Principal:
    """The caller (cached on the request); :data:`ANONYMOUS` when auth is off."""
    found: Principal | None = request.scope.get(PRINCIPAL_KEY)
    if found is not None:
        return found
    ring: KeyRing | None = request.scope["state"].get(STATE_KEY)
    found = ANONYMOUS if ring is None else ring.authenticate(presented_key(request.headers))
    request.scope[PRINCIPAL_KEY] = found
    return found


def check_scope(request: Request, scope: Scope, why: str = "") -> Principal:
    """The caller, if it holds ``scope``; else :class:`AuthError` (401 unauthenticated,
    403 without the scope; ``why`` names the route or mode that needs it)."""
    who = principal(request)
    if scope not in who.scopes:
        what = why or f"{request.method} {request.url.path}"
        raise AuthError(403, f"key {who.key_id!r} lacks scope {scope.value!r} needed for {what}")
    return who


def require_scope(scope: Scope) -> Callable[[Request], Awaitable[Principal]]:
    """A FastAPI dependency: ``dependencies=[Depends(require_scope(Scope.SCORE))]`` on a
    route (or router) lets only keys holding ``scope`` through. It runs before the body
    is read (as long as the route declares no body parameter)."""

    async def dependency(request: Request) -> Principal:  # async: no thread hop per request
        return check_scope(request, scope)

    return dependency
