"""Every setting of an engine, in one frozen dataclass with one set of defaults.

Field names are SGLang's server arguments: `Engine(model, page_size=16)`, `jspec.generate`
and the server's flags (`--page-size`, generated from these fields) all build one of these.
Each field's help text lives in its metadata, so the flags and the docs share it.
"""

from __future__ import annotations

import dataclasses
import os

from jspec.config.fields import setting
from jspec.config.spec import SpecConfig

DEFAULT_COMPILATION_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jspec", "xla")
ATTENTION_BACKENDS = ("pallas", "mosaic", "reference")
LAYER_LOOPS = ("auto", "scan", "unrolled", "unrolled_stack")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
QUANTIZATIONS = ("fp8",)
FP8_GEMM_BACKENDS = ("auto", "xla", "pallas", "mosaic", "w8a8")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
GRAMMAR_BACKENDS = ("llguidance", "none")
# mixed_chunk_slowdown's value on an accelerator when none is given (engine.mixed_step_slowdown):
# a little under the twice-the-median inter-token latency it is meant to keep, since the gap a
# running request sees across a mixed step is that step plus the loop's own time.
ACCELERATOR_MIXED_CHUNK_SLOWDOWN = 1.8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # The KV pool and batching.
    page_size: int = setting(16, "tokens per KV page (a power of two)", group="memory")
    max_running_requests: int | None = setting(
        None,
        "requests decoded together at most (default: 32 without an accelerator; on one 256, 64 with "
        "speculation, fewer if the KV pool holds less than two pages a request)",
        group="memory",
    )
    max_total_tokens: int | None = setting(
        None,
        "KV pool size in tokens (default: on an accelerator, the memory left after the weights and the "
        "programs' measured needs; without one, 256 MiB of KV)",
        group="memory",
    )
    mem_fraction_static: float | None = setting(
        None,
        "fraction of the accelerator's memory for weights + KV; the programs get the rest (GPU only)",
        group="memory",
    )
    chunked_prefill_size: int = setting(512, "prompt tokens prefilled per step at most", group="memory")
    precompile_bs_paddings: tuple[int, ...] | None = setting(
        None,
        "decode batch sizes compiled (powers of two): a decode pads to the smallest at or above its rows "
        "(past the largest, to the next power of two); default: every power of two up to --max-running-requests",
        nargs="+",
        type=int,
        metavar="BS",
        group="kernels",
    )
    context_length: int | None = setting(
        None, "longest prompt + output served (default: the model's max_position_embeddings)", group="model"
    )
    # The loop.
    disable_overlap_schedule: bool = setting(False, "run the synchronous loop instead", group="memory")
    disable_mixed_chunk: bool = setting(
        False,
        "run each prefill alone; by default the running requests decode in the same step (SGLang's "
        "--enable-mixed-chunk), so new prompts do not stall them (plain decoding; speculation alternates)",
        group="memory",
    )
    mixed_chunk_slowdown: float | None = setting(
        None,
        "a step that prefills while running requests decode may cost at most this many times their decode "
        "step (its prompt tokens are cut to fit, from step costs timed at warm-up): their inter-token latency "
        f"bound; 0: only --chunked-prefill-size bounds it; default: {ACCELERATOR_MIXED_CHUNK_SLOWDOWN:g} on an "
        "accelerator, 0 without one",
        group="memory",
    )
    disable_radix_cache: bool = setting(False, "no prefix cache", group="memory")
    random_seed: int = setting(0, "seeds requests that bring none", group="serving")
    max_top_logprobs: int = setting(5, "largest top-n logprobs a request may ask for", group="serving")
    stream_interval: int = setting(
        1,
        "a streamed request's outputs go to the server in chunks of at least this many tokens (its first and "
        "last at once): fewer, larger chunks cost the HTTP side less per token at high concurrency",
        group="serving",
    )
    disable_gc_freeze: bool = setting(
        False,
        "leave Python's garbage collector as it is; by default a serving process collects once after "
        "start-up and freezes what is left, so no later collection walks the start-up heap in the loop",
        group="serving",
    )
    # Quantization.
    quantization: str | None = setting(
        None,
        "fp8: quantize a bf16 checkpoint's decoder projections to FP8 e4m3 per output channel at load "
        "(an FP8 checkpoint is read as FP8 without it)",
        choices=QUANTIZATIONS,
        group="model",
    )
    fp8_gemm_backend: str = setting(
        "auto",
        "FP8 weights' matmul: xla (the upcast inside XLA's dot), pallas (the skinny GEMV upcasting in "
        "registers, for decode rows on one GPU; XLA's dot for the others), mosaic (the same on Mosaic GPU, "
        "upcasting in shared memory; per-tensor or per-channel weights), w8a8 (activations quantized "
        "per token, XLA's FP8 x FP8 GEMM; per-tensor or per-channel weights), auto: pallas for one row of "
        "a large weight, xla for the rest (each measured the fastest there)",
        choices=FP8_GEMM_BACKENDS,
        group="kernels",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto: the model's dtype; fp8_e4m3: an FP8 KV cache (per-layer K and V scales from the checkpoint, else 1.0)",
        choices=KV_CACHE_DTYPES,
        group="model",
    )
    # Structured outputs.
    grammar_backend: str = setting(
        "llguidance",
        "the library that compiles json_schema / regex / ebnf grammars (none: refuse them)",
        choices=GRAMMAR_BACKENDS,
        group="serving",
    )
    grammar_cache_size: int = setting(
        256, "compiled grammars kept (by kind and text), least recently used dropped", group="serving"
    )
    grammar_compile_timeout: float = setting(
        10.0, "seconds a grammar may take to compile; a slower one is refused as too complex", group="serving"
    )
    # Programs.
    attention_backend: str | None = setting(
        None,
        "default: pallas on the GPU, the jnp reference elsewhere (Pallas would run interpreted); "
        "mosaic: decode, extend and tree verify on the Mosaic GPU kernels (16-bit or FP8 KV, pages >= 8, trees "
        "of at most 256 tokens; latent attention: its decode and verify; the rest refused by name at build)",
        choices=ATTENTION_BACKENDS,
        group="kernels",
    )
    layer_loop: str = setting(
        "auto",
        "scan: one compiled layer body (compile time independent of depth); unrolled: per-layer "
        "weight arrays (no weight sliced out of a stack); unrolled_stack: the stacked weights, each "
        "layer compiled over static slices of them (a launch takes one array per weight kind, not "
        "one per layer); auto: unrolled on the GPU, else scan",
        choices=LAYER_LOOPS,
        group="kernels",
    )
    compilation_cache_dir: str = setting(
        DEFAULT_COMPILATION_CACHE_DIR,
        "JAX's persistent compilation cache: a restart loads its programs from here",
        group="kernels",
    )
    disable_compilation_cache: bool = setting(False, "compile every program afresh", group="kernels")
    # Parallelism.
    tp_size: int = setting(
        1, "tensor-parallel degree: shards the model and KV over this many local devices", group="parallel"
    )
    ep_size: int = setting(
        1,
        "expert-parallel degree of an MoE model: equal to --tp-size (experts split over those devices)",
        group="parallel",
    )
    dp_size: int = setting(
        1,
        "DP attention ranks (with --enable-dp-attention): attention data-parallel over dp "
        "groups of tp-size / dp-size devices, each with its own requests and KV; the MLP "
        "stays over all tp",
        group="parallel",
    )
    enable_dp_attention: bool = setting(False, "data-parallel attention (see --dp-size)", group="parallel")
    load_balance_method: str = setting(
        "round_robin", "how DP attention assigns new requests to ranks", choices=LOAD_BALANCE_METHODS, group="parallel"
    )
    # LoRA adapters.
    enable_lora: bool = setting(
        False, "serve LoRA adapters even when --lora-paths gives none (load them by /load_lora_adapter)", group="lora"
    )
    lora_paths: dict[str, str] = setting(
        None,
        "PEFT LoRA adapters loaded at start-up, NAME=PATH (a directory or a Hugging Face Hub repo id; a bare "
        "PATH is named by its last component); requests pick one with lora_path, or model BASE:NAME",
        nargs="+",
        metavar="NAME=PATH",
        group="lora",
    )
    max_loras_per_batch: int | None = setting(
        None, "adapters resident at once (LoRA pool slots; default: the number of --lora-paths, >= 1)", group="lora"
    )
    max_lora_rank: int | None = setting(
        None, "largest adapter rank the pool holds (default: the largest among --lora-paths, at least 16)", group="lora"
    )
    # Speculative decoding (its own flags: --speculative-*, from SpecConfig's fields).
    speculative: SpecConfig | None = setting(None, "speculative decoding; None: off", group="speculative")

    def __post_init__(self):
        for name in ("page_size", "max_running_requests", "chunked_prefill_size", "tp_size", "ep_size", "dp_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1")
        if self.max_top_logprobs < 0:
            raise ValueError(f"max_top_logprobs={self.max_top_logprobs} must be >= 0")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} must be >= 1")
        if self.mixed_chunk_slowdown is not None and self.mixed_chunk_slowdown != 0 and self.mixed_chunk_slowdown < 1:
            raise ValueError(f"mixed_chunk_slowdown={self.mixed_chunk_slowdown} must be 0 (no bound) or >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1]")
        for name in (
            "attention_backend",
            "layer_loop",
            "load_balance_method",
            "quantization",
            "fp8_gemm_backend",
            "kv_cache_dtype",
        ):
            choices = EngineConfig.__dataclass_fields__[name].metadata["choices"]
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of {choices}")
        object.__setattr__(self, "lora_paths", dict(self.lora_paths or {}))
        paddings = tuple(sorted(set(self.precompile_bs_paddings or ()))) or None
        if paddings is not None and any(b < 1 or b & (b - 1) for b in paddings):
            raise ValueError(f"precompile_bs_paddings must be powers of two, got {list(paddings)}")
        object.__setattr__(self, "precompile_bs_paddings", paddings)

    @property
    def compilation_cache(self) -> str | None:
        return None if self.disable_compilation_cache else self.compilation_cache_dir

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_paths or self.enable_lora or self.max_loras_per_batch or self.max_lora_rank)
