"""The device pool of resident LoRA adapters.

For a fused projection the pool appends each slot's A columns to the model's weight and keeps
the B matrices beside it, so the model's own matmul yields [y | u] and layers/lora.py adds
mask(u) @ B: every token's own delta, whatever mix of adapters a batch holds. Loading writes a
slot in place (no recompilation). Under TP or DP attention the pool's parts take the sharded
weights' layouts, so the delta adds no collective. docs/design-details.md, "The LoRA pool".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.config.model import ModelConfig
from jspec.distributed.mesh import DATA, TENSOR
from jspec.distributed.tensor_parallel import block_columns, kv_head_repeat, repeat_kv_columns
from jspec.layers.lora import LoraWeights
from jspec.lora.adapter import FUSED_PROJECTIONS, LoraAdapter, LoraError, module_shapes

# fused projection -> the model's weight that carries its a_P columns (models/llama.py).
PROJECTION_WEIGHT = {"qkv": "wqkv", "gate_up": "w_gate_up", "o": "wo", "down": "w_down"}


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """fused projection -> (input width, output width of each of its modules)."""
    shapes = module_shapes(cfg)
    return {p: (shapes[ms[0]][0], [shapes[m][1] for m in ms]) for p, ms in FUSED_PROJECTIONS.items()}


@dataclasses.dataclass(frozen=True)
class ProjectionLayout:
    """How a fused projection's weight lies on the mesh, and so where the pool's parts go.

    plain: [in, out] (one device; or row-parallel o / down under TP, split over `in`, so u
    comes out of the all-reduce XLA already puts after the matmul, and B is whole on each
    device). blocked: column-parallel qkv / gate_up under TP, [in, k, out / k] (k = the
    "tensor" size): a_P on every shard (u is tiny, computing it k times costs nothing), B
    split as the weight. DP attention's MLP adds a rank axis: ranked_blocked gate_up [in,
    dp, k, out / tp] (A on every block, B split over both axes), ranked_rows down [dp,
    in / dp, out] (A split over `in` as the weight, B whole). None of it adds a collective.
    """

    kind: str  # "plain", "blocked", "ranked_blocked" or "ranked_rows"
    fan_in: int
    held: tuple[int, ...]  # module widths as the model holds them (k / v widened by kv_repeat)
    dp: int = 1
    k: int = 1
    w_spec: tuple | None = None  # None: one device, nothing to place
    b_spec: tuple = ()

    @property
    def out(self) -> int:
        """The weight's last axis before the pool's columns."""
        return sum(self.held) // {"blocked": self.k, "ranked_blocked": self.dp * self.k}.get(self.kind, 1)

    def w_lead(self) -> tuple[int, ...]:
        return {
            "plain": (self.fan_in,),
            "blocked": (self.fan_in, self.k),
            "ranked_blocked": (self.fan_in, self.dp, self.k),
            "ranked_rows": (self.dp, self.fan_in // self.dp),
        }[self.kind]

    def b_shape(self, rows: int) -> tuple[int, ...]:
        if self.kind == "blocked":
            return (rows, self.k, self.out)
        if self.kind == "ranked_blocked":
            return (rows, self.dp, self.k, self.out)
        return (rows, sum(self.held))

    def lay_a(self, A: np.ndarray) -> np.ndarray:
        """A [in, cols] -> the weight's leading shape + (cols,)."""
        if self.kind == "ranked_rows":
            return A.reshape(self.dp, -1, A.shape[1])
        return np.broadcast_to(
            A.reshape(A.shape[0], *(1,) * (len(self.w_lead()) - 1), A.shape[1]), (*self.w_lead(), A.shape[1])
        )

    def lay_b(self, B: np.ndarray) -> np.ndarray:
        """B [rows, sum(held)] -> b_shape(rows)."""
        if self.kind not in ("blocked", "ranked_blocked"):
            return B
        return np.asarray(block_columns(B, self.held, self.dp * self.k)).reshape(self.b_shape(B.shape[0]))


