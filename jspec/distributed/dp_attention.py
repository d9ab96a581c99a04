"""DP attention (SGLang's --enable-dp-attention): the mesh and the layouts.

A ("data", "tensor") mesh of dp ranks of tp/dp devices. Each rank has its own requests, KV
pool (a [dp, ...] stack split over "data") and slots, and runs attention tensor-parallel over
its devices; the MLP stays over all devices. The one-rank steps run unchanged inside one
shard_map manual over "data" (`RankStep`); every rank runs every step, an idle one on padding
rows, so the MLP's collectives always have all ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.config.model import ModelConfig
from jspec.distributed.mesh import DATA, TENSOR
from jspec.distributed.tensor_parallel import block_columns, param_specs, replicate_kv_heads


def make_dp_mesh(tp_size: int, dp_size: int, devices=None) -> Mesh:
    """("data", "tensor") = (dp, tp / dp) over the first tp_size devices, "data" major, so rank r
    holds devices r * tp/dp .. (r + 1) * tp/dp - 1."""
    devices = list(jax.devices() if devices is None else devices)
    if tp_size > len(devices):
        raise ValueError(
            f"tp_size={tp_size} needs that many devices; this process sees {len(devices)} "
            f"(on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)"
        )
    grid = np.asarray(devices[:tp_size]).reshape(dp_size, tp_size // dp_size)
    return Mesh(grid, (DATA, TENSOR), axis_types=(AxisType.Auto, AxisType.Auto))


def check_dp_config(cfg: ModelConfig, dp: int, attn_tp: int) -> None:
    tp = dp * attn_tp
    if cfg.attention_sinks:
        raise ValueError("DP attention over attention sinks (gpt-oss) is not implemented")
    problems = []
    if cfg.num_heads % attn_tp:
        problems.append(f"num_attention_heads ({cfg.num_heads}) by tp_size / dp_size = {attn_tp}")
    if cfg.num_kv_heads % attn_tp and attn_tp % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads ({cfg.num_kv_heads}) by tp_size / dp_size = {attn_tp} (or the reverse)")
    if cfg.dense_layers and cfg.intermediate_size % tp:
        problems.append(f"intermediate_size ({cfg.intermediate_size}) by tp_size = {tp}")
    if cfg.is_moe and cfg.num_experts % tp:
        problems.append(f"num_experts ({cfg.num_experts}) by tp_size = {tp}")
    if problems:
        raise ValueError("DP attention cannot split: " + "; ".join(problems))


def dp_param_specs(params) -> dict:
    """PartitionSpecs of a DP-laid-out param pytree (stacked or per-layer): attention over
    "tensor" (replicated over "data"), MLP and experts over ("data", "tensor")."""
    base = param_specs(params, 1)  # divisibility was checked; embed / lm_head go over "tensor"

    def spec(path, leaf, s):
        name = path[-1].key if hasattr(path[-1], "key") else None
        lead = (None,) * (leaf.ndim - {"w_gate_up": 4, "w_down": 3}.get(name, 3))
        if name == "w_gate_up":  # [..., H, dp, tp/dp, 2I/tp]
            return P(*lead, None, DATA, TENSOR, None)
        if name == "w_down":  # [..., dp, I/dp, H]
            return P(*lead, DATA, TENSOR, None)
        if name in ("experts_gate_up", "experts_down"):  # [..., E, in, out]
            return P(*lead, (DATA, TENSOR), None, None)
        return s

    return jax.tree_util.tree_map_with_path(spec, params, base)


def shard_params_dp(cfg: ModelConfig, params, mesh: Mesh):
    """(cfg, params) laid out and placed for DP attention on mesh. The dense MLP weights get an
    explicit rank axis (w_gate_up [H, dp, tp/dp, 2I/tp], w_down [dp, I/dp, H]): that layout is
    what tells the forward (models/llama.mlp_delta) to gather tokens over the ranks."""
    dp, attn_tp = mesh.shape[DATA], mesh.shape[TENSOR]
    tp = dp * attn_tp
    check_dp_config(cfg, dp, attn_tp)
    cfg, params = replicate_kv_heads(cfg, params, attn_tp)
    I = cfg.intermediate_size

    def layer(lp):
        lp = dict(lp)
        sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        lp["wqkv"] = block_columns(lp["wqkv"], sizes, attn_tp)
        if "bqkv" in lp:
            lp["bqkv"] = block_columns(lp["bqkv"], sizes, attn_tp)
        if "w_gate_up" in lp:
            w = block_columns(lp["w_gate_up"], (I, I), tp)
            lp["w_gate_up"] = w.reshape(*w.shape[:-2], dp, attn_tp, w.shape[-1])
            d = lp["w_down"]
            lp["w_down"] = d.reshape(*d.shape[:-2], dp, I // dp, d.shape[-1])
        return lp

    layers = params["layers"]
    layers = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
    params = {**params, "layers": layers}
    return cfg, place(params, mesh)


def place(params, mesh: Mesh):
    specs = dp_param_specs(params)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def in_rank_region() -> bool:
    """True inside per_rank_step's shard_map (the "data" axis is manual there)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and DATA in mesh.manual_axes


