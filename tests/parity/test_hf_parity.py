"""jspec logits equal HF transformers' (float32) for checkpoints that transformers itself wrote:
a prefill of every prompt position of 3 prompts, then 12 greedy decode steps through the paged
KV cache (every family and feature of HF_VARIANTS: windows narrower than the prompts, RoPE
positions past the original context)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import HF_VARIANTS, hf_logits_many, hf_make_checkpoints, requires_hf
from support.models import draft_config
from support.parity import forward_logits, rel_err

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.eagle_config import tiny_capture_layers
from jspec.checkpoint.loader import load_model
from jspec.checkpoint.mxfp4 import FP4_E2M1
from jspec.config.spec import SpecConfig
from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.pool import create_kv_pool
from jspec.models.llama import dense_forward
from jspec.worker.inputs import SeqChunk, build_forward_batch

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

PAGE_SIZE = 4
DECODE_STEPS = 12
# The Pallas kernels (interpreted: slow to compile) where they have something new to show;
# tests/kernels/ checks them against the reference everywhere else.
PALLAS_VARIANTS = {"llama", "llama3_rope", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_tied"}
PALLAS_VARIANTS |= {"mistral_window", "gemma2", "gpt_oss"}  # windows; soft-capping and sinks in windows


VOCAB = 320  # every variant's (tests/support/hf_oracle.py)
PROMPTS = [list(map(int, np.random.default_rng(0).integers(0, VOCAB, n))) for n in (11, 6, 9)]


@pytest.fixture(scope="module")
def hf_references(tmp_path_factory):
    """Every variant's checkpoint and HF's logits for it, in two oracle runs."""
    ckpts = hf_make_checkpoints(tmp_path_factory.mktemp("hf"))
    refs = hf_logits_many({name: c["path"] for name, c in ckpts.items()}, PROMPTS, decode_steps=DECODE_STEPS)
    return {name: (ckpts[name]["path"], refs[name]) for name in ckpts}


@requires_hf
@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_logits_match_transformers(hf_references, variant):
    path, ref = hf_references[variant]
    cfg, params = load_model(path, dtype=jnp.float32)
    assert cfg.vocab_size == VOCAB
    prompts = PROMPTS
    backend = "pallas" if variant in PALLAS_VARIANTS else "reference"

    alloc = PageAllocator(48)
    kv = create_kv_pool(cfg, 48, PAGE_SIZE, jnp.float32)
    pages = [alloc.alloc(-(-(len(p) + DECODE_STEPS + 1) // PAGE_SIZE)) for p in prompts]
    # Every batch's page table as wide as the longest sequence gets: the decode steps then share
    # one program instead of compiling another each time the table outgrows a power of two.
    width = max(map(len, pages))

    # Prefill both prompts in one ragged batch, logits at every position.
    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=PAGE_SIZE, num_pages=48, min_pages=width
    )
    T = batch.tokens.shape[0]
    batch = batch._replace(logits_indices=np.arange(T, dtype=np.int32))
    kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend=backend))
    starts = batch.query_start
    for i, p in enumerate(prompts):
        got = np.asarray(out.logits[starts[i] : starts[i] + len(p)])
        assert rel_err(got, ref["prefill_logits"][i]) < 1e-4, f"{variant} prefill prompt {i}"

    # Decode HF's own greedy tokens one at a time through the paged cache.
    for step in range(DECODE_STEPS):
        chunks = [SeqChunk([int(ref["generated"][i][step])], len(p) + step, pages[i]) for i, p in enumerate(prompts)]
        batch, mode = build_forward_batch(chunks, page_size=PAGE_SIZE, num_pages=48, min_pages=width)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend=backend))
        for i in range(len(prompts)):
            got = np.asarray(out.logits[i])
            want = ref["decode_logits"][i][step]
            assert rel_err(got, want) < 1e-4, f"{variant} decode step {step} prompt {i}"
            assert int(np.argmax(got)) == int(ref["generated"][i][step + 1])


@requires_hf
@pytest.mark.parametrize("variant", ["gpt_oss", "phi3", "gemma2", "qwen2"])
def test_per_layer_load_equals_the_stacked_one(hf_references, variant):
    """The loader's per-layer arrays (one GPU's layout, built without a stacked copy) for
    checkpoints transformers wrote: gpt-oss's experts, Phi-3's fused projections, Gemma's norm
    offset, Qwen2's biases equal the stacked load's rows."""
    path, _ = hf_references[variant]
    cfg, stacked = load_model(path, dtype=jnp.float32)
    _, per_layer = load_model(path, dtype=jnp.float32, per_layer=True)
    assert isinstance(per_layer["layers"], list) and len(per_layer["layers"]) == cfg.num_layers
    for i, lp in enumerate(per_layer["layers"]):
        want = (
            stacked["layers"][i]
            if isinstance(stacked["layers"], list)
            else jax.tree.map(lambda a: a[i], stacked["layers"])
        )
        assert set(lp) == set(want)
        for name in lp:
            np.testing.assert_array_equal(
                np.asarray(lp[name]), np.asarray(want[name]), err_msg=f"{variant} layer {i} {name}"
            )


# NGRAM and a random EAGLE-3 head on each family past Llama, at both page sizes, chains and
# trees; one of them on each window and RoPE variant; gpt-oss under all three methods (its
# STANDALONE draft is its own first layer, windowed, so it drafts chains). Drafts are 2 deep:
# below every window here.
SPECULATION_CASES = [  # (variant, method, page size, topk)
    ("gemma", "NGRAM", 1, 1),
    ("gemma", "EAGLE3", 16, 2),
    ("gemma2", "NGRAM", 16, 2),
    ("gemma2", "EAGLE3", 1, 1),
    ("gemma3", "NGRAM", 1, 1),
    ("gemma3", "EAGLE3", 16, 2),
    ("phi3", "NGRAM", 16, 2),
    ("phi3", "EAGLE3", 1, 1),
    ("olmo2", "NGRAM", 1, 1),
    ("olmo2", "EAGLE3", 16, 2),
    ("granite", "NGRAM", 16, 2),
    ("granite", "EAGLE3", 1, 1),
    ("smollm3", "NGRAM", 1, 1),
    ("smollm3", "EAGLE3", 16, 2),
    ("llama_attention_bias", "NGRAM", 16, 2),
    ("llama_attention_bias", "EAGLE3", 1, 1),
    ("mistral_window", "NGRAM", 1, 1),
    ("qwen2_window", "EAGLE3", 1, 2),
    ("llama_linear_rope", "NGRAM", 16, 1),
    ("llama_dynamic_rope", "EAGLE3", 16, 2),
    ("qwen2_yarn_rope", "NGRAM", 1, 1),
    ("llama_longrope", "EAGLE3", 1, 2),
    ("gpt_oss", "NGRAM", 1, 2),
    ("gpt_oss", "EAGLE3", 16, 2),
    ("gpt_oss", "STANDALONE", 16, 1),
]


@requires_hf
@pytest.mark.parametrize("variant,method,page_size,topk", SPECULATION_CASES)
def test_speculation_keeps_transformers_greedy_tokens(hf_references, variant, method, page_size, topk):
    """Speculation on the checkpoint transformers wrote, with a random EAGLE-3 head or a one-layer
    draft of the same family (sinks, experts, its window): HF's own 12 greedy tokens."""
    path, ref = hf_references[variant]
    cfg, params = load_model(path, dtype=jnp.float32)
    draft = None
    if method == "NGRAM":
        spec = SpecConfig("NGRAM", num_draft_tokens=2 + topk, ngram_max_bfs_breadth=topk)
    else:
        spec = SpecConfig(method, num_steps=2, eagle_topk=topk, num_draft_tokens=None if topk == 1 else 4)
    if method == "EAGLE3":
        dcfg = dataclasses.replace(draft_config("EAGLE3", cfg), capture_layers=tiny_capture_layers(cfg.num_layers))
        draft = (dcfg, init_random_draft_params(dcfg, jax.random.key(2), std=0.2))
    if method == "STANDALONE":  # the target's first layer, weights included: right some of the time
        dcfg = dataclasses.replace(
            cfg, num_layers=1, sliding_windows=cfg.sliding_windows[:1], moe_layers=cfg.moe_layers[:1]
        )
        draft = (dcfg, {**params, "layers": jax.tree.map(lambda w: w[:1], params["layers"])})
    engine = jspec.Engine(
        path,
        speculative=spec,
        draft=draft,
        page_size=page_size,
        max_total_tokens=64 * page_size,
        max_running_requests=1,  # one batch shape: one decode program
        chunked_prefill_size=16,  # one prefill program
        attention_backend="reference",
    )
    out = jspec.generate(path, PROMPTS, max_new_tokens=DECODE_STEPS, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == [list(map(int, g[:DECODE_STEPS])) for g in ref["generated"]]
    assert all(o.spec_verify_ct >= 1 for o in out)
    if method == "STANDALONE":  # some drafts were right: the accepting path ran too
        assert sum(o.spec_verify_ct for o in out) < len(PROMPTS) * (DECODE_STEPS - 1)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, out, in] f32 -> the published MXFP4 (blocks [E, out, in / 32, 16], scales [E, out, in / 32]):
    each block of 32 scaled by a power of two so that its largest value fits e2m1's 6, then
    rounded to the nearest e2m1 code."""
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(blocks).max(axis=-1), 1e-30)
    exponent = np.ceil(np.log2(amax / 6.0)).astype(np.int32)
    scaled = blocks / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_E2M1).argmin(axis=-1).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).astype(np.uint8)


@requires_hf
def test_mxfp4_experts_match_transformers(hf_references, tmp_path):
    """gpt-oss's published MXFP4 expert layout: transformers dequantises the same blocks and
    scales itself (its CPU path), and the prefill logits agree."""
    from safetensors.numpy import load_file, save_file

    path, _ = hf_references["gpt_oss"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name), 1, 2))  # stored [E, in, out]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "dequantize": True}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    ref = hf_logits_many({"mxfp4": tmp_path}, PROMPTS, decode_steps=0)["mxfp4"]
    cfg, params = load_model(tmp_path, dtype=jnp.float32)
    unquantized = load_model(path, dtype=jnp.float32)[1]
    for i, p in enumerate(PROMPTS):
        got = np.asarray(dense_forward(params, cfg, jnp.asarray(p)))
        assert rel_err(got, ref["prefill_logits"][i]) < 1e-4, f"prompt {i}"
    # Rounding to FP4 moved the logits: the blocks were read, not the unquantised weights.
    moved = np.asarray(dense_forward(unquantized, cfg, jnp.asarray(PROMPTS[0])))
    assert rel_err(moved, ref["prefill_logits"][0]) > 1e-3
