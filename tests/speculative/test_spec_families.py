"""STANDALONE with a draft of the target's own family stays lossless on the families past
Llama: greedy output equals greedy decoding without speculation, for random models with each
family's switches (windows narrower than the prompts, RoPE positions past the original
context). NGRAM and EAGLE-3 on every family, against transformers' own tokens: tests/parity."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import TARGET, prompts

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import RopeScaling
from jspec.config.spec import SpecConfig
from jspec.models.llama import dense_forward

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

LONGROPE = RopeScaling(
    4.0,
    rope_type="longrope",
    original_max_position_embeddings=16,
    attention_factor=1.2,
    short_factor=(1.0, 1.2, 1.5, 2.0, 2.5, 3.0),
    long_factor=(1.0, 2.0, 4.0, 6.0, 9.0, 12.0),
)
GEMMA = dict(tie_word_embeddings=True, hidden_act="gelu_tanh", embedding_multiplier=8.0)
FAMILIES = {
    "gemma": dict(family="gemma", **GEMMA),
    "gemma2": dict(
        family="gemma2",
        **GEMMA,
        norm_layout="sandwich",
        attention_scale=32**-0.5,
        attn_logit_softcap=2.0,
        final_logit_softcap=15.0,
        sliding_windows=(6, 0, 6, 0),
    ),
    "gemma3": dict(
        family="gemma3",
        **GEMMA,
        norm_layout="sandwich",
        qk_norm=True,
        sliding_windows=(6, 6, 0, 6),
        rope_theta=1e6,
        rope_scaling=RopeScaling(2.0, rope_type="linear"),
        sliding_rope_theta=1e4,
    ),
    "phi3": dict(family="phi3", partial_rotary_factor=0.75, rope_scaling=LONGROPE),
    "olmo2": dict(family="olmo2", norm_layout="post", qk_norm_whole=True),
    "smollm3": dict(family="smollm3", rope_layers=(True, False, True, False), sliding_windows=(0, 6, 0, 6)),
    "granite": dict(
        family="granite",
        qkv_bias=True,
        o_bias=True,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_scale=0.2,
        logits_divisor=3.0,
    ),
    "llama_attention_bias": dict(family="llama", qkv_bias=True, o_bias=True),
    # gpt-oss's attention on a dense model: a sink logit per head, windows from layer 0, biases.
    "gpt_oss_attention": dict(
        family="llama", attention_sinks=True, sliding_windows=(6, 0, 6, 0), qkv_bias=True, o_bias=True
    ),
}
# Every family with a draft of its own family, at page sizes 1 and 16. Beams, whose layers the
# beam drafter runs itself, need a draft without windows (a windowed one is refused by name,
# below), so those drafts are the full-attention form of the target's first layers; chains
# (topk 1) run the shared forward, windows included.
CASES = [
    ("gemma", 16, 2),
    ("gemma2", 16, 2),
    ("gemma3", 1, 1),
    ("phi3", 1, 2),
    ("olmo2", 1, 2),
    ("granite", 16, 2),
    ("smollm3", 16, 1),
    ("llama_attention_bias", 1, 2),
    ("gpt_oss_attention", 16, 1),
]
NEW_TOKENS = 12
PROMPTS = prompts([3, 9, 14])  # two longer than the windows of 6; each one prefill chunk of 16
# One request at a time, in chunks of 16: each engine runs one prefill and one decode program.
# The backend's own attention: the jnp reference on the CPU, the kernels on the GPU.
ENGINE = dict(max_running_requests=1, chunked_prefill_size=16)


def family_config(family):
    return dataclasses.replace(TARGET, **FAMILIES[family])


def weight_std(cfg, name, shape):
    """0.2, and the embedding's divided by its multiplier: scaled up, it would drown the layers'
    updates, and the model would only repeat the last token."""
    return 0.2 / cfg.embedding_multiplier if "embed" in name else 0.2


def greedy_without_speculation(cfg, params, prompt, n):
    """The model's n greedy tokens by its no-cache forward (the paged path's oracle), one program
    for every step: the tokens sit in a fixed buffer whose padding, after them, causal attention
    never lets them see."""
    step = jax.jit(lambda params, tokens: jnp.argmax(dense_forward(params, cfg, tokens), axis=-1))
    tokens = np.zeros(len(prompt) + n, np.int32)
    tokens[: len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        tokens[t] = int(step(params, tokens)[t - 1])
    return tokens[len(prompt) :].tolist()


@pytest.fixture(scope="module")
def greedy_outputs():
    """Each family's random model and its greedy tokens without speculation (once per family)."""
    cache = {}

    def get(family):
        if family not in cache:
            cfg = family_config(family)
            params = init_random_params(cfg, jax.random.key(3), jnp.float32, std=partial(weight_std, cfg))
            cache[family] = (cfg, params, [greedy_without_speculation(cfg, params, p, NEW_TOKENS) for p in PROMPTS])
        return cache[family]

    return get


def standalone_draft(cfg, params, windowed):
    """A draft of the target's own family: its first two layers, weights included, so that its
    drafts are right some of the time; windowed=False: their full-attention form."""
    cut = dataclasses.replace(
        cfg,
        num_layers=2,
        rope_layers=cfg.rope_layers[:2],
        sliding_windows=cfg.sliding_windows[:2] if windowed else (),
    )
    return cut, {**params, "layers": jax.tree.map(lambda w: w[:2], params["layers"])}


@pytest.mark.parametrize("family,page_size,topk", CASES)
def test_standalone_draft_of_the_same_family_is_lossless(greedy_outputs, family, page_size, topk):
    cfg, params, want = greedy_outputs(family)
    spec = SpecConfig("STANDALONE", num_steps=2, eagle_topk=topk, num_draft_tokens=None if topk == 1 else 4)
    draft = standalone_draft(cfg, params, windowed=topk == 1)
    engine = jspec.Engine(
        (cfg, params), speculative=spec, draft=draft, page_size=page_size, max_total_tokens=64 * page_size, **ENGINE
    )
    out = jspec.generate((cfg, params), PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == want
    assert all(o.spec_verify_ct >= 1 for o in out)
    # Some drafts were right: the accepting path ran too.
    assert sum(o.spec_verify_ct for o in out) < len(PROMPTS) * (NEW_TOKENS - 1)


@pytest.mark.parametrize("family", [f for f in FAMILIES if family_config(f).sliding_windows])
def test_standalone_beams_over_a_windowed_draft_are_refused(family):
    """By design: beam drafting runs the draft's layers without their windows."""
    cfg = family_config(family)
    params = init_random_params(cfg, jax.random.key(3), jnp.float32)
    with pytest.raises(ValueError, match="drafts chains only"):
        jspec.Engine(
            (cfg, params),
            speculative=SpecConfig("STANDALONE", num_steps=2, eagle_topk=2, num_draft_tokens=4),
            draft=standalone_draft(cfg, params, windowed=True),
            **ENGINE,
        )
