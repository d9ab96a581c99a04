"""Tiny models for the tests: the one checkpoint factory, a permutation target with drafts that
predict it exactly, and random EAGLE-3 heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.model import with_context_length
from jspec.checkpoint.tiny import make_tiny_model
from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig


def tiny_model(tmp_path_factory, name: str = "m", *, context: int | None = None, **checkpoint):
    """A tiny checkpoint written by make_tiny_model (its keywords: seed, arch, head counts, ...)
    and loaded, cut to `context` tokens when given: a shorter context means narrower page
    tables, hence fewer and cheaper programs on the CPU."""
    model = jspec.load(make_tiny_model(str(tmp_path_factory.mktemp(name) / "m"), **checkpoint))
    return model if context is None else with_context_length(model, context)


H = 64

TARGET = ModelConfig(
    family="llama",
    vocab_size=H,
    hidden_size=H,
    intermediate_size=H,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)


def draft_config(algorithm, cfg=TARGET, vocab=None):
    return DraftConfig(
        algorithm=algorithm,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=None,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=vocab or cfg.vocab_size,
        num_layers=1,
        capture_layers=(1, 2, 3) if algorithm == "EAGLE3" else (),
        fc_bias=algorithm == "EAGLE",
        has_embed=False,
        has_lm_head=algorithm == "EAGLE3",
    )


def permutation_models(algorithm, seed=0, perm=None):
    """Target whose greedy next token is pi(current), and a draft that predicts it exactly."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(H) if perm is None else np.asarray(perm)
    P = np.zeros((H, H), np.float32)
    P[np.arange(H), perm] = 1.0  # e_x @ P = e_pi(x)
    L = TARGET.num_layers
    qkv = TARGET.q_size + 2 * TARGET.kv_size
    target = {
        "embed": jnp.eye(H),
        "layers": {
            "attn_norm": jnp.ones((L, H)),
            "wqkv": jnp.asarray(rng.normal(size=(L, H, qkv)) * 0.1, jnp.float32),
            "wo": jnp.zeros((L, TARGET.q_size, H)),
            "mlp_norm": jnp.ones((L, H)),
            "w_gate_up": jnp.asarray(rng.normal(size=(L, H, 2 * H)) * 0.1, jnp.float32),
            "w_down": jnp.zeros((L, H, H)),
        },
        "final_norm": jnp.ones(H),
        "lm_head": jnp.asarray(P),
    }
    dcfg = draft_config(algorithm)
    a = b = 2.0
    alpha = float(jax.nn.silu(a * np.sqrt(H)) * b * np.sqrt(H))
    eye = np.eye(H, dtype=np.float32)
    layer = {
        "wqkv": jnp.asarray(rng.normal(size=(1, 2 * H if algorithm == "EAGLE3" else H, qkv)) * 0.1, jnp.float32),
        "wo": jnp.zeros((1, TARGET.q_size, H)),
        "mlp_norm": jnp.ones((1, H)),
        "w_gate_up": jnp.asarray(np.concatenate([a * eye, b * eye], 1)[None]),
    }
    if algorithm == "EAGLE3":
        # fc keeps the lowest captured layer (= e_x); the MLP steps e_x -> e_pi(x); own lm_head = P.
        layer.update(
            attn_norm=jnp.ones((1, H)), hidden_norm=jnp.ones((1, H)), w_down=jnp.asarray(((P - eye) / alpha)[None])
        )
        fc = np.concatenate([eye, 0 * eye, 0 * eye], 0)
        draft = {
            "fc": jnp.asarray(fc),
            "layers": layer,
            "final_norm": jnp.ones(H),
            "lm_head": jnp.asarray(P),
            "d2t": jnp.zeros(H, jnp.int32),
        }
    else:
        # fc keeps the token embedding; the layer is the identity; the target's lm_head does the rest.
        layer.update(w_down=jnp.zeros((1, H, H)))
        draft = {"fc": jnp.asarray(np.concatenate([eye, 0 * eye], 0)), "fc_bias": jnp.zeros(H), "layers": layer}
    return target, dcfg, draft


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, H, n))) for n in lengths]


def eagle_draft(model, algorithm="EAGLE3", seed=7):
    """A random EAGLE / EAGLE-3 head over a tiny model, capturing its layers 0-2."""
    dcfg = dataclasses.replace(draft_config(algorithm, cfg=model.cfg), capture_layers=(0, 1, 2))
    return dcfg, init_random_draft_params(dcfg, jax.random.key(seed), std=0.2)


# The parallel tests' shared workload: one device and each mesh run the same prompts.
PROMPTS = [[1, 5, 9, 33, 70], list(range(40, 100)), [7] * 3, list(range(200, 230))]

SPEC = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)


def engine_settings(page_size: int, overlap: bool) -> dict:
    """The speculative tests' engine: room for 127 pages, 4 requests, the reference attention.
    Every decode pads to 4 rows: rows finishing at different iterations would otherwise compile
    the 2- and 1-row programs too (the buckets have their own test in test_programs.py)."""
    return dict(
        page_size=page_size,
        max_total_tokens=127 * page_size,
        max_running_requests=4,
        precompile_bs_paddings=[4],
        attention_backend="reference",
        disable_overlap_schedule=not overlap,
    )
