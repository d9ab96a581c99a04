"""HF transformers reference oracle. Runs under the .venv-hf python (torch +
transformers), never the jspec venv: jax and jspec are not importable here.

    python tests/support/hf_oracle.py request.json

The request is one job, or {"jobs": [job, ...], "out": ...} whose jobs each
have a "name" that prefixes their keys ("name/key") in the single .npz
written to request["out"]. Jobs:

  {"mode": "make", "arch": a key of ARCH_DEFAULTS (llama, mistral, qwen2, gemma2, phi3, ...),
   "out_dir": DIR, "seed": 0, "dtype": "float32"|"bfloat16", "overrides": {...config kwargs},
   "dump_params": false, "save_original_format": true}
      Builds a random model with transformers' own config class and
      save_pretrained(safe_serialization=True). Weights are redrawn (not HF's
      0.02 init) so attention and routing are peaked and norms/biases are not
      constant. save_original_format=false keeps transformers 5's in-memory MoE
      layout (fused experts.gate_up_proj / experts.down_proj) in the files.
      Writes: num_params [1]; with dump_params, "param:<HF name>" for each
      parameter as saved.

  {"mode": "inspect", "checkpoint": DIR, "dump_params": true}
      Loads DIR with from_pretrained and fails if any weight is missing,
      unexpected or mismatched (transformers would otherwise random-init it
      silently). Writes num_params and optionally the params.

  {"mode": "logits", "checkpoint": DIR, "prompts": [[ids], ...],
   "decode_steps": 8, "hidden_states": false}
      float32, eager attention, each prompt alone (batch 1, no padding):
        prefill_logits_{i} [T_i, V]  logits at every prompt position
        generated_{i}     [decode_steps + 1]  greedy tokens: argmax of the last
                          prefill row, then one per decode step
        decode_logits_{i} [decode_steps, V]  logits after feeding generated[s]
                          through HF's own KV cache (position T_i + s)
        prefill_hidden_{i} [L + 1, T_i, H]  (hidden_states only) embeddings and
                          each layer's output, the last one after the final norm

  {"mode": "dflash_generate", "checkpoint": DIR, "drafter": DIR, "prompts": [[ids], ...],
   "max_new_tokens": 16}
      The reference DFlash implementation (z-lab's `dflash` package: DFlashDraftModel loaded
      strictly from DIR, dflash_generate) drafting for the target, greedy, float32, each prompt
      alone: output_ids_{i}, and for every drafted block of the drafter's full size
      starts_{i} [K] (the block's first position) and draft_logits_{i} [K, block - 1, V].

  {"mode": "gguf_generate", "gguf": FILE, "messages": [str, ...], "max_new_tokens": 24}
      transformers' own GGUF loading, float32; each message rendered with the GGUF's chat
      template: prompt_ids_{i} and the greedy generated_{i}.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
import transformers

DEFAULT_SHAPES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
    tie_word_embeddings=False,
)
ARCH_DEFAULTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rms_norm_eps=1e-5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=1000000.0, sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    # Real Qwen3 has head_dim * heads != hidden; keep that property.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0, head_dim=32)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(rope_theta=1000000.0, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    # Gemma's own layout: tied embeddings, head_dim * heads != hidden; caps small enough to bite.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=32,
            tie_word_embeddings=True,
            sliding_window=4,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=15.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            tie_word_embeddings=True,
            sliding_window=4,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    # Phi-4-mini's partial rotary (3/4 of each head) under LongRoPE past a 12-token original context.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=48,
            original_max_position_embeddings=12,
            pad_token_id=0,
            partial_rotary_factor=0.75,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 2.0, 4.0, 6.0, 9.0, 12.0],
            },
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0),
    ),
    # NoPE on every other layer; a window on the NoPE ones (SmolLM3's own rule).
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5, pad_token_id=0),
    ),
    # Small MLA shapes with every DeepSeek-V3 switch on: q LoRA, interleaved YaRN RoPE whose
    # mscale differs from mscale_all_dim (so both cos/sin and the softmax scale change), four
    # expert groups of which two are kept, a shared expert, one dense layer first.
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        ),
    ),
    # DeepSeek-V2-Lite's switches: queries straight from q_proj, softmax routing limited to the
    # best groups (by their best expert), no renormalisation.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
    ),
    # Windows of 4 on alternate layers, attention sinks, experts with biases and a SwiGLU clamp
    # tight enough to bite, YaRN (untruncated) past a 12-token original context.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            swiglu_limit=1.0,
            max_position_embeddings=48,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 12,
            },
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            rope_theta=1000000.0, sliding_window=None, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48
        ),
    ),
}


def _dtype_kw(dtype: torch.dtype) -> dict:
    # transformers 5 renamed torch_dtype= to dtype=.
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}


def _num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def _param_dump(model) -> dict[str, np.ndarray]:
    return {f"param:{n}": p.detach().float().cpu().numpy() for n, p in model.named_parameters()}


@torch.no_grad()
def _redraw(model, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # nn.Linear [out, in], or stacked experts [E, out, in]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def job_make(job: dict) -> dict[str, np.ndarray]:
    arch = job["arch"]
    config_cls, model_cls, arch_kw = ARCH_DEFAULTS[arch]
    kwargs = {**DEFAULT_SHAPES, **arch_kw, **job.get("overrides", {})}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(int(job.get("seed", 0)))
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(int(job.get("seed", 0)))
    _redraw(model, gen)
    _redraw_router_biases(model, gen)
    if job.get("dtype", "float32") == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(
        job["out_dir"],
        safe_serialization=True,
        **({} if job.get("save_original_format", True) else {"save_original_format": False}),
    )
    if job.get("mtp_layers"):
        _append_mtp_layers(model, int(job["mtp_layers"]), job["out_dir"], gen)
    out = {"num_params": np.array([_num_params(model)], np.int64)}
    if job.get("dump_params"):
        out.update(_param_dump(model))
    return out


@torch.no_grad()
def _redraw_router_biases(model, gen: torch.Generator) -> None:
    """DeepSeek's e_score_correction_bias is a buffer (zeros at init): redrawn too, so that the
    routing depends on it."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))


