"""What the benchmarks share: the model shapes, random weights, timing loops, the device's
bandwidth and matmul probes, and the result writer (one JSON schema for every benchmark).

    from benchmarks.common import LLAMA_8B, Results, random_params, timed
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.loader import param_shapes
from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.config.sampling import SamplingParams
from jspec.train.eagle3 import draft_config_for
from jspec.worker.inputs import decode_inputs, decode_lora_slots, lora_batch
from jspec.worker.programs import decode_jobs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES_DIR = os.path.join(REPO_ROOT, "benchmarks", "shapes")
RESULTS_DIR = "benchmarks/results"  # every script's default --out, relative to the repo root it runs from


# ---- model shapes: benchmarks/shapes/*/config.json, the one source ----------------------------


def shape(name: str) -> ModelConfig:
    """A model shape of benchmarks/shapes (config.json only: the benchmarks make random weights)."""
    return ModelConfig.from_pretrained(os.path.join(SHAPES_DIR, name))


def eagle3_head(target: ModelConfig, draft_vocab_size: int) -> DraftConfig:
    """An EAGLE-3 head for `target`: one layer of its shapes, SGLang's capture layers."""
    return draft_config_for(target, draft_vocab_size)


def tiny(cfg: ModelConfig, num_layers: int = 4) -> ModelConfig:
    """cfg shrunk to a few-layer model of the same family: the scripts' CPU dry runs (--tiny)."""
    return dataclasses.replace(
        cfg,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )


def tiny_head(target: ModelConfig) -> DraftConfig:
    """The EAGLE-3 head of a tiny() target."""
    return eagle3_head(target, 256)


LLAMA_8B = shape("llama-3.1-8b")
EAGLE3_8B = eagle3_head(LLAMA_8B, 32000)
# The engine benchmarks run the 8B shape at the small model's 2048-token context, as all their
# results so far: fewer page-table buckets to compile, and narrower ones.
LLAMA_8B_CTX = dataclasses.replace(LLAMA_8B, max_position_embeddings=2048)
EAGLE3_8B_CTX = eagle3_head(LLAMA_8B_CTX, 32000)
SMALL = shape("smollm2-135m")  # where host overhead matters most
SMALL_DRAFT = eagle3_head(SMALL, 16384)
TINY = tiny(SMALL)
TINY_DRAFT = tiny_head(TINY)


def random_params(cfg: ModelConfig, dtype, seed: int = 0):
    """Random weights of cfg's shapes, made on the device (norm scales near 1, the rest small)."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    @jax.jit
    def make(keys):
        out = []
        for k, shape in zip(keys, leaves, strict=True):
            is_norm = (
                len(shape) <= 2
                and shape[-1] in (cfg.hidden_size, cfg.head_dim)
                and not (len(shape) == 2 and shape[0] == cfg.vocab_size)
            )
            x = jax.random.normal(k, shape, jnp.float32) * (0.1 if is_norm else 0.02) + (1.0 if is_norm else 0.0)
            out.append(x.astype(dtype))
        return out

    return jax.tree.unflatten(treedef, make(keys))


# ---- timing -------------------------------------------------------------------------------------


def timed(fn, iters: int, repeats: int) -> float:
    """Median seconds per call over `repeats` runs of `iters` back-to-back calls (waited for
    once per run, so host dispatch overlaps the device)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))


def median_ms(fn, n: int, before=None) -> float:
    """Median milliseconds of n calls of fn, each timed alone; before() runs untimed ahead of each."""
    ts = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def median(xs) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def int_list(text: str) -> list[int]:
    """An argparse type: "1,32" -> [1, 32]."""
    return [int(x) for x in text.split(",")]


# ---- what the device can do: the floors the benchmarks compare with -----------------------------


def copy_bandwidth(elements: int = 1 << 31) -> float:
    """Bytes read + written per second by an elementwise pass over `elements` bf16 (4 GiB by
    default): the better of a plain copy and a scaling."""
    # Random, not constant: data that compresses can time faster than real data.
    x = jax.random.normal(jax.random.key(1), (elements,), jnp.bfloat16)
    best = 0.0
    for f in (jax.jit(jnp.copy), jax.jit(lambda a: a * 1.0001)):
        for _ in range(3):  # compile, and let the clocks ramp up from idle
            jax.block_until_ready(f(x))
        best = max(best, 2 * x.nbytes / timed(lambda f=f: f(x), 10, 5))
    return best


