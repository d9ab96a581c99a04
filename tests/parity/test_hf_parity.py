"""jspec logits equal HF transformers' (float32) for checkpoints that transformers itself wrote:
a prefill of every prompt position of 3 prompts, then 12 greedy decode steps through the paged
KV cache (every family and feature of HF_VARIANTS: windows narrower than the prompts, RoPE
positions past the original context)."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import HF_VARIANTS, hf_logits_many, hf_make_checkpoints, requires_hf
from support.parity import forward_logits, rel_err

from jspec.checkpoint.loader import load_model
from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.pool import create_kv_pool
from jspec.worker.inputs import SeqChunk, build_forward_batch

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

    # Prefill both prompts in one ragged batch, logits at every position.
    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=PAGE_SIZE, num_pages=48
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
        batch, mode = build_forward_batch(chunks, page_size=PAGE_SIZE, num_pages=48)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend=backend))
        for i in range(len(prompts)):
            got = np.asarray(out.logits[i])
            want = ref["decode_logits"][i][step]
            assert rel_err(got, want) < 1e-4, f"{variant} decode step {step} prompt {i}"
            assert int(np.argmax(got)) == int(ref["generated"][i][step + 1])
