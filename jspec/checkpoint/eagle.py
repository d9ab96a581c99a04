"""EAGLE / EAGLE-3 draft-head checkpoints -> `DraftConfig` (config/draft.py) + draft param pytree.

`load_draft_model(path, target_cfg)` reads a draft directory (config.json plus safetensors,
sharded or not, or pytorch_model.bin read without torch: checkpoint/torch_pickle.py). What the draft forward computes,
the capture-layer conventions and the pytree are as SGLang reads these heads:
docs/design-details.md, "EAGLE and EAGLE-3 heads".
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingTensorError,
    NoSafetensorsError,
    TensorShapeError,
)
from jspec.checkpoint.files import read_hf_tensors
from jspec.checkpoint.random_weights import random_weights
from jspec.checkpoint.torch_pickle import read_torch_bin_file
from jspec.config.draft import DraftConfig, default_capture_layers, normalize_algorithm
from jspec.config.errors import UnsupportedArchitectureError
from jspec.config.model import ModelConfig

log = logging.getLogger(__name__)


class UnknownDraftLayoutError(CheckpointError):
    """The checkpoint's tensors are neither an EAGLE nor an EAGLE-3 head."""


class DraftAlgorithmMismatchError(CheckpointError):
    """The requested algorithm (or config.json) disagrees with the tensors."""


# ---------------------------------------------------------------------------
# Reading a draft directory
# ---------------------------------------------------------------------------


def _has_safetensors(path: str) -> bool:
    return (
        os.path.isfile(os.path.join(path, "model.safetensors"))
        or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
        or any(f.startswith("model-") and f.endswith(".safetensors") for f in os.listdir(path))
    )


def read_draft_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A draft directory's tensors by name: safetensors (single or sharded)
    when present, else pytorch_model.bin (single or sharded by
    pytorch_model.bin.index.json). A leading "model." is stripped from every
    name, since converters disagree on it (SGLang adds it on load)."""
    path = os.fspath(path)
    if _has_safetensors(path):
        raw = read_hf_tensors(path)
    else:
        index = os.path.join(path, "pytorch_model.bin.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set((json.load(f).get("weight_map") or {}).values()))
            missing = [s for s in files if not os.path.isfile(os.path.join(path, s))]
            if missing or not files:
                raise NoSafetensorsError(
                    f"draft directory {path!r}: pytorch_model.bin.index.json lists missing or no shards ({missing})"
                )
        elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            files = ["pytorch_model.bin"]
        else:
            raise NoSafetensorsError(
                f"draft directory {path!r} has no model.safetensors, model.safetensors.index.json, "
                f"pytorch_model.bin or pytorch_model.bin.index.json; it contains {sorted(os.listdir(path))[:20]}"
            )
        raw = {}
        for fname in files:
            for name, arr in read_torch_bin_file(os.path.join(path, fname)).items():
                if name in raw:
                    raise CorruptCheckpointError(f"tensor {name!r} appears in more than one shard of {path!r}")
                raw[name] = arr
    out: dict[str, np.ndarray] = {}
    for name, arr in raw.items():
        short = name[len("model.") :] if name.startswith("model.") else name
        if short in out:
            raise CorruptCheckpointError(f"draft checkpoint {path!r} has both {name!r} and {short!r}")
        out[short] = arr
    return out


_EAGLE_LAYER = re.compile(r"layers\.(\d+)\.")


def detect_algorithm(hf: Mapping[str, Any], tensors: Mapping[str, Any], where: str = "(in memory)") -> str:
    """EAGLE or EAGLE3 from tensor names (authoritative), checked against
    config.json's architectures when that names one."""
    names = list(tensors)
    if any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in names) or "d2t" in tensors:
        found = "EAGLE3"
    elif "fc.weight" in tensors and any(_EAGLE_LAYER.match(n) for n in names):
        found = "EAGLE"
    else:
        full_model = "embed_tokens.weight" in tensors and "norm.weight" in tensors
        raise UnknownDraftLayoutError(
            f"draft checkpoint {where}: neither an EAGLE head (fc.weight + layers.N.*) nor an EAGLE-3 head "
            f"(fc.weight + midlayer.*, d2t)"
            + (" (it looks like a full model: a draft head has an fc layer)" if full_model else "")
            + f"; it has {len(names)} tensor(s), e.g. {sorted(names)[:8]}"
        )
    archs = [str(a) for a in (hf.get("architectures") or [])]
    hinted = (
        "EAGLE3"
        if any("eagle3" in a.lower() for a in archs)
        else ("EAGLE" if any("eagle" in a.lower() for a in archs) else None)
    )
    if hinted is not None and hinted != found:
        raise DraftAlgorithmMismatchError(
            f"draft checkpoint {where}: config.json architectures {archs} say {hinted}, but the tensors are an "
            f"{found} head"
        )
    return found


