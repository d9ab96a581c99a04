"""An engine's worker, built from its settings: the weights' precision and parallel layout,
the speculative method, the LoRA pool, and the KV pool's size, measured on an accelerator
(engine/sizing.py has the rules)."""

from __future__ import annotations

import logging
import time

import jax

from jspec.checkpoint.model import Model
from jspec.config.engine import EngineConfig
from jspec.config.model import ModelConfig
from jspec.distributed.dp_attention import make_dp_mesh, shard_params_dp
from jspec.distributed.tensor_parallel import make_mesh, shard_params
from jspec.engine.sizing import (
    PROBE_PAGES,
    PoolPlan,
    check_parallel,
    device_bytes_in_use,
    device_memory_bytes,
    device_memory_stats,
    page_bytes,
    plan_pool,
    probe_running_requests,
)
from jspec.kernels.backend import one_gpu
from jspec.kernels.mgpu_tiles import GROUP_ROWS
from jspec.kernels.mla_decode_mgpu import mla_mosaic_unsupported
from jspec.kernels.paged_decode_mgpu import MosaicUnsupported, mosaic_decode_unsupported
from jspec.kernels.paged_extend_mgpu import mosaic_extend_unsupported
from jspec.kvcache.pool import FP8_KV_BYTES, kv_cache_dtype
from jspec.layers.attention import mosaic_runs_mla
from jspec.layers.batch import bucket
from jspec.layers.matmul import (
    PADDED_MIN_WEIGHT_ELEMENTS,
    SKINNY_MATMUL_ENV,
    lays_out_projections_out_in,
    skinny_backend,
    with_out_in_projections,
)
from jspec.layers.norm import add_rms_norm_backend
from jspec.layers.quant import has_fp8_weights, quantize_params, with_fp8_gemm
from jspec.lora.adapter import read_rank
from jspec.lora.pool import LoraPool
from jspec.models.llama import rope_kv_runs
from jspec.speculative.registry import make_method
from jspec.worker.base import Worker, check_layer_loop, default_attention_backend, lay_out_layers
from jspec.worker.dp import DPWorker
from jspec.worker.plain import PlainWorker
from jspec.worker.programs import first_step, measure_programs
from jspec.worker.spec import SpecWorker

log = logging.getLogger("jspec.engine")


def loads_per_layer(config: EngineConfig) -> bool:
    """Whether the weights should be loaded as per-layer arrays: the layout the unrolled layer
    loop runs on one device. Loaded stacked and copied out later, the freed stacks would leave a
    hole below the weights that the KV pool's large leaves cannot use. Sharded engines take the
    stacked layout the sharding code expects."""
    return check_layer_loop(config.layer_loop) == "unrolled" and config.tp_size == 1 and not config.enable_dp_attention


