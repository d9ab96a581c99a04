"""GGUF checkpoints (llama.cpp's format) converted into an HF-layout directory.

A GGUF file holds the weights (often quantised), the model's hyper-parameters and its
tokenizer (vocabulary, merges, special tokens, chat template) in one file. jspec reads it
with the `gguf` package (llama.cpp's own reader, which dequantises every tensor type with
numpy) and writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json, so the converted directory loads like any HF checkpoint, in jspec
and in transformers alike.

Two things differ from HF's layout. llama.cpp's converter permutes the rows of the llama
architecture's q and k projections (its rope pairs adjacent dimensions, HF's pairs the two
halves); qwen2 GGUFs keep HF's order. And the tokenizer is stored as lists, which are
rebuilt here into the `tokenizers` BPE model the HF checkpoint would ship.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

from jspec.checkpoint.files import write_safetensors

# GGUF tensor names (after the block prefix) -> HF names.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# llama.cpp's pre-tokenizer names -> the regex split before byte-level BPE (HF's tokenizer.json
# of the same models has these splits).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "smollm": [{"type": "Digits", "individual_digits": True}],
    "gpt2": [],
    "qwen2": [{"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False}],
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are special (added) tokens


class GGUFError(ValueError):
    pass


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: w [out, in] with out = n_heads * head_dim."""
    out, fan_in = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, fan_in).swapaxes(1, 2).reshape(out, fan_in)


def read_gguf(path: str | os.PathLike):
    """-> (HF config dict, {HF name: float32 array}, gguf reader) for a llama or qwen2 GGUF."""
    try:  # imported here: gguf is an optional extra (`demo`), needed only to read GGUF files
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise ImportError("reading GGUF needs the `gguf` package: pip install -e .[demo]") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    reader = GGUFReader(os.fspath(path))
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"{path!r}: architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")

    def hp(name, default=None):
        v = _field(reader, f"{arch}.{name}", default)
        if v is None:
            raise GGUFError(f"{path!r}: metadata {arch}.{name} is missing")
        return v

    n_heads, n_kv = int(hp("attention.head_count")), int(hp("attention.head_count_kv"))
    hidden = int(hp("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(hp("feed_forward_length")),
        "num_hidden_layers": int(hp("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(hp("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(hp("context_length")),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "bfloat16",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    tensors = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_TENSORS:
            hf = _GLOBAL_TENSORS[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in _LAYER_TENSORS:
                raise GGUFError(f"{path!r}: tensor {t.name!r} has no place in a {arch} model")
            hf = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = w.reshape(shape)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = unpermute_rope_rows(w, n_heads if "attn_q" in t.name else n_kv)
        tensors[hf] = w
    return config, tensors, reader


def gguf_tokenizer(reader) -> tuple[dict, dict]:
    """-> (tokenizer.json, tokenizer_config.json) rebuilt from a byte-level BPE ('gpt2') vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only)")
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not supported (supported: {sorted(_PRE_TOKENIZERS)})")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(_field(reader, "tokenizer.ggml.merges", []))
    split = (
        []
        if pre == "qwen2"
        else [{"type": "Split", "pattern": {"Regex": _GPT2_SPLIT}, "behavior": "Isolated", "invert": False}]
    )
    tok_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, ty in enumerate(types)
            if ty in (_CONTROL, _USER_DEFINED)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": _PRE_TOKENIZERS[pre]
            + split
            + [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }

    def token(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length")),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    return tok_json, tok_config


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16") -> str:
    """Writes the HF-layout directory of a GGUF checkpoint (weights stored in `dtype`); returns out_dir."""
    config, tensors, reader = read_gguf(path)
    tok_json, tok_config = gguf_tokenizer(reader)
    np_dtype = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}[dtype]
    out_dir = os.fspath(out_dir)
    tmp = out_dir + ".partial"
    os.makedirs(tmp, exist_ok=True)
    write_safetensors(tmp, {k: v.astype(np_dtype) for k, v in tensors.items()})
    config["torch_dtype"] = dtype
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, data in (
        ("config.json", config),
        ("tokenizer.json", tok_json),
        ("tokenizer_config.json", tok_config),
        ("generation_config.json", gen),
    ):
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1 if name != "tokenizer.json" else None)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)  # a reader never sees a half-written directory
    return out_dir
