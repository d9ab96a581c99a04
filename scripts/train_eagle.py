"""Train an EAGLE-3 draft head for a target model (jspec/train/eagle3.py explains the objective).

The target answers jspec's own prompt set (jspec/train/prompts.py) through its chat template,
greedily; the head learns, from those sequences, to predict the target's next-token
distribution from three of its layers' features, unrolled over --ttt-steps draft steps as
speculative decoding runs it. The result is written in the published EAGLE-3 layout
(config.json + model.safetensors, plus the orbax pytree and train_meta.json), so that

    python scripts/generate.py --model-path MODEL --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path OUT --speculative-num-steps 3 --speculative-eagle-topk 1 \\
        --speculative-num-draft-tokens 4

uses it. At the end it reports, on held-out prompts: the teacher-forced top-1 agreement per
draft step, the accept length those imply for a greedy chain, and (--eval-spec-prompts) the
accept length the engine actually measures with the new head, with a check that speculative
output equals plain greedy output.

    python scripts/train_eagle.py --model-path ~/.cache/jspec/smollm2-135m-instruct --out /tmp/eagle3-smol
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax

import jspec
from jspec.train import eagle3
from jspec.train.prompts import all_prompts, split_prompts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="target HF checkpoint directory (default: the demo SmolLM2-135M)")
    ap.add_argument("--out", help="directory to write the draft head into (needed unless --save-examples)")
    ap.add_argument("--num-prompts", type=int, default=448, help="training prompts (of jspec's 544)")
    ap.add_argument("--num-heldout", type=int, default=64, help="held-out prompts for the final evaluation")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    ap.add_argument(
        "--sampled-answers",
        type=int,
        default=0,
        help="answers per training prompt sampled at --temperature, besides the greedy one",
    )
    ap.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, warmup + cosine)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training (K)")
    ap.add_argument("--seq-len", type=int, default=256, help="sequences are padded or cut to this length")
    ap.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="draft vocabulary: the most frequent target tokens of the data (0: the whole vocabulary)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--eval-spec-prompts",
        type=int,
        default=16,
        help="held-out prompts to run through the engine with the trained head (0: skip)",
    )
    ap.add_argument("--max-running-requests", type=int, default=64, help="engine batch for data generation")
    ap.add_argument(
        "--save-examples",
        metavar="NPZ",
        help="also write the training answers to NPZ (reuse them with --examples); without --out, stop there",
    )
    ap.add_argument(
        "--examples",
        metavar="NPZ",
        help="training answers from --save-examples instead of generating them (the held-out "
        "answers are still generated here, so the engine check compares on one device)",
    )
    ap.add_argument(
        "--results",
        metavar="JSON",
        help="also write the run's record (device, jax, commit, settings, curve, held-out figures) here",
    )
    args = ap.parse_args(argv)
    if not args.out and not args.save_examples:
        ap.error("--out is required (unless --save-examples only generates answers)")
    return args


def model_path(args) -> str:
    if args.model_path:
        return args.model_path
    from jspec.checkpoint.demo import default_model_path

    path, what = default_model_path()
    print(f"[train_eagle] using {what} at {path}")
    return path


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    model = jspec.load(model_path(args))
    cfg = model.cfg
    print(
        f"[train_eagle] target: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
        f"capture layers {eagle3.capture_layers_for(cfg)}"
    )

    train_prompts, heldout_prompts = split_prompts(args.num_prompts, args.num_heldout, seed=args.seed)
    t = time.perf_counter()
    engine = jspec.Engine(model, max_running_requests=args.max_running_requests)
    gen_settings = {
        k: getattr(args, k)
        for k in ("num_prompts", "num_heldout", "max_new_tokens", "sampled_answers", "temperature", "seed")
    }
    if args.examples:
        train_ex, meta = eagle3.load_examples(args.examples, cfg.vocab_size)
        # The held-out prompts are the shuffled set's tail: the file's prompts must come from its head.
        if meta.get("seed") != args.seed or meta.get("num_prompts", 10**9) + args.num_heldout > len(
            all_prompts(args.seed)
        ):
            raise SystemExit(
                f"[train_eagle] {args.examples} was generated for prompt seed {meta.get('seed')} and "
                f"{meta.get('num_prompts')} training prompts: its prompts may overlap the "
                f"{args.num_heldout} held-out ones of seed {args.seed}"
            )
        print(f"[train_eagle] {len(train_ex)} training answers from {args.examples} ({meta})")
    else:
        train_ex = eagle3.generate_examples(
            model,
            train_prompts,
            args.max_new_tokens,
            engine=engine,
            sampled_answers=args.sampled_answers,
            temperature=args.temperature,
            seed=args.seed,
        )
    if args.save_examples:
        eagle3.save_examples(args.save_examples, train_ex, cfg.vocab_size, meta=gen_settings)
        n_resp = sum(len(e.tokens) - e.prompt_len for e in train_ex)
        print(
            f"[train_eagle] wrote {len(train_ex)} answers, {n_resp} tokens, to {args.save_examples} "
            f"in {time.perf_counter() - t:.1f} s"
        )
        if not args.out:
            return
    # Held-out answers are greedy only: the engine check below compares speculative output with them.
    heldout_ex = eagle3.generate_examples(model, heldout_prompts, args.max_new_tokens, engine=engine)
    examples = train_ex + heldout_ex
    del engine
    n_resp = sum(len(e.tokens) - e.prompt_len for e in examples)
    generate_s = time.perf_counter() - t
    print(f"[train_eagle] {len(examples)} answers, {n_resp} tokens, generated or read in {generate_s:.1f} s")

    tc = eagle3.TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    train_data = eagle3.pack_examples(train_ex, args.seq_len)
    t = time.perf_counter()
    result = eagle3.train_eagle3(model, train_data, tc, log=lambda s: print("[train_eagle] " + s, flush=True))
    train_s = time.perf_counter() - t
    print(f"[train_eagle] trained {args.steps} steps in {train_s:.1f} s")

    report: dict = {
        "args": vars(args),
        "train_s": train_s,
        "num_train_sequences": len(train_data.lengths),
        "answer_tokens": n_resp,
        "generate_s": generate_s,
        "examples_from": args.examples or "generated here",
    }
    if heldout_ex:
        ev = eagle3.evaluate_head(model, result, tc, eagle3.pack_examples(heldout_ex, args.seq_len))
        report["heldout_teacher_forced"] = {k: v for k, v in ev.items() if k != "accept_lengths"}
        print(
            f"[train_eagle] held-out ({ev['rows']} rows): top-1 agreement per step {eagle3.fmt(ev['step_acc'])}, "
            f"loss per step {eagle3.fmt(ev['step_loss'])}"
        )
        print(
            f"[train_eagle] held-out accept length estimate (chain of {args.ttt_steps}): "
            f"{ev['accept_length']:.3f} tokens per verify"
        )
    out = eagle3.save_head(args.out, result, cfg, meta=report)
    print(f"[train_eagle] saved {out}")

    if heldout_ex and args.eval_spec_prompts > 0:
        picked = heldout_ex[: args.eval_spec_prompts]
        t = time.perf_counter()
        head = jspec.SpecConfig("EAGLE3", draft_model_path=out, num_steps=args.ttt_steps, eagle_topk=1)
        spec = {**eagle3.speculation_check(model, head, picked, args.max_new_tokens), "num_steps": args.ttt_steps}
        report["heldout_engine"] = spec
        print(
            f"[train_eagle] engine on {len(picked)} held-out prompts (EAGLE3, {spec['num_steps']} steps, topk 1): "
            f"mean accept length {spec['mean_accept_length']:.3f}, outputs identical to greedy "
            f"{spec['identical_outputs']} ({time.perf_counter() - t:.1f} s)"
        )
        with open(os.path.join(out, "train_meta.json")) as f:
            meta = json.load(f)
        with open(os.path.join(out, "train_meta.json"), "w") as f:
            json.dump({**meta, "heldout_engine": spec}, f, indent=2)
    total_s = time.perf_counter() - t_start
    print(f"[train_eagle] total {total_s:.1f} s")
    if args.results:
        from benchmarks.common import git_commit

        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            json.dump(
                {
                    "name": "train_eagle3",
                    "gpu": jax.devices()[0].device_kind,
                    "jax": jax.__version__,
                    "commit": git_commit(),
                    "command": " ".join(["python3", *sys.argv]),
                    "total_s": total_s,
                    **report,
                    "history": result.history,
                },
                f,
                indent=1,
            )
        print(f"[train_eagle] wrote {args.results}")


if __name__ == "__main__":
    main()
