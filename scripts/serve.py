"""An OpenAI-compatible HTTP server for jspec, with SGLang's flag names.

    python scripts/serve.py                       # the embedded tiny model on 127.0.0.1:30000
    python scripts/serve.py --model-path DIR --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path HEAD_DIR --speculative-num-steps 3 --speculative-eagle-topk 1 \\
        --speculative-num-draft-tokens 4 --page-size 16

PD disaggregation (README): a prefill engine with --disaggregation-mode prefill
--disaggregation-bootstrap-port PORT, and this server with --disaggregation-mode decode
--disaggregation-prefill-addrs HOST:PORT.

Endpoints: /v1/completions, /v1/chat/completions, /v1/models (OpenAI), /generate (SGLang),
/health, /metrics (Prometheus), /debug/state. SIGINT / SIGTERM stop it cleanly: running
requests are aborted and the step in flight is drained.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

STARTED = time.perf_counter()


def build_parser() -> argparse.ArgumentParser:
    from jspec.server.args import add_speculative_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="local HF checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights of config.json's shape (benchmarks)")
    ap.add_argument("--served-model-name", help="the model name clients send (default: the directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    ap.add_argument("--max-running-requests", type=int, default=32, help="requests decoded together at most")
    ap.add_argument("--max-total-tokens", type=int,
                    help="KV pool size in tokens (default: 256 MiB of KV, or what --mem-fraction-static gives)")
    ap.add_argument("--mem-fraction-static", type=float,
                    help="fraction of the accelerator's memory for weights + KV (GPU only)")
    ap.add_argument("--context-length", type=int,
                    help="longest prompt + output served (default: the model's max_position_embeddings); "
                         "a shorter one means smaller page tables and fewer programs to compile")
    ap.add_argument("--chunked-prefill-size", type=int, default=512, help="prompt tokens prefilled per step at most")
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="run the synchronous loop instead")
    ap.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache")
    ap.add_argument("--max-top-logprobs", type=int, default=5, help="largest top-n logprobs a request may ask for")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor-parallel degree: shards the model and KV over this many local devices")
    ap.add_argument("--ep-size", type=int, default=1,
                    help="expert-parallel degree of an MoE model: equal to --tp-size (experts split over those devices)")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="DP attention ranks (with --enable-dp-attention): attention data-parallel over dp groups of "
                         "tp-size / dp-size devices, each with its own requests and KV; the MLP stays over all tp")
    ap.add_argument("--enable-dp-attention", action="store_true", help="data-parallel attention (see --dp-size)")
    ap.add_argument("--load-balance-method", choices=["round_robin", "shortest_queue"], default="round_robin",
                    help="how DP attention assigns new requests to ranks")
    ap.add_argument("--nnodes", type=int, default=1, help="hosts in a multi-host run (jax.distributed)")
    ap.add_argument("--node-rank", type=int, default=0, help="this host's rank in [0, nnodes)")
    ap.add_argument("--dist-init-addr", help="HOST:PORT of node 0's jax.distributed coordinator (nnodes > 1)")
    ap.add_argument("--attention-backend", choices=["pallas", "reference"], help="default: pallas on the GPU, the jnp reference elsewhere (Pallas would run interpreted)")
    ap.add_argument("--skip-warmup", action="store_true", help="compile lazily instead of at start-up")
    ap.add_argument("--warmup-sampling-modes", default="all",
                    help="comma list of greedy,sampled: the decode programs to compile at start-up, or 'all' "
                         "(the others compile at first use)")
    ap.add_argument("--layer-loop", choices=["auto", "scan", "unrolled"], default="auto",
                    help="scan: one compiled layer body (compile time independent of depth); unrolled: per-layer "
                         "weight arrays (no weight sliced out of a stack); auto: unrolled on the GPU, else scan")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX's persistent compilation cache: a restart loads its programs from here "
                         "(default ~/.cache/jspec/xla)")
    ap.add_argument("--disable-compilation-cache", action="store_true", help="compile every program afresh")
    ap.add_argument("--random-seed", type=int, default=0, help="seeds requests that bring none")
    ap.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=DIR",
                    help="PEFT LoRA adapters loaded at start-up (a bare DIR is named by its basename); requests "
                         "pick one with lora_path, or model BASE:NAME")
    ap.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters even when --lora-paths gives none (load them by /load_lora_adapter)")
    ap.add_argument("--max-loras-per-batch", type=int,
                    help="adapters resident at once (LoRA pool slots; default: the number of --lora-paths, >= 1)")
    ap.add_argument("--max-lora-rank", type=int, help="largest adapter rank the pool holds (default: the largest "
                                                      "among --lora-paths, at least 16)")
    ap.add_argument("--log-level", default="info")
    add_speculative_args(ap)
    add_disaggregation_args(ap)
    return ap


def add_disaggregation_args(ap) -> None:
    g = ap.add_argument_group("PD disaggregation (SGLang's flag names, plus the decode side's prefill list)")
    g.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="prefill: compute prompts' KV and hand them to decode engines (serves no HTTP, listens "
                        "on --disaggregation-bootstrap-port); decode: the HTTP server, which sends each prompt "
                        "to a prefill engine and decodes it here")
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill: the port decode engines connect to (on --host)")
    g.add_argument("--disaggregation-transfer-backend", choices=["socket", "shm"], default="socket",
                   help="decode: how KV arrays cross (socket: in the TCP stream, works between hosts; shm: "
                        "POSIX shared memory, one host)")
    g.add_argument("--disaggregation-prefill-addrs", nargs="+", default=["127.0.0.1:8998"], metavar="HOST:PORT",
                   help="decode: the prefill engines' bootstrap addresses (each request goes to the least loaded)")


def kv_pages(args, model, page_size: int) -> int | None:
    """Pages for --max-total-tokens, or the rest of --mem-fraction-static after the weights."""
    if args.max_total_tokens:
        return -(-args.max_total_tokens // page_size) + 1
    if args.mem_fraction_static:
        import jax

        from jspec.kvcache.pool import kv_bytes_per_page

        stats = jax.devices()[0].memory_stats() or {}
        total = stats.get("bytes_limit")
        if not total:
            raise SystemExit("--mem-fraction-static needs an accelerator that reports its memory; "
                             "use --max-total-tokens")
        # Per device: 1/tp of the weights and of each page's KV heads (repeated up to tp when fewer);
        # with DP attention a rank's pages are split over its tp / dp devices (--max-total-tokens is per rank).
        tp, kv_heads = args.tp_size, model.cfg.num_kv_heads
        weights = sum(x.nbytes for x in jax.tree.leaves(model.params)) / tp
        heads_tp = tp // args.dp_size if args.enable_dp_attention else tp
        per_page = (kv_bytes_per_page(model.cfg, page_size, model.params["embed"].dtype) * max(kv_heads, heads_tp)
                    / kv_heads / heads_tp)
        free = total * args.mem_fraction_static - weights
        return max(2, int(free // (2 * per_page)))
    return None


def make_engine(args, model, spec):
    import jspec
    from jspec.worker.programs import DEFAULT_CACHE_DIR

    cls, extra = jspec.Engine, {}
    if args.disaggregation_mode == "prefill":
        from jspec.disaggregation.prefill import PrefillEngine as cls
    elif args.disaggregation_mode == "decode":
        from jspec.disaggregation.decode import DecodeEngine as cls

        extra = dict(prefill_addrs=args.disaggregation_prefill_addrs,
                     transfer_backend=args.disaggregation_transfer_backend)
    return cls(
        model, **extra, spec=spec, page_size=args.page_size, max_running_requests=args.max_running_requests,
        num_pages=kv_pages(args, model, args.page_size), chunked_prefill_size=args.chunked_prefill_size,
        disable_overlap_schedule=args.disable_overlap_schedule, disable_radix_cache=args.disable_radix_cache,
        max_top_logprobs=args.max_top_logprobs, attention_backend=args.attention_backend, seed=args.random_seed,
        tp_size=args.tp_size, ep_size=args.ep_size, dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention, load_balance_method=args.load_balance_method, **lora_args(args),
        compilation_cache_dir=None if args.disable_compilation_cache else (args.compilation_cache_dir or DEFAULT_CACHE_DIR),
        layer_loop=args.layer_loop,
    )


def lora_args(args) -> dict:
    """Engine keywords for the LoRA flags (none unless adapters are asked for)."""
    paths = {}
    for item in args.lora_paths:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(item)), item
        if not name or not path or name in paths:
            raise ValueError(f"--lora-paths {item!r}: give NAME=DIR (or DIR), each name once")
        paths[name] = path
    if not (paths or args.enable_lora or args.max_loras_per_batch or args.max_lora_rank):
        return {}
    return dict(lora_paths=paths, max_loras=args.max_loras_per_batch or max(1, len(paths)),
                max_lora_rank=args.max_lora_rank)


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    from jspec.server.args import spec_config_from_args

    spec = spec_config_from_args(args, ap)
    logging.basicConfig(level=args.log_level.upper(), format="[jspec] %(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("jspec.serve")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU / no GPU" probes are noise
    from jspec.distributed.multihost import init_distributed

    try:  # before anything starts a JAX backend
        if init_distributed(args.nnodes, args.node_rank, args.dist_init_addr):
            log.warning("node %d of %d joined %s; the serving loop is single-controller: multi-host serving "
                        "(every node running the same steps) is not implemented yet", args.node_rank, args.nnodes,
                        args.dist_init_addr)
    except ValueError as e:
        ap.error(str(e))

    import uvicorn

    import jspec
    from jspec.engine.async_engine import AsyncEngine
    from jspec.checkpoint.loader import count_params
    from jspec.server.app import create_app

    path = args.model_path
    if path is None:
        from jspec.testing.demo import default_model_path

        path, what = default_model_path()
        log.info("serving %s at %s", what, path)
    t0 = time.perf_counter()
    try:
        model = jspec.load(path, load_format=args.load_format, context_length=args.context_length)
    except ValueError as e:
        ap.error(str(e))
    log.info("weights loaded: %s, %d layers, %.0fM parameters, %s, in %.1f s", os.path.basename(os.path.normpath(path)),
             model.cfg.num_layers, count_params(model.params) / 1e6, model.params["embed"].dtype,
             time.perf_counter() - t0)
    try:
        engine = make_engine(args, model, spec)
    except ValueError as e:  # e.g. a --tp-size that does not divide the heads
        ap.error(str(e))
    if not args.skip_warmup:
        modes = args.warmup_sampling_modes
        t0 = time.perf_counter()
        try:
            n = engine.warmup() if modes == "all" else engine.warmup(modes.split(","))
        except ValueError as e:
            ap.error(f"--warmup-sampling-modes: {e}")
        log.info("warm-up: %d programs ready in %.1f s", n, time.perf_counter() - t0)
    if args.disaggregation_mode == "prefill":
        return serve_prefill(engine, args, log)
    async_engine = AsyncEngine(engine)
    name = args.served_model_name or os.path.basename(os.path.normpath(path))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        log.info("ready: %s on http://%s:%d (%.0f s after start)", name, args.host, args.port,
                 time.perf_counter() - STARTED)
        yield
        log.warning("shutting down: aborting running requests")
        async_engine.shutdown()

    app = create_app(async_engine, name, lifespan=lifespan)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


def serve_prefill(engine, args, log) -> None:
    """A prefill engine: no HTTP, only the bootstrap port; SIGTERM / SIGINT stop it."""
    import signal
    import threading

    from jspec.disaggregation.prefill import PrefillServer

    server = PrefillServer(engine, args.host, args.disaggregation_bootstrap_port)

    def stop(signum, frame):
        log.warning("shutting down the prefill engine")
        server.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    server.serve_forever()


if __name__ == "__main__":
    main()