def _parse_draft_hf(hf: Mapping[str, Any], target: ModelConfig, where: str) -> ModelConfig:
    """The draft layer's shapes and RoPE, parsed by ModelConfig.from_hf (same
    defaults as transformers' LlamaConfig, e.g. rope_theta 10000 when absent,
    which is what the head was trained with); missing shape fields fall back
    to the target's, as EAGLE heads copy the target's layer shapes."""
    d = dict(hf)
    d["architectures"] = ["LlamaForCausalLM"]
    d.setdefault("vocab_size", target.vocab_size)
    d.setdefault("hidden_size", target.hidden_size)
    d.setdefault("intermediate_size", target.intermediate_size)
    d.setdefault("num_hidden_layers", 1)
    if "num_attention_heads" not in d:
        d.update(
            num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads, head_dim=target.head_dim
        )
    try:
        return ModelConfig.from_hf(d)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{e} [draft checkpoint {where}]") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"draft config.json in {where} lacks or mistypes a field: {e}") from None


def _capture_layers(hf: Mapping[str, Any], target: ModelConfig, where: str) -> tuple[int, ...]:
    eagle_cfg = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
    if eagle_cfg.get("eagle_aux_hidden_state_layer_ids"):
        src = "eagle_config.eagle_aux_hidden_state_layer_ids"
        ids = [int(i) + 1 for i in eagle_cfg["eagle_aux_hidden_state_layer_ids"]]  # SGLang: output of layer i
    elif hf.get("eagle_aux_hidden_state_layer_ids"):
        src = "eagle_aux_hidden_state_layer_ids"
        ids = [int(i) for i in hf["eagle_aux_hidden_state_layer_ids"]]  # vLLM: entering layer i
    else:
        src = f"the default [2, L//2, L-3] for the target's L={target.num_layers} layers"
        ids = list(default_capture_layers(target.num_layers))
    if len(set(ids)) != len(ids) or not all(0 <= i <= target.num_layers for i in ids):
        raise CheckpointError(
            f"draft checkpoint {where}: capture layers {ids} (from {src}, as layers whose input is captured) "
            f"must be distinct and within [0, {target.num_layers}] for a {target.num_layers}-layer target"
        )
    return tuple(sorted(ids))


def _eagle3_prefix(tensors: Mapping[str, Any]) -> str:
    """SafeAILab/SGLang name the layer midlayer.*; vLLM-speculators exports use layers.0.*."""
    if "midlayer.self_attn.q_proj.weight" not in tensors and "layers.0.self_attn.q_proj.weight" in tensors:
        return "layers.0."
    return "midlayer."


def _layer_shapes(cfg: DraftConfig, p: str) -> dict[str, tuple[int, ...]]:
    H, I, A = cfg.hidden_size, cfg.intermediate_size, cfg.attn_in
    return {
        p + "self_attn.q_proj.weight": (cfg.q_size, A),
        p + "self_attn.k_proj.weight": (cfg.kv_size, A),
        p + "self_attn.v_proj.weight": (cfg.kv_size, A),
        p + "self_attn.o_proj.weight": (H, cfg.q_size),
        p + "post_attention_layernorm.weight": (H,),
        p + "mlp.gate_proj.weight": (I, H),
        p + "mlp.up_proj.weight": (I, H),
        p + "mlp.down_proj.weight": (H, I),
    }


def _expected_shapes(cfg: DraftConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every HF tensor `cfg` needs, in HF's [out, in] layout."""
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (H, cfg.fc_in)}
    if cfg.fc_bias:
        shapes["fc.bias"] = (H,)
    if cfg.algorithm == "EAGLE":
        shapes.update(_layer_shapes(cfg, "layers.0."))
    else:
        shapes.update(_layer_shapes(cfg, prefix))
        shapes[prefix + "input_layernorm.weight"] = (H,)
        shapes[prefix + "hidden_norm.weight"] = (H,)
        shapes["norm.weight"] = (H,)
    if cfg.has_lm_head:
        shapes["lm_head.weight"] = (cfg.draft_vocab_size, H)
    if cfg.has_embed:
        shapes["embed_tokens.weight"] = (cfg.vocab_size, H)
    return shapes


