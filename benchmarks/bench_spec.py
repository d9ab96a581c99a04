"""One EAGLE iteration against one plain decode step, on the GPU, in one run.

Llama-3.1-8B-shaped target and an EAGLE-3-shaped head (random bf16): the
iteration (draft num_steps-1 forwards -> tree -> verify over num_draft_tokens
nodes -> accept -> KV move -> draft-extend) is timed back to back with the
state donated, next to the plain decode step at the same batch and context.
The figure that matters is iteration time / decode-step time: with a mean
acceptance of A tokens per iteration, speculation is worth A / ratio.

    python -m benchmarks.bench_spec [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    EAGLE3_8B,
    LLAMA_8B,
    RESULTS_DIR,
    Results,
    int_list,
    random_params,
    timed,
    tiny,
    tiny_head,
)
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.penalties import init_penalty_state
from jspec.layers.sampling import sampling_mode, sampling_rows
from jspec.models.common import unstack_layers
from jspec.models.eagle import layer_config
from jspec.speculative.eagle import EagleExtra, EagleMethod
from jspec.speculative.method import SpecCarry, SpecState
from jspec.speculative.steps import spec_decode_step
from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step


def random_pool(cfg_layers, num_pages, S, cfg, dtype, seed):
    shape = (cfg_layers, num_pages, S, cfg.num_kv_heads, cfg.head_dim)
    fill = jax.jit(
        lambda k: jax.lax.map(lambda kk: jax.random.normal(kk, shape[1:], dtype), jax.random.split(k, shape[0]))
    )
    return KVPool(fill(jax.random.key(seed)), fill(jax.random.key(seed + 1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int_list, help="e.g. 1,32")
    ap.add_argument("--contexts", type=int_list, help="e.g. 1024,4096")
    ap.add_argument(
        "--configs",
        type=lambda v: [tuple(int(x) for x in c.split("/")) for c in v.split(",")],
        help="(steps/topk/draft_tokens),...: e.g. 3/1/4,5/4/8",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument(
        "--sampling",
        action="store_true",
        help="also time each iteration with sampled, mixed, and sampled + penalties + top-5 logprobs rows",
    )
    ap.add_argument("--name", default="bench_spec", help="JSON file name under --out")
    args = ap.parse_args()
    cfg, dcfg, dtype, S, ctx = LLAMA_8B, EAGLE3_8B, jnp.bfloat16, args.page_size, args.context
    if args.tiny:
        cfg = tiny(cfg)
        dcfg, ctx, dtype = tiny_head(cfg), 64, jnp.float32
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)

    # Per-layer weight arrays, as the engine's workers hold them.
    params = unstack_layers(random_params(cfg, dtype))
    dparams = unstack_layers(init_random_draft_params(dcfg, jax.random.key(5), dtype))
    batches = args.batches or ([1, 8, 32] if not args.quick else [1, 32])
    configs = args.configs or [(3, 1, 4), (5, 4, 8), (1, 1, 2)]
    iters = 10 if args.quick else 20
    headroom = (iters * 3 + 8) * 6 + 64  # every timed iteration may advance up to num_steps + 1 tokens
    pages_per_seq = -(-(ctx + headroom) // S)
    num_pages = max(batches) * pages_per_seq + 2
    tkv = random_pool(cfg.num_layers, num_pages, S, cfg, dtype, 10)
    dkv = random_pool(1, num_pages, S, layer_config(dcfg), dtype, 20)
    rng = np.random.default_rng(0)
    rows = []
    results = Results(
        args.out,
        "bench_spec",
        {"model": "llama-3.1-8b shape + EAGLE-3 head shape, random bf16", "page_size": S},
        file_name=args.name,
    )

    for B in batches:
        pages = rng.permutation(np.arange(1, num_pages))[: B * pages_per_seq].reshape(B, pages_per_seq).astype(np.int32)
        # Plain decode step at this batch and context (the engine's own step).
        slot_ids = jnp.arange(B, dtype=jnp.int32)
        pt = jnp.asarray(pages)
        greedy_rows = jax.tree.map(jnp.asarray, sampling_rows([], [], B))
        sampled_p = SamplingParams(temperature=0.8, top_p=0.95, top_k=50)
        penalised_p = SamplingParams(
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            repetition_penalty=1.1,
            return_logprob=True,
            top_logprobs_num=5,
        )
        # name -> (rows, sampling mode, top_n); the first is the baseline the others are compared with.
        variants = {"greedy": (greedy_rows, "greedy", 0)}
        if args.sampling:
            seeds = list(range(B))
            top_p_p = SamplingParams(temperature=0.8, top_p=0.95)
            for name, plist, top_n in (
                ("sampled", [sampled_p] * B, 0),
                ("mixed", [sampled_p, SamplingParams()] * (B // 2) + [sampled_p] * (B % 2), 0),
                ("sampled+penalties+top5", [penalised_p] * B, 5),
                ("temperature-only", [SamplingParams(temperature=0.8)] * B, 0),
                ("top-p-only", [top_p_p] * B, 0),
            ):
                variants[name] = (sampling_rows(plist, seeds, B), sampling_mode(plist), top_n)
        variants = {k: (jax.tree.map(jnp.asarray, r), m, t) for k, (r, m, t) in variants.items()}
        pen = init_penalty_state(B, cfg.vocab_size)
        box = {
            "s": PlainState(
                tkv, PlainCarry(jnp.zeros(B + 1, jnp.int32), jnp.full(B + 1, ctx, jnp.int32).at[B].set(0)), pen
            )
        }

        def plain():
            box["s"], out = plain_decode_step(params, box["s"], slot_ids, pt, greedy_rows, cfg=cfg, sampling="greedy")
            return out.ints

        jax.block_until_ready(plain())
        t_plain = timed(plain, iters, 5)
        tkv, pen = box["s"].target_kv, box["s"].penalties
        print(f"B={B} plain decode {t_plain * 1e3:.3f} ms", flush=True)
        for steps, topk, ndt in configs:
            spec = SpecConfig("EAGLE3", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
            method = EagleMethod(spec, dcfg)
            carry = SpecCarry(
                jnp.asarray(rng.integers(0, cfg.vocab_size, B + 1), jnp.int32),
                jnp.full(B + 1, ctx, jnp.int32).at[B].set(0),
                EagleExtra(jnp.asarray(rng.normal(size=(B + 1, cfg.hidden_size)), dtype)),
            )
            st = {"s": SpecState(tkv, dkv, carry, pen)}
            base_ms = None
            for variant, (vrows, mode, top_n) in variants.items():

                def iteration():
                    st["s"], out = spec_decode_step(
                        params,
                        dparams,
                        st["s"],
                        slot_ids,
                        pt,
                        vrows,
                        cfg=cfg,
                        method=method,
                        sampling=mode,
                        top_n=top_n,
                    )
                    return out.ints

                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(iteration())
                    compile_s = time.perf_counter() - t0
                    # Reset lengths so every timed run sees the same context.
                    st["s"] = st["s"]._replace(
                        carry=st["s"].carry._replace(seq_len=jnp.full(B + 1, ctx, jnp.int32).at[B].set(0))
                    )
                    t_iter = timed(iteration, iters, 3)
                    st["s"] = st["s"]._replace(
                        carry=st["s"].carry._replace(seq_len=jnp.full(B + 1, ctx, jnp.int32).at[B].set(0))
                    )
                except Exception as e:  # noqa: BLE001 - one failing config must not hide the others
                    print(
                        f"FAILED B={B} {(steps, topk, ndt)} {variant}: {type(e).__name__}: {str(e)[:400]}", flush=True
                    )
                    continue
                finally:
                    tkv, dkv, pen = st["s"].target_kv, st["s"].draft, st["s"].penalties
                base_ms = base_ms or t_iter * 1e3
                row = dict(
                    batch=B,
                    context=ctx,
                    steps=steps,
                    topk=topk,
                    draft_tokens=ndt,
                    variant=variant,
                    iteration_ms=t_iter * 1e3,
                    decode_step_ms=t_plain * 1e3,
                    ratio=t_iter / t_plain,
                    vs_greedy=t_iter * 1e3 / base_ms,
                    compile_s=compile_s,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
                results.write(rows=rows)

    path = results.write(rows=rows)
    print(f"\nwrote {path}\n")
    print(
        f"{'B':>3} {'(steps,topk,ndt)':>16} {'variant':>22} {'iter ms':>8} {'decode ms':>9} {'ratio':>6} {'vs greedy':>9}"
    )
    for r in rows:
        cfg_s = f"({r['steps']},{r['topk']},{r['draft_tokens']})"
        print(
            f"{r['batch']:>3} {cfg_s:>16} {r['variant']:>22} {r['iteration_ms']:>8.3f} {r['decode_step_ms']:>9.3f} "
            f"{r['ratio']:>6.2f} {r['vs_greedy']:>9.3f}"
        )


if __name__ == "__main__":
    main()
