"""DeepSeek-V3 and V2 (MLA, grouped MoE, YaRN) equal HF transformers in float32, on tiny
checkpoints that transformers' own DeepseekV3ForCausalLM (MTP layer beside it) and
DeepseekV2ForCausalLM wrote: prefill
logits at every position through the expanded form, then decode steps through the absorbed
form over the paged latent cache (the Pallas MLA decode kernel, interpreted), and HF's greedy
tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import hf_logits, hf_make_checkpoints, requires_hf
from support.parity import forward_logits, rel_err

from jspec.checkpoint.loader import load_model, param_shapes
from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.pool import create_kv_pool
from jspec.worker.inputs import SeqChunk, build_forward_batch

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

DECODE_STEPS = 6


# V3 (q LoRA, sigmoid router with correction bias, its MTP layer beside it) and V2-Lite's
# switches (q_proj, softmax group-limited routing, no renormalisation).
VARIANTS = {"deepseek_v3": ("deepseek_v3", {}, {"mtp_layers": 1}), "deepseek_v2": ("deepseek_v2", {})}


@pytest.fixture(scope="module")
def deepseek_checkpoints(tmp_path_factory):
    return hf_make_checkpoints(tmp_path_factory.mktemp("hf"), VARIANTS)


@requires_hf
@pytest.mark.parametrize("variant,page_size", [("deepseek_v3", 4), ("deepseek_v2", 1)])
def test_deepseek_matches_transformers(deepseek_checkpoints, variant, page_size):
    path = deepseek_checkpoints[variant]["path"]
    cfg, params = load_model(path, dtype=jnp.float32)
    assert cfg.deepseek is not None and cfg.deepseek.yarn_factor == 4.0
    assert cfg.num_mtp_layers == (1 if variant == "deepseek_v3" else 0)
    # The loader's layout is the one param_shapes (dummy loads, random weights) describes.
    assert jax.tree.map(lambda a: tuple(a.shape), params) == param_shapes(cfg)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (11, 6)]
    ref = hf_logits(path, prompts, decode_steps=DECODE_STEPS)
    pages_total = 64
    alloc = PageAllocator(pages_total)
    kv = create_kv_pool(cfg, pages_total, page_size, jnp.float32)
    assert kv.k.shape[-2:] == (1, cfg.deepseek.latent_dim) and kv.v.shape[-1] == 0
    pages = [alloc.alloc(-(-(len(p) + DECODE_STEPS + 1) // page_size)) for p in prompts]
    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=page_size, num_pages=pages_total
    )
    T = batch.tokens.shape[0]
    batch = batch._replace(logits_indices=np.arange(T, dtype=np.int32))
    kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="reference"))
    starts = batch.query_start
    for i, p in enumerate(prompts):
        got = np.asarray(out.logits[starts[i] : starts[i] + len(p)])
        assert rel_err(got, ref["prefill_logits"][i]) < 1e-4, f"prefill prompt {i}"
    for step in range(DECODE_STEPS):
        chunks = [SeqChunk([int(ref["generated"][i][step])], len(p) + step, pages[i]) for i, p in enumerate(prompts)]
        batch, mode = build_forward_batch(chunks, page_size=page_size, num_pages=pages_total)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="pallas"))
        for i in range(len(prompts)):
            got = np.asarray(out.logits[i])
            assert rel_err(got, ref["decode_logits"][i][step]) < 1e-4, f"decode step {step} prompt {i}"
            assert int(np.argmax(got)) == int(ref["generated"][i][step + 1])
