"""JSPEC_SKINNY_MATMUL=xla_nk: the small projection weights laid out [out, in] when the engine
is built, used through the same layers, give the default layout's greedy tokens under either
layer loop; the layouts that extend or reshape those weights are refused by name."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.config.model import ModelConfig
from jspec.engine.build import out_in_projections
from jspec.layers import matmul

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
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40]]


def greedy(params, layer_loop):
    engine = jspec.Engine(
        (TINY, params),
        page_size=16,
        max_running_requests=2,
        precompile_bs_paddings=[2],
        attention_backend="reference",
        layer_loop=layer_loop,
    )
    out = [o.token_ids for o in engine.generate(PROMPTS, jspec.SamplingParams(max_new_tokens=8))]
    return out, engine.worker.params["layers"]


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
def test_out_in_projections_give_the_default_tokens(monkeypatch, layer_loop):
    params = init_random_params(TINY, jax.random.key(0), jnp.float32)
    monkeypatch.delenv(matmul.SKINNY_MATMUL_ENV, raising=False)
    expected, _ = greedy(jax.tree.map(jnp.copy, params), layer_loop)
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "xla_nk")
    got, layers = greedy(params, layer_loop)
    assert got == expected
    lp = layers[0] if layer_loop == "unrolled" else layers
    for name in matmul.LAYER_PROJECTIONS:
        w = lp[name]
        assert isinstance(w, matmul.OutInWeight), name
        assert w.shape[-2:] == w.t.shape[::-1][:2]  # used as [in, out], stored [out, in]


def test_out_in_weight_products_and_refusals(monkeypatch):
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
