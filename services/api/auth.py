"""The API key: with one set, the OpenAI routes (`/v1/*`) and `/tokenize`, `/detokenize` answer only a
request that carries `Authorization: Bearer KEY`; any other gets a 401 with an OpenAI error object
(`code: invalid_api_key`). /health, /ready, /metrics and /version stay open (probes and scrapers
carry no key); the admin router checks its own token (services/api/admin.py).

An ASGI middleware, so that it runs before routing (an unknown /v1 path is a 401 too, never a hint
that it exists) and never touches the request body or the stream of a response.
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from specloop.services.api.schemas import ApiError, error_response

GUARDED_PREFIX = "/v1/"
GUARDED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})


def guarded(path: str) -> bool:
    return path.startswith(GUARDED_PREFIX) or path in GUARDED_PATHS


def bearer_token(authorization: str | None) -> str | None:
    """The KEY of `Bearer KEY` (the scheme in any case), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def key_error(authorization: str | None, key: bytes) -> ApiError | None:
    """None when `authorization` carries the key (compared in constant time), else the 401."""
    token = bearer_token(authorization)
    if token is None:
        return unauthorized("You didn't provide an API key: pass it as `Authorization: Bearer KEY`.")
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key):
        return unauthorized("Incorrect API key provided.")
    return None


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", code="invalid_api_key")


class ApiKeyAuth:
    """ASGI middleware: the key on every guarded path (`app.add_middleware(ApiKeyAuth, api_key=...)`)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and guarded(scope["path"]):
            err = key_error(Headers(scope=scope).get("authorization"), self.key)
            if err is not None:
                response = error_response(err, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
