"""Tiny random-weight HF checkpoints, written without torch.

`make_tiny_model(out_dir)` writes what `from_pretrained` expects: config.json,
model.safetensors (or shards + index), generation_config.json, and a
byte-level tokenizer (tokenizer.json + tokenizer_config.json). It is the
default model of scripts/generate.py and the fixture of CPU tests, so shapes
are small and the weights are scaled to give peaked attention and logits
(N(0, 1/fan_in) rather than HF's 0.02, which makes every attention pattern
nearly uniform and hides position bugs).

Token ids 0..255 are the raw bytes (through GPT-2's byte-to-unicode alphabet),
then the special tokens; the vocab in config.json is padded beyond that, as
real checkpoints pad theirs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from jspec.checkpoint.files import write_safetensors
from jspec.checkpoint.random_weights import random_weights

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
MOE_ARCHS = ("qwen3_moe", "mixtral")
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
BOS_ID = 256
EOS_IDS = [257, 258]  # <|end_of_text|>, <|eot_id|>
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: with head_dim 16 all three llama3 bands (kept, smoothed, scaled) occur.
    "original_max_position_embeddings": 64,
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def build_byte_tokenizer():
    """A `tokenizers.Tokenizer`: id b (0..255) is byte b, then SPECIAL_TOKENS; prepends BOS."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    assert tok.token_to_id(bos) == BOS_ID and tok.get_vocab_size() == 256 + len(SPECIAL_TOKENS)
    return tok


def _hf_config(
    arch: str,
    *,
    vocab_size,
    hidden_size,
    intermediate_size,
    num_layers,
    num_heads,
    num_kv_heads,
    head_dim,
    tie_word_embeddings,
    rope_theta,
    rope_scaling,
    max_position_embeddings,
    dtype,
    num_experts=4,
    num_experts_per_tok=2,
) -> dict:
    """config.json in the pre-transformers-5 style (rope_theta + rope_scaling), as
    most published checkpoints are; checkpoints made by transformers 5 itself
    (rope_parameters) are covered by tests/support/hf_oracle.py."""
    architecture, model_type = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5 if arch in ("llama", "mistral") else 1e-6,
        "rope_theta": rope_theta if rope_theta is not None else (500000.0 if arch == "llama" else 1000000.0),
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_IDS,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(LLAMA3_ROPE_SCALING) if rope_scaling == "llama3" else dict(rope_scaling)
    if arch in ("llama", "mistral", "qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("mistral", "mixtral"):
        cfg["sliding_window"] = None  # Mistral v0.3 style: full attention
    if arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if arch == "qwen3_moe":  # Qwen3-30B-A3B's fields; experts half as wide as the (unused) dense MLP
        cfg.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            norm_topk_prob=True,
            moe_intermediate_size=intermediate_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "mixtral":
        cfg.update(num_local_experts=num_experts, num_experts_per_tok=num_experts_per_tok)
    return cfg


def hf_std(init_std: float | None = None):
    """The std of an HF-named tensor: biases 0.1, the embedding init_std or 1, a Linear
    ([out, in]) init_std or in ** -0.5 (norm scales are random_weights' own rule)."""

    def std(name: str, shape: tuple[int, ...]) -> float:
        if "bias" in name:
            return 0.1
        if "embed_tokens" in name:
            return init_std or 1.0
        return init_std if init_std is not None else shape[-1] ** -0.5

    return std


def draw_hf_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, init_std: float | None = None
) -> dict[str, np.ndarray]:
    """Float32 numpy tensors for HF-named shapes, through the one weight initialiser."""
    return {
        k: np.asarray(v) for k, v in random_weights(shapes, jax.random.key(seed), np.float32, hf_std(init_std)).items()
    }


