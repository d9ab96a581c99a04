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

import jspec
from jspec.checkpoint.eagle import DraftConfig, init_random_draft_params
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig

H = 64
TARGET = ModelConfig(
    family="llama", vocab_size=H, hidden_size=H, intermediate_size=H, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
)


def draft_config(algorithm, cfg=TARGET, vocab=None):
    return DraftConfig(
        algorithm=algorithm, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
        max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
        draft_vocab_size=vocab or cfg.vocab_size, num_layers=1,
        capture_layers=(1, 2, 3) if algorithm == "EAGLE3" else (), fc_bias=algorithm == "EAGLE",
        has_embed=False, has_lm_head=algorithm == "EAGLE3",
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
            "attn_norm": jnp.ones((L, H)), "wqkv": jnp.asarray(rng.normal(size=(L, H, qkv)) * 0.1, jnp.float32),
            "wo": jnp.zeros((L, TARGET.q_size, H)), "mlp_norm": jnp.ones((L, H)),
            "w_gate_up": jnp.asarray(rng.normal(size=(L, H, 2 * H)) * 0.1, jnp.float32),
            "w_down": jnp.zeros((L, H, H)),
        },
        "final_norm": jnp.ones(H), "lm_head": jnp.asarray(P),
    }
    dcfg = draft_config(algorithm)
    a = b = 2.0
    alpha = float(jax.nn.silu(a * np.sqrt(H)) * b * np.sqrt(H))
    eye = np.eye(H, dtype=np.float32)
    layer = {
        "wqkv": jnp.asarray(rng.normal(size=(1, 2 * H if algorithm == "EAGLE3" else H, qkv)) * 0.1, jnp.float32),
        "wo": jnp.zeros((1, TARGET.q_size, H)), "mlp_norm": jnp.ones((1, H)),
        "w_gate_up": jnp.asarray(np.concatenate([a * eye, b * eye], 1)[None]),
    }
    if algorithm == "EAGLE3":
        # fc keeps the lowest captured layer (= e_x); the MLP steps e_x -> e_pi(x); own lm_head = P.
        layer.update(attn_norm=jnp.ones((1, H)), hidden_norm=jnp.ones((1, H)),
                     w_down=jnp.asarray(((P - eye) / alpha)[None]))
        fc = np.concatenate([eye, 0 * eye, 0 * eye], 0)
        draft = {"fc": jnp.asarray(fc), "layers": layer, "final_norm": jnp.ones(H), "lm_head": jnp.asarray(P),
                 "d2t": jnp.zeros(H, jnp.int32)}
    else:
        # fc keeps the token embedding; the layer is the identity; the target's lm_head does the rest.
        layer.update(w_down=jnp.zeros((1, H, H)))
        draft = {"fc": jnp.asarray(np.concatenate([eye, 0 * eye], 0)), "fc_bias": jnp.zeros(H), "layers": layer}
    return target, dcfg, draft


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, H, n))) for n in lengths]


def run_both(target, dcfg, draft, spec, page_size, ps, max_new=12, backend="reference"):
    base = jspec.generate((TARGET, target), ps, max_new_tokens=max_new, ignore_eos=True, page_size=page_size,
                          attention_backend=backend)
    engine = jspec.Engine((TARGET, target), speculative=spec, draft=(dcfg, draft), page_size=page_size, max_total_tokens=95 * page_size,
                          max_running_requests=8, attention_backend=backend)
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


@pytest.mark.parametrize("algorithm,page_size,steps,topk,ndt,backend", CASES)
def test_random_draft_is_lossless(algorithm, page_size, steps, topk, ndt, backend):
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    dcfg = draft_config(algorithm, vocab=48 if algorithm == "EAGLE3" else None)
    draft = init_random_draft_params(dcfg, jax.random.key(2), std=0.2)
    spec = SpecConfig(algorithm, num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    acc = run_both(target, dcfg, draft, spec, page_size, prompts([3, 17, 30]), backend=backend)
    print(f"random draft {algorithm} steps={steps} topk={topk}: mean accept length {acc:.2f}")
    assert 1.0 <= acc < 1.5


@pytest.mark.parametrize("algorithm,page_size,steps,topk,ndt,backend", CASES)
def test_agreeing_draft_is_lossless_and_accepts_everything(algorithm, page_size, steps, topk, ndt, backend):
    target, dcfg, draft = permutation_models(algorithm)
    spec = SpecConfig(algorithm, num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    acc = run_both(target, dcfg, draft, spec, page_size, prompts([2, 9, 21], seed=1), max_new=3 * (steps + 1))
    print(f"agreeing draft {algorithm} steps={steps} topk={topk}: mean accept length {acc:.2f}")
    # Every iteration emits the full depth, except that the last one may be cut by max_new_tokens.
    assert acc >= 0.9 * (steps + 1) if steps > 1 else acc == 2.0


def test_over_allocation_never_writes_outside_reserved_pages():
    """Pages never handed to a request keep their poison after speculative generation."""
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    dcfg = draft_config("EAGLE3")
    draft = init_random_draft_params(dcfg, jax.random.key(2), std=0.2)
    spec = SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5)
    engine = jspec.Engine((TARGET, target), speculative=spec, draft=(dcfg, draft), page_size=4, max_total_tokens=252,
                          max_running_requests=4, attention_backend="reference")
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