@torch.no_grad()
def _append_mtp_layers(model, n: int, out_dir: str, gen: torch.Generator) -> None:
    """Writes DeepSeek-V3's multi-token-prediction layers beside the model in the published
    layout (model.layers.{num_hidden_layers + i}: embed_tokens, enorm, hnorm, eh_proj, a full
    decoder layer, shared_head.norm, shared_head.head), which transformers itself never builds.
    The decoder layer is transformers' own class, saved with the names it gives its layers."""
    from safetensors.torch import load_file, save_file

    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    layer_cls = type(model.model.layers[0])
    for i in range(n):
        idx = L + i
        layer = layer_cls(cfg, layer_idx=idx).eval()
        _redraw(layer, gen)
        _redraw_router_biases(layer, gen)
        extra = {
            "enorm.weight": 1.0 + 0.1 * torch.randn(H, generator=gen),
            "hnorm.weight": 1.0 + 0.1 * torch.randn(H, generator=gen),
            "eh_proj.weight": torch.randn(H, 2 * H, generator=gen) / math.sqrt(2 * H),
            "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(H, generator=gen),
            "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
            "shared_head.head.weight": model.lm_head.weight.detach().clone(),
        }
        state = {**_per_expert(layer.state_dict()), **extra}
        for k, v in state.items():
            tensors[f"model.layers.{idx}.{k}"] = v.detach().to(next(model.parameters()).dtype).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def _per_expert(state: dict) -> dict:
    """transformers 5's fused in-memory experts -> the published per-expert tensors."""
    out = {}
    for k, v in state.items():
        if k.endswith("experts.gate_up_proj"):
            gate, up = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            out[k] = v
    return out


def _load(path: str):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", output_loading_info=True, **_dtype_kw(torch.float32)
    )
    mtp = f"model.layers.{model.config.num_hidden_layers}."  # DeepSeek's MTP layers, which transformers drops
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys") or () if not k.startswith(mtp)]
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise SystemExit(f"hf_oracle: transformers could not load {path!r} cleanly: {problems}")
    return model.eval()


def job_inspect(job: dict) -> dict[str, np.ndarray]:
    model = _load(job["checkpoint"])
    out = {"num_params": np.array([_num_params(model)], np.int64)}
    if job.get("dump_params", True):
        out.update(_param_dump(model))
    return out


