"""An engine on an accelerator that reports its memory sizes its pool from what is left after
the weights and its measured programs (the CPU reports none: its memory is stood in for here)."""

import gc

import jax
import pytest
from support.models import eagle_draft, tiny_model

import jspec
import jspec.engine.build as build_module
import jspec.worker.plain as plain_module
from jspec.checkpoint.tiny import make_tiny_model
from jspec.engine.sizing import MAX_RUNNING_REQUESTS, PROBE_PAGES

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=5, context=128)


def test_pool_is_sized_from_the_device_after_measuring_the_programs(tiny, monkeypatch):
    monkeypatch.setattr(build_module, "device_memory_bytes", lambda: 2 * GiB)
    kw = dict(page_size=16, attention_backend="reference", chunked_prefill_size=64, precompile_bs_paddings=[1, 256])
    engine = jspec.Engine(tiny, **kw)
    plan, w = engine.plan, engine.worker
    assert plan.pool_source.startswith("device:") and "measured peak" in plan.pool_source
    assert w.num_pages == plan.pages > PROBE_PAGES and w.state.target_kv.num_pages == plan.pages
    assert w.max_slots == plan.max_running_requests == MAX_RUNNING_REQUESTS
    assert engine.scheduler.kv.allocator.num_usable == plan.pages - 1
    # The probe's programs were for the two-page pool: none survives the resize; the first step
    # over the real pool (the largest greedy decode) ran at start-up.
    assert list(w.programs.labels.values()) == ["decode B=256 greedy"]
    assert engine.model.params is None  # the worker holds the weights; the engine keeps no copy
    params = jspec.SamplingParams(max_new_tokens=6, ignore_eos=True)
    fixed = jspec.Engine(tiny, max_total_tokens=4096, max_running_requests=8, **kw)
    prompts = [[1, 2, 3], list(range(40))]
    assert [o.token_ids for o in engine.generate(prompts, params)] == [
        o.token_ids for o in fixed.generate(prompts, params)
    ]
    assert fixed.plan.pool_source == "max_total_tokens"
    engine.check_idle_no_leaks()


def test_adaptive_speculation_measures_every_draft_shape(tiny, monkeypatch, caplog):
    """A wider draft shape than the configured one is a larger program: sizing measures each."""
    monkeypatch.setattr(build_module, "device_memory_bytes", lambda: 2 * GiB)
    dcfg, draft = eagle_draft(tiny)
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4, adaptive=True)
    # Four rows and 64-token chunks: the measured programs are the same kinds, smaller.
    kw = dict(max_running_requests=4, chunked_prefill_size=64, attention_backend="reference")
    with caplog.at_level("INFO", logger="jspec"):
        engine = jspec.Engine(tiny, speculative=spec, draft=(dcfg, draft), **kw)
    measured = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("programs measured"))
    B = engine.plan.max_running_requests
    assert all(f"decode B={B} greedy shape {s}:" in measured for s in range(1, engine.worker.num_shapes))
    assert engine.worker.num_shapes > 1 and engine.plan.pool_source.startswith("device:")


def test_the_loaders_stacked_layers_are_gone_before_the_pool_is_created(tmp_path, monkeypatch):
    """The GPU runs the layers from per-layer arrays, device copies of the loader's stacks: the
    stacks must be dropped before the pool is created, or the device holds the layers twice
    beside a pool sized as if it did not."""

    def live_bytes():
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays())

    at_pool = []
    create = plain_module.create_kv_pool
    monkeypatch.setattr(
        plain_module, "create_kv_pool", lambda *a, **k: (at_pool.append(live_bytes()), create(*a, **k))[1]
    )
    before = live_bytes()
    # Built from a checkpoint, as the server builds it: the loader's weights are the engine's alone.
    engine = jspec.Engine(
        make_tiny_model(str(tmp_path / "m"), seed=5),
        layer_loop="unrolled",
        context_length=128,
        max_total_tokens=256,
        attention_backend="reference",
    )
    w = engine.worker
    assert isinstance(w.params["layers"], list)
    weights = sum(x.nbytes for x in jax.tree.leaves(w.params))
    layers = sum(x.nbytes for x in jax.tree.leaves(w.params["layers"]))
    assert at_pool[0] - before < weights + layers / 2


def test_a_pool_that_could_not_be_allocated_is_reported_as_the_pool(tiny, monkeypatch):
    """Dispatch is asynchronous: a pool whose allocation failed would otherwise fail the first
    step that reads it, under that step's name."""

    def out_of_memory(x):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")

    monkeypatch.setattr(build_module.jax, "block_until_ready", out_of_memory)
    with pytest.raises(MemoryError, match=r"the KV pool of 4096 tokens .* max_total_tokens"):
        jspec.Engine(tiny, max_total_tokens=4096, attention_backend="reference")