def projection_layouts(cfg: ModelConfig, mesh) -> tuple[dict[str, ProjectionLayout], int]:
    """Each fused projection's layout on mesh (None, TP's ("tensor",) or DP attention's
    ("data", "tensor")), and the factor the model repeats KV heads by (replicate_kv_heads)."""
    shapes = projection_shapes(cfg)
    if mesh is None:
        return {p: ProjectionLayout("plain", fan_in, tuple(outs)) for p, (fan_in, outs) in shapes.items()}, 1
    if set(mesh.axis_names) - {DATA, TENSOR}:
        raise ValueError(f"LoRA on a mesh with axes {mesh.axis_names} is not supported")
    dp, k = mesh.shape.get(DATA, 1), mesh.shape[TENSOR]
    kv_repeat = kv_head_repeat(cfg, k)
    held = {
        p: tuple([outs[0]] + [o * kv_repeat for o in outs[1:]] if p == "qkv" else outs)
        for p, (_, outs) in shapes.items()
    }
    L = lambda p, kind, **kw: ProjectionLayout(kind, shapes[p][0], held[p], **kw)  # noqa: E731
    out = {
        "qkv": L("qkv", "blocked", k=k, w_spec=(None, TENSOR, None), b_spec=(None, TENSOR, None)),
        "o": L("o", "plain", w_spec=(TENSOR, None)),
    }
    if DATA in mesh.axis_names:
        out["gate_up"] = L(
            "gate_up",
            "ranked_blocked",
            dp=dp,
            k=k,
            w_spec=(None, DATA, TENSOR, None),
            b_spec=(None, DATA, TENSOR, None),
        )
        out["down"] = L("down", "ranked_rows", dp=dp, w_spec=(DATA, TENSOR, None))
    else:
        out["gate_up"] = L("gate_up", "blocked", k=k, w_spec=(None, TENSOR, None), b_spec=(None, TENSOR, None))
        out["down"] = L("down", "plain", w_spec=(TENSOR, None))
    return out, kv_repeat


def _write(arr, val, start):
    return jax.lax.dynamic_update_slice(arr, val.astype(arr.dtype), start)


@functools.cache
def _writer(sharding):
    # Donated, so a load does not hold two copies of the pool; offsets traced, so one compile
    # per array shape whatever the slot; the result placed as the array was.
    return jax.jit(_write, donate_argnums=0, out_shardings=sharding)


def _write_donated(arr, val, *start):
    return _writer(arr.sharding)(arr, val, tuple(jnp.int32(i) for i in start))


