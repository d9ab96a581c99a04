"""How big an engine's KV pool is, how many requests run at once, and which parallel layouts a
model allows.

`plan_pool` is a pure function of the device's memory, the weights' bytes and the programs'
measured needs, so its rules are tested on the CPU. The engine measures the programs by
compiling its largest prefill and decode against a two-page pool (engine.py), then sizes the
real pool from what is left. docs/design-details.md ("Sizing") gives the rules' reasons.
"""

from __future__ import annotations

import dataclasses

import jax

from jspec.config.engine import EngineConfig
from jspec.config.model import ModelConfig
from jspec.kvcache.pool import kv_bytes_per_page, kv_cache_dtype

GiB = 2**30
# Without an accelerator that reports its memory (the CPU): a pool this size.
DEFAULT_KV_BYTES = 256 * 2**20
# Running requests without an accelerator, and at most on one, plain and speculative. The
# caps are SGLang's decode-graph batch (256) and its speculative running limit (48) rounded up
# to a decode bucket: every power of two up to the limit is a compiled program.
CPU_RUNNING_REQUESTS = 32
MAX_RUNNING_REQUESTS = 256
MAX_RUNNING_REQUESTS_SPECULATIVE = 64
# What the pool leaves free of the allocator's memory besides the programs' measured peak: the
# allocator's fragmentation and the libraries' scratch (cuBLAS workspaces, autotuning).
HEADROOM_FRACTION = 0.04
HEADROOM_MIN_BYTES = 1 * GiB
# The programs' measured peak is scaled by this: buckets not measured (smaller prefills that
# batch more sequences, the sampled programs) may need a little more.
PROGRAM_BYTES_FACTOR = 1.25
# Pages of the pool the programs are measured against (the scratch page and one more).
PROBE_PAGES = 2


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The KV pool and the running-request limit an engine runs with, and where each came from
    (start-up logs it, /get_server_info returns it)."""

    pages: int  # pages of one pool (one per DP rank), the scratch page included
    page_size: int
    bytes_per_page: int
    max_running_requests: int
    pool_source: str
    running_source: str

    @property
    def tokens(self) -> int:
        """KV positions requests can hold (the scratch page excluded)."""
        return (self.pages - 1) * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.bytes_per_page

    def describe(self) -> dict:
        return {
            "max_total_tokens": self.tokens,
            "kv_pool_pages": self.pages,
            "kv_pool_gib": round(self.pool_bytes / GiB, 3),
            "kv_pool_source": self.pool_source,
            "max_running_requests": self.max_running_requests,
            "max_running_requests_source": self.running_source,
        }


def plan_pool(
    *,
    page_size: int,
    bytes_per_page: int,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    max_running_requests: int | None = None,
    device_bytes: int | None = None,
    weight_bytes: int = 0,
    program_bytes: int | None = None,
    speculative: bool = False,
) -> PoolPlan:
    """The pool's pages and the running-request limit.

    device_bytes: what the device's allocator may hold (None: no accelerator that reports it);
    weight_bytes: what one device holds besides the pool (the weights; measured, when it is); program_bytes: the largest temporary memory any
    program needs (measured; None: not measured). bytes_per_page: one page of the target's KV
    and the draft's, per device.

    The pool, first rule that applies: max_total_tokens' worth; mem_fraction_static of the
    device for weights + KV (SGLang's meaning; the programs get the rest); on an accelerator,
    all of it less the weights, the programs' measured peak (x PROGRAM_BYTES_FACTOR) and a
    headroom;
    otherwise DEFAULT_KV_BYTES.
    """
    S = page_size
    if max_total_tokens:
        pages, source = -(-max_total_tokens // S) + 1, "max_total_tokens"
    elif mem_fraction_static:
        if not device_bytes:
            raise ValueError("mem_fraction_static needs an accelerator that reports its memory; use max_total_tokens")
        kv = device_bytes * mem_fraction_static - weight_bytes
        if kv < 2 * bytes_per_page:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} of {_gib(device_bytes)} leaves no room for KV after "
                f"{_gib(weight_bytes)} of weights; raise it or use max_total_tokens"
            )
        pages = int(kv // bytes_per_page)
        source = (
            f"mem_fraction_static {mem_fraction_static} of {_gib(device_bytes)}, less {_gib(weight_bytes)} of weights"
        )
        rest = device_bytes - weight_bytes - pages * bytes_per_page
        if program_bytes is not None and rest < program_bytes:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} leaves {_gib(rest)} for the programs, which need "
                f"{_gib(program_bytes)}; lower it, or leave it unset to size the pool from the programs' needs"
            )
    elif device_bytes:
        programs = int((program_bytes or 0) * PROGRAM_BYTES_FACTOR)
        headroom = max(HEADROOM_MIN_BYTES, int(device_bytes * HEADROOM_FRACTION))
        kv = device_bytes - weight_bytes - programs - headroom
        if kv < 2 * bytes_per_page:
            raise ValueError(
                f"the device's {_gib(device_bytes)} hold {_gib(weight_bytes)} of weights and {_gib(programs)} for the "
                f"programs, which leaves no room for KV; use a smaller model, more devices (--tp-size) or "
                f"a shorter --chunked-prefill-size / --max-running-requests"
            )
        pages = int(kv // bytes_per_page)
        source = (
            f"device: {_gib(device_bytes)} less {_gib(weight_bytes)} of weights in use, {_gib(programs)} for the programs "
            f"(measured peak x {PROGRAM_BYTES_FACTOR}) and {_gib(headroom)} headroom"
        )
    else:
        pages, source = DEFAULT_KV_BYTES // bytes_per_page, f"default {DEFAULT_KV_BYTES // 2**20} MiB (no accelerator)"
    pages = max(2, pages)
    running, running_source = plan_running_requests(
        pages - 1, max_running_requests, accelerator=bool(device_bytes), speculative=speculative
    )
    return PoolPlan(pages, S, bytes_per_page, running, source, running_source)


def page_bytes(config: EngineConfig, cfg: ModelConfig, method, dtype) -> int:
    """Bytes of one KV page: the target's pool (in kv_cache_dtype) and the draft's state per
    page, if the speculative method keeps one (in the model's dtype)."""
    page = kv_bytes_per_page(cfg, config.page_size, kv_cache_dtype(config.kv_cache_dtype, dtype))
    return page + (method.draft_kv_bytes_per_page(config.page_size, dtype) if method is not None else 0)


def plan_running_requests(
    usable_pages: int, max_running_requests: int | None, *, accelerator: bool, speculative: bool
) -> tuple[int, str]:
    """The running-request limit: as given; off an accelerator CPU_RUNNING_REQUESTS; on one the
    cap (plain or speculative), lowered so each running request has two pages of the pool."""
    if max_running_requests:
        return max_running_requests, "max_running_requests"
    if not accelerator:
        return CPU_RUNNING_REQUESTS, "default (no accelerator)"
    cap = MAX_RUNNING_REQUESTS_SPECULATIVE if speculative else MAX_RUNNING_REQUESTS
    fit = max(1, usable_pages // 2)
    if fit < cap:
        return fit, f"two pages of the pool per request ({usable_pages} pages)"
    return cap, f"default cap{' with speculation' if speculative else ''}"


def probe_running_requests(config: EngineConfig, accelerator: bool) -> int:
    """The running-request limit the programs are measured with: the one the plan gives unless
    the pool turns out smaller (then fewer rows need less memory, never more)."""
    speculative = config.speculative is not None
    return plan_running_requests(2**62, config.max_running_requests, accelerator=accelerator, speculative=speculative)[
        0
    ]


def device_memory_bytes() -> int | None:
    """What the first local device's allocator may hold; None without an accelerator that says."""
    dev = jax.local_devices()[0]
    if dev.platform == "cpu":
        return None
    return (dev.memory_stats() or {}).get("bytes_limit")


def device_memory_stats() -> dict:
    """The first local device's allocator statistics ({} where it has none)."""
    return jax.local_devices()[0].memory_stats() or {}


def device_bytes_in_use() -> int:
    """Bytes the first local device's allocator holds now (0 where it does not say)."""
    return device_memory_stats().get("bytes_in_use", 0)


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def check_parallel(config: EngineConfig, cfg: ModelConfig) -> None:
    """SGLang's rules for tp / ep / dp, checked before anything is placed."""
    tp, ep, dp = config.tp_size, config.ep_size, config.dp_size
    if cfg.deepseek is not None and (tp > 1 or dp > 1):
        raise ValueError(
            f"{cfg.family}: tensor / expert parallelism and DP attention are not implemented for latent-attention "
            f"(MLA) models yet; run with tp_size=1, dp_size=1 (got {tp}, {dp})"
        )
    if cfg.deepseek is not None and config.kv_cache_dtype != "auto":
        raise ValueError(f"{cfg.family}: an FP8 KV cache is not supported for latent-attention (MLA) models yet")
    if cfg.deepseek is not None and (config.lora_paths or config.enable_lora):
        raise ValueError(f"{cfg.family}: LoRA adapters are not supported for latent-attention (MLA) models")
    if ep != 1 and not (cfg.is_moe and ep == tp):
        raise ValueError(
            f"ep_size={ep}: expert parallelism splits an MoE model's experts over its "
            f"tensor-parallel devices, so it must equal tp_size ({tp}) on an MoE model "
            f"(this one is {'MoE' if cfg.is_moe else 'dense'}); 1 otherwise"
        )
    if cfg.is_moe and tp > 1 and ep != tp:
        raise ValueError(
            f"an MoE model with tp_size={tp} needs ep_size={tp} (its experts are split whole over the "
            f"devices, not column-wise)"
        )
    if dp > 1 and not config.enable_dp_attention:
        raise ValueError(
            f"dp_size={dp} needs enable_dp_attention=True (--enable-dp-attention): jspec "
            f"implements data parallelism only as DP attention inside the tp_size devices, "
            f"not as replicated engines"
        )
    if config.enable_dp_attention and dp == 1:
        raise ValueError("enable_dp_attention needs dp_size > 1 (--dp-size)")
    if config.enable_dp_attention and tp % dp:
        raise ValueError(
            f"DP attention needs tp_size % dp_size == 0 (each of the dp_size={dp} attention "
            f"ranks gets tp_size / dp_size devices); got tp_size={tp}"
        )
