"""End-to-end generation over the paged KV pool against a dense no-cache recompute, and under
the [out, in] projection-weight layout (the one-GPU default, JSPEC_SKINNY_MATMUL=xla_nk on any
device) against the [in, out] one."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.engine.build import out_in_projections
from jspec.engine.facts import serving_facts
from jspec.kvcache.allocator import OutOfPagesError
from jspec.layers import matmul
from jspec.models.llama import dense_forward

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

TINY = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_ids=(),
)


@pytest.fixture(scope="module")
def tiny_params():
    return init_random_params(TINY, jax.random.key(0), jnp.float32)


# A sliding window of 8 on the first layer (the second attends to everything).
TINY_WINDOW = dataclasses.replace(TINY, sliding_windows=(8, 0))


@functools.partial(jax.jit, static_argnames="cfg")
def _dense_logits(params, tokens, cfg=TINY):
    return dense_forward(params, cfg, tokens)


def dense_greedy(params, cfg, prompt, n, pad_to=64):
    """Greedy decoding by full recompute; tokens are padded to one length (causal, so the
    padding never changes earlier logits) to compile once."""
    assert len(prompt) + n <= pad_to
    toks = list(prompt)
    for _ in range(n):
        padded = jnp.asarray(toks + [0] * (pad_to - len(toks)), jnp.int32)
        toks.append(int(jnp.argmax(_dense_logits(params, padded, cfg=cfg)[len(toks) - 1])))
    return toks[len(prompt) :]


def prompts_of_lengths(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, TINY.vocab_size, n))) for n in lengths]


@pytest.mark.parametrize("page_size,backend", [(1, "pallas"), (16, "pallas"), (64, "reference"), (4, "reference")])
def test_paged_greedy_equals_dense_recompute(tiny_params, page_size, backend):
    prompts = prompts_of_lengths([1, 7, 16, 23])
    n_new = 9
    # Every decode pads to 4 rows: at page size 1 the pool admits the prompts in waves, which
    # would compile a 1-row program too.
    engine = jspec.Engine(
        (TINY, tiny_params),
        page_size=page_size,
        max_total_tokens=63 * page_size,
        precompile_bs_paddings=[4],
        attention_backend=backend,
    )
    outs = jspec.generate((TINY, tiny_params), prompts, max_new_tokens=n_new, engine=engine, ignore_eos=True)
    engine.check_idle_no_leaks()
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_greedy(tiny_params, TINY, p, n_new)
        assert o.finish_reason == "length"


@pytest.mark.parametrize("page_size,backend", [(4, "pallas"), (1, "reference")])
def test_sliding_window_attends_past_the_window(tiny_params, page_size, backend):
    """A window narrower than the prompts neither caps the context nor the output: every
    request gets all its tokens, equal to a dense recompute that windows the first layer."""
    m = (TINY_WINDOW, tiny_params)
    prompts = prompts_of_lengths([5, 17], seed=4)
    # The first request decodes alone while the second prefills chunk by chunk: padding it to two
    # rows keeps one decode program.
    engine = jspec.Engine(
        m, page_size=page_size, chunked_prefill_size=8, precompile_bs_paddings=[2], attention_backend=backend
    )
    outs = jspec.generate(m, prompts, max_new_tokens=12, engine=engine, ignore_eos=True)
    engine.check_idle_no_leaks()
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_greedy(tiny_params, TINY_WINDOW, p, 12)
        assert o.finish_reason == "length"
    # The window changes the tokens (the first layer really is windowed).
    assert [o.token_ids for o in outs] != [dense_greedy(tiny_params, TINY, p, 12) for p in prompts]


def test_chunked_prefill_and_admission_waves_match(tiny_params):
    """A pool too small for all requests at once runs them in waves; chunked prefill splits prompts."""
    prompts = prompts_of_lengths([30, 5, 12], seed=1)
    engine = jspec.Engine(
        (TINY, tiny_params), page_size=4, max_total_tokens=52, chunked_prefill_size=8, attention_backend="reference"
    )
    outs = jspec.generate((TINY, tiny_params), prompts, max_new_tokens=6, engine=engine, ignore_eos=True)
    engine.check_idle_no_leaks()
    for p, o in zip(prompts, outs):
        assert o.token_ids == dense_greedy(tiny_params, TINY, p, 6)


def test_stop_token_ends_a_request(tiny_params):
    prompt = prompts_of_lengths([5], seed=2)[0]
    expect = dense_greedy(tiny_params, TINY, prompt, 8)
    stop = expect[3]
    out = jspec.generate(
        (TINY, tiny_params), [prompt], max_new_tokens=8, stop_token_ids=[stop], attention_backend="reference"
    )[0]
    assert out.token_ids == expect[: expect.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_temperature_sampling_is_seeded(tiny_params):
    prompts = prompts_of_lengths([4, 9], seed=3)
    kw = dict(max_new_tokens=12, temperature=1.0, attention_backend="reference", ignore_eos=True)
    a = jspec.generate((TINY, tiny_params), prompts, seed=7, **kw)
    b = jspec.generate((TINY, tiny_params), prompts, seed=7, **kw)
    c = jspec.generate((TINY, tiny_params), prompts, seed=8, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert [o.token_ids for o in a] != [dense_greedy(tiny_params, TINY, p, 12) for p in prompts]


def test_bad_inputs_are_named(tiny_params):
    m = (TINY, tiny_params)
    with pytest.raises(TypeError, match="token 1 is 2.5"):
        jspec.generate(m, [[1, 2.5, 3]])
    with pytest.raises(TypeError, match="not an integer"):
        jspec.generate(m, [[1, "a"]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jspec.generate(m, [[1, 500]])
    with pytest.raises(ValueError, match="prompt 1 has 300 tokens; the model's context is 256"):
        jspec.generate(m, [[1], [1] * 300])
    with pytest.raises(ValueError, match="prompt 2 has 256 tokens"):
        jspec.Engine(m, attention_backend="reference").generate([[1], [2], [1] * 256])
    with pytest.raises(ValueError, match="no tokenizer"):
        jspec.generate(m, ["hello"])
    with pytest.raises(ValueError, match="empty"):
        jspec.generate(m, [[]])
    with pytest.raises(OutOfPagesError, match="needs up to 9 KV pages"):
        jspec.generate(m, [[1] * 30], max_new_tokens=4, page_size=4, max_total_tokens=12)
    with pytest.raises(TypeError, match="checkpoint path"):
        jspec.generate(42, [[1]])
    with pytest.raises(TypeError, match=r"\['nucleus'\]: neither SamplingParams' nor EngineConfig's"):
        jspec.generate(m, [[1]], nucleus=0.9)
    with pytest.raises(TypeError, match=r"not both \(got \['top_k'\]"):
        jspec.generate(m, [[1]], top_k=3, sampling_params=jspec.SamplingParams())
    with pytest.raises(ValueError, match="top_p must be in"):
        jspec.generate(m, [[1]], top_p=0)


def test_every_sampling_field_is_a_generate_keyword(tiny_params):
    """generate's keywords reach SamplingParams beyond the named ones: n completions, seeded
    top-k sampling equal to the same SamplingParams given whole."""
    m = (TINY, tiny_params)
    kw = dict(temperature=0.8, seed=3, top_k=5, n=2, max_new_tokens=6)
    by_keyword = jspec.generate(m, [[5, 6, 7]], **kw, attention_backend="reference")
    whole = jspec.generate(m, [[5, 6, 7]], sampling_params=jspec.SamplingParams(**kw), attention_backend="reference")
    assert len(by_keyword) == 2 and [o.token_ids for o in by_keyword] == [o.token_ids for o in whole]


def test_one_requests_room_is_what_the_pool_holds_below_the_context(tiny_params):
    """A pool smaller than the context bounds one request's prompt + new tokens: the engine's
    facts say so, and a request of exactly that room is taken where one token more is refused."""
    engine = jspec.Engine((TINY, tiny_params), page_size=4, max_total_tokens=24, attention_backend="reference")
    room = engine.scheduler.max_request_tokens
    assert 0 < room < TINY.max_position_embeddings
    assert serving_facts(engine).max_request_tokens == room
    engine.add_request([1] * 4, jspec.SamplingParams(max_new_tokens=room - 4))
    with pytest.raises(OutOfPagesError, match="needs up to"):
        engine.add_request([1] * 4, jspec.SamplingParams(max_new_tokens=room - 3))
    roomy = jspec.Engine((TINY, tiny_params), page_size=4, attention_backend="reference")
    assert serving_facts(roomy).max_request_tokens == TINY.max_position_embeddings


OUT_IN_PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40]]
# The families whose layers take projection weights in their own ways: Gemma 2's soft-caps and
# sandwich norms, Granite's biases beside the weights, a sparse layer beside a dense one (its
# shared expert's weights are not the dense projections the layout touches).
OUT_IN_FAMILIES = {
    "llama": TINY,
    "gemma2": dataclasses.replace(
        TINY,
        family="gemma2",
        tie_word_embeddings=True,
        hidden_act="gelu_tanh",
        embedding_multiplier=8.0,
        norm_layout="sandwich",
        attn_logit_softcap=2.0,
        final_logit_softcap=15.0,
        sliding_windows=(6, 0),
    ),
    "granite": dataclasses.replace(
        TINY, family="granite", qkv_bias=True, o_bias=True, residual_multiplier=0.5, logits_divisor=3.0
    ),
    "qwen3_moe": dataclasses.replace(
        TINY,
        family="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_layers=(1,),
        shared_expert_intermediate_size=32,
    ),
}


def out_in_greedy(cfg, params, layer_loop, speculative=None):
    engine = jspec.Engine(
        (cfg, params),
        page_size=16,
        max_running_requests=2,
        precompile_bs_paddings=[2],
        attention_backend="reference",
        layer_loop=layer_loop,
        speculative=speculative,
    )
    out = [o.token_ids for o in engine.generate(OUT_IN_PROMPTS, jspec.SamplingParams(max_new_tokens=8))]
    return out, engine.worker.params["layers"]


@pytest.mark.parametrize(
    "family, layer_loop, speculative",
    [
        ("llama", "unrolled", None),
        ("llama", "scan", None),
        ("llama", "unrolled", SpecConfig("NGRAM", num_draft_tokens=5)),
        ("gemma2", "unrolled", None),
        ("granite", "unrolled", None),
        ("qwen3_moe", "unrolled", None),
    ],
    ids=["llama", "llama-scan", "llama-ngram", "gemma2", "granite", "qwen3_moe"],
)
def test_out_in_projections_give_the_default_tokens(monkeypatch, family, layer_loop, speculative):
    """The small projection weights laid out [out, in] when the engine is built (asked for by
    JSPEC_SKINNY_MATMUL=xla_nk; the default on one GPU), used through the same layers, give the
    default layout's greedy tokens: plain decoding, a multi-row verify, each family's layers."""
    cfg = OUT_IN_FAMILIES[family]
    params = init_random_params(cfg, jax.random.key(0), jnp.float32)
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "xla")  # [in, out] on every device
    expected, kept = out_in_greedy(cfg, jax.tree.map(jnp.copy, params), layer_loop, speculative)
    assert not any(isinstance(w, matmul.OutInWeight) for w in jax.tree.leaves(kept, is_leaf=is_out_in))
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "xla_nk")
    got, layers = out_in_greedy(cfg, params, layer_loop, speculative)
    assert got == expected
    lp = layers[0] if layer_loop == "unrolled" else layers
    for name in matmul.LAYER_PROJECTIONS:
        w = lp[name]
        assert isinstance(w, matmul.OutInWeight), name
        assert w.shape[-2:] == w.t.shape[::-1][:2]  # used as [in, out], stored [out, in]


def is_out_in(x):
    return isinstance(x, matmul.OutInWeight)


def test_one_gpu_default_lays_out_projections_where_the_layout_applies(monkeypatch, tiny_params):
    """With no setting, the build lays the weights out [out, in] on one GPU (stood in for here)
    and not elsewhere; a configuration the layout does not apply to keeps them [in, out] rather
    than being refused, as it is when xla_nk is asked for by name."""
    monkeypatch.delenv(matmul.SKINNY_MATMUL_ENV, raising=False)
    assert not matmul.lays_out_projections_out_in()  # the CPU
    monkeypatch.setattr(matmul, "one_gpu", lambda: True)
    assert matmul.lays_out_projections_out_in()
    _, layers = out_in_greedy(TINY, jax.tree.map(jnp.copy, tiny_params), "unrolled")
    assert isinstance(layers[0]["wqkv"], matmul.OutInWeight)
    params = {"layers": [{"wqkv": tiny_params["layers"]["wqkv"][0]}]}
    lora = types.SimpleNamespace(serves_lora=True, tp_size=1, enable_dp_attention=False)
    assert out_in_projections(lora, params, "unrolled") is params
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "xla")
    assert not matmul.lays_out_projections_out_in()


def test_out_in_weight_products_and_refusals(monkeypatch):
    """An OutInWeight's product is the [in, out] weight's; asked for by name, the layout is refused
    where the engine extends or reshapes the projection weights."""
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "xla_nk")
    x = jax.random.normal(jax.random.key(0), (1, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (64, 48), jnp.float32)
    np.testing.assert_allclose(
        matmul.dense_f32(x, matmul.OutInWeight(w.T)), jnp.dot(x, w, preferred_element_type=jnp.float32), atol=1e-5
    )
    params = {"layers": [{"wqkv": w, "norm": jnp.ones(64)}]}
    laid = matmul.with_out_in_projections(params, per_layer_ndim=2)["layers"][0]
    assert isinstance(laid["wqkv"], matmul.OutInWeight) and laid["norm"] is params["layers"][0]["norm"]
    base = dict(serves_lora=False, tp_size=1, enable_dp_attention=False)
    for over, match in [
        (dict(serves_lora=True), "LoRA"),
        (dict(tp_size=2), "tensor parallelism"),
    ]:
        with pytest.raises(NotImplementedError, match=f"JSPEC_SKINNY_MATMUL=xla_nk with {match}"):
            out_in_projections(types.SimpleNamespace(**{**base, **over}), params, "unrolled")
    with pytest.raises(NotImplementedError, match="--layer-loop unrolled_stack"):
        out_in_projections(types.SimpleNamespace(**base), params, "unrolled_stack")