class LoraPool:
    """Resident adapters: the device arrays and the host registry name -> slot.

    max_loras adapters fit at once (slots 1..max_loras; slot 0 is no adapter). Loading writes
    an adapter's matrices into a free slot without touching the compiled steps (the pool's
    shapes never change); unloading frees the slot for the next load. cfg is the
    checkpoint's config (what adapters are checked against); mesh, the mesh the model's
    params are laid out on (TP's shard_params or DP attention's shard_params_dp), or None.
    """

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, mesh=None, stacked: bool = True):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        self.cfg, self.max_loras, self.max_rank, self.mesh = cfg, max_loras, max_rank, mesh
        self.layouts, self.kv_repeat = projection_layouts(cfg, mesh)
        # An MoE layer's MLP is its experts: no adapter there, so no pool parts either.
        self.projections = [
            tuple(p for p in FUSED_PROJECTIONS if p in ("qkv", "o") or i not in cfg.moe_layers)
            for i in range(cfg.num_layers)
        ]
        # Stacked like the model's layers (a scan slices both alike), which are then all alike.
        self.stacked = stacked
        if stacked and len(set(self.projections)) > 1:
            raise ValueError("a stacked LoRA pool needs alike layers; this model mixes dense and MoE layers")

        def b_zeros(p, *lead):
            shape, spec = self.layouts[p].b_shape(self._columns(p)), self.layouts[p].b_spec
            return self._place(jnp.zeros((*lead, *shape), dtype), (None,) * len(lead) + tuple(spec or ()))

        L = cfg.num_layers
        layers = (
            {"b_" + p: b_zeros(p, L) for p in self.projections[0]}
            if stacked
            else [{"b_" + p: b_zeros(p) for p in self.projections[i]} for i in range(L)]
        )
        self.weights = LoraWeights(layers, self._place(jnp.zeros(max_loras, jnp.float32), ()))
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.num_loads = 0  # gives each load its uid
        self.adapters: dict[str, LoraAdapter] = {}

    def _columns(self, p: str) -> int:
        """N of fused projection P: S * G * r_max."""
        return self.max_loras * len(FUSED_PROJECTIONS[p]) * self.max_rank

    def _place(self, x, spec: tuple | None):
        if self.mesh is None:
            return x

        return jax.device_put(x, NamedSharding(self.mesh, P(*spec)))

    def extend_params(self, params) -> dict:
        """The model's params with every fused projection weight grown by its a_P columns
        (zeros: no adapter yet); a copy, the caller's params are left as they were. The
        layers are stacked or per-layer, as this pool is."""
        layers = params["layers"]
        if isinstance(layers, (list, tuple)) == self.stacked:
            raise ValueError(
                f"this LoRA pool is {'stacked' if self.stacked else 'per-layer'}; the model's layers are not"
            )

        def extend(lp, projections, lead):
            lp = dict(lp)
            for p in projections:
                lay = self.layouts[p]
                w, want = lp[PROJECTION_WEIGHT[p]], (*lead, *lay.w_lead(), lay.out)
                if w.shape != want:
                    raise ValueError(
                        f"{PROJECTION_WEIGHT[p]} has shape {w.shape}, expected {want} "
                        f"(already extended, or not this model's weights)"
                    )
                zeros = jnp.zeros((*w.shape[:-1], self._columns(p)), w.dtype)
                spec = lay.w_spec and (None,) * len(lead) + tuple(lay.w_spec)
                lp[PROJECTION_WEIGHT[p]] = self._place(jnp.concatenate([w, zeros], axis=-1), spec)
            return lp

        if self.stacked:
            return {**params, "layers": extend(layers, self.projections[0], (self.cfg.num_layers,))}
        return {**params, "layers": [extend(lp, self.projections[i], ()) for i, lp in enumerate(layers)]}

    def load(self, adapter: LoraAdapter, params) -> tuple[int, dict]:
        """Writes the adapter into a free slot: its b_P into the pool, its a_P into params
        (extend_params' result, donated). Returns (slot, the new params). Every check runs
        before the first write; the writes donate (the weights are not held twice), so a
        device failure part way (out of memory) leaves the engine to be restarted."""
        if adapter.name in self.slots:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded (unload it first)")
        if adapter.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank={self.max_rank}")
        free = [s for s in range(1, self.max_loras + 1) if s not in self.slots.values()]
        if not free:
            raise ValueError(
                f"all {self.max_loras} LoRA slots are in use ({sorted(self.slots)}); unload one or raise max_loras"
            )
        slot = free[0]
        r, R = adapter.rank, self.max_rank
        # A stacked pool is written whole per projection (the layer axis leads); a per-layer
        # one layer by layer: either way, one writer program per array shape.
        if self.stacked:
            layers, model_layers = dict(self.weights.layers), dict(params["layers"])
            targets = [(layers, model_layers, list(range(self.cfg.num_layers)))]
        else:
            layers = [dict(lw) for lw in self.weights.layers]
            model_layers = [dict(lp) for lp in params["layers"]]
            targets = [(lw, lp, [i]) for i, (lw, lp) in enumerate(zip(layers, model_layers))]
        # The slot's whole block is written (zeros where the adapter has no module or its rank
        # is below r_max), so nothing of the slot's previous adapter survives.
        for p, (fan_in, outs) in projection_shapes(self.cfg).items():
            G, name, lay = len(outs), PROJECTION_WEIGHT[p], self.layouts[p]
            col_of = np.cumsum([0] + outs)
            off = (slot - 1) * G * R
            for lw, lp, layer_ids in targets:
                if p not in self.projections[layer_ids[0]]:
                    continue
                As, Bs = [], []
                for layer in layer_ids:
                    A = np.zeros((fan_in, G * R), np.float32)
                    B = np.zeros((G * R, sum(outs)), np.float32)
                    for g, module in enumerate(FUSED_PROJECTIONS[p]):
                        if module in adapter.weights:
                            A[:, g * R : g * R + r] = adapter.weights[module][0][layer]
                            B[g * R : g * R + r, col_of[g] : col_of[g + 1]] = adapter.weights[module][1][layer]
                    if p == "qkv" and self.kv_repeat > 1:
                        B = np.asarray(repeat_kv_columns(self.cfg, B, self.kv_repeat))
                    Bs.append(lay.lay_b(B))
                    As.append(lay.lay_a(A))
                B, A = (np.stack(Bs), np.stack(As)) if self.stacked else (Bs[0], As[0])
                lead = (0,) if self.stacked else ()
                lw["b_" + p] = _write_donated(
                    lw["b_" + p], jnp.asarray(B), *lead, off, *(0,) * (B.ndim - 1 - len(lead))
                )
                lp[name] = _write_donated(lp[name], jnp.asarray(A), *(0,) * (A.ndim - 1), lay.out + off)
        scale = self.weights.scale.at[slot - 1].set(adapter.scaling)
        self.weights = LoraWeights(layers, self._place(scale, ()))
        self.num_loads += 1
        adapter.uid = self.num_loads
        self.slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot, {**params, "layers": model_layers}

    def unload(self, name: str) -> None:
        if name not in self.slots:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.slots)})")
        slot = self.slots.pop(name)
        del self.adapters[name]
        # Zero its scale: a token that still names the slot (none should) gets no delta.
        self.weights = self.weights._replace(scale=self._place(self.weights.scale.at[slot - 1].set(0.0), ()))

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return 0
        if name not in self.slots:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.slots)}")
        return self.slots[name]
