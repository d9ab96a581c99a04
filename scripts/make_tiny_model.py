"""Write a tiny random-weight HF checkpoint (no torch needed).

python scripts/make_tiny_model.py /tmp/tiny-llama
python scripts/make_tiny_model.py /tmp/tiny-qwen3 --arch qwen3 --layers 4 --dtype bfloat16
python scripts/make_tiny_model.py /tmp/tiny-moe --arch qwen3_moe --experts 8 --experts-per-tok 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jspec.checkpoint.tiny import ARCHITECTURES, make_tiny_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=None, help="default hidden/heads (qwen3: twice that)")
    ap.add_argument("--vocab", type=int, default=320, help="padded vocab (>= 261 byte tokenizer tokens)")
    ap.add_argument("--tie-embeddings", action="store_true")
    ap.add_argument("--rope-theta", type=float, default=None)
    ap.add_argument("--llama3-rope", action="store_true", help="add llama3 rope_scaling")
    ap.add_argument("--max-position", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shards", type=int, default=1, help="> 1 writes model-*-of-*.safetensors + index")
    ap.add_argument("--init-std", type=float, default=None, help="weight std (default 1/sqrt(fan_in))")
    ap.add_argument("--experts", type=int, default=4, help="qwen3_moe / mixtral: experts per layer")
    ap.add_argument("--experts-per-tok", type=int, default=2, help="qwen3_moe / mixtral: experts chosen per token")
    a = ap.parse_args(argv)
    path = make_tiny_model(
        a.out_dir,
        a.arch,
        a.seed,
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        tie_word_embeddings=a.tie_embeddings,
        rope_theta=a.rope_theta,
        rope_scaling="llama3" if a.llama3_rope else None,
        max_position_embeddings=a.max_position,
        dtype=a.dtype,
        num_shards=a.shards,
        init_std=a.init_std,
        num_experts=a.experts,
        num_experts_per_tok=a.experts_per_tok,
    )
    print(path)


if __name__ == "__main__":
    main()
