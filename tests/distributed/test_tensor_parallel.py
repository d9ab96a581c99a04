"""Tensor parallelism on 8 CPU devices (conftest forces them): the same greedy tokens as one
device, with EAGLE-3 and the overlap loop on, and what the mesh holds where."""

import dataclasses

import jax
import numpy as np
import pytest
from support.models import PROMPTS, SPEC, eagle_draft, tiny_model

import jspec
from jspec.distributed.tensor_parallel import block_columns, make_mesh, shard_params

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 8 query heads and 2 KV heads: TP 2 splits KV heads, TP 4 and 8 repeat them.
    return tiny_model(tmp_path_factory, "tp", seed=11, num_heads=8, num_kv_heads=2, context=256)


def greedy(model, **kw):
    engine = jspec.Engine(
        model,
        page_size=4,
        max_total_tokens=1020,
        max_running_requests=4,
        precompile_bs_paddings=[4],  # one decode program however the rows finish
        attention_backend="reference",
        **kw,
    )
    outs = engine.generate(PROMPTS, jspec.SamplingParams(max_new_tokens=10, ignore_eos=True))
    engine.check_idle_no_leaks()
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def one_device_eagle3(tiny):
    draft = eagle_draft(tiny, seed=5)
    return draft, greedy(tiny, speculative=SPEC, draft=draft)[0]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_greedy_equals_one_device_with_eagle3_and_overlap(tiny, one_device_eagle3, tp):
    draft, ref = one_device_eagle3
    got, engine = greedy(tiny, speculative=SPEC, draft=draft, tp_size=tp)
    assert got == ref
    kv = engine.worker.state.target_kv.k
    assert kv.sharding.spec[3] == "tensor" and len(kv.sharding.device_set) == tp
    # Each device holds only its KV heads: max(2, tp) heads in all, max(2, tp) / tp each.
    assert kv.addressable_shards[0].data.shape[3] == max(2, tp) // tp


def test_tp_plain_greedy_equals_one_device_on_the_pallas_kernels(tiny):
    ref, _ = greedy(tiny)
    engine = jspec.Engine(
        tiny, page_size=4, max_total_tokens=1020, max_running_requests=4, tp_size=4
    )  # pallas, interpreted
    got = [o.token_ids for o in engine.generate(PROMPTS, jspec.SamplingParams(max_new_tokens=10, ignore_eos=True))]
    assert got == ref


def test_blocked_layout_puts_each_shards_heads_together():
    w = np.arange(2 * 12).reshape(2, 12)  # q: 8 columns, k: 2, v: 2
    b = np.asarray(block_columns(w, (8, 2, 2), 2))
    assert b.shape == (2, 2, 6)
    np.testing.assert_array_equal(b[:, 0], np.concatenate([w[:, 0:4], w[:, 8:9], w[:, 10:11]], axis=1))
    np.testing.assert_array_equal(b[:, 1], np.concatenate([w[:, 4:8], w[:, 9:10], w[:, 11:12]], axis=1))


def test_tp_refuses_what_does_not_divide(tiny):
    with pytest.raises(ValueError, match="num_attention_heads"):
        shard_params(dataclasses.replace(tiny.cfg, num_heads=6, num_kv_heads=2), tiny.params, make_mesh(4))
    with pytest.raises(ValueError, match="needs that many devices"):
        make_mesh(len(jax.devices()) + 1)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    # 8 experts, 2 per token; 8 query and 2 KV heads, so TP/EP 2 and 4 divide everything.
    return tiny_model(
        tmp_path_factory,
        "tp_moe",
        arch="qwen3_moe",
        seed=12,
        num_heads=8,
        num_kv_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_moe_greedy_equals_one_device_with_eagle3_and_overlap(tiny_moe, ep):
    draft = eagle_draft(tiny_moe, seed=5)
    ref, _ = greedy(tiny_moe, speculative=SPEC, draft=draft)
    got, engine = greedy(tiny_moe, speculative=SPEC, draft=draft, tp_size=ep, ep_size=ep)
    assert got == ref
    experts = engine.worker.params["layers"]["experts_gate_up"]  # [L, E, in, out]
    assert experts.addressable_shards[0].data.shape[1] == 8 // ep  # each device holds its experts only


def test_ep_size_must_match_tp_on_moe_and_be_1_on_dense(tiny, tiny_moe):
    with pytest.raises(ValueError, match="needs ep_size=2"):
        jspec.Engine(tiny_moe, tp_size=2, max_total_tokens=240, attention_backend="reference")
    with pytest.raises(ValueError, match="must equal tp_size"):
        jspec.Engine(tiny, tp_size=2, ep_size=2, max_total_tokens=240, attention_backend="reference")