def build_worker(model: Model, config: EngineConfig, draft=None, target_path=None) -> tuple[Worker, PoolPlan]:
    """The worker of `model` under `config`, over its KV pool, and the pool's plan. draft: an
    EAGLE / STANDALONE draft given in memory as (config, params); target_path: the target's
    checkpoint (NEXTN reads its MTP layers there).

    The weights are handed over: model.params is None afterwards, and the worker holds them as
    its steps take them (quantized, sharded, per layer on the GPU), so that nothing keeps the
    loader's arrays alive while the pool is sized from the device memory left."""
    cfg, params = model.cfg, model.params
    model.params = None
    check_parallel(config, cfg)
    params = fp8_weights(config, params)
    check_attention_backend(config, cfg, params["embed"].dtype)
    log_layer_kernels(config, cfg, params["embed"].dtype, fp8_weights=has_fp8_weights(params))
    dp = config.dp_size if config.enable_dp_attention else 1
    spec = config.speculative
    if spec is not None and spec.adaptive and dp > 1:
        raise ValueError("adaptive speculation (--speculative-adaptive) is not implemented with DP attention")
    dp_mesh = mesh = None
    if dp > 1:
        # DP attention: dp ranks of tp / dp devices, each with max_running_requests / dp request
        # slots and its own pool of the configured size (jspec/distributed/dp_attention.py).
        dp_mesh = make_dp_mesh(config.tp_size, dp)
        cfg, params = shard_params_dp(cfg, params, dp_mesh)
    elif config.tp_size > 1:
        mesh = make_mesh(config.tp_size)
        cfg, params = shard_params(cfg, params, mesh)  # cfg changes only if KV heads are repeated
    method = dparams = None
    if spec is not None:
        # The draft is built against the checkpoint's config; it runs replicated on every shard.
        method, dparams = make_method(
            spec,
            model.cfg,
            draft,
            dtype=params["embed"].dtype,
            target_path=target_path,
            per_layer=loads_per_layer(config),
        )
    dtype = params["embed"].dtype
    kw = dict(
        page_size=config.page_size,
        decode_paddings=config.precompile_bs_paddings,
        chunked_prefill_size=max(8, config.chunked_prefill_size // dp),
        top_n=config.max_top_logprobs,
        attention_backend=config.attention_backend,
        mesh=mesh,
        layer_loop=config.layer_loop,
        lora=lora_pool(config, model.cfg, dtype, mesh or dp_mesh, params),
        kv_cache_dtype=config.kv_cache_dtype,
    )
    # Laid out here, where the weights are owned, so the loader's stacked copy is gone before any
    # pool exists: a worker laying them out itself creates its pool while the caller holds both.
    layer_loop = check_layer_loop(config.layer_loop)
    params = lay_out_layers(params, layer_loop)
    if lays_out_projections_out_in():
        params = out_in_projections(config, params, layer_loop)
    sizing = sizing_arguments(config, cfg, params, method, dp)
    pages, slots = first_pool(config, sizing, dp)
    if method is None:
        worker = PlainWorker(cfg, params, num_pages=pages, max_slots=slots, **kw)
    else:
        worker = SpecWorker(cfg, params, method, dparams, num_pages=pages, max_slots=slots, **kw)
    del params
    plan = size_pool(worker, sizing, dp)
    check_pool_allocated(worker, plan)
    log.info(
        "KV pool: %d tokens, %.2f GiB (%s); at most %d running requests (%s)",
        plan.tokens,
        plan.pool_bytes / 2**30,
        plan.pool_source,
        plan.max_running_requests,
        plan.running_source,
    )
    if dp_mesh is not None:
        worker = DPWorker(worker, dp_mesh)
    return worker, plan


def check_pool_allocated(worker, plan: PoolPlan) -> None:
    """Waits for the device state's buffers: an allocation that failed is reported here, by what
    it was for, not by the first step that reads the pool (dispatch is asynchronous)."""
    try:
        jax.block_until_ready(worker.state)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise MemoryError(
            f"the KV pool of {plan.tokens} tokens ({plan.pool_bytes / 2**30:.2f} GiB, {plan.pool_source}) "
            f"does not fit on the device beside the weights: ask for fewer tokens (max_total_tokens, "
            f"mem_fraction_static). {e}"
        ) from None


def layer_kernels(config: EngineConfig, cfg: ModelConfig, dtype, *, fp8_weights: bool = False) -> dict[str, str] | None:
    """What runs each of a decoder layer's steps on one GPU, by step (attention, add-and-norm,
    RoPE and K / V write, projections), from the settings and the switches the layers read;
    None elsewhere (XLA's ops and the jnp attention), and for latent-attention models, whose
    attention the log names when it is built."""
    if not one_gpu() or cfg.deepseek is not None:
        return None
    attention = config.attention_backend or default_attention_backend()
    norm = {
        "pallas": "the Triton-backend kernel",
        "mosaic": "the Mosaic GPU kernel (the Triton-backend one at widths not a multiple of 64)",
        "xla": "XLA's ops",
    }[add_rms_norm_backend(attention)]
    fp8_pool = (
        kv_cache_dtype(config.kv_cache_dtype, dtype) == FP8_KV_BYTES
    )  # is_fp8_cache's test, before the pool exists
    rope = rope_kv_runs(cfg, attention, shards=config.tp_size, fp8_pool=fp8_pool, norms_in_dtype=True)
    out_in = (
        f"XLA's dot, weights under {PADDED_MIN_WEIGHT_ELEMENTS:,} elements stored [out, in], one-row products "
        "of larger ones as two rows"
    )
    refusal = out_in_refusal(config, check_layer_loop(config.layer_loop))
    projections = {
        "auto": out_in
        if refusal is None
        else f"XLA's dot, one-row products of weights of {PADDED_MIN_WEIGHT_ELEMENTS:,} elements or more as two rows",
        "xla": "XLA's dot",
        "xla_padded": "XLA's dot, every one-row product as two rows",
        "pallas": "the Triton-backend GEMV up to 16 rows",
        "mosaic": "the Mosaic GPU GEMV where it covers the shape",
        "xla_nk": out_in,
    }[skinny_backend()]
    return {
        "attention": {"pallas": "the Triton-backend kernels", "mosaic": "the Mosaic GPU kernels"}.get(
            attention, attention
        ),
        "add-and-norm": norm if cfg.norm_layout != "post" else "XLA's add (no norm after it)",
        "RoPE and K / V write": "one Triton-backend kernel" if rope else "XLA's ops",
        "projections": "the FP8 weights' path (--fp8-gemm-backend)" if fp8_weights else projections,
    }


def log_layer_kernels(config: EngineConfig, cfg: ModelConfig, dtype, *, fp8_weights: bool) -> None:
    """Logs layer_kernels once an engine is built on one GPU: which kernel runs each step."""
    kernels = layer_kernels(config, cfg, dtype, fp8_weights=fp8_weights)
    if kernels:
        log.info("layer kernels: %s", "; ".join(f"{step} on {what}" for step, what in kernels.items()))


def check_attention_backend(config: EngineConfig, cfg: ModelConfig, dtype) -> None:
    """--attention-backend mosaic runs decode, extend and tree verify on the Mosaic GPU kernels
    (a latent-attention model: MLA decode and verify), which cover the common case only: what they
    lack is refused here by name, before any program is built."""
    if config.attention_backend != "mosaic":
        return
    if cfg.deepseek is not None:
        ds = cfg.deepseek
        heads = cfg.num_heads // config.tp_size
        if not mosaic_runs_mla(heads):
            log.info(
                "attention: MLA decode and verify on the Triton-backend kernels: %d query heads per device "
                "leave most of a Mosaic program's %d-row products empty",
                heads,
                GROUP_ROWS,
            )
            return
        latent_shape = (cfg.num_layers, 1, config.page_size, 1, ds.latent_dim)
        feature = mla_mosaic_unsupported(latent_shape, kv_cache_dtype(config.kv_cache_dtype, dtype), ds.kv_lora_rank)
        if feature is not None:
            raise MosaicUnsupported(f"{feature} ({cfg.family}); use --attention-backend pallas", "MLA")
        log.info("attention: MLA decode and verify on the Mosaic GPU kernels; prefill on the expanded jnp form")
        return
    cache_shape = (cfg.num_layers, 1, config.page_size, cfg.num_kv_heads, cfg.head_dim)
    cache_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
    # Verify runs each draft tree padded to its bucket. A drafter's own block (DFLASH's default)
    # is known only once it is loaded: the kernel refuses it then, if it must.
    spec = config.speculative
    trees = [tokens for _, _, tokens in spec.shapes() if tokens] if spec is not None else []
    largest_tree = bucket(max(trees, default=1))
    checks = {
        "decode": mosaic_decode_unsupported(cache_shape, cache_dtype, cfg.num_heads),
        "extend": mosaic_extend_unsupported(cache_shape, cache_dtype, cfg.num_heads, max_q_len=largest_tree, tree=True),
    }
    for kernel, feature in checks.items():
        if feature is not None:
            raise MosaicUnsupported(f"{feature} ({cfg.family}); use --attention-backend pallas", kernel)
    log.info("attention: decode, extend and tree verify on the Mosaic GPU kernels")


def fp8_weights(config: EngineConfig, params):
    """params quantized as config.quantization asks, their FP8 weights' matmul path set; the
    features FP8 weights do not reach yet are refused by name."""
    params = quantize_params(params, config.quantization)
    if not has_fp8_weights(params):
        return params
    if config.serves_lora:
        raise NotImplementedError("LoRA adapters over FP8 weights are not implemented")
    if config.enable_dp_attention:
        raise NotImplementedError("DP attention with FP8 weights is not implemented")
    return with_fp8_gemm(params, config.fp8_gemm_backend)


def out_in_refusal(config: EngineConfig, layer_loop: str) -> str | None:
    """Why the [out, in] projection layout does not apply to this engine, or None: LoRA extends
    the projection weights with the pool's columns, tensor parallelism and DP attention reshape
    them into blocks, and the stacked-and-unrolled loop slices them as [in, out]."""
    if config.serves_lora:
        return "LoRA adapters (which extend the projection weights)"
    if config.tp_size > 1 or config.enable_dp_attention:
        return "tensor parallelism or DP attention"
    if layer_loop not in ("unrolled", "scan"):
        return f"--layer-loop {layer_loop}"
    return None


def out_in_projections(config: EngineConfig, params, layer_loop: str):
    """The small projection weights laid out [out, in] where the layers take them so. Asked for
    by name (JSPEC_SKINNY_MATMUL=xla_nk), a configuration the layout does not apply to is
    refused; as the one-GPU default, such a configuration keeps the [in, out] weights."""
    refusal = out_in_refusal(config, layer_loop)
    if refusal is None:
        return with_out_in_projections(params, per_layer_ndim=2 if layer_loop == "unrolled" else 3)
    if skinny_backend() == "xla_nk":
        raise NotImplementedError(f"{SKINNY_MATMUL_ENV}=xla_nk with {refusal} is not implemented")
    log.info("projection weights kept [in, out]: the [out, in] layout does not apply to %s", refusal)
    return params


def lora_pool(config: EngineConfig, cfg, dtype, mesh, params) -> LoraPool | None:
    """The adapter pool (max_loras_per_batch slots of rank max_lora_rank; by default as many
    slots as lora_paths, at least 1, and the largest rank among them, at least 16)."""
    if not config.serves_lora:
        return None
    paths = config.lora_paths
    max_loras = config.max_loras_per_batch or max(1, len(paths))
    max_rank = config.max_lora_rank or max([16] + [read_rank(p) for p in paths.values()])
    stacked = check_layer_loop(config.layer_loop) in ("scan", "unrolled_stack") and isinstance(params["layers"], dict)
    return LoraPool(cfg, max_loras, max_rank, dtype, mesh, stacked=stacked)


def sizing_arguments(config: EngineConfig, cfg, params, method, dp: int) -> dict:
    """plan_pool's arguments but the measured ones (engine/sizing.py)."""
    page = page_bytes(config, cfg, method, params["embed"].dtype)
    return dict(
        page_size=config.page_size,
        # Per device: 1/tp of the weights, and each page's KV heads split over a rank's tp / dp devices.
        bytes_per_page=page // max(1, config.tp_size // dp),
        max_total_tokens=config.max_total_tokens,
        mem_fraction_static=config.mem_fraction_static,
        max_running_requests=config.max_running_requests,
        device_bytes=device_memory_bytes(),
        weight_bytes=sum(x.nbytes for x in jax.tree.leaves(params)) // config.tp_size,
        speculative=method is not None,
    )


def first_pool(config: EngineConfig, sizing: dict, dp: int) -> tuple[int, int]:
    """(pages, request slots per rank) of the pool the worker is first built over: the final
    one when the settings fix it; on an accelerator with no pool size given, a two-page probe
    (size_pool measures the worker's programs over it, then resizes it)."""
    if sizing["device_bytes"] is None or config.max_total_tokens:
        plan = plan_pool(**sizing)
        pages, running = plan.pages, plan.max_running_requests
    else:
        pages, running = PROBE_PAGES, probe_running_requests(config, accelerator=True)
    return pages, max(1, running // dp)


def size_pool(worker, sizing: dict, dp: int) -> PoolPlan:
    """The pool plan; over a probe pool, the worker's largest programs are measured and the
    pool sized from the memory they and everything already on the device leave."""
    if worker.num_pages != PROBE_PAGES or sizing["device_bytes"] is None or sizing["max_total_tokens"]:
        return plan_pool(**sizing)
    t0 = time.perf_counter()
    measured = measure_programs(worker)
    peak = max(m.needs_bytes for m in measured.values())
    log.info(
        "programs measured in %.1f s: the largest needs %.2f GiB (%s)",
        time.perf_counter() - t0,
        peak / 2**30,
        ", ".join(f"{k}: {m.needs_bytes / 2**30:.2f}" for k, m in measured.items()),
    )
    # What is on the device besides the probe's pool: the weights as the worker laid them out,
    # and anything the caller still holds.
    in_use = device_bytes_in_use() - PROBE_PAGES * sizing["bytes_per_page"]
    plan = plan_pool(**{**sizing, "weight_bytes": max(in_use, sizing["weight_bytes"])}, program_bytes=peak)
    worker.resize(plan.pages, max(1, plan.max_running_requests // dp))
    first_step(worker)
    stats = device_memory_stats()
    log.info(
        "first step over the pool: %.2f GiB in use on the device, peak %.2f GiB of %.2f GiB",
        stats.get("bytes_in_use", 0) / 2**30,
        stats.get("peak_bytes_in_use", 0) / 2**30,
        sizing["device_bytes"] / 2**30,
    )
    return plan
