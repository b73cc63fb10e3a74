"""API keys: client keys for the OpenAI routes, admin keys for /admin/*, matched in constant time; the
routes' dependencies that check them.

Only SHA-256 digests are kept. A presented key is hashed once and compared with ``hmac.compare_digest``
against every stored digest, whether or not an earlier one matched, so the time taken says nothing about
which key (or how much of one) was right. Keys never reach a log line or an error body.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway import errors
from gateway.config import ApiKey, Settings, hash_key
from gateway.limits import KeyLimits
from gateway.service import ANONYMOUS, Caller


class KeyRing:
    """A set of keys, by digest."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._keys = [((k.sha256 or "").lower(), k) for k in keys]  # hash_key's form; sha256 may be in capitals

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, token: str) -> ApiKey | None:
        digest = hash_key(token)
        found = None
        for stored, key in self._keys:  # no early exit: every digest is compared
            if hmac.compare_digest(stored, digest):
                found = key
        return found


def bearer_token(request: Request) -> str:
    """The ``Authorization: Bearer`` token; a 401 when there is none."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.unauthorized()
    return token.strip()


@dataclass(frozen=True)
class ApiKeys:
    """Who may call what, as the app holds it (``app.state.keys``): client keys for the OpenAI, tokenizer and
    info routes, admin keys for /admin/*; with no key of either kind configured, nothing is guarded."""

    clients: KeyRing
    admins: KeyRing
    protect_metrics: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        return cls(KeyRing(settings.api_keys), KeyRing(settings.admin_api_keys), settings.protect_metrics)

    @property
    def guarded(self) -> bool:
        return bool(self.clients or self.admins)


async def authenticate(request: Request) -> Caller:  # async: no threadpool hop per request
    """The caller of a client route and its limits (anonymous where no client key is configured)."""
    keys: ApiKeys = request.app.state.keys
    if not keys.clients:
        return ANONYMOUS
    key = keys.clients.match(bearer_token(request))
    if key is None:
        raise errors.unauthorized()
    return Caller(key.name, KeyLimits(key.requests_per_minute, key.tokens_per_minute))


async def authenticate_admin(request: Request) -> None:
    """Admin routes take admin keys only."""
    keys: ApiKeys = request.app.state.keys
    if keys.guarded and keys.admins.match(bearer_token(request)) is None:
        raise errors.unauthorized("Invalid or missing admin API key." if keys.admins else
                                  "Admin routes are disabled: no admin_api_keys are configured.")


async def authenticate_metrics(request: Request) -> None:
    """/metrics is open unless ``protect_metrics``: then a client or an admin key."""
    keys: ApiKeys = request.app.state.keys
    if keys.protect_metrics and keys.guarded:
        token = bearer_token(request)
        if keys.clients.match(token) is None and keys.admins.match(token) is None:
            raise errors.unauthorized()