def _check_tensors(cfg: DraftConfig, tensors: Mapping[str, Any], prefix: str, where: str, layout_note: str) -> None:
    expected = _expected_shapes(cfg, prefix)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise MissingTensorError(
            f"draft checkpoint {where}: missing {len(missing)} tensor(s) required for an {cfg.algorithm} head "
            f"with {cfg.num_layers} layer(s): {', '.join(repr(n) for n in missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    bad = [(n, s, tuple(tensors[n].shape)) for n, s in expected.items() if tuple(tensors[n].shape) != s]
    if bad:
        lines = "; ".join(f"{n!r}: expected {list(s)}, got {list(g)}" for n, s, g in bad[:8])
        raise TensorShapeError(
            f"draft checkpoint {where}: {len(bad)} tensor(s) disagree with the target ({layout_note}; "
            f"HF layout, nn.Linear weights are [out, in]): {lines}"
        )
    optional = {"t2d", "d2t", "layers.0.input_layernorm.weight"}
    unused = [n for n in tensors if n not in expected and n not in optional and not n.endswith("rotary_emb.inv_freq")]
    biases = [n for n in unused if n.endswith(".bias")]
    if biases:  # ignoring a bias would silently change the math
        raise CheckpointError(f"draft checkpoint {where}: unsupported bias tensor(s) {biases[:8]}")
    if unused:
        log.warning("draft checkpoint %s: ignoring %d unexpected tensor(s), e.g. %s", where, len(unused), unused[:4])


def draft_config_from_hf(
    hf: Mapping[str, Any],
    target: ModelConfig,
    tensors: Mapping[str, Any],
    algorithm: str | None = None,
    where: str = "(in memory)",
) -> DraftConfig:
    """Builds and validates the DraftConfig of a head (tensor names and shapes
    included; values are not read)."""
    found = detect_algorithm(hf, tensors, where)
    if algorithm is not None and normalize_algorithm(algorithm) != found:
        raise DraftAlgorithmMismatchError(
            f"draft checkpoint {where} is an {found} head (by its tensor names), but algorithm "
            f"{normalize_algorithm(algorithm)} was requested (--speculative-algorithm)"
        )
    lc = _parse_draft_hf(hf, target, where)
    H = target.hidden_size
    for field in ("hidden_size", "target_hidden_size"):
        if field in hf and int(hf[field]) != H:
            raise TensorShapeError(
                f"draft checkpoint {where}: config.json {field} is {hf[field]}, but the target's hidden_size is {H}"
            )
    if int(hf.get("vocab_size", target.vocab_size)) != target.vocab_size:
        log.warning(
            "draft checkpoint %s: config.json vocab_size %s differs from the target's %d; using the target's",
            where,
            hf.get("vocab_size"),
            target.vocab_size,
        )
    has_embed = "embed_tokens.weight" in tensors
    prefix = ""
    if lc.num_layers != 1:
        # The forward gives every layer the same norms; an EAGLE head with more
        # layers has none before layer 0 but one before the others.
        raise CheckpointError(
            f"draft checkpoint {where}: {found} heads with num_hidden_layers={lc.num_layers} are "
            f"not supported (only 1, the published layout)"
        )
    if found == "EAGLE":
        num_layers, capture = 1, ()
        if "layers.0.input_layernorm.weight" in tensors:
            log.warning(
                "draft checkpoint %s: ignoring layers.0.input_layernorm.weight (EAGLE's first layer has no "
                "input norm; SGLang drops it too)",
                where,
            )
        has_lm_head, draft_vocab = "lm_head.weight" in tensors, target.vocab_size
    else:
        num_layers, capture, prefix = 1, _capture_layers(hf, target, where), _eagle3_prefix(tensors)
        cfg_vocab = hf.get("draft_vocab_size")
        if "lm_head.weight" in tensors:
            has_lm_head = True
            draft_vocab = int(cfg_vocab) if cfg_vocab is not None else int(tensors["lm_head.weight"].shape[0])
        elif cfg_vocab is not None and int(cfg_vocab) != target.vocab_size:
            raise MissingTensorError(
                f"draft checkpoint {where}: missing tensor 'lm_head.weight' (draft_vocab_size={cfg_vocab} needs "
                f"the head's own lm_head)"
            )
        elif hf.get("tie_word_embeddings") and not has_embed:
            raise CheckpointError(
                f"draft checkpoint {where}: a tied EAGLE3 head without embed_tokens.weight is not supported"
            )
        else:  # SGLang's load_lm_head_from_target (or a tied head, whose lm_head is its embedding)
            has_lm_head = bool(hf.get("tie_word_embeddings"))
            draft_vocab = target.vocab_size
    cfg = DraftConfig(
        algorithm=found,
        hidden_size=H,
        intermediate_size=lc.intermediate_size,
        num_heads=lc.num_heads,
        num_kv_heads=lc.num_kv_heads,
        head_dim=lc.head_dim,
        rms_norm_eps=lc.rms_norm_eps,
        rope_theta=lc.rope_theta,
        rope_scaling=lc.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab,
        num_layers=num_layers,
        capture_layers=capture,
        fc_bias="fc.bias" in tensors or bool(hf.get("bias", False) and found == "EAGLE3"),
        has_embed=has_embed,
        has_lm_head=has_lm_head,
    )
    note = (
        f"hidden {H}, heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, intermediate "
        f"{cfg.intermediate_size}, draft vocab {cfg.draft_vocab_size}"
    )
    tensors_for_check = dict(tensors)
    if hf.get("tie_word_embeddings") and found == "EAGLE3" and "lm_head.weight" not in tensors:
        tensors_for_check["lm_head.weight"] = tensors["embed_tokens.weight"]
    _check_tensors(cfg, tensors_for_check, prefix, where, note)
    return cfg


# ---------------------------------------------------------------------------
# HF names -> param pytree
# ---------------------------------------------------------------------------


def _d2t(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], where: str) -> np.ndarray:
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            log.warning("draft checkpoint %s: no d2t; draft token i is taken to be target token i", where)
        return np.zeros(cfg.draft_vocab_size, np.int32)
    d2t = np.asarray(tensors["d2t"])
    if d2t.shape != (cfg.draft_vocab_size,) or d2t.dtype.kind not in "iu":
        raise TensorShapeError(
            f"draft checkpoint {where}: 'd2t': expected [{cfg.draft_vocab_size}] integers, "
            f"got {list(d2t.shape)} {d2t.dtype}"
        )
    target_ids = np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t.astype(np.int64)
    if target_ids.size and (target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size):
        raise CheckpointError(
            f"draft checkpoint {where}: d2t maps draft ids outside the target vocab "
            f"[0, {cfg.vocab_size}) (target_id = draft_id + d2t[draft_id])"
        )
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"])
        if t2d.shape != (cfg.vocab_size,):
            raise TensorShapeError(
                f"draft checkpoint {where}: 't2d': expected [{cfg.vocab_size}], got {list(t2d.shape)}"
            )
        if not t2d.astype(bool)[target_ids].all():
            log.warning("draft checkpoint %s: t2d disagrees with d2t (t2d is unused; d2t wins)", where)
    return d2t.astype(np.int32)


