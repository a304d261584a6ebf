"""Who may call the server, and how many generation requests each API key may have open at once.

An ASGI middleware rather than a route dependency, so that a streamed response counts until its last byte.
"""

from __future__ import annotations

import hmac
from collections import Counter

from .errors import ApiError, error_response

OPEN_PATHS = ("/health", "/health_generate", "/metrics", "/cookbook", "/docs", "/openapi.json")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class KeyGate:
    """401 without one of `keys` (when any are set); 429 for a key that already has `per_key_limit` generation
    requests open."""

    def __init__(self, app, keys: tuple[str, ...], per_key_limit: int | None):
        self.app, self.keys, self.per_key_limit = app, keys, per_key_limit
        self.open: Counter[str] = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"].startswith(OPEN_PATHS):
            return await self.app(scope, receive, send)
        key = self._key(dict(scope["headers"]).get(b"authorization", b""))
        if key is None:
            error = ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'.",
                             kind="authentication_error")
            return await error_response(error)(scope, receive, send)
        if self.per_key_limit is None or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.open[key] >= self.per_key_limit:
            error = ApiError(429, f"this API key already has {self.open[key]} requests open, the server's limit "
                                  "(--max-concurrent-requests-per-key); retry when one finishes.",
                             kind="rate_limit_error", headers={"Retry-After": "1"})
            return await error_response(error)(scope, receive, send)
        self.open[key] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open[key] -= 1
            if not self.open[key]:
                del self.open[key]

    def _key(self, authorization: bytes) -> str | None:
        """The configured key this Authorization header carries, compared in constant time; None if none."""
        if not authorization.startswith(b"Bearer "):
            return None
        given = authorization.removeprefix(b"Bearer ")
        return next((k for k in self.keys if hmac.compare_digest(k.encode(), given)), None)
