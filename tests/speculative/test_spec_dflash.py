"""DFLASH speculative decoding is lossless and its draft state is the dense recompute's.

A permutation target with a hand-built drafter (support/dflash_models.py) that is right for the first
draft of every block and for the whole block at a fixed point, so iterations accept 1 or all
7 drafts. In one batch: greedy with logprobs, seeded sampling, and penalised greedy and
sampled rows; each equals the plain engine token for token (logprobs too). Every block
forward the engine runs is recorded and compared with the drafter recomputed from scratch
over the request's committed tokens: context features injected at the right positions,
through chunked prefill, accepts of every length, prefix-cache hits, retraction, pages 1 and 16,
overlap on and off, and blocks shortened or switched off by adaptive speculation.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.dflash_models import (
    FIXED,
    TARGET,
    agreeing_drafter,
    check_records,
    permutation_target,
    prompts,
    random_drafter,
    recorded_blocks,
)

import jspec
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.speculative.adaptive import Choice, CostTable

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

BLOCK = 8
NEW = 20
PROMPTS = prompts([5, 17, 30, 9], [FIXED[0], 3, 12, 20])
PARAMS = [
    SamplingParams(max_new_tokens=NEW, ignore_eos=True, return_logprob=True, top_logprobs_num=3),
    SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(max_new_tokens=NEW, ignore_eos=True, frequency_penalty=0.3),
    SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=5, presence_penalty=0.5),
]


def settings(page_size: int, overlap: bool) -> dict:
    """Room for 127 pages, 4 requests, every decode padded to 4 rows (one program per shape)."""
    return dict(
        page_size=page_size,
        max_total_tokens=127 * page_size,
        max_running_requests=4,
        precompile_bs_paddings=[4],
        max_top_logprobs=3,
        attention_backend="reference",
        disable_overlap_schedule=not overlap,
    )


@pytest.fixture(scope="module")
def models():
    return permutation_target(), agreeing_drafter(BLOCK)


@pytest.fixture(scope="module")
def plain(models):
    target, _ = models
    return jspec.Engine((TARGET, target), **settings(16, True)).generate(PROMPTS, PARAMS)


def assert_same(out, base):
    for o, b in zip(out, base):
        assert o.token_ids == b.token_ids
    np.testing.assert_allclose(out[0].logprobs, base[0].logprobs, atol=1e-4)
    assert [[t for t, _ in r] for r in out[0].top_logprobs] == [[t for t, _ in r] for r in base[0].top_logprobs]


def test_outputs_equal_plain_and_drafts_equal_the_dense_drafter(models, plain):
    target, (dcfg, dparams) = models
    with recorded_blocks() as records:
        engine = jspec.Engine(
            (TARGET, target), speculative=SpecConfig("DFLASH"), draft=(dcfg, dparams), **settings(16, True)
        )
        assert engine.worker.method.spec.shape == (BLOCK - 1, 1, BLOCK)  # the drafter's own block
        # Over-allocation stays inside the pages handed out: the others keep their poison.
        poison = 1e4
        state = engine.worker.state
        engine.worker.state = state._replace(
            target_kv=jax.tree.map(lambda a: jnp.full_like(a, poison), state.target_kv),
            draft=jax.tree.map(lambda a: jnp.full_like(a, poison), state.draft),
        )
        handed_out, alloc = set(), engine.scheduler.kv.allocator.alloc
        engine.scheduler.kv.allocator.alloc = lambda n: handed_out.update(pages := alloc(n)) or pages
        out = engine.generate(PROMPTS, PARAMS)
        assert_same(out, plain)
        # The longest unpenalised prompt again: its first page comes from the prefix cache.
        before = engine.scheduler.prefilled_tokens
        again = engine.generate(PROMPTS[1:2], PARAMS[1:2])
        assert again[0].token_ids == plain[1].token_ids
        assert engine.scheduler.prefilled_tokens - before < len(PROMPTS[1])
    engine.check_idle_no_leaks()
    untouched = sorted(set(range(1, engine.worker.state.target_kv.num_pages)) - handed_out)
    assert len(untouched) > 10
    for pool in (engine.worker.state.target_kv, engine.worker.state.draft):
        assert all(bool(jnp.all(np.asarray(c)[:, untouched] == poison)) for c in pool)
    accept = [o.mean_accept_length for o in out]
    print(f"DFLASH: mean accept lengths {accept}")
    assert accept[0] >= 0.9 * BLOCK and min(accept[1:]) >= 1.5  # drafts used, not just tolerated
    sequences = [p + o.token_ids for p, o in zip(PROMPTS, out)]
    assert check_records(records, sequences, TARGET, target, dcfg, dparams) >= 15


def test_shortened_block_and_off_switching_with_retraction_equal_plain(models, plain):
    """A block of 4 of the drafter's 8 and speculation off, alternating (off twice in a row:
    the context must stay current without drafting), some iterations with rows opted out, at
    page size 1 without overlap, prompts prefilled in chunks of 16 tokens, and a pool too small
    for the four requests: one is retracted and prefilled again."""
    target, (dcfg, dparams) = models
    spec = SpecConfig("DFLASH", num_draft_tokens=4, adaptive=True, adaptive_shapes="0,1,1")
    with recorded_blocks() as records:
        kw = {**settings(1, False), "max_total_tokens": 96, "chunked_prefill_size": 16}
        engine = jspec.Engine((TARGET, target), speculative=spec, draft=(dcfg, dparams), **kw)
        assert [m.spec.shape for m in engine.worker.methods] == [(3, 1, 4), (0, 1, 1)]
        # Rows opted out besides (the ragged verify): every other row verifies its root alone.
        cycle = itertools.cycle([0, "ragged", 1, 1, 0, 1, "ragged"])
        engine.adaptive.costs = CostTable({}, "unused: the shapes are forced")
        ragged = []

        def choose(alphas, bucket, ready=None):
            c = next(cycle)
            if c != "ragged":
                return Choice(c)
            ragged.append(len(alphas) > 1)
            return Choice(0, [i % 2 == 1 for i in range(len(alphas))]) if len(alphas) > 1 else Choice(0)

        engine.adaptive.choose = choose
        out = engine.generate(PROMPTS, PARAMS)
    engine.check_idle_no_leaks()
    assert engine.scheduler.num_retractions > 0 and sum(ragged) >= 2
    assert_same(out, plain)
    assert out[0].mean_accept_length > 1.5
    sequences = [p + o.token_ids for p, o in zip(PROMPTS, out)]
    assert {len(r[0]) for r in records} == {4}
    assert check_records(records, sequences, TARGET, target, dcfg, dparams) >= 8


def test_refusals(models):
    target, (dcfg, dparams) = models
    draft = (dcfg, dparams)
    with pytest.raises(ValueError, match="DFLASH drafts one chain per block: eagle_topk"):
        SpecConfig("DFLASH", eagle_topk=2, num_draft_tokens=6)
    with pytest.raises(ValueError, match="each adaptive shape's topk"):
        SpecConfig("DFLASH", adaptive=True, adaptive_shapes="5,4,8 0,1,1")  # a tree
    # By default the shorter blocks this drafter (block 8) holds, one chain each, and off.
    adaptive = jspec.Engine((TARGET, target), speculative=SpecConfig("DFLASH", adaptive=True), draft=draft)
    assert [m.spec.shape for m in adaptive.worker.methods] == [(7, 1, 8), (3, 1, 4), (0, 1, 1)]
    with pytest.raises(ValueError, match="an adaptive shape"):
        jspec.Engine(
            (TARGET, target), speculative=SpecConfig("DFLASH", adaptive=True, adaptive_shapes="15,1,16"), draft=draft
        )
    with pytest.raises(ValueError, match="at most the drafter's block of 8 tokens"):
        jspec.Engine((TARGET, target), speculative=SpecConfig("DFLASH", num_draft_tokens=16), draft=draft)
    assert SpecConfig("DFLASH", num_draft_tokens=5).shape == (4, 1, 5)
    wide = random_drafter(dataclasses.replace(TARGET, hidden_size=32), target_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="does not fit the target"):
        jspec.Engine((TARGET, target), speculative=SpecConfig("DFLASH"), draft=wide)


def test_iteration_lowers_for_cuda(models, monkeypatch):
    """The whole DFLASH iteration (block forward through the Pallas extend kernel with its full
    block mask, verify, injection) lowers for an H200 in bfloat16: interpret mode hides GPU
    lowering errors."""
    import functools

    from support.lowering import lower_for_cuda
    from support.spec_steps import iteration_args

    import jspec.kernels.backend
    from jspec.speculative.dflash import DFlashMethod
    from jspec.speculative.steps import spec_decode_step

    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)  # kernels as on the GPU
    target, (dcfg, dparams) = models
    method = DFlashMethod(SpecConfig("DFLASH", num_draft_tokens=BLOCK), dcfg)
    args = iteration_args(
        method, TARGET, target, dparams, rows=4, pages=32, page_size=16, table_width=4, dtype=jnp.bfloat16
    )
    step = functools.partial(spec_decode_step, cfg=TARGET, method=method, backend="pallas", sampling="greedy")
    text = lower_for_cuda(step, *args).as_text()
    assert "bf16" in text and text.count("__gpu$xla.gpu.triton") >= 2  # the block's and the verify's kernels


def test_iteration_copies_no_pool(models):
    """The compiled iteration updates the donated pools in place: its temporaries stay far below
    one pool (a block forward whose written pool were dropped would copy the whole draft pool
    every iteration, ~90 ms at 512k tokens on the CPU)."""
    import functools

    from support.spec_steps import iteration_args

    from jspec.speculative.dflash import DFlashMethod
    from jspec.speculative.steps import spec_decode_step

    target, (dcfg, dparams) = models
    method = DFlashMethod(SpecConfig("DFLASH", num_draft_tokens=BLOCK), dcfg)
    args = iteration_args(
        method, TARGET, target, dparams, rows=4, pages=4096, page_size=16, table_width=4, dtype=jnp.float32
    )
    state = args[2]
    step = functools.partial(spec_decode_step, cfg=TARGET, method=method, backend="reference", sampling="greedy")
    compiled = jax.jit(step, donate_argnames=("state",)).lower(*args).compile()
    pool = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.draft))
    assert compiled.memory_analysis().temp_size_in_bytes < pool / 8