def _random_tensors(cfg: dict, arch: str, seed: int, init_std: float | None) -> dict[str, np.ndarray]:
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D

    def linear(out_f, in_f):  # HF nn.Linear layout: [out, in]
        return (out_f, in_f)

    def norm(n):
        return (n,)

    t = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = linear(q, H)
        t[p + "self_attn.k_proj.weight"] = linear(kv, H)
        t[p + "self_attn.v_proj.weight"] = linear(kv, H)
        if arch == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                t[p + f"self_attn.{name}_proj.bias"] = (n,)
        if arch in ("qwen3", "qwen3_moe"):
            t[p + "self_attn.q_norm.weight"] = norm(D)
            t[p + "self_attn.k_norm.weight"] = norm(D)
        t[p + "self_attn.o_proj.weight"] = linear(H, q)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        if arch in MOE_ARCHS:
            t.update(_random_experts(cfg, arch, p, linear))
            continue
        t[p + "mlp.gate_proj.weight"] = linear(I, H)
        t[p + "mlp.up_proj.weight"] = linear(I, H)
        t[p + "mlp.down_proj.weight"] = linear(H, I)
    t["model.norm.weight"] = norm(H)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = linear(V, H)
    return draw_hf_tensors(t, seed, init_std)


def _random_experts(cfg: dict, arch: str, p: str, linear) -> dict[str, np.ndarray]:
    """One sparse layer in HF's classic per-expert naming (what save_pretrained writes)."""
    H = cfg["hidden_size"]
    if arch == "mixtral":
        E, I, base, names = cfg["num_local_experts"], cfg["intermediate_size"], "block_sparse_moe", ("w1", "w3", "w2")
    else:
        E, I, base = cfg["num_experts"], cfg["moe_intermediate_size"], "mlp"
        names = ("gate_proj", "up_proj", "down_proj")
    t = {f"{p}{base}.gate.weight": linear(E, H)}
    for e in range(E):
        gate, up, down = (f"{p}{base}.experts.{e}.{n}.weight" for n in names)
        t[gate], t[up], t[down] = linear(I, H), linear(I, H), linear(H, I)
    return t


def make_tiny_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    rope_theta: float | None = None,
    rope_scaling: str | dict | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    num_shards: int = 1,
    init_std: float | None = None,
    tokenizer: bool = True,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> str:
    """Writes a random HF-format checkpoint into out_dir and returns its path.

    num_experts / num_experts_per_tok shape the MoE archs (qwen3_moe, mixtral), whose
    every layer is sparse. head_dim defaults to hidden/heads, except for qwen3 where it is twice that
    (as in real Qwen3, q_size != hidden). rope_scaling="llama3" selects
    LLAMA3_ROPE_SCALING. config.json is written last, so its presence means the
    directory is complete.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHITECTURES)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    n_text = 256 + len(SPECIAL_TOKENS)
    if tokenizer and vocab_size < n_text:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte tokenizer's {n_text} tokens")
    if head_dim is None:
        head_dim = hidden_size // num_heads * (2 if arch in ("qwen3", "qwen3_moe") else 1)
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    cfg = _hf_config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
    )
    tensors = _random_tensors(cfg, arch, seed, init_std)
    if dtype == "bfloat16":
        tensors = {n: a.astype(ml_dtypes.bfloat16) for n, a in tensors.items()}
    write_safetensors(out_dir, tensors, num_shards)

    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_IDS, "do_sample": False}, f, indent=2)
    if tokenizer:
        build_byte_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": SPECIAL_TOKENS[0],
                    "eos_token": SPECIAL_TOKENS[1],
                    "add_bos_token": True,
                    "model_max_length": max_position_embeddings,
                    "chat_template": CHAT_TEMPLATE,
                    "added_tokens_decoder": {
                        str(256 + i): {
                            "content": t,
                            "special": True,
                            "lstrip": False,
                            "rstrip": False,
                            "normalized": False,
                            "single_word": False,
                        }
                        for i, t in enumerate(SPECIAL_TOKENS)
                    },
                },
                f,
                indent=2,
            )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


DEFAULT_MODEL_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jspec", "tiny-llama")


def tiny_model_path() -> str:
    """The tiny random-weight model, written once into ~/.cache/jspec/tiny-llama (the fallback
    default model where the real one cannot be fetched: jspec.checkpoint.demo)."""
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        make_tiny_model(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR
