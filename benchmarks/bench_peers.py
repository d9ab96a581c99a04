"""jspec's decode step against a peer's, on the same GPU, the same shapes and the same context.

The peer is Hugging Face transformers with its static KV cache and torch.compile in
"reduce-overhead" mode (CUDA graphs): the gpt-fast recipe, and the fastest PyTorch decode
path this machine's image has without network access. jspec runs its plain decode step
(paged KV, greedy sampling, the pool donated) as the engine compiles it. Both use random bf16
weights of the shape's config; each side runs in its own process so neither holds the
other's GPU memory. A row gives the median ms per decode step (every row of the batch one
token further) and the weight + KV read floor at the bandwidth measured in jspec's process.

    python -m benchmarks.bench_peers [--shapes llama-3.1-8b,smollm2-135m] [--batches 1,16]
        [--context 1024] [--peer-python PYTHON] [--tiny] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# The peer's child imports torch and transformers only, never jax: each side gets the GPU alone.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jspec_rows(shapes: list[str], batches: list[int], context: int, tiny_run: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import copy_bandwidth, random_params, shape, timed, tiny
    from jspec.kvcache.pool import KVPool
    from jspec.layers.penalties import init_penalty_state
    from jspec.layers.sampling import sampling_rows
    from jspec.models.common import unstack_layers
    from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step

    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    bandwidth = copy_bandwidth(1 << 30 if on_gpu else 1 << 22)
    rows = []
    for name in shapes:
        cfg = tiny(shape(name), num_layers=3) if tiny_run else shape(name)
        params = random_params(cfg, dtype)
        # The layout the engine's default layer loop picks for this backend.
        weights = unstack_layers(params) if on_gpu else params
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"].nbytes
        if on_gpu:
            del params
        page = 16
        per_seq = (context + 128) // page
        num_pages = max(batches) * per_seq + 2
        kv_shape = (cfg.num_layers, num_pages, page, cfg.num_kv_heads, cfg.head_dim)
        kv = KVPool(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype))
        rng = np.random.default_rng(0)
        for B in batches:
            pages = rng.permutation(np.arange(1, num_pages))[: B * per_seq].reshape(B, per_seq)
            slots = jnp.arange(B, dtype=jnp.int32)
            tables = jnp.asarray(pages, jnp.int32)
            greedy = jax.tree.map(jnp.asarray, sampling_rows([], [], B))
            carry = PlainCarry(
                jnp.asarray(rng.integers(0, cfg.vocab_size, B + 1), jnp.int32),
                jnp.full(B + 1, context, jnp.int32).at[B].set(0),
            )
            state = {"s": PlainState(kv, carry, init_penalty_state(B, cfg.vocab_size))}

            def step(slots=slots, tables=tables, greedy=greedy):
                state["s"], out = plain_decode_step(
                    weights, state["s"], slots, tables, greedy, cfg=cfg, sampling="greedy"
                )
                return out.ints

            def reset(B=B):
                c = state["s"].carry
                state["s"] = state["s"]._replace(carry=c._replace(seq_len=c.seq_len.at[:B].set(context)))

            jax.block_until_ready(step())
            times = []
            for _ in range(5):
                reset()
                times.append(timed(step, 20, 1))
            kv = state["s"].target_kv
            kv_bytes = 2 * cfg.num_layers * B * context * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
            rows.append(
                dict(
                    engine="jspec",
                    shape=name,
                    batch=B,
                    context=context,
                    step_ms=float(np.median(times)) * 1e3,
                    floor_ms=(weight_bytes + kv_bytes) / bandwidth * 1e3,
                    bandwidth=bandwidth,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def peer_rows(shapes: list[str], batches: list[int], context: int, tiny_run: bool) -> list[dict]:
    import statistics

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []
    for name in shapes:
        with open(os.path.join(REPO_ROOT, "benchmarks", "shapes", name, "config.json")) as f:
            cfg_dict = json.load(f)
        if tiny_run:  # the shapes of benchmarks.common.tiny, three layers
            cfg_dict.update(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
            )
        config = LlamaConfig(**cfg_dict)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
        for B in batches:
            cache = StaticCache(config=config, max_cache_len=context + 128)
            prompt = torch.randint(0, config.vocab_size, (B, context), device=device)
            with torch.no_grad():  # the prefill, uncompiled: it fills the cache to `context`
                out = model(
                    input_ids=prompt,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=torch.arange(context, device=device),
                )
            token = out.logits[:, -1:].argmax(-1)

            def decode(token, position):
                logits = model(
                    input_ids=token,
                    past_key_values=cache,
                    use_cache=True,
                    cache_position=position,
                    position_ids=position.expand(token.shape[0], 1),
                ).logits
                return logits[:, -1:].argmax(-1)

            compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True) if cuda else decode
            t0 = time.perf_counter()
            with torch.no_grad():
                for i in range(3):  # compile, record the CUDA graph, replay it
                    token = compiled(token, torch.tensor([context + i], device=device)).clone()
            compile_s = time.perf_counter() - t0
            times = []
            with torch.no_grad():
                for _ in range(5):
                    # Rewinding the position rewrites the same cache rows: the context stays `context`.
                    positions = [torch.tensor([context + i], device=device) for i in range(20)]
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for p in positions:
                        token = compiled(token, p).clone()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) / len(positions))
            rows.append(
                dict(
                    engine="hf_static_compiled" if cuda else "hf_static_eager",
                    shape=name,
                    batch=B,
                    context=context,
                    step_ms=statistics.median(times) * 1e3,
                    compile_s=compile_s,
                    torch=torch.__version__,
                    transformers=__import__("transformers").__version__,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.1-8b,smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--peer-python", default=sys.executable, help="the python with torch and transformers")
    ap.add_argument("--tiny", action="store_true", help="three-layer tiny shapes: a CPU dry run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--child", choices=("jspec", "peer"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes, batches = args.shapes.split(","), [int(b) for b in args.batches.split(",")]
    if args.child:
        rows = (jspec_rows if args.child == "jspec" else peer_rows)(shapes, batches, args.context, args.tiny)
        with open(os.environ["JSPEC_CHILD_OUT"], "w") as f:
            json.dump(rows, f)
        return
    rows, failures = [], {}
    for child, python in (("jspec", sys.executable), ("peer", args.peer_python)):
        out_file = f"/tmp/bench_peers_{child}.json"
        cmd = [
            python,
            "-m",
            "benchmarks.bench_peers",
            "--child",
            child,
            "--shapes",
            args.shapes,
            "--batches",
            args.batches,
            "--context",
            str(args.context),
        ] + (["--tiny"] if args.tiny else [])
        r = subprocess.run(cmd, env=dict(os.environ, JSPEC_CHILD_OUT=out_file), cwd=REPO_ROOT, check=False)
        if r.returncode == 0:
            with open(out_file) as f:
                rows += json.load(f)
        else:  # recorded, not fatal: the other side's rows still count
            failures[child] = r.returncode

    from benchmarks.common import Results

    settings = {"shapes": shapes, "batches": batches, "context": args.context, "tiny": args.tiny}
    path = Results(args.out, "bench_peers", settings).write(rows=rows, failures=failures)
    print(f"\nwrote {path}")
    jspec = {(r["shape"], r["batch"]): r for r in rows if r["engine"] == "jspec"}
    print(f"{'shape':>14} {'B':>3} {'jspec ms':>9} {'peer ms':>8} {'floor ms':>9} {'peer/jspec':>10}")
    for r in rows:
        if r["engine"] == "jspec":
            continue
        j = jspec.get((r["shape"], r["batch"]))
        if j:
            print(
                f"{r['shape']:>14} {r['batch']:>3} {j['step_ms']:>9.3f} {r['step_ms']:>8.3f} "
                f"{j['floor_ms']:>9.3f} {r['step_ms'] / j['step_ms']:>10.2f}"
            )
    if failures:
        print("failed:", failures)


if __name__ == "__main__":
    main()