# ---- per-rank state and steps -----------------------------------------------------------------


def state_shardings(state, mesh: Mesh):
    """Every leaf gets a leading rank axis split over "data"; the target KV pool
    [dp, L, pages, page_size, Hkv, D] also splits its heads over "tensor" (as plain TP)."""
    kv = NamedSharding(mesh, P(DATA, None, None, None, TENSOR, None))
    ranked = NamedSharding(mesh, P(DATA))
    rest = jax.tree.map(lambda _: ranked, state._replace(target_kv=None))
    return rest._replace(target_kv=jax.tree.map(lambda _: kv, state.target_kv))


def lift_state(state, mesh: Mesh):
    """One rank's freshly made state -> dp copies of it, each on its rank's devices."""
    dp = mesh.shape[DATA]
    stack = lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x[None], (dp,) + x.shape), s)  # noqa: E731
    return jax.jit(stack, out_shardings=state_shardings(state, mesh))(state)


def rank_inputs(per_rank: list, mesh: Mesh):
    """Per-rank numpy input pytrees (equal shapes) -> one [dp, ...] pytree split over "data"."""
    ranked = NamedSharding(mesh, P(DATA))
    return jax.tree.map(lambda *xs: jax.device_put(np.stack(xs), ranked), *per_rank)


def data_part(spec: P) -> P:
    """The "data" part of a param's spec: what shard_map splits; "tensor" stays automatic."""
    return P(*(DATA if (e == DATA or (isinstance(e, tuple) and DATA in e)) else None for e in spec))


class RankStep:
    """A single-rank step `(state, out) = step(*shared, state, *inputs, **static)` run on every
    DP rank in one dispatch.

    shared: the spec pytrees of the leading arguments that are the same for every rank (the
    params: each rank receives its "data" slice of them, e.g. its 1/dp of the MLP). The state
    and every later argument are per rank, with a leading [dp] axis; each rank's step sees its
    own slice without that axis. Outputs get the leading [dp] axis back. The state is donated.
    """

    def __init__(self, step, mesh: Mesh, shared: tuple):
        self.step, self.mesh, self.shared = step, mesh, shared
        self._jitted = {}  # per set of static argument names

    def __call__(self, *args, **static):
        names = tuple(sorted(static))
        if names not in self._jitted:
            self._jitted[names] = jax.jit(self._run, static_argnames=names, donate_argnums=(len(self.shared),))
        with jax.set_mesh(self.mesh):
            return self._jitted[names](*args, **static)

    def _run(self, *args, **static):
        n = len(self.shared)

        def body(*local):
            mine = [jax.tree.map(lambda x: x[0], a) for a in local[n:]]
            return jax.tree.map(lambda x: x[None], self.step(*local[:n], *mine, **static))

        in_specs = tuple(self.shared) + (P(DATA),) * (len(args) - n)
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=P(DATA), axis_names={DATA}, check_vma=False
        )(*args)