def convert_draft_params(
    cfg: DraftConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any = jnp.float32,
    *,
    device: jax.Device | None = None,
    where: str = "(in memory)",
) -> dict[str, Any]:
    """HF-named tensors (validated by draft_config_from_hf) -> the draft pytree.
    Heads are small, so tensors go to the device one by one and are cast and
    transposed there."""
    dtype = jnp.dtype(dtype)

    def vec(name: str) -> jax.Array:
        return jax.device_put(np.asarray(tensors[name]), device).astype(dtype)

    def lin(name: str) -> jax.Array:  # [out, in] -> [in, out]
        return vec(name).T

    def layer(p: str) -> dict[str, jax.Array]:
        return {
            "wqkv": jnp.concatenate([lin(p + f"self_attn.{x}_proj.weight") for x in "qkv"], axis=1),
            "wo": lin(p + "self_attn.o_proj.weight"),
            "mlp_norm": vec(p + "post_attention_layernorm.weight"),
            "w_gate_up": jnp.concatenate([lin(p + "mlp.gate_proj.weight"), lin(p + "mlp.up_proj.weight")], axis=1),
            "w_down": lin(p + "mlp.down_proj.weight"),
        }

    if cfg.algorithm == "EAGLE":
        per_layer = [layer("layers.0.")]
    else:
        p = _eagle3_prefix(tensors)
        per_layer = [
            {**layer(p), "attn_norm": vec(p + "input_layernorm.weight"), "hidden_norm": vec(p + "hidden_norm.weight")}
        ]
    params: dict[str, Any] = {
        "fc": lin("fc.weight"),
        "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer),
    }
    if cfg.fc_bias:
        params["fc_bias"] = vec("fc.bias")
    if cfg.algorithm == "EAGLE3":
        params["final_norm"] = vec("norm.weight")
        params["d2t"] = jax.device_put(_d2t(cfg, tensors, where), device)
    if cfg.has_lm_head:
        params["lm_head"] = lin("lm_head.weight" if "lm_head.weight" in tensors else "embed_tokens.weight")
    if cfg.has_embed:
        params["embed"] = vec("embed_tokens.weight")
    return params


