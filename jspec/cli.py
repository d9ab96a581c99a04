"""The `jspec` command: `jspec serve [flags]` starts the server, `jspec generate [flags]` prints
completions of a few prompts (the embedded demo model's by default)."""

from __future__ import annotations

import sys
import time

from jspec.checkpoint.demo import default_model_path
from jspec.checkpoint.model import load_logged
from jspec.config.sampling import SamplingParams
from jspec.engine.build import loads_per_layer
from jspec.engine.engine import Engine
from jspec.server.args import build_parser, engine_config, load_config
from jspec.server.chat_template import render_chat
from jspec.server.launch import main as serve

USAGE = "usage: jspec {serve,generate} [flags]   (jspec serve --help, jspec generate --help)"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else None
    if command == "serve":
        return serve(argv)
    if command == "generate":
        return generate(argv)
    raise SystemExit(USAGE)


def generate(argv=None) -> None:
    """Generates text from the command line, with the chat template for the built-in prompts."""
    ap = build_parser(generate.__doc__, server=False, prog="jspec generate")
    g = ap.add_argument_group("generation")
    g.add_argument(
        "--model-path", help="a local HF checkpoint directory or a Hub repo id (default: the embedded demo model)"
    )
    g.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    g.add_argument("--chat", action="store_true", help="send each prompt as a chat user message")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, help="the requests' sampling seed")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    args = ap.parse_args(argv)
    try:
        load, config = load_config(args), engine_config(args)
    except ValueError as e:
        ap.error(str(e))
    path = args.model_path
    if path is None:
        path, what = default_model_path()
        print(f"[jspec] using {what} at {path}")
    prompts = args.prompt or ["What is the capital of France?", "Write a short poem about speculation."]
    try:
        model = load_logged(path, load, per_layer=loads_per_layer(config))
    except (ValueError, OSError) as e:  # a missing or bad checkpoint, a Hub repo id that resolves nowhere
        ap.error(str(e))
    shown = prompts
    if (args.chat or not args.prompt) and model.tokenizer is not None and model.tokenizer.chat_template:
        prompts = [render_chat(model.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    engine = Engine(model, config)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    for p, o in zip(shown, outs):
        accept = f", mean accept length {o.mean_accept_length:.2f}" if o.mean_accept_length else ""
        print(f"--- prompt: {p!r}\n{o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}{accept}]")
    print(f"[jspec] {sum(len(o.token_ids) for o in outs)} tokens in {dt:.2f}s (including compilation)")


if __name__ == "__main__":
    main()
