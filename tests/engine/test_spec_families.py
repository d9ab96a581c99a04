"""Speculation stays lossless on the families past Llama: greedy output with NGRAM, a random
EAGLE-3 head or a random STANDALONE draft of the same family equals plain greedy decoding, for random models with each family's switches
(windows narrower than the prompts, RoPE positions past the original context)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from support.models import TARGET, draft_config, prompts

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import RopeScaling
from jspec.config.spec import SpecConfig

LONGROPE = RopeScaling(
    4.0,
    rope_type="longrope",
    original_max_position_embeddings=16,
    attention_factor=1.2,
    short_factor=(1.0, 1.2, 1.5, 2.0, 2.5, 3.0),
    long_factor=(1.0, 2.0, 4.0, 6.0, 9.0, 12.0),
)
FAMILIES = {
    "gemma2": dict(
        family="gemma2",
        tie_word_embeddings=True,
        hidden_act="gelu_tanh",
        norm_layout="sandwich",
        embedding_multiplier=8.0,
        attention_scale=32**-0.5,
        attn_logit_softcap=2.0,
        final_logit_softcap=15.0,
        sliding_windows=(6, 0, 6, 0),
    ),
    "gemma3": dict(
        family="gemma3",
        tie_word_embeddings=True,
        hidden_act="gelu_tanh",
        norm_layout="sandwich",
        qk_norm=True,
        embedding_multiplier=8.0,
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
}
# (family, method, page_size, topk): each family once, each method on trees and chains, both
# page sizes; the verify tree, capture layers and drafting never branch on a family.
CASES = [
    ("gemma2", "EAGLE3", 16, 2),
    ("gemma3", "NGRAM", 1, 2),
    ("phi3", "EAGLE3", 1, 1),
    ("olmo2", "STANDALONE", 16, 2),  # the beam drafter runs the draft's layers itself
    ("granite", "NGRAM", 16, 1),
    ("smollm3", "EAGLE3", 1, 2),
]


@pytest.fixture(scope="module")
def plain_outputs():
    """Each family's model and its plain greedy tokens (computed once per family)."""
    cache = {}

    def get(family):
        if family not in cache:
            cfg = dataclasses.replace(TARGET, **FAMILIES[family])
            params = init_random_params(cfg, jax.random.key(3), jnp.float32, std=0.2)
            out = jspec.generate(
                (cfg, params), prompts([3, 17, 30]), max_new_tokens=12, ignore_eos=True, attention_backend="reference"
            )
            cache[family] = (cfg, params, [o.token_ids for o in out])
        return cache[family]

    return get


@pytest.mark.parametrize("family,method,page_size,topk", CASES)
def test_speculation_is_lossless_on_every_family(plain_outputs, family, method, page_size, topk):
    cfg, params, want = plain_outputs(family)
    draft = None
    if method == "NGRAM":
        spec = SpecConfig("NGRAM", num_draft_tokens=1 + 4 * topk, ngram_max_bfs_breadth=topk)
    elif method == "STANDALONE":  # a draft of the same family: a two-layer cut of the target
        spec = SpecConfig("STANDALONE", num_steps=3, eagle_topk=topk, num_draft_tokens=6)
        dcfg = dataclasses.replace(cfg, num_layers=2, rope_layers=cfg.rope_layers[:2], sliding_windows=())
        draft = (dcfg, init_random_params(dcfg, jax.random.key(4), jnp.float32, std=0.2))
    else:
        spec = SpecConfig("EAGLE3", num_steps=3, eagle_topk=topk, num_draft_tokens=None if topk == 1 else 6)
        dcfg = draft_config("EAGLE3", cfg)
        draft = (dcfg, init_random_draft_params(dcfg, jax.random.key(2), std=0.2))
    engine = jspec.Engine(
        (cfg, params),
        speculative=spec,
        draft=draft,
        page_size=page_size,
        max_total_tokens=127 * page_size,
        attention_backend="reference",
    )
    out = jspec.generate((cfg, params), prompts([3, 17, 30]), max_new_tokens=12, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == want
    assert all(o.spec_verify_ct >= 1 for o in out)
