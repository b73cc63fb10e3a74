"""API keys: client keys for the OpenAI routes, admin keys for /admin/*, matched in constant time.

Only SHA-256 digests are kept. A presented key is hashed once and compared with ``hmac.compare_digest``
against every stored digest, whether or not an earlier one matched, so the time taken says nothing about
which key (or how much of one) was right. Keys never reach a log line or an error body.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway import errors
from gateway.config import ApiKey, hash_key


class KeyRing:
    """A set of keys, by digest."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self._keys = [(k.sha256.lower(), k) for k in keys]  # hash_key's form; sha256: may be given in capitals

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
