"""The HTTP server: one FastAPI app assembled from a router per API (openai.py, sglang.py,
admin.py), the state they share (state.py), the API key check (auth.py) and OpenAI's error
shape for every refusal.

The engine runs its overlap loop on its own thread (AsyncEngine) or in its own process
(EngineProcess, what `jspec serve` runs); handlers only submit requests and read their output
streams, so a slow or vanished client never blocks the loop.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from jspec.engine.async_engine import AsyncEngine
from jspec.engine.engine_process import EngineProcess
from jspec.server import admin, openai, sglang
from jspec.server.auth import APIKeyMiddleware
from jspec.server.errors import APIError
from jspec.server.state import ServerState


async def _api_error(request: Request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status)


async def _validation_error(request: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return JSONResponse(APIError(msg).body(), status_code=400)
    loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())[1:])}: {er.get('msg')}" for er in errs[:4])
    return JSONResponse(APIError(msg or "invalid request", param=loc).body(), status_code=400)


def create_app(
    engine: AsyncEngine | EngineProcess,
    model_name: str,
    lifespan=None,
    *,
    api_key: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The app over an engine. api_key: every route but /health needs it (auth.py);
    reasoning_parser: a REASONING_FORMATS name, whose reasoning part chat completions return
    as reasoning_content (reasoning.py)."""
    app = FastAPI(title="jspec", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.served = ServerState(engine, model_name, reasoning_parser)
    if api_key is not None:
        if not api_key:
            raise ValueError("--api-key must not be empty")
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    for api in (openai, sglang, admin):
        app.include_router(api.router)
    return app