def read_bandwidth(elements: int = 1 << 31) -> float:
    """Bytes read per second by a reduction over `elements` bf16 (decode mostly reads)."""
    x = jax.random.normal(jax.random.key(4), (elements,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(f(x))
    return x.nbytes / timed(lambda: f(x), 10, 5)


def matmul_flops(n: int = 8192) -> float:
    """bf16 matmul FLOP/s of an [n, n] @ [n, n] product."""
    a = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(a, b))
    return 2 * n**3 / timed(lambda: f(a, b), 10, 5)


def pyplot(script: str):
    """matplotlib's pyplot, drawing to files; None (and a line saying so) when it is missing:
    the JSON is the result, the PNG is drawn elsewhere with `python -m benchmarks.SCRIPT --plot`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is missing: no plot (python -m benchmarks.{script} --plot JSON elsewhere)")
        return None
    return plt


def run_label(data: dict) -> str:
    """(device, commit) of a result JSON, for a plot's title."""
    return f"({data.get('device', '')}, {(data.get('commit') or '')[:10]})"


def save_png(fig, path_json: str) -> str:
    """Saves fig as the PNG beside the JSON path_json; returns its path."""
    fig.tight_layout()
    png = path_json[: -len(".json")] + ".png"
    fig.savefig(png, dpi=110)
    return png


def spec_costs(engine, repeats: int = 5):
    """An adaptive speculative engine's cost table (SpecWorker.measure_costs), its greedy
    decode programs of every shape and bucket compiled first, on threads, as warm-up does: one
    at a time at first use they take minutes on a GPU."""
    w = engine.worker
    w.programs.compile_all(decode_jobs(w, ["greedy"], shapes=range(w.num_shapes)))
    return w.measure_costs(repeats=repeats)


# ---- an engine's compiled decode step, without its loop -------------------------------------------


class HeldDecode:
    """`batch` requests' slots and pages taken from an engine's KV book and the decode step's
    inputs built for them once, on the device: decode() launches the engine's compiled step
    alone (no host work between launches), reset() puts every row back at `context` tokens.
    A context manager: the slots and pages go back on exit."""

    def __init__(self, engine, batch: int, pages_per_request: int, context: int, lora_ids=None):
        self.worker, self.kv, self.context = engine.worker, engine.scheduler.kv, context
        w = self.worker
        self.slots = [self.kv.alloc_slot() for _ in range(batch)]
        self.pages = [self.kv.allocator.alloc(pages_per_request) for _ in range(batch)]
        greedy = [(SamplingParams(), 0)] * batch
        self.inputs = jax.device_put(decode_inputs(w, self.slots, self.pages, greedy))
        self.lora = (
            lora_batch(w.lora, decode_lora_slots(self.inputs[0].shape[0], lora_ids)) if w.lora is not None else None
        )

    def decode(self):
        return self.worker.decode_arrays(*self.inputs, "greedy", self.lora).ints

    def reset(self) -> None:
        w = self.worker
        c = w.state.carry
        w.state = w.state._replace(carry=c._replace(seq_len=c.seq_len.at[jnp.asarray(self.slots)].set(self.context)))

    def step_ms(self, repeats: int = 3) -> float:
        """Median device time of one step: 10 back-to-back launches per repeat, each repeat
        from `context` tokens."""
        self.reset()
        jax.block_until_ready(self.decode())
        times = []
        for _ in range(repeats):
            self.reset()
            times.append(timed(self.decode, 10, 1))
        return float(np.median(times)) * 1e3

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for s in self.slots:
            self.kv.free_slot(s)
        for p in self.pages:
            self.kv.allocator.free(p)


# ---- results ------------------------------------------------------------------------------------


def git_commit() -> str:
    """The commit benchmarked: JSPEC_COMMIT first (the GPU machine's copy of the tree has no
    .git), else the repo's HEAD."""
    if os.environ.get("JSPEC_COMMIT"):
        return os.environ["JSPEC_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL, cwd=REPO_ROOT
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def result_header(
    name: str, settings: dict | None = None, *, device: str | None = None, server: dict | None = None
) -> dict:
    """The fields every result JSON starts with. device: a description recorded instead of the
    device's kind. server: what a server reported (/get_server_info) when the figures are its:
    its device and jax version go in, and this process never starts a backend of its own (on a
    GPU that would take memory from the server)."""
    if server is not None:
        device, backend, version = server.get("device_kind"), server.get("backend"), server.get("jax_version")
    else:
        device, backend, version = device or jax.devices()[0].device_kind, jax.default_backend(), jax.__version__
    return {
        "name": name,
        "device": device,
        "backend": backend,
        "jax_version": version,
        "commit": git_commit(),
        "settings": settings if settings is not None else {},
    }


class Results:
    """One benchmark's JSON, out/<file_name or name>.json: result_header, then the script's
    figures (rows, ...). Scripts write() after every row, so a run cut short still leaves what
    it measured."""

    def __init__(self, out: str, name: str, settings: dict | None = None, *, file_name: str | None = None, **header):
        file_name = file_name or name
        self.path = os.path.join(out, file_name if file_name.endswith(".json") else file_name + ".json")
        self.header = result_header(name, settings, **header)

    def write(self, **figures) -> str:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        # Through a temporary file: a run killed mid-write keeps the previous rows' JSON whole.
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**self.header, **figures}, f, indent=1)
        os.replace(tmp, self.path)
        return self.path