@torch.no_grad()
def job_logits(job: dict) -> dict[str, np.ndarray]:
    model = _load(job["checkpoint"])
    steps = int(job.get("decode_steps", 8))
    want_hidden = bool(job.get("hidden_states", False))
    out = {"num_params": np.array([_num_params(model)], np.int64)}
    for i, prompt in enumerate(job["prompts"]):
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        res = model(input_ids=ids, use_cache=True, output_hidden_states=want_hidden)
        out[f"prefill_logits_{i}"] = res.logits[0].float().numpy()
        if want_hidden:
            out[f"prefill_hidden_{i}"] = torch.stack([h[0] for h in res.hidden_states]).float().numpy()
        cache = res.past_key_values
        token = int(res.logits[0, -1].argmax())
        generated, decode_logits = [token], []
        for _ in range(steps):
            res = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            logits = res.logits[0, -1].float()
            decode_logits.append(logits.numpy())
            token = int(logits.argmax())
            generated.append(token)
        out[f"generated_{i}"] = np.array(generated, np.int64)
        out[f"decode_logits_{i}"] = (
            np.stack(decode_logits) if decode_logits else np.zeros((0, model.config.vocab_size), np.float32)
        )
    return out


@torch.no_grad()
def job_gguf_generate(job: dict) -> dict[str, np.ndarray]:
    """transformers' own GGUF loading (its dequantiser and q/k un-permutation, its tokenizer
    converter), float32, greedy: prompt_ids_{i} and generated_{i} for each chat message."""
    import functools

    import gguf

    folder, name = os.path.split(job["gguf"])
    # transformers parses the whole file (its ~100k tokenizer strings, field by field) for the
    # tokenizer, again for the config and again for the weights: a minute of this oracle's time.
    # One parse serves all three (the reader is read-only: a memory map and the fields read from it).
    parse = gguf.GGUFReader
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(parse)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        gguf.GGUFReader = parse
    model.eval()
    out = {}
    for i, text in enumerate(job["messages"]):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        gen = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=int(job["max_new_tokens"]),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        out[f"prompt_ids_{i}"] = ids[0].numpy().astype(np.int64)
        out[f"generated_{i}"] = gen[0, ids.shape[1] :].numpy().astype(np.int64)
    return out


@torch.no_grad()
def job_dflash_generate(job: dict) -> dict[str, np.ndarray]:
    from dflash.model import DFlashDraftModel, dflash_generate

    target = _load(job["checkpoint"])
    draft, info = DFlashDraftModel.from_pretrained(job["drafter"], output_loading_info=True, **_dtype_kw(torch.float32))
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise SystemExit(f"hf_oracle: the reference could not load {job['drafter']!r} cleanly: {problems}")
    draft.eval()
    blocks, logits = [], []

    def record_block(module, args, kwargs):  # the block's first position and its size
        size = kwargs["noise_embedding"].shape[1]
        blocks.append((int(kwargs["position_ids"][0, -size]), size))

    draft.register_forward_pre_hook(record_block, with_kwargs=True)
    compute = draft.compute_logits
    draft.compute_logits = lambda hidden, head: (
        logits.append(compute(hidden, head)[0].float().numpy()) or compute(hidden, head)
    )
    out = {}
    for i, prompt in enumerate(job["prompts"]):
        blocks.clear()
        logits.clear()
        ids = dflash_generate(
            draft, target, torch.tensor([list(prompt)]), int(job["max_new_tokens"]), None, temperature=0.0
        )
        full = [k for k, (_, size) in enumerate(blocks) if size == draft.block_size]
        out[f"output_ids_{i}"] = ids[0].numpy().astype(np.int64)
        out[f"starts_{i}"] = np.array([blocks[k][0] for k in full], np.int64)
        out[f"draft_logits_{i}"] = np.stack([logits[k] for k in full])
    return out


JOBS = {
    "make": job_make,
    "inspect": job_inspect,
    "logits": job_logits,
    "gguf_generate": job_gguf_generate,
    "dflash_generate": job_dflash_generate,
}


def run(request: dict) -> dict[str, np.ndarray]:
    if "jobs" in request:
        out = {}
        for job in request["jobs"]:
            out.update({f"{job['name']}/{k}": v for k, v in JOBS[job["mode"]](job).items()})
        return out
    return JOBS[request["mode"]](request)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} request.json")
    with open(argv[1]) as f:
        request = json.load(f)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = run(request)
    np.savez(request["out"], **out)
    print(json.dumps({"out": request["out"], "keys": len(out), "transformers": transformers.__version__}))


if __name__ == "__main__":
    main(sys.argv)
