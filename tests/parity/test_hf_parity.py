"""jspec logits equal HF transformers' (float32) for checkpoints that transformers itself wrote:
a prefill of every prompt position, then 8 decode steps through the paged KV cache."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import HF_VARIANTS, hf_logits, hf_make_checkpoints, requires_hf
from support.parity import forward_logits, rel_err

from jspec.checkpoint.loader import load_model
from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.pool import create_kv_pool
from jspec.worker.inputs import SeqChunk, build_forward_batch

PAGE_SIZE = 4
DECODE_STEPS = 8
BACKEND = "pallas"


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    return hf_make_checkpoints(tmp_path_factory.mktemp("hf"))


@requires_hf
@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_logits_match_transformers(hf_checkpoints, variant):
    path = hf_checkpoints[variant]["path"]
    cfg, params = load_model(path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (11, 6)]
    ref = hf_logits(path, prompts, decode_steps=DECODE_STEPS)

    alloc = PageAllocator(32)
    kv = create_kv_pool(cfg, 32, PAGE_SIZE, jnp.float32)
    pages = [alloc.alloc(-(-(len(p) + DECODE_STEPS + 1) // PAGE_SIZE)) for p in prompts]

    # Prefill both prompts in one ragged batch, logits at every position.
    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=PAGE_SIZE, num_pages=32
    )
    T = batch.tokens.shape[0]
    batch = batch._replace(logits_indices=np.arange(T, dtype=np.int32))
    kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend=BACKEND))
    starts = batch.query_start
    for i, p in enumerate(prompts):
        got = np.asarray(out.logits[starts[i] : starts[i] + len(p)])
        assert rel_err(got, ref["prefill_logits"][i]) < 1e-4, f"{variant} prefill prompt {i}"

    # Decode HF's own greedy tokens one at a time through the paged cache.
    for step in range(DECODE_STEPS):
        chunks = [SeqChunk([int(ref["generated"][i][step])], len(p) + step, pages[i]) for i, p in enumerate(prompts)]
        batch, mode = build_forward_batch(chunks, page_size=PAGE_SIZE, num_pages=32)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend=BACKEND))
        for i in range(len(prompts)):
            got = np.asarray(out.logits[i])
            want = ref["decode_logits"][i][step]
            assert rel_err(got, want) < 1e-4, f"{variant} decode step {step} prompt {i}"
            assert int(np.argmax(got)) == int(ref["generated"][i][step + 1])
