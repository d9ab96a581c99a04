"""DeepSeek-V3 served by the engine, and NEXTN (its MTP layer drafting).

One tiny checkpoint written by transformers' DeepseekV3ForCausalLM (its MTP layer beside it in
the published layout) and HF's greedy tokens for the prompts serve every test:
- the plain engine (paged latent cache, prefix cache, overlap) emits HF's greedy tokens;
- NEXTN is lossless: greedy output equal to HF's, chain and trees, page sizes 1 and 16,
  overlap on and off (random MTP weights: drafts mostly rejected, every path exercised);
- a constructed checkpoint whose MTP layer predicts exactly what the target emits gets
  every draft accepted (the draft's token, position and hidden-state conventions);
- seeded sampling with NEXTN emits exactly what plain sampling does.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.hf_reference import requires_hf, run_oracle

import jspec
from jspec.checkpoint.deepseek import load_mtp_params
from jspec.checkpoint.loader import load_model
from jspec.config.load import LoadConfig
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.worker.inputs import decode_inputs

PROMPTS = [[5, 9, 13, 200, 7], list(range(11, 31)), [5, 9, 13, 200, 7, 31]]
NEW = 8

pytestmark = [pytest.mark.slow, requires_hf]

# Loaded from its path, float32 on every backend (the loader's default is bfloat16 on a GPU).
FLOAT32 = LoadConfig(dtype="float32")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = os.fspath(tmp_path_factory.mktemp("hf") / "deepseek_v3")
    make = {"name": "m", "mode": "make", "arch": "deepseek_v3", "out_dir": path, "seed": 0, "mtp_layers": 1}
    logits = {"name": "l", "mode": "logits", "checkpoint": path, "prompts": PROMPTS, "decode_steps": NEW - 1}
    out = run_oracle({"jobs": [make, logits]})
    cfg, params = load_model(path, dtype=jnp.float32)
    hf_tokens = [list(map(int, out[f"l/generated_{i}"])) for i in range(len(PROMPTS))]
    return path, cfg, params, hf_tokens


def engine_kw(page_size, overlap, backend="reference"):
    return dict(
        page_size=page_size,
        max_total_tokens=127 * page_size,
        max_running_requests=4,
        precompile_bs_paddings=[4],  # one decode program however the rows finish
        attention_backend=backend,
        disable_overlap_schedule=not overlap,
    )


def test_engine_serves_deepseek_with_hf_greedy_tokens(deepseek):
    path, cfg, params, hf_tokens = deepseek
    engine = jspec.Engine((cfg, params), **engine_kw(16, True))
    prefilled = []
    for _ in range(2):  # the second round reads its prompts' latents from the prefix cache
        before = engine.scheduler.prefilled_tokens
        out = jspec.generate((cfg, params), PROMPTS, max_new_tokens=NEW, ignore_eos=True, engine=engine)
        prefilled.append(engine.scheduler.prefilled_tokens - before)
        assert [o.token_ids for o in out] == hf_tokens
    assert prefilled[1] == prefilled[0] - 16  # the long prompt's first page came from the cache
    engine.check_idle_no_leaks()


@pytest.mark.parametrize(
    "page_size,overlap,steps,topk,ndt,backend",
    [(16, True, 3, 1, None, "reference"), (1, False, 2, 3, 5, "reference"), (4, True, 2, 2, 4, "pallas")],
)
def test_nextn_greedy_equals_plain_greedy(deepseek, page_size, overlap, steps, topk, ndt, backend):
    """backend "pallas": the MLA decode and verify kernels, interpreted, inside the engine."""
    path, cfg, params, hf_tokens = deepseek
    spec = SpecConfig("NEXTN", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    # From the path, so that NEXTN reads the MTP layer from the target's own checkpoint.
    engine = jspec.Engine(path, load=FLOAT32, speculative=spec, **engine_kw(page_size, overlap, backend))
    out = jspec.generate(engine.model, PROMPTS, max_new_tokens=NEW, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == hf_tokens


def copying_model(cfg, params, mtp):
    """The target and MTP layer with attention outputs and MLPs zeroed and lm_head[:, perm[x]] =
    embed[x]: the target's next token is perm[current token], and so is the MTP layer's (eh_proj
    passes its normed embedding on), so every draft is right."""
    V, H = cfg.vocab_size, cfg.hidden_size
    perm = np.random.default_rng(3).permutation(V)
    embed = np.asarray(params["embed"])
    head = np.zeros((H, V), np.float32)
    head[:, perm] = embed.T

    def silence(lp):
        lp = dict(lp, wo=jnp.zeros_like(lp["wo"]))
        for name in ("w_down", "experts_down", "shared_down"):
            if name in lp:
                lp[name] = jnp.zeros_like(lp[name])
        return lp

    params = dict(params, layers=[silence(lp) for lp in params["layers"]], lm_head=jnp.asarray(head))
    params["final_norm"] = jnp.ones_like(params["final_norm"])
    m = silence(mtp["mtp"])
    eh = np.zeros((2 * H, H), np.float32)
    eh[:H] = np.eye(H)
    m.update(eh_proj=jnp.asarray(eh), enorm=jnp.ones(H), head_norm=jnp.ones(H), attn_norm=m["attn_norm"])
    return params, {"mtp": m}, perm


def walk(perm, token, n):
    """The copying target's greedy continuation of `token`."""
    out = []
    for _ in range(n):
        token = int(perm[token])
        out.append(token)
    return out


