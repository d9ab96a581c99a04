"""Mixture-of-experts MLP (jspec/models/moe.py).

- the grouped (sorted + ragged_dot) MoE equals a dense reference that runs every expert
  on every token and masks by the routing, written here independently of moe.py;
- the expert-parallel shard_map version (all_to_all dispatch) equals it on meshes of 2
  and 4 CPU devices (a subprocess: the CPU device count is fixed at jax's start-up);
- logits of tiny random Qwen3-MoE / Qwen2-MoE / Mixtral checkpoints written by
  transformers equal HF's, prefill and greedy decode, through the paged forward; the
  fused-expert files of transformers 5 load to the same params as the classic ones;
- EAGLE-3 speculative decoding over an MoE target is lossless.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import REPO_ROOT
from support.hf_reference import HF_MOE_VARIANTS, hf_make_checkpoints, requires_hf, run_oracle
from support.lowering import lower_for_cuda
from support.parity import forward_logits, rel_err

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.loader import init_random_params, load_model, param_shapes
from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.models.moe import moe_mlp, moe_mlp_expert_parallel

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

H = 64


def moe_cfg(num_experts=8, top_k=2, norm=False, shared=0, inter=32, layers=1, family="qwen3_moe", limit=None):
    """limit: gpt-oss's experts (router and expert biases, SwiGLU clamped at limit)."""
    return ModelConfig(
        family=family,
        vocab_size=H,
        hidden_size=H,
        intermediate_size=2 * inter,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=norm,
        moe_layers=tuple(range(layers)),
        shared_expert_intermediate_size=shared,
        moe_biases=limit is not None,
        swiglu_limit=limit,
        swiglu_alpha=1.702 if limit is not None else 1.0,
    )


def random_layer(cfg, seed, skew=False):
    """One sparse layer's weights, N(0, 1/fan_in), and tokens h [37, H]. skew: a shared
    direction in every token and the router sends all tokens to the same two experts
    (two groups hold every row, the others none; under EP one shard receives everything)."""
    rng = np.random.default_rng(seed)
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    n = lambda *s: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-2])  # noqa: E731
    lp = {"router": n(H, E), "experts_gate_up": n(E, H, 2 * I), "experts_down": n(E, I, H)}
    if Is:
        lp.update(shared_gate_up=n(H, 2 * Is), shared_down=n(Is, H), shared_gate=n(H, 1))
    if cfg.moe_biases:
        lp.update(router_bias=n(1, E)[0], experts_b_gate_up=n(1, E, 2 * I)[0], experts_b_down=n(1, E, H)[0])
    h = rng.standard_normal((37, H)).astype(np.float32)
    if skew:
        u = rng.standard_normal(H).astype(np.float32)
        h += 4 * u
        lp["router"][:, 3] += 2 * u / H
        lp["router"][:, 5] += 1 * u / H
    return jax.tree.map(jnp.asarray, lp), jnp.asarray(h)


def dense_reference(cfg, lp, h):
    """Every expert on every token, masked: float64 numpy, routing by a full sort."""
    h, lp = np.asarray(h, np.float64), jax.tree.map(lambda a: np.asarray(a, np.float64), lp)
    logits = h @ lp["router"] + lp.get("router_bias", 0.0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.num_experts_per_tok]
    mask = np.zeros_like(probs)
    np.put_along_axis(mask, top, 1.0, axis=-1)
    w = probs * mask
    if cfg.norm_topk_prob:
        w /= w.sum(-1, keepdims=True)
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    I = cfg.moe_intermediate_size
    gu = np.einsum("th,ehi->tei", h, lp["experts_gate_up"]) + lp.get("experts_b_gate_up", 0.0)
    gate, up = gu[..., :I], gu[..., I:]
    if cfg.swiglu_limit is None:
        act = silu(gate) * up
    else:
        gate, up = np.minimum(gate, cfg.swiglu_limit), np.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        act = (up + 1) * gate / (1 + np.exp(-cfg.swiglu_alpha * gate))
    y = np.einsum("tei,eih->teh", act, lp["experts_down"]) + lp.get("experts_b_down", 0.0)
    out = np.einsum("te,teh->th", w, y)
    if cfg.shared_expert_intermediate_size:
        Is = cfg.shared_expert_intermediate_size
        gu = h @ lp["shared_gate_up"]
        gate = 1 / (1 + np.exp(-(h @ lp["shared_gate"])))
        out += gate * ((silu(gu[:, :Is]) * gu[:, Is:]) @ lp["shared_down"])
    return out


