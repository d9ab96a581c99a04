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
    tables, hence fewer and cheaper programs on the CPU. float32 on every backend (the loader's
    default is bfloat16 on a GPU): the tests claim token-for-token equalities that hold in exact
    float32 arithmetic (docs/design-details.md, "Precision")."""
    model = jspec.load(make_tiny_model(str(tmp_path_factory.mktemp(name) / "m"), **checkpoint), dtype="float32")
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


# A reasoning model in miniature: its chat output, from a prompt that ends in "\n", is
# "<think>OK</think>{}" then end of turn. Where a grammar refuses the "{" after </think>, its
# runner-up is '"'.
REASONING_SCRIPT = {"\n": "<think>", "<think>": "O", "O": "K", "K": "</think>", "</think>": "{", "{": "}"}
REASONING_RUNNER_UP = {"</think>": '"'}
REASONING_TAGS = ("<think>", "</think>")


def scripted_model(out_dir, script=REASONING_SCRIPT, runner_up=REASONING_RUNNER_UP, **checkpoint) -> str:
    """A tiny checkpoint (make_tiny_model's, with <think> and </think> added to its tokenizer as
    Qwen3 adds them) whose greedy next token depends on the current token alone: script maps a
    token's text to the next one's (a token it does not map ends the turn), runner_up to the
    second best. Attention and MLP add nothing to the residual stream (zero output projections),
    so the last token's embedding, one axis per scripted token, picks the logits."""
    from tokenizers import AddedToken

    from jspec.checkpoint.files import read_hf_tensors, write_safetensors
    from jspec.checkpoint.tiny import EOS_IDS, build_byte_tokenizer

    path = make_tiny_model(out_dir, **checkpoint)
    tok = build_byte_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TAGS])
    tok.save(f"{path}/tokenizer.json")

    def token(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    tensors = {name: np.array(t, np.float32) for name, t in read_hf_tensors(path).items()}
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    embed[:] = 0
    head[:] = 0
    sources = sorted(set(script) | set(script.values()) | set(runner_up))
    assert len(sources) <= embed.shape[1]
    for axis, text in enumerate(sources):
        embed[token(text), axis] = 1.0
        head[token(script[text]) if text in script else EOS_IDS[1], axis] += 4.0
        if text in runner_up:
            head[token(runner_up[text]), axis] += 2.0
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[:] = 0
        elif name.endswith("norm.weight"):
            t[:] = 1
    write_safetensors(path, tensors, checkpoint.get("num_shards", 1))
    return path