def test_nextn_accepts_a_perfect_mtp_layer(deepseek):
    from jspec.checkpoint.deepseek import mtp_param_shapes

    path, cfg, params, _ = deepseek
    loaded = load_mtp_params(path, cfg)
    assert jax.tree.map(lambda a: tuple(a.shape), loaded) == mtp_param_shapes(cfg)
    params, mtp, perm = copying_model(cfg, params, loaded)
    steps = 3
    spec = SpecConfig("NEXTN", num_steps=steps)
    engine = jspec.Engine((cfg, params), speculative=spec, draft=(cfg, mtp), **engine_kw(16, True))
    out = jspec.generate((cfg, params), PROMPTS, max_new_tokens=4 * (steps + 1), ignore_eos=True, engine=engine)
    for p, o in zip(PROMPTS, out):
        assert o.token_ids == walk(perm, p[-1], len(o.token_ids))
        assert o.mean_accept_length == steps + 1


def test_nextn_seeded_sampling_equals_plain_sampling(deepseek):
    path, cfg, params, _ = deepseek
    kw = engine_kw(16, True)
    params_list = [
        SamplingParams(max_new_tokens=NEW, temperature=t, top_p=0.9, seed=s, ignore_eos=True)
        for t, s in ((1.0, 1), (0.7, 2), (1.0, 3))
    ]
    plain = jspec.Engine((cfg, params), **kw).generate(PROMPTS, params_list)
    spec = SpecConfig("NEXTN", num_steps=3)
    engine = jspec.Engine((cfg, params), speculative=spec, draft=(cfg, load_mtp_params(path, cfg)), **kw)
    assert [o.token_ids for o in engine.generate(PROMPTS, params_list)] == [o.token_ids for o in plain]


def test_nextn_needs_mtp_layers_of_a_deepseek_target():
    from support.models import TARGET

    from jspec.checkpoint.loader import init_random_params

    with pytest.raises(ValueError, match="NEXTN drafts with the checkpoint.s own multi-token-prediction layers"):
        jspec.Engine(
            (TARGET, init_random_params(TARGET, jax.random.key(0))), speculative=SpecConfig("NEXTN", num_steps=1)
        )


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_nextn_tree_decode_step_lowers_for_cuda(deepseek, monkeypatch):
    """One NEXTN iteration with a beam tree, in bfloat16, lowered for an abstract H200 with the
    kernels compiled (the beams' prefix attention is the Pallas MLA decode kernel)."""
    import functools

    from support.lowering import lower_for_cuda

    import jspec.kernels.backend
    from jspec.speculative.steps import spec_decode_step

    path, cfg, params, _ = deepseek
    to_bf16 = functools.partial(jax.tree.map, lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a)
    spec = SpecConfig("NEXTN", num_steps=3, eagle_topk=2, num_draft_tokens=6)
    engine = jspec.Engine(
        (cfg, to_bf16(params)),
        speculative=spec,
        draft=(cfg, to_bf16(load_mtp_params(path, cfg))),
        page_size=16,
        max_total_tokens=1008,
        attention_backend="pallas",
    )
    w = engine.worker
    slot_ids, pt, rows = decode_inputs(w, [0, 1], [[1, 2], [3]], [(SamplingParams(), 0)] * 2)
    args = (w.params, w.dparams, w.state, slot_ids, pt, rows)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)
    fn = functools.partial(spec_decode_step, cfg=w.cfg, method=w.method, backend="pallas", sampling="greedy")
    text = lower_for_cuda(fn, *specs).as_text()
    assert "mla_decode" in text and "mla_extend" in text and "__gpu$xla.gpu.triton" in text


def test_nextn_adaptive_forced_switches_keep_a_perfect_draft_lossless(deepseek):
    """Adaptive NEXTN with the shape forced to change every iteration (a tree, the (1,1,2)
    path, off twice in a row): the constructed MTP layer's drafts keep being accepted across
    the switches and the output stays the target's."""
    import itertools

    from jspec.speculative.adaptive import Choice, CostTable

    path, cfg, params, _ = deepseek
    params, mtp, perm = copying_model(cfg, params, load_mtp_params(path, cfg))
    spec = SpecConfig("NEXTN", num_steps=3, adaptive=True, adaptive_shapes="2,2,4 1,1,2 0,1,1")
    engine = jspec.Engine((cfg, params), speculative=spec, draft=(cfg, mtp), **engine_kw(16, True))
    cycle = itertools.cycle([Choice(i) for i in (0, 1, 2, 3, 3, 1, 0, 2)])
    engine.adaptive.costs = CostTable({}, "unused: the shapes are forced")
    engine.adaptive.choose = lambda alphas, bucket, ready=None: next(cycle)
    out = jspec.generate((cfg, params), PROMPTS[:2], max_new_tokens=14, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    for p, o in zip(PROMPTS, out):
        assert o.token_ids == walk(perm, p[-1], len(o.token_ids))
        assert o.mean_accept_length > 1.5


def test_nextn_with_penalties_and_logprobs_equals_plain(deepseek):
    """The shared verify paths under NEXTN: penalised greedy rows emit plain decoding's tokens,
    with its logprobs and top logprobs."""
    path, cfg, params, _ = deepseek
    kw = engine_kw(16, True)
    sp = SamplingParams(
        max_new_tokens=NEW,
        ignore_eos=True,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        return_logprob=True,
        top_logprobs_num=2,
    )
    plain = jspec.Engine((cfg, params), **kw).generate(PROMPTS, sp)
    spec = SpecConfig("NEXTN", num_steps=3)
    engine = jspec.Engine((cfg, params), speculative=spec, draft=(cfg, load_mtp_params(path, cfg)), **kw)
    out = engine.generate(PROMPTS, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    for a, b in zip(out, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
