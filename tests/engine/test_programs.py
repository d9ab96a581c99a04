"""The compiled programs: scanned and unrolled layer loops agree, the default server compiles a
bounded set, rare programs compile in the background, and a restart finds the persistent cache."""

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from support import REPO_ROOT
from support.models import tiny_model

import jspec
from jspec.layers.sampling import SAMPLING_MODES
from jspec.models.common import UnrolledStack
from jspec.worker.executables import program_key
from jspec.worker.programs import GPU_COMPILER_OPTIONS, abstract_args, prefill_key, warmup_jobs

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=5, context=256)


PROMPTS = [[1, 2, 3, 4, 5], [7] * 19, [9, 8]]
# 64-token prefill chunks hold every prompt here, and the warm-ups compile two prefill buckets, not four.
KW = dict(
    page_size=16, max_total_tokens=2032, max_running_requests=4, chunked_prefill_size=64, attention_backend="reference"
)


def greedy(engine):
    outs = engine.generate(PROMPTS, jspec.SamplingParams(max_new_tokens=12, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("spec", [None, "EAGLE3"])
def test_scanned_and_unrolled_layers_give_the_same_tokens(tiny, spec):
    from support.models import eagle_draft

    kw = dict(KW)
    if spec:
        kw.update(speculative=jspec.SpecConfig(spec, num_steps=3, eagle_topk=1), draft=eagle_draft(tiny))
    scanned = jspec.Engine(tiny, **kw)
    unrolled = jspec.Engine(tiny, layer_loop="unrolled", **kw)
    unrolled_stack = jspec.Engine(tiny, layer_loop="unrolled_stack", **kw)
    assert isinstance(scanned.worker.params["layers"], dict)
    assert isinstance(unrolled.worker.params["layers"], list)
    assert isinstance(unrolled_stack.worker.params["layers"], UnrolledStack)
    # One program argument per weight kind, as the scan's, not one per layer and kind.
    leaves = lambda e: len(jax.tree.leaves(e.worker.params))  # noqa: E731
    assert leaves(unrolled_stack) == leaves(scanned) < leaves(unrolled)
    assert greedy(scanned) == greedy(unrolled) == greedy(unrolled_stack)


@pytest.mark.parametrize("standalone,converted", [(False, False), (True, False), (False, True)])
def test_an_unrolled_engine_loads_its_layers_per_layer(tiny, monkeypatch, tmp_path, standalone, converted):
    """Given a checkpoint (HF's, or a jspec converted directory), an engine on the unrolled loop
    (one GPU's default) has the loader build per-layer arrays, a STANDALONE draft's too: no
    stacked leaf is copied out (and freed below the weights)."""
    import jspec.worker.base
    from jspec.checkpoint.loader import convert_checkpoint
    from jspec.config.load import LoadConfig

    def unstack_nothing(params):
        assert not isinstance(params["layers"], dict), "a stacked load was unstacked"
        return params

    monkeypatch.setattr(jspec.worker.base, "unstack_layers", unstack_nothing)
    kw = dict(KW, layer_loop="unrolled", context_length=256, load=LoadConfig(dtype="float32"))
    if standalone:
        kw["speculative"] = jspec.SpecConfig("STANDALONE", num_steps=2, eagle_topk=1, draft_model_path=tiny.path)
    path = convert_checkpoint(tiny.path, tmp_path / "converted", dtype="float32") if converted else tiny.path
    engine = jspec.Engine(path, **kw)
    assert isinstance(engine.worker.params["layers"], list)
    if standalone:
        assert isinstance(engine.worker.dparams["layers"], list)
    assert greedy(engine) == greedy(jspec.Engine(tiny, **KW))


def test_an_unknown_layer_loop_is_refused(tiny):
    with pytest.raises(ValueError, match="unknown layer_loop"):
        jspec.Engine(tiny, layer_loop="fused", **KW)


@pytest.mark.parametrize("spec", [None, "EAGLE3"])
def test_the_default_server_compiles_at_most_16_programs(tiny, spec):
    from support.models import eagle_draft

    # The server's defaults: 32 running requests, 512-token prefill chunks, both sampling programs.
    kw = dict(page_size=16, max_running_requests=32, chunked_prefill_size=512, max_top_logprobs=5)
    if spec:
        kw.update(speculative=jspec.SpecConfig(spec, num_steps=3, eagle_topk=1), draft=eagle_draft(tiny))
    engine = jspec.Engine(tiny, **kw)
    jobs = warmup_jobs(engine.worker)
    keys = [j.program.key for j in jobs]
    assert len(set(keys)) == len(keys) <= 16
    assert {k[1] for k in keys if k[0] == "prefill"} == {16, 64, 256, 512}


def test_prompt_logprob_prefills_compile_in_the_background_while_others_run(tiny):
    engine = jspec.Engine(tiny, **KW)  # the other tests' programs: warm-up compiles only what they did not
    engine.warmup(sampling_modes=("greedy",))
    plain = engine.add_request([1, 2, 3], jspec.SamplingParams(max_new_tokens=4, ignore_eos=True))
    scoring = jspec.SamplingParams(
        max_new_tokens=4, ignore_eos=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    scored = engine.add_request([4, 5, 6], scoring)
    scored_req = engine.scheduler.requests[scored]
    first = engine.scheduler.schedule()
    assert [r.rid for r in first.reqs] == [plain]  # the scored prompt waits for its program
    engine._inflight = engine._launch(first)
    done = {}
    while engine.has_work():
        for out in engine.step():
            done.setdefault(out.rid, []).extend(out.new_token_ids)
    assert len(done[plain]) == len(done[scored]) == 4
    reference = jspec.Engine(tiny, **KW).generate([[4, 5, 6]], scoring)[0]
    assert done[scored] == reference.token_ids
    assert len(reference.input_logprobs) == 3
    np.testing.assert_allclose(scored_req.input_logprobs[1:], reference.input_logprobs[1:], rtol=1e-5)
    engine.check_idle_no_leaks()


CACHE_PROBE = textwrap.dedent("""
    import sys, jax, jspec
    from jspec.checkpoint.model import with_context_length
    from jspec.worker import programs
    from jspec.checkpoint.tiny import make_tiny_model
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    model = with_context_length(jspec.load(make_tiny_model(sys.argv[2], seed=5)), 256)
    # One prefill chunk: its prefill and two decode programs, enough to show each is loaded whole.
    engine = jspec.Engine(model, page_size=16, max_total_tokens=1008, max_running_requests=2, attention_backend="reference",
                          chunked_prefill_size=16, compilation_cache_dir=sys.argv[1])
    n = engine.warmup(sampling_modes=("greedy",))
    tokens = engine.generate([[4, 5, 6]], jspec.SamplingParams(max_new_tokens=6))[0].token_ids
    print(n, events.count("/jax/compilation_cache/cache_hits"), programs.EXECUTABLES.loaded,
          programs.programs_loaded(), "-".join(map(str, tokens)))
""")


def test_a_restart_loads_its_programs_from_the_compilation_cache(tmp_path):
    """A second process loads every program whole (no tracing, no lowering) and emits the same
    tokens; without the stored executables, JAX's persistent cache still answers every compile."""
    cache = str(tmp_path / "xla")
    stored = os.path.join(cache, "jspec-executables")
    probe = [sys.executable, "-c", CACHE_PROBE, cache, str(tmp_path / "m")]

    def run():
        r = subprocess.run(probe, capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        n, jax_hits, whole, logged, tokens = r.stdout.split()[-5:]
        return int(n), int(jax_hits), int(whole), int(logged), tokens

    n1, jax_hits1, whole1, logged1, tokens1 = run()
    written, executables = sorted(os.listdir(cache)), sorted(os.listdir(stored))
    assert n1 > 0 and sum(name.startswith("jit_plain_") for name in written) == n1, written
    assert len(executables) == n1 and (jax_hits1, whole1, logged1) == (0, 0, 0)
    # The second process loads each program whole (JAX's cache answers only the small helper
    # programs outside the step programs).
    n2, jax_hits2, whole2, logged2, tokens2 = run()
    assert (n2, whole2, logged2, tokens2) == (n1, n1, n1, tokens1)
    assert sorted(os.listdir(cache)) == written and sorted(os.listdir(stored)) == executables
    # Without them (and with one file garbled, which is dropped), JAX's persistent cache answers;
    # what it answered is not stored again (a re-serialized copy would not run).
    for name in executables[1:]:
        os.remove(os.path.join(stored, name))
    with open(os.path.join(stored, executables[0]), "wb") as f:
        f.write(b"not an executable")
    n3, jax_hits3, whole3, logged3, tokens3 = run()
    assert (n3, whole3, logged3, tokens3) == (n1, 0, n1, tokens1) and jax_hits3 == jax_hits2 + n1
    assert os.listdir(stored) == []


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    names: tuple = ("q", "k")


@functools.partial(jax.jit, static_argnames=("shape",))
def scaled(x, shape):
    return x * shape.layers


def test_a_stored_programs_key_follows_everything_it_is_made_from(monkeypatch):
    """Same step, statics, arguments' types and settings: same key; any of them changed (a
    kernel switch read from the environment at trace time among them): a new one; a static
    that has no determining text (an arbitrary object): no key, so the program compiles
    through JAX."""
    monkeypatch.delenv("JSPEC_ROPE_KV", raising=False)
    x = jax.numpy.ones(3)
    key = program_key(scaled, {"shape": Shape(2)}, (x,), {})
    assert key == program_key(scaled, {"shape": Shape(2)}, (jax.numpy.zeros(3),), {})
    changed = [
        program_key(scaled, {"shape": Shape(3)}, (x,), {}),
        program_key(scaled, {"shape": Shape(2, ("q",))}, (x,), {}),
        program_key(scaled, {"shape": Shape(2)}, (jax.numpy.ones(4),), {}),
        program_key(scaled, {"shape": Shape(2)}, (jax.numpy.ones(3, jax.numpy.bfloat16),), {}),
        program_key(scaled, {"shape": Shape(2)}, (x,), GPU_COMPILER_OPTIONS),
        program_key(jax.jit(lambda x, shape: x), {"shape": Shape(2)}, (x,), {}),
    ]
    with jax.default_matmul_precision("highest"):
        changed.append(program_key(scaled, {"shape": Shape(2)}, (x,), {}))
    for value in ("xla", "pallas"):
        monkeypatch.setenv("JSPEC_ROPE_KV", value)
        changed.append(program_key(scaled, {"shape": Shape(2)}, (x,), {}))
    monkeypatch.delenv("JSPEC_ROPE_KV")
    assert None not in changed and len({key, *changed}) == len(changed) + 1
    assert program_key(scaled, {"shape": object()}, (x,), {}) is None


def test_the_gpu_compiler_options_are_options_xla_knows():
    """The GPU's options are XLA debug options every backend parses: a misspelt one would fail
    every program's compile on the GPU, which the CPU suite would not otherwise see."""
    step = jax.jit(lambda x: x * 2)
    assert float(step.lower(1.0).compile(compiler_options=GPU_COMPILER_OPTIONS)(1.0)) == 2.0
    with pytest.raises(Exception, match="No such compile option"):
        step.lower(1.0).compile(compiler_options={"xla_gpu_no_such_option": 1})


def test_precompile_bs_paddings_bound_the_decode_programs(tiny):
    """Listed decode batch sizes (and every power of two past the largest) are the only decode
    programs: warm-up compiles them, the loop pads into them and compiles nothing more, and the
    tokens are the default buckets' tokens."""
    engine = jspec.Engine(tiny, precompile_bs_paddings=[2], **KW)
    w = engine.worker
    assert w.buckets.decode_buckets() == [2, 4] and [w.buckets.decode_bucket(r) for r in (1, 2, 3, 4)] == [2, 2, 4, 4]
    assert engine.warmup(sampling_modes=("greedy",)) == len(w.buckets.prefill_token_buckets()) + 2
    compiled = dict(w.programs.compiled)
    assert greedy(engine) == greedy(jspec.Engine(tiny, **KW))
    assert w.programs.compiled == compiled, "the loop compiled"
    engine.check_idle_no_leaks()
    assert jspec.Engine(tiny, precompile_bs_paddings=[64], **KW).worker.buckets.decode_buckets() == [4]
    with pytest.raises(ValueError, match="powers of two"):
        jspec.Engine(tiny, precompile_bs_paddings=[3], **KW)


def test_all_greedy_prefills_get_their_own_program_where_the_worker_keeps_one(tiny):
    """The GPU's layout, forced on the CPU: a greedy prefill program beside the sampled one
    (which always runs the top-k / top-p search there). Warm-up compiles both for every token
    bucket, an all-greedy prefill runs the greedy one, a batch with a sampled row the sampled
    one, and every request gets the tokens of the engine with one prefill program."""
    one = jspec.Engine(tiny, **KW)
    two = jspec.Engine(tiny, **KW)
    two.worker.prefill_sampling_modes = SAMPLING_MODES
    w = two.worker
    buckets = w.buckets.prefill_token_buckets()
    assert two.warmup() == one.warmup() + len(buckets)
    assert all(w.programs.ready(prefill_key(T, False, w.top_n, m)) for T in buckets for m in SAMPLING_MODES)
    compiled = dict(w.programs.compiled)
    params = [
        jspec.SamplingParams(max_new_tokens=10, ignore_eos=True),
        jspec.SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
    ]
    for p in (params[0], params):  # all greedy, then greedy beside sampled
        got = [o.token_ids for o in two.generate(PROMPTS[:2], p)]
        assert got == [o.token_ids for o in one.generate(PROMPTS[:2], p)]
    assert w.programs.compiled == compiled, "the loop compiled"
    two.check_idle_no_leaks()


def test_programs_are_lowered_from_shapes_not_arrays():
    """Every device array of a launch becomes its shape, dtype, sharding and weak type (no
    layout: on newer JAX an array a stored executable returned carries one, which a fresh
    compile over it would take for another type); the host's values stay as they are."""
    pool = jax.numpy.zeros((2, 3, 4), jax.numpy.bfloat16)
    scalar = jax.numpy.asarray(1.5)  # weakly typed, as a Python float becomes
    host = np.arange(3, dtype=np.int32)
    (a, (b, c, d)) = abstract_args((pool, (scalar, host, None)))
    assert isinstance(a, jax.ShapeDtypeStruct) and (a.shape, a.dtype, a.sharding) == (
        pool.shape,
        pool.dtype,
        pool.sharding,
    )
    assert isinstance(b, jax.ShapeDtypeStruct) and b.weak_type and not a.weak_type
    assert c is host and d is None
    assert jax.jit(lambda x, s: x * s).lower(a, b).compile()(pool, scalar).dtype == pool.dtype
