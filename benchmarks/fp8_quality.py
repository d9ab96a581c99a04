"""FP8 quality on real weights: greedy agreement with bf16 and held-out perplexity.

The model (default: the embedded SmolLM2-135M-Instruct) runs five ways: bf16, --quantization
fp8 (weights per output channel), --kv-cache-dtype fp8_e4m3 (scales 1), both, and float32
(the yardstick: how far greedy decoding moves when only bf16's rounding goes). Greedy
completions of the held-out prompts (jspec/train/prompts.py, chat template) are compared with
bf16's, token by token (agreement = matching positions before the first divergence, and the
share of completions identical in full); perplexity is scored on the same prompts' rendered
text (prompt logprobs). Runs on the CPU or a GPU.

    python -m benchmarks.fp8_quality [--model-path DIR] [--num-prompts 16] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import math
import time

import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import RESULTS_DIR, Results
from jspec.server.chat_template import render_chat
from jspec.train.prompts import split_prompts

VARIANTS = {
    "bf16": {},
    "fp8_weights": dict(quantization="fp8"),
    "fp8_kv": dict(kv_cache_dtype="fp8_e4m3"),
    "fp8_weights_kv": dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"),
    "float32": {},  # the same weights in f32 activations: the noise floor of the comparison
}


def run(model, prompts, settings, max_new_tokens):
    engine = jspec.Engine(
        model, page_size=16, max_running_requests=16, max_total_tokens=16384, context_length=1024, **settings
    )
    t0 = time.perf_counter()
    outs = engine.generate(prompts, jspec.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    gen_s = time.perf_counter() - t0
    scored = engine.generate(prompts, jspec.SamplingParams(max_new_tokens=1, return_logprob=True, logprob_start_len=0))
    nll = [-lp for o in scored for lp in o.input_logprobs[1:]]
    return [o.token_ids for o in outs], float(math.exp(np.mean(nll))), len(nll), gen_s


def agreement(tokens, ref):
    prefix = []
    for a, b in zip(tokens, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / len(b))
    return float(np.mean(prefix)), float(np.mean([a == b for a, b in zip(tokens, ref)]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--name", default="fp8_quality")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    path = args.model_path
    if path is None:
        from jspec.checkpoint.demo import default_model_path

        path, _ = default_model_path()
    model = jspec.load(path, dtype=jnp.bfloat16)
    _, heldout = split_prompts(0, args.num_prompts)
    prompts = [render_chat(model.tokenizer, [{"role": "user", "content": p}]) for p in heldout]
    settings = {"model": path, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "greedy": True}
    results = Results(args.out, args.name, settings)
    rows, ref = [], None
    for name in args.variants.split(","):
        m = jspec.load(path, dtype=jnp.float32) if name == "float32" else model
        tokens, ppl, scored, gen_s = run(m, prompts, VARIANTS[name], args.max_new_tokens)
        ref = tokens if ref is None else ref
        prefix, exact = agreement(tokens, ref)
        rows.append(
            dict(
                variant=name,
                settings=VARIANTS[name],
                greedy_prefix_agreement=prefix,
                identical_completions=exact,
                perplexity=ppl,
                scored_tokens=scored,
                generate_s=gen_s,
            )
        )
        print(f"{name:16s} agreement {prefix:.3f} identical {exact:.3f} ppl {ppl:.3f} ({gen_s:.1f} s)", flush=True)
        results.write(rows=rows)
    return rows


if __name__ == "__main__":
    main()