CASES = {  # name -> (config kwargs, skew)
    "e8k2": (dict(), False),
    "e4k1_norm": (dict(num_experts=4, top_k=1, norm=True), False),
    "e8k3_norm_shared": (dict(top_k=3, norm=True, shared=48), False),
    "e8k2_skewed": (dict(), True),
    "e8k2_gpt_oss": (dict(norm=True, limit=0.5), False),  # biases, and a clamp that bites
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_moe_matches_dense_reference(case):
    kw, skew = CASES[case]
    cfg = moe_cfg(**kw)
    lp, h = random_layer(cfg, seed=len(case), skew=skew)
    if skew:
        assert len(np.unique(np.argsort(-np.asarray(h @ lp["router"]), axis=-1)[:, :2])) == 2
    got = np.asarray(jax.jit(moe_mlp, static_argnums=0)(cfg, lp, h))
    np.testing.assert_allclose(got, dense_reference(cfg, lp, h), rtol=2e-5, atol=2e-5)


def _ep_check():
    """Run in a subprocess with 8 CPU devices: EP over 2 and 4 shards == the dense reference."""
    assert jax.device_count() >= 4, jax.devices()
    for ep in (2, 4):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:ep]), ("expert",))
        for case, (kw, skew) in sorted(CASES.items()):
            cfg = moe_cfg(**kw)
            lp, h = random_layer(cfg, seed=len(case), skew=skew)
            h = h[:36]  # divisible by 2 and 4: each shard its own 18 or 9 tokens
            fn = jax.jit(functools.partial(moe_mlp_expert_parallel, cfg, mesh))
            got = np.asarray(fn(lp, h))
            np.testing.assert_allclose(
                got, dense_reference(cfg, lp, h), rtol=2e-5, atol=2e-5, err_msg=f"ep={ep} {case}"
            )
            print(f"ep={ep} {case}: ok")


def test_expert_parallel_matches_dense_reference():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO_ROOT, "tests"), REPO_ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "ep"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(": ok") == 2 * len(CASES)


def test_moe_lowers_for_cuda():
    """The grouped MoE at a Qwen3-30B-A3B layer's shape (bf16) lowers for an abstract H200
    (see tests/kernels/test_kernels_lowering.py): ragged_dot and the sort need no CPU-only path."""
    cfg = dataclasses.replace(moe_cfg(num_experts=128, top_k=8, norm=True, inter=768), hidden_size=2048)
    shapes = param_shapes(cfg)["layers"]
    lp = {k: jax.ShapeDtypeStruct(shapes[k][1:], jnp.bfloat16) for k in ("router", "experts_gate_up", "experts_down")}
    lowered = lower_for_cuda(functools.partial(moe_mlp, cfg), lp, jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16))
    assert "ragged_dot" in lowered.as_text()


# ---------------------------------------------------------------------------
# HF transformers parity
# ---------------------------------------------------------------------------

PAGE_SIZE = 4
DECODE_STEPS = 4
# transformers 5's in-memory layout (fused experts), same seed hence same weights as its twin.
FUSED_VARIANTS = {
    "qwen3_moe_fused": ("qwen3_moe", {}, {"save_original_format": False}),
    "mixtral_fused": ("mixtral", {}, {"save_original_format": False}),
}


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(0, 320, n))) for n in (11, 6)]


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """Checkpoints written by transformers and its float32 logits for each, in two oracle runs."""
    ckpts = hf_make_checkpoints(tmp_path_factory.mktemp("hf_moe"), {**HF_MOE_VARIANTS, **FUSED_VARIANTS})
    jobs = [
        {
            "name": n,
            "mode": "logits",
            "checkpoint": ckpts[n]["path"],
            "prompts": _prompts(),
            "decode_steps": DECODE_STEPS,
        }
        for n in HF_MOE_VARIANTS
    ]
    out = run_oracle({"jobs": jobs})
    refs = {
        n: {
            key: [out[f"{n}/{key}_{i}"] for i in range(len(_prompts()))]
            for key in ("prefill_logits", "decode_logits", "generated")
        }
        for n in HF_MOE_VARIANTS
    }
    return ckpts, refs


