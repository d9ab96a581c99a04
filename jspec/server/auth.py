"""--api-key: every route but /health answers only requests that carry the key as OpenAI's
clients send it, `Authorization: Bearer KEY`; any other gets a 401 in OpenAI's error shape.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which wraps every response body
and would stand between a streaming route and its client's disconnect). The key is compared
in constant time (hmac.compare_digest), so the time of a refusal says nothing of the key.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from jspec.server.errors import APIError

OPEN_PATHS = ("/health",)  # what load balancers and probes ask without a key


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        refusal = self.refusal(dict(scope["headers"]).get(b"authorization"))
        if refusal is None:
            return await self.app(scope, receive, send)
        response = JSONResponse(refusal.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def refusal(self, header: bytes | None) -> APIError | None:
        """None if the Authorization header carries the key, else the 401 to answer."""
        if not header:
            return APIError(
                "You didn't provide an API key. You need to provide your API key in an Authorization "
                "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                401,
            )
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return APIError("Incorrect API key provided.", 401, code="invalid_api_key")
