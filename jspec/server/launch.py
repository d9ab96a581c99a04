"""Starts a server from its flags: the OpenAI-compatible HTTP server, or a PD prefill engine.

The HTTP server runs its engine in a process of its own (engine/engine_process.py says why);
the PD prefill and decode engines, a multi-host run and --engine-in-thread keep the engine's
loop on a thread of the server's process.

Start-up logs what it does as it goes: the weights loaded, the programs compiled (n / N with
the elapsed time), then one ready line with the URL. SIGINT / SIGTERM stop it cleanly:
running requests are aborted and the step in flight is drained.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import uvicorn

from jspec.checkpoint.demo import default_model_path
from jspec.checkpoint.model import display_name, load_logged
from jspec.checkpoint.tokenizer import read_chat_template
from jspec.disaggregation.decode import DecodeEngine
from jspec.disaggregation.prefill import PrefillEngine, PrefillServer
from jspec.distributed.multihost import init_distributed
from jspec.engine.async_engine import AsyncEngine
from jspec.engine.build import loads_per_layer
from jspec.engine.engine import Engine
from jspec.engine.engine_process import LOG_FORMAT, EngineLaunch, EngineProcess, EngineStartError, warm_up
from jspec.engine.heap import settle_heap
from jspec.server.app import create_app
from jspec.server.args import ServerConfig, build_parser, engine_config, load_config, server_config
from jspec.server.chat_template import check_chat_template

log = logging.getLogger("jspec.serve")
SERVER_GPU_MEMORY_FRACTION = "0.90"


def make_engine(config, server: ServerConfig, load, path: str):
    """The engine a server runs: a plain Engine, or a PD prefill / decode engine. A plain engine
    loads the weights itself, so it holds the loader's copy alone and frees it once laid out."""
    if server.disaggregation_mode not in ("prefill", "decode"):
        return Engine(path, config, load=load)
    model = load_logged(path, load, per_layer=loads_per_layer(config))
    if model.cfg.deepseek is not None:
        raise ValueError(
            f"PD disaggregation is not implemented for latent-attention (MLA) models ({model.cfg.family}) yet"
        )
    if server.disaggregation_mode == "prefill":
        return PrefillEngine(model, config)
    return DecodeEngine(
        model,
        config,
        prefill_addrs=list(server.disaggregation_prefill_addrs),
        transfer_backend=server.disaggregation_transfer_backend,
    )


def main(argv=None) -> None:
    started = time.perf_counter()
    ap = build_parser(__doc__, prog="jspec serve")
    args = ap.parse_args(argv)
    try:
        server, load, config = server_config(args), load_config(args), engine_config(args)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=server.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU / no GPU" probes are noise
    # JAX's GPU allocator takes 75% of the memory by default; a server holds the device alone,
    # so it takes SGLang's share for weights, KV and programs (the KV pool is sized from it).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", SERVER_GPU_MEMORY_FRACTION)
    if load.chat_template is not None:  # before the weights load, which may take minutes
        try:
            check_chat_template(read_chat_template(load.chat_template))
        except (ValueError, OSError) as e:
            ap.error(str(e))
    if server.disaggregation_mode == "null" and server.nnodes == 1 and not server.engine_in_thread:
        return serve_engine_process(ap, server, load, config, started)
    try:  # before anything starts a JAX backend
        if init_distributed(server.nnodes, server.node_rank, server.dist_init_addr):
            log.warning(
                "node %d of %d joined %s; the serving loop is single-controller: multi-host serving "
                "(every node running the same steps) is not implemented yet",
                server.node_rank,
                server.nnodes,
                server.dist_init_addr,
            )
    except ValueError as e:
        ap.error(str(e))

    path = server.model_path
    if path is None:
        path, what = default_model_path()
        log.info("serving %s at %s", what, path)
    try:
        engine = make_engine(config, server, load, path)
    except (ValueError, NotImplementedError, OSError) as e:
        # A checkpoint that is missing or bad, a Hub repo id that resolves nowhere, a --tp-size
        # that does not divide the heads.
        ap.error(str(e))
    if not server.skip_warmup:
        try:
            warm_up(engine, server.warmup_sampling_modes)
        except ValueError as e:
            ap.error(str(e))
    if server.disaggregation_mode == "prefill":
        return serve_prefill(engine, server)
    name = server.served_model_name or display_name(path)
    serve_http(AsyncEngine(engine), server, name, started, freeze_gc=not config.disable_gc_freeze)


def serve_engine_process(ap, server: ServerConfig, load, config, started: float) -> None:
    """The HTTP server over an engine in a process of its own, which loads the weights and
    compiles the programs; this process starts no JAX backend."""
    launch = EngineLaunch(
        server.model_path,
        config,
        load,
        warmup_sampling_modes=None if server.skip_warmup else server.warmup_sampling_modes,
        log_level=server.log_level,
    )
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:  # stopped while the engine builds: exit through Python, which stops the child too
        previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        engine = EngineProcess.start(launch)
    except EngineStartError as e:
        ap.error(str(e))
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    name = server.served_model_name or display_name(engine.model_path)
    serve_http(engine, server, name, started, freeze_gc=not config.disable_gc_freeze)


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def serve_http(
    engine: AsyncEngine | EngineProcess, server: ServerConfig, name: str, started: float, *, freeze_gc: bool
) -> None:
    """The HTTP server over an engine; once it is up, this process's heap is settled
    (engine/heap.py), its start-up objects frozen out of Python's collections with freeze_gc."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        settle_heap("HTTP server", freeze=freeze_gc)
        log.info(
            "ready: %s on http://%s:%d (%.0f s after start)",
            name,
            server.host,
            server.port,
            time.perf_counter() - started,
        )
        yield
        log.warning("shutting down: aborting running requests")
        engine.shutdown()

    app = create_app(engine, name, lifespan=lifespan, api_key=server.api_key, reasoning_parser=server.reasoning_parser)
    uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level, timeout_graceful_shutdown=5)


def serve_prefill(engine, server: ServerConfig) -> None:
    """A prefill engine: no HTTP, only the bootstrap port; SIGTERM / SIGINT stop it."""
    prefill_server = PrefillServer(engine, server.host, server.disaggregation_bootstrap_port)

    def stop(signum, frame):
        log.warning("shutting down the prefill engine")
        prefill_server.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    prefill_server.serve_forever()
