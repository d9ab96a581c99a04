"""Operating the server: /health, /metrics (Prometheus), /get_server_info (SGLang's: what
serves, for benchmark records) and /debug/state (KV bookkeeping, for leak checks)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from jspec.engine.async_engine import RequestFailed
from jspec.engine.facts import EngineStats
from jspec.server.errors import APIError
from jspec.server.state import Served, ServerState

router = APIRouter()


@router.get("/health")
async def health(st: Served):
    if not st.engine.alive:
        return JSONResponse(APIError("the engine loop stopped", 503, "server_error").body(), status_code=503)
    return Response(status_code=200)


async def engine_stats(st: ServerState) -> EngineStats:
    try:
        return await st.engine.stats()
    except RequestFailed as e:
        raise APIError(str(e), 503, "server_error") from None


@router.get("/metrics")
async def prometheus(st: Served):
    stats = await engine_stats(st)
    return Response(st.metrics.exposition(stats), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/get_server_info")
async def server_info(st: Served):
    """What serves: device, jax version and engine settings, so a benchmark client can record
    what it measured."""
    facts, stats = st.facts, await engine_stats(st)
    return {
        "model": st.model_name,
        "device_kind": facts.device_kind,
        "num_devices": facts.num_devices,
        "jax_version": facts.jax_version,
        "dtype": facts.dtype,
        "context_length": facts.model_cfg.max_position_embeddings,
        "max_request_tokens": facts.max_request_tokens,
        "page_size": facts.page_size,
        **facts.plan,
        "overlap_schedule": facts.overlap,
        "speculative": facts.speculative,
        "speculative_adaptive": stats.adaptive,
    }


@router.get("/debug/state")
async def debug_state(st: Served):
    """KV and request bookkeeping: at idle every page is free or cached."""
    stats = await engine_stats(st)
    return {
        "requests": stats.requests,
        "running": stats.running,
        "waiting": stats.waiting,
        **stats.usage,
        # The loop's host time against its wait on the device, summed since start (seconds).
        "loop": stats.loop,
        # Where the engine loop runs (its process is the server's own under AsyncEngine): a
        # benchmark reads the loop thread's CPU time from /proc/PID/task/TID.
        "engine_pid": stats.pid,
        "engine_thread_id": stats.thread_id,
        # Python's collections in the engine's process since it started serving (per generation:
        # count, total_ms, max_ms), or null.
        "gc": stats.gc,
    }
