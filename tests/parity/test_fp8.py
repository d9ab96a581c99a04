"""FP8 checkpoints of every published layout: jspec's logits equal HF transformers' on the same
dequantised weights, and greedy tokens equal jspec's own run of the dequantised checkpoint.

Tolerance: jspec multiplies the FP8 weight's f32 product by the scales, HF multiplies f32 weights
that already hold them; both in f32, so they differ by summation order only (rel. 1e-5 seen,
1e-4 asserted, as for the unquantized parity tests)."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import requires_hf, run_oracle
from support.parity import forward_logits, rel_err

import jspec
from jspec.checkpoint.loader import load_model
from jspec.checkpoint.tiny import make_tiny_model
from jspec.kvcache.allocator import PageAllocator
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.quant import Fp8Weight
from jspec.testing.fp8 import LAYOUTS, write_fp8_checkpoint
from jspec.worker.inputs import SeqChunk, build_forward_batch

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

PAGE_SIZE = 4
DECODE_STEPS = 6
# Blocks smaller than DeepSeek's 128 so that the tiny model's projections have several.
BLOCK = (32, 32)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_model(str(root / "src"), "qwen2", seed=3)  # q/k/v biases beside the FP8 weights
    dirs = {}
    for layout in LAYOUTS:
        fp8, deq = root / layout, root / f"{layout}-dequantised"
        write_fp8_checkpoint(src, fp8, layout, block=BLOCK, dequantized_dir=deq)
        dirs[layout] = (str(fp8), str(deq))
    return dirs


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(0, 256, n))) for n in (9, 5)]


@pytest.fixture(scope="module")
def hf_reference(checkpoints, prompts):
    """HF's float32 logits for every dequantised checkpoint, in one oracle run."""
    jobs = [
        {"name": layout, "mode": "logits", "checkpoint": deq, "prompts": prompts, "decode_steps": DECODE_STEPS}
        for layout, (_, deq) in checkpoints.items()
    ]
    return run_oracle({"jobs": jobs})


@requires_hf
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_logits_match_transformers_on_the_dequantised_weights(checkpoints, hf_reference, prompts, layout):
    cfg, params = load_model(checkpoints[layout][0], dtype=jnp.float32)
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        leaf = params["layers"][name]
        assert isinstance(leaf, Fp8Weight) and leaf.w.dtype == jnp.float8_e4m3fn
    blocks = params["layers"]["w_down"].in_blocks
    assert blocks == (cfg.intermediate_size // BLOCK[1] if "block" in layout else 1)
    ref = {k.split("/", 1)[1]: v for k, v in hf_reference.items() if k.startswith(layout + "/")}

    alloc = PageAllocator(32)
    kv = create_kv_pool(cfg, 32, PAGE_SIZE, jnp.float32)
    pages = [alloc.alloc(-(-(len(p) + DECODE_STEPS + 1) // PAGE_SIZE)) for p in prompts]
    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=PAGE_SIZE, num_pages=32
    )
    batch = batch._replace(logits_indices=np.arange(batch.tokens.shape[0], dtype=np.int32))
    kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="reference"))
    for i, p in enumerate(prompts):
        got = np.asarray(out.logits[batch.query_start[i] : batch.query_start[i] + len(p)])
        assert rel_err(got, ref[f"prefill_logits_{i}"]) < TOLERANCE, f"{layout} prefill prompt {i}"
    for step in range(DECODE_STEPS):
        chunks = [SeqChunk([int(ref[f"generated_{i}"][step])], len(p) + step, pages[i]) for i, p in enumerate(prompts)]
        batch, mode = build_forward_batch(chunks, page_size=PAGE_SIZE, num_pages=32)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="reference"))
        for i in range(len(prompts)):
            assert rel_err(out.logits[i], ref[f"decode_logits_{i}"][step]) < TOLERANCE, f"{layout} step {step}"


def greedy(path, **kw):
    engine = jspec.Engine(
        path, page_size=4, max_total_tokens=400, max_running_requests=4, chunked_prefill_size=64, **kw
    )
    prompts = ["The FP8 cache", "def main():", "1 2 3 4 5"]
    outs = engine.generate(prompts, jspec.SamplingParams(max_new_tokens=32, ignore_eos=True))
    engine.check_idle_no_leaks()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp8_greedy_tokens_equal_the_dequantised_run(checkpoints, layout):
    """32 tokens x 3 prompts, the dequantised checkpoint run in f32 as the FP8 one."""
    fp8, deq = checkpoints[layout]
    assert greedy(fp8) == greedy(deq)
