"""Train a DFlash block drafter for a target model (jspec/train/dflash.py explains the objective).

The target answers jspec's own prompt set (jspec/train/prompts.py), plus --self-prompts it writes
itself (jspec/train/self_prompts.py), through its chat template, greedily (plus
--sampled-answers seeded samples per prompt); the drafter learns to draft blocks of
--block-size tokens at random anchors of those answers from the target's states at its chosen
layers. Every --eval-every steps it is scored on --num-validation prompts that neither training
nor the final report uses, and the best step's weights are kept. The result is written in the
published DFlash layout (config.json + model.safetensors, what z-lab's reference and SGLang
read, plus train_meta.json), so that

    python scripts/generate.py --model-path MODEL --speculative-algorithm DFLASH \\
        --speculative-draft-model-path OUT

uses it. At the end it reports, on held-out prompts: the teacher-forced agreement per block
row, the accept length it implies, and (--eval-spec-prompts) the accept length the engine
measures with the new drafter, with a check that speculative output equals plain greedy output.

    python scripts/train_dflash.py --model-path ~/.cache/jspec/smollm2-135m-instruct \\
        --mask-token-id 16 --out /tmp/dflash-smol
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
from jspec.train import dflash, eagle3
from jspec.train.prompts import split_prompts, validation_prompts
from jspec.train.self_prompts import self_prompts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="target HF checkpoint directory (default: the demo SmolLM2-135M)")
    ap.add_argument("--out", required=True, help="directory to write the drafter into")
    ap.add_argument("--num-prompts", type=int, default=448, help="training prompts (of jspec's 544)")
    ap.add_argument("--num-heldout", type=int, default=64, help="held-out prompts for the final evaluation")
    ap.add_argument(
        "--num-validation",
        type=int,
        default=32,
        help="prompts (besides both) that choose the step whose weights are kept",
    )
    ap.add_argument(
        "--eval-every", type=int, default=250, help="steps between validation scores (0: keep the last step)"
    )
    ap.add_argument(
        "--self-prompts", type=int, default=0, help="more training prompts, written by the target itself (Magpie)"
    )
    ap.add_argument("--max-new-tokens", type=int, default=256, help="length of the target's answers")
    ap.add_argument("--sampled-answers", type=int, default=0, help="seeded sampled answers per prompt, besides greedy")
    ap.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers")
    ap.add_argument(
        "--examples", metavar="NPZ", help="training answers saved by --save-examples (here or train_eagle.py's)"
    )
    ap.add_argument("--save-examples", metavar="NPZ", help="also write the training answers generated here")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=384, help="sequences are padded or cut to this length")
    ap.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW, warmup + cosine)")
    ap.add_argument("--block-size", type=int, default=16, help="block drafted per forward (the root + masks)")
    ap.add_argument("--num-draft-layers", type=int, default=2, help="the drafter's decoder layers")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument(
        "--loss-decay-gamma", type=float, default=0.0, help="row weight exp(-(k-1)/gamma); 0: by block size"
    )
    ap.add_argument(
        "--mask-token-id", type=int, help="the block's mask token (default: a padding row of the embedding)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument(
        "--eval-spec-prompts", type=int, default=16, help="held-out prompts run through the engine (0: skip)"
    )
    ap.add_argument("--max-running-requests", type=int, default=64, help="engine batch for data generation")
    ap.add_argument("--engine-kw", default="{}", help="JSON of Engine settings for generation (CPU dry runs)")
    ap.add_argument("--results", metavar="JSON", help="also write the run's record here")
    return ap.parse_args(argv)


def model_path(args) -> str:
    if args.model_path:
        return args.model_path
    from jspec.checkpoint.demo import default_model_path

    path, what = default_model_path()
    print(f"[train_dflash] using {what} at {path}")
    return path


def main(argv=None):
    args = parse_args(argv)
    if args.examples and args.self_prompts:
        raise SystemExit("--self-prompts writes new training prompts; --examples brings answers already made: pick one")
    log = lambda s: print("[train_dflash] " + s, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    engine_kw = json.loads(args.engine_kw)
    model = jspec.load(model_path(args))
    cfg = model.cfg
    tc = dflash.DFlashTrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        block_size=args.block_size,
        num_layers=args.num_draft_layers,
        anchors=args.anchors,
        loss_decay_gamma=args.loss_decay_gamma,
        mask_token_id=args.mask_token_id,
        seed=args.seed,
        log_every=args.log_every,
        eval_every=args.eval_every if args.num_validation > 0 else 0,
    )
    dcfg = dflash.drafter_config(model, tc)
    log(
        f"target: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; drafter: "
        f"{tc.num_layers} layers, block {tc.block_size}, target layers {dcfg.target_layer_ids}, mask token "
        f"{dcfg.mask_token_id}; {dflash.gamma_note(tc)}"
    )
    train_prompts, heldout_prompts = split_prompts(args.num_prompts, args.num_heldout, seed=args.seed)
    val_prompts = validation_prompts(args.num_prompts, args.num_validation, args.num_heldout, seed=args.seed)
    t = time.perf_counter()
    engine = jspec.Engine(model, max_running_requests=args.max_running_requests, **engine_kw)
    if args.self_prompts:
        written = self_prompts(
            model, args.self_prompts, engine=engine, seed=args.seed, exclude=[*val_prompts, *heldout_prompts]
        )
        log(f"{len(written)} prompts written by the target, e.g. {written[0][:80]!r}")
        train_prompts = train_prompts + written
    if args.examples:
        train_ex, meta = eagle3.load_examples(args.examples, cfg.vocab_size)
        log(f"{len(train_ex)} training answers from {args.examples} ({meta})")
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
    if args.save_examples and not args.examples:
        meta = {"sampled_answers": args.sampled_answers, "self_prompts": args.self_prompts, "seed": args.seed}
        eagle3.save_examples(args.save_examples, train_ex, cfg.vocab_size, meta=meta)
        log(f"wrote the {len(train_ex)} training answers to {args.save_examples}")
    heldout_ex = eagle3.generate_examples(model, heldout_prompts, args.max_new_tokens, engine=engine)
    val_ex = eagle3.generate_examples(model, val_prompts, args.max_new_tokens, engine=engine)
    del engine
    generate_s = time.perf_counter() - t
    n_resp = sum(len(e.tokens) - e.prompt_len for e in train_ex)
    log(
        f"{len(train_ex)} training answers ({n_resp} tokens), {len(val_ex)} for validation, {len(heldout_ex)} held "
        f"out, in {generate_s:.1f} s"
    )

    train_data = eagle3.pack_examples(train_ex, args.seq_len)
    val_data = eagle3.pack_examples(val_ex, args.seq_len) if val_ex else None
    t = time.perf_counter()
    result = dflash.train_dflash(model, train_data, tc, log=log, validation=val_data)
    train_s = time.perf_counter() - t
    log(f"trained {args.steps} steps in {train_s:.1f} s")
    report: dict = {
        "args": vars(args),
        "train_s": train_s,
        "generate_s": generate_s,
        "answer_tokens": n_resp,
        "training_prompts": None if args.examples else len(train_prompts),
        "kept_step": result.kept_step,
    }
    if heldout_ex:
        ev = dflash.evaluate_drafter(model, result, tc, eagle3.pack_examples(heldout_ex, args.seq_len))
        report["heldout_teacher_forced"] = ev
        log(
            f"held-out ({ev['blocks']} blocks): agreement per row {eagle3.fmt(ev['row_acc'])}; "
            f"accept length estimate {ev['accept_length']:.3f}"
        )
    out = dflash.save_drafter(args.out, result, cfg, meta=report)
    log(f"saved {out}")
    if heldout_ex and args.eval_spec_prompts > 0:
        t = time.perf_counter()
        spec = eagle3.speculation_check(
            model,
            jspec.SpecConfig("DFLASH", draft_model_path=out),
            heldout_ex[: args.eval_spec_prompts],
            args.max_new_tokens,
            **engine_kw,
        )
        report["heldout_engine"] = spec
        log(
            f"engine on {args.eval_spec_prompts} held-out prompts (DFLASH, block {tc.block_size}): mean accept "
            f"length {spec['mean_accept_length']:.3f}, outputs identical to greedy {spec['identical_outputs']} "
            f"({time.perf_counter() - t:.1f} s)"
        )
    report["total_s"] = time.perf_counter() - t_start
    with open(os.path.join(out, "train_meta.json"), "w") as f:
        json.dump({"history": result.history, **report}, f, indent=2, default=str)
    log(f"total {report['total_s']:.1f} s")
    if args.results:
        from benchmarks.common import git_commit

        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w") as f:
            record = {"name": "train_dflash", "gpu": jax.devices()[0].device_kind, "jax": jax.__version__}
            record.update(commit=git_commit(), command=" ".join(["python3", *sys.argv]), **report)
            json.dump({**record, "history": result.history}, f, indent=1, default=str)
        log(f"wrote {args.results}")


if __name__ == "__main__":
    main()
