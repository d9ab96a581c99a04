"""EAGLE / EAGLE-3 speculative decoding is lossless: greedy speculative output equals plain greedy.

Two extremes of acceptance are covered:
- random draft heads over a random target: nearly every draft is rejected;
- a one-hot "permutation" target (next token = pi(current token)) with draft heads
  built to compute the same function: every draft is accepted.
The measured acceptance is printed (pytest -s) and asserted, so it is visibly not zero.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import TARGET, draft_config, engine_settings, permutation_models, prompts

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.loader import init_random_params
from jspec.config.spec import SpecConfig

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


def run_both(target, dcfg, draft, spec, page_size, ps, max_new=12, backend="reference"):
    # The other speculative tests' settings: the plain engine's programs are theirs too.
    kw = {**engine_settings(page_size, overlap=True), "attention_backend": backend}
    base = jspec.generate(
        (TARGET, target), ps, max_new_tokens=max_new, ignore_eos=True, engine=jspec.Engine((TARGET, target), **kw)
    )
    engine = jspec.Engine((TARGET, target), speculative=spec, draft=(dcfg, draft), **kw)
    out = jspec.generate((TARGET, target), ps, max_new_tokens=max_new, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    for b, o in zip(base, out):
        assert o.token_ids == b.token_ids
        assert o.spec_verify_ct >= 1
    return np.mean([o.mean_accept_length for o in out])


# Each page size, chain and tree, both algorithms; the Pallas kernels (interpreted on the CPU,
# slow) in two cases, their own tests (test_kernels.py) cover them against the references.
CASES = [  # (algorithm, page_size, num_steps, topk, num_draft_tokens, backend)
    ("EAGLE", 16, 3, 1, None, "pallas"),
    ("EAGLE3", 1, 3, 1, None, "reference"),
    ("EAGLE", 1, 2, 4, 6, "reference"),
    ("EAGLE3", 16, 5, 4, 8, "pallas"),
    ("EAGLE", 16, 1, 1, None, "reference"),
    ("EAGLE3", 16, 4, 2, 7, "reference"),
    ("EAGLE3", 1, 1, 4, 4, "reference"),
]
# The random EAGLE-3 heads with a draft vocabulary of their own (48 of 64 tokens): a chain at
# page size 1 and a tree on the Pallas kernels. The other EAGLE-3 cases draft over the whole
# vocabulary, as the agreeing heads do, so that both tests run the same programs.
OWN_VOCAB = {CASES[1], CASES[3]}


@pytest.mark.parametrize("algorithm,page_size,steps,topk,ndt,backend", CASES)
def test_random_draft_is_lossless(algorithm, page_size, steps, topk, ndt, backend):
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    own_vocab = (algorithm, page_size, steps, topk, ndt, backend) in OWN_VOCAB
    dcfg = draft_config(algorithm, vocab=48 if own_vocab else None)
    draft = init_random_draft_params(dcfg, jax.random.key(2), std=0.2)
    spec = SpecConfig(algorithm, num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    acc = run_both(target, dcfg, draft, spec, page_size, prompts([3, 17, 30]), backend=backend)
    print(f"random draft {algorithm} steps={steps} topk={topk}: mean accept length {acc:.2f}")
    assert 1.0 <= acc < 1.5


@pytest.mark.parametrize("algorithm,page_size,steps,topk,ndt,backend", CASES)
def test_agreeing_draft_is_lossless_and_accepts_everything(algorithm, page_size, steps, topk, ndt, backend):
    target, dcfg, draft = permutation_models(algorithm)
    spec = SpecConfig(algorithm, num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    ps = prompts([2, 9, 21], seed=1)
    acc = run_both(target, dcfg, draft, spec, page_size, ps, max_new=3 * (steps + 1), backend=backend)
    print(f"agreeing draft {algorithm} steps={steps} topk={topk}: mean accept length {acc:.2f}")
    # Every iteration emits the full depth, except that the last one may be cut by max_new_tokens.
    assert acc >= 0.9 * (steps + 1) if steps > 1 else acc == 2.0


def test_over_allocation_never_writes_outside_reserved_pages():
    """Pages never handed to a request keep their poison after speculative generation."""
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    dcfg = draft_config("EAGLE3")
    draft = init_random_draft_params(dcfg, jax.random.key(2), std=0.2)
    spec = SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5)
    engine = jspec.Engine(
        (TARGET, target),
        speculative=spec,
        draft=(dcfg, draft),
        page_size=4,
        max_total_tokens=252,
        max_running_requests=4,
        attention_backend="reference",
    )
    runner = engine.worker
    poison = 1e4
    runner.state = runner.state._replace(
        target_kv=jax.tree.map(lambda a: jnp.full_like(a, poison), runner.state.target_kv),
        draft=jax.tree.map(lambda a: jnp.full_like(a, poison), runner.state.draft),
    )
    handed_out = set()
    allocator = engine.scheduler.kv.allocator
    alloc = allocator.alloc

    def recording_alloc(n):
        pages = alloc(n)
        handed_out.update(pages)
        return pages

    allocator.alloc = recording_alloc
    jspec.generate((TARGET, target), prompts([5, 13]), max_new_tokens=10, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    untouched = sorted(set(range(1, 64)) - handed_out)
    assert len(untouched) > 10
    for pool in (runner.state.target_kv, runner.state.draft):
        for cache in pool:
            assert bool(jnp.all(np.asarray(cache)[:, untouched] == poison))


@pytest.mark.parametrize("topk,ndt", [(1, 4), (4, 8)])
def test_iteration_updates_the_target_pool_in_place(topk, ndt):
    """The compiled iteration writes the donated target pool in place: its temporaries stay far
    below one pool leaf. A tree (topk > 1) also moves the accepted nodes' KV to their depths'
    positions, a read and a write of the same leaf that must not turn into a copy of it (an
    adaptive EAGLE-3 8B server's tree shape once needed a leaf-sized temporary on the GPU)."""
    import functools

    from support.spec_steps import iteration_args

    from jspec.speculative.registry import make_method
    from jspec.speculative.steps import spec_decode_step

    dcfg = draft_config("EAGLE3")
    spec = SpecConfig("EAGLE3", num_steps=3, eagle_topk=topk, num_draft_tokens=ndt)
    method, _ = make_method(spec, TARGET, draft=(dcfg, None))
    target = jax.eval_shape(lambda: init_random_params(TARGET, jax.random.key(0)))
    draft = jax.eval_shape(lambda: init_random_draft_params(dcfg, jax.random.key(1)))
    args = iteration_args(
        method, TARGET, target, draft, rows=4, pages=4096, page_size=16, table_width=8, dtype=jnp.float32
    )
    state = args[2]
    step = functools.partial(spec_decode_step, cfg=TARGET, method=method, backend="reference", sampling="greedy")
    compiled = jax.jit(step, donate_argnames=("state",)).lower(*args).compile()
    leaf = state.target_kv.k.size * state.target_kv.k.dtype.itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < leaf / 8