@requires_hf
@pytest.mark.parametrize("variant", sorted(HF_MOE_VARIANTS))
def test_moe_logits_match_transformers(hf_moe, variant):
    from jspec.kvcache.allocator import PageAllocator
    from jspec.kvcache.pool import create_kv_pool
    from jspec.worker.inputs import SeqChunk, build_forward_batch

    ckpts, refs = hf_moe
    cfg, params = load_model(ckpts[variant]["path"], dtype=jnp.float32)
    assert cfg.is_moe and jax.tree.map(lambda x: tuple(x.shape), params) == param_shapes(cfg)
    ref, prompts = refs[variant], _prompts()
    alloc = PageAllocator(32)
    kv = create_kv_pool(cfg, 32, PAGE_SIZE, jnp.float32)
    pages = [alloc.alloc(-(-(len(p) + DECODE_STEPS + 1) // PAGE_SIZE)) for p in prompts]

    batch, mode = build_forward_batch(
        [SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page_size=PAGE_SIZE, num_pages=32
    )
    batch = batch._replace(logits_indices=np.arange(batch.tokens.shape[0], dtype=np.int32))
    kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="reference"))
    for i, p in enumerate(prompts):
        got = out.logits[batch.query_start[i] : batch.query_start[i] + len(p)]
        assert rel_err(got, ref["prefill_logits"][i]) < 1e-4, f"{variant} prefill prompt {i}"

    for step in range(DECODE_STEPS):
        chunks = [SeqChunk([int(ref["generated"][i][step])], len(p) + step, pages[i]) for i, p in enumerate(prompts)]
        batch, mode = build_forward_batch(chunks, page_size=PAGE_SIZE, num_pages=32)
        kv, out = forward_logits(params, kv, batch, cfg=cfg, mode=mode._replace(backend="reference"))
        for i in range(len(prompts)):
            got = np.asarray(out.logits[i])
            assert rel_err(got, ref["decode_logits"][i][step]) < 1e-4, f"{variant} decode step {step} prompt {i}"
            assert int(np.argmax(got)) == int(ref["generated"][i][step + 1])


@requires_hf
@pytest.mark.parametrize("variant", sorted(FUSED_VARIANTS))
def test_fused_expert_files_load_like_classic_ones(hf_moe, variant):
    ckpts, _ = hf_moe
    cfg, fused = load_model(ckpts[variant]["path"], dtype=jnp.float32)
    cfg2, classic = load_model(ckpts[FUSED_VARIANTS[variant][0]]["path"], dtype=jnp.float32)
    assert cfg == cfg2
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), fused, classic)


# ---------------------------------------------------------------------------
# Speculative decoding over an MoE target
# ---------------------------------------------------------------------------


def test_eagle3_over_moe_target_is_lossless():
    target = moe_cfg(num_experts=4, top_k=2, norm=True, layers=4)
    params = init_random_params(target, jax.random.key(1), jnp.float32, std=0.1)
    dcfg = DraftConfig(
        algorithm="EAGLE3",
        hidden_size=H,
        intermediate_size=2 * H,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=None,
        max_position_embeddings=512,
        vocab_size=H,
        draft_vocab_size=48,
        num_layers=1,
        capture_layers=(1, 2, 3),
        fc_bias=False,
        has_embed=False,
        has_lm_head=True,
    )
    draft = init_random_draft_params(dcfg, jax.random.key(2), std=0.2)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, H, n))) for n in (3, 17, 30)]
    base = jspec.generate(
        (target, params), prompts, max_new_tokens=12, ignore_eos=True, page_size=16, attention_backend="reference"
    )
    spec = SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5)
    engine = jspec.Engine(
        (target, params),
        speculative=spec,
        draft=(dcfg, draft),
        page_size=16,
        max_total_tokens=1520,
        max_running_requests=8,
        precompile_bs_paddings=[8],  # one decode program however the rows finish
        attention_backend="reference",
    )
    out = jspec.generate((target, params), prompts, max_new_tokens=12, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    for b, o in zip(base, out):
        assert o.token_ids == b.token_ids
        assert o.spec_verify_ct >= 1


if __name__ == "__main__" and sys.argv[1:] == ["ep"]:
    _ep_check()
