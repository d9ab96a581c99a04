"""GGUF conversion without a download: a tiny model written as llama.cpp's converter writes it
(q/k rows permuted, Q8_0 weights, the tokenizer as lists) converts back to its own tensors."""

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import jspec  # noqa: E402 (after the importorskip)
from jspec.checkpoint.files import read_hf_tensors  # noqa: E402 (after the importorskip)
from jspec.checkpoint.gguf import GGUFError, convert_gguf, unpermute_rope_rows  # noqa: E402 (after the importorskip)
from jspec.checkpoint.tiny import make_tiny_model  # noqa: E402 (after the importorskip)

HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_rope_rows(w, n_heads):
    """What llama.cpp's converter does to q/k rows (rope on adjacent pairs)."""
    out, fan_in = w.shape
    return w.reshape(n_heads, 2, out // n_heads // 2, fan_in).swapaxes(1, 2).reshape(out, fan_in)


def write_llama_gguf(hf_dir, path, arch="llama"):
    """-> the tensors as they should come back (Q8_0-rounded matrices)."""
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    want = {}
    for name, t in read_hf_tensors(hf_dir).items():
        t = np.asarray(t, np.float32)
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            g = {
                "model.embed_tokens.weight": "token_embd.weight",
                "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight",
            }[name]
        else:
            layer, rest = name.split(".")[2], name.split(".", 3)[3]
            g = f"blk.{layer}.{HF_TO_GGUF[rest]}"
        if t.ndim == 2:
            stored = t
            if g.endswith("attn_q.weight"):
                stored = permute_rope_rows(t, cfg["num_attention_heads"])
            elif g.endswith("attn_k.weight"):
                stored = permute_rope_rows(t, cfg["num_key_value_heads"])
            q = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            t = gguf.quants.dequantize(
                gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(g, t)
        want[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)


def test_tiny_gguf_converts_back_to_its_tensors_config_and_tokenizer(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), seed=3)
    want = write_llama_gguf(hf, str(tmp_path / "m.gguf"))
    out = convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "conv"), dtype="float32")
    got = read_hf_tensors(out)
    assert set(got) == set(want)
    for name in want:  # q/k: Q8_0 blocks run along the input dimension, so rounding commutes with the row permutation
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), want[name], err_msg=name)
    a, b = json.load(open(os.path.join(hf, "config.json"))), json.load(open(os.path.join(out, "config.json")))
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert a[k] == b[k], k
    src, conv = jspec.load(hf).tokenizer, jspec.load(out).tokenizer
    text = "Hello, world! 123 speculative  decoding\n<|eot_id|>"
    assert conv.encode(text, add_special_tokens=False) == src.encode(text, add_special_tokens=False)
    assert conv.chat_template.startswith("{% for m in messages %}")


def test_unsupported_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        convert_gguf(str(tmp_path / "x.gguf"), str(tmp_path / "out"))
