"""Operating the server: /health, /metrics (Prometheus), /get_server_info (SGLang's: what
serves, for benchmark records) and /debug/state (KV bookkeeping, for leak checks)."""

from __future__ import annotations

import dataclasses

import jax
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from jspec.server.errors import APIError
from jspec.server.state import Served

router = APIRouter()


@router.get("/health")
async def health(st: Served):
    if not st.engine.alive:
        return JSONResponse(APIError("the engine loop stopped", 503, "server_error").body(), status_code=503)
    return Response(status_code=200)


@router.get("/metrics")
async def prometheus(st: Served):
    return Response(st.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/get_server_info")
async def server_info(st: Served):
    """What serves: device, jax version and engine settings, so a benchmark client can record
    what it measured."""
    core = st.core
    spec = core.spec
    return {
        "model": st.model_name,
        "device_kind": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "dtype": str(core.worker.dtype),
        "context_length": st.model.cfg.max_position_embeddings,
        "page_size": core.worker.page_size,
        **core.plan.describe(),
        "overlap_schedule": core.overlap,
        "speculative": dataclasses.asdict(spec) if spec is not None else None,
        "speculative_adaptive": core.adaptive.describe() if core.adaptive is not None else None,
    }


@router.get("/debug/state")
async def debug_state(st: Served):
    """KV and request bookkeeping: at idle every page is free or cached."""
    sched = st.core.scheduler
    return {
        "requests": len(sched.requests),
        "running": len(sched.running) + len(sched.prefilling),
        "waiting": len(sched.waiting),
        **sched.usage(),
        # The loop's host time against its wait on the device, summed since start (seconds).
        "loop": dataclasses.asdict(st.core.loop_times),
        "engine_thread_id": st.engine.thread_id,
    }
