"""End-to-end generation over the paged KV pool against a dense no-cache recompute."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import ModelConfig
from jspec.kvcache.allocator import OutOfPagesError
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
