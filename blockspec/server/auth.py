"""Bearer-token auth (`--api-key` / VLLM_API_KEY) on every endpoint except /health.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware) so streaming responses and client
disconnects pass through untouched. Keys are compared as SHA-256 digests with hmac.compare_digest:
constant time in the key's content and length.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from blockspec.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class BearerAuth:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self._digests = [_digest(k.encode("utf-8")) for k in api_keys]

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        given = _digest(token.strip())
        ok = False
        for d in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, d)
        return ok and bool(token.strip())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if self.authorized(header):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not header
                   else "invalid API key")
        body = json.dumps(error_body(401, message)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