def draft_param_shapes(cfg: DraftConfig) -> dict[str, Any]:
    """The pytree's leaf shapes (same structure as the params; d2t is int32)."""
    H, I, Ld = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    layers = {
        "wqkv": (Ld, cfg.attn_in, cfg.q_size + 2 * cfg.kv_size),
        "wo": (Ld, cfg.q_size, H),
        "mlp_norm": (Ld, H),
        "w_gate_up": (Ld, H, 2 * I),
        "w_down": (Ld, I, H),
    }
    if cfg.algorithm == "EAGLE3":
        layers["attn_norm"] = (Ld, H)
        layers["hidden_norm"] = (Ld, H)
    shapes: dict[str, Any] = {"fc": (cfg.fc_in, H), "layers": layers}
    if cfg.fc_bias:
        shapes["fc_bias"] = (H,)
    if cfg.algorithm == "EAGLE3":
        shapes["final_norm"] = (H,)
        shapes["d2t"] = (cfg.draft_vocab_size,)
    if cfg.has_lm_head:
        shapes["lm_head"] = (H, cfg.draft_vocab_size)
    if cfg.has_embed:
        shapes["embed"] = (cfg.vocab_size, H)
    return shapes


def init_random_draft_params(
    cfg: DraftConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02
) -> dict[str, Any]:
    """Random params in the draft pytree (checkpoint/random_weights.py's rule); d2t maps the
    draft vocab onto a random sorted subset of the target vocab (zeros when the vocabs are equal)."""
    shapes = draft_param_shapes(cfg)
    with_d2t = shapes.pop("d2t", None) is not None
    key, k_vocab = jax.random.split(key)
    params = random_weights(shapes, key, dtype, std)
    if with_d2t:
        Vd, V = cfg.draft_vocab_size, cfg.vocab_size
        hot = jnp.sort(jax.random.permutation(k_vocab, V)[:Vd]) if Vd < V else jnp.arange(V)
        params["d2t"] = (hot - jnp.arange(Vd)).astype(jnp.int32)
    return params


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def read_draft_config(path: str, what: str) -> dict[str, Any]:
    """A draft checkpoint's config.json; `what` names the kind of directory in the errors."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {what} directory {path!r}")
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise CheckpointError(f"unreadable config.json in {path!r}: {e}") from None


def default_draft_dtype():
    """A draft's weights: bfloat16 on a GPU backend, float32 otherwise."""
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def load_draft_model(
    path: str | os.PathLike, target_cfg: ModelConfig, dtype: Any = None, algorithm: str | None = None
) -> tuple[DraftConfig, dict[str, Any]]:
    """Loads an EAGLE or EAGLE-3 draft head for `target_cfg`.

    algorithm None: detected from the tensor names; otherwise it must agree
    with them (DraftAlgorithmMismatchError). dtype None: bfloat16 on a GPU
    backend, float32 otherwise (d2t is int32 regardless). Errors are
    CheckpointError subclasses naming the tensor or field at fault.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"draft model directory {path!r} does not exist or is not a directory")
    hf = read_draft_config(path, "draft model")
    dtype = default_draft_dtype() if dtype is None else dtype
    tensors = read_draft_tensors(path)
    where = repr(path)
    cfg = draft_config_from_hf(hf, target_cfg, tensors, algorithm, where)
    return cfg, convert_draft_params(cfg, tensors, dtype, where=where)
