"""Adaptive speculation replayed: recorded acceptance traces through the policy and a cost table.

1. Record: the embedded SmolLM2-135M decodes chat prompts greedily (plain decoding; speculation
   is lossless, so every shape emits these same tokens). NGRAM's drafts are a function of the
   tokens so far, so for every position and every shape the accepted length is computed exactly
   from the record (the engine's own matcher and acceptance rule), without running each shape.
2. Costs: each shape's iteration time per batch bucket, and with only d rows drafting (the
   ragged verify), measured on this device by the engine (SpecWorker.measure_costs), or loaded
   with --cost-table. The JSON's "costs" and "ragged" are a cost table the server loads.
3. Replay: batches of traces run to completion under each fixed shape, under "off", and under
   the policy (the engine's AdaptivePolicy, fed only the accept lengths it would read back).
   Three workloads, from the traces ranked by how often the always-on shape's drafts are
   accepted: the top half (the drafts pay), the bottom half (they do not), and a batch that
   mixes both.

    python -m benchmarks.bench_adaptive [--tiny] [--cost-table F] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import RESULTS_DIR, SMALL, TINY, Results, git_commit, int_list, random_params, spec_costs
from jspec.layers.batch import bucket
from jspec.speculative.adaptive import AdaptivePolicy, CostTable, shape_label
from jspec.speculative.ngram import PAD, match_candidates_ref

SHAPES = "3,1,4 1,1,2 3,2,7 0,1,1"  # with the default NGRAM chain (7,1,8) first
PROMPTS = [  # some ask for repetitive output, where copied drafts are right; some for free prose
    "Repeat this sentence exactly five times, one per line: The quick brown fox jumps over the lazy dog.",
    "Write the numbers from 1 to 40 separated by commas.",
    "Write a Python function that returns the list [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], then call it three times.",
    "Copy this line three times: apples, pears, plums, cherries, grapes, lemons.",
    "List the days of the week, then list them again in reverse order.",
    "Write an HTML table with three rows, each with the cells Name, Age and City.",
    "Write a short poem about the sea at night.",
    "Describe your ideal weekend in a few sentences.",
    "What are three reasons people enjoy hiking?",
    "Tell a short story about a fox who learns to sing.",
    "Explain why the sky is blue to a child.",
    "Give advice to someone starting their first job.",
]
TINY_PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7], [11, 40, 3], [90, 5, 17, 33]]


@dataclasses.dataclass
class Trace:
    """One request's record: accept[s][p] drafts accepted by shape s from position p on."""

    name: str
    prompt_len: int
    generated: int
    accept: dict  # shape -> np.ndarray over positions prompt_len - 1 .. end


def ngram_accepts(tokens: list[int], start: int, shape, spec: jspec.SpecConfig) -> np.ndarray:
    """Accepted drafts of NGRAM with `shape` at each root position n >= start, as the engine
    gets them: `breadth` chains from its matcher over tokens[:n+1] (a position no match covers
    drafts PAD, which the target may confirm), walked as verification does (the first chain
    whose first draft the target confirms, then that chain only)."""
    steps, breadth, _ = shape
    out = np.zeros(len(tokens) - start, np.int32)
    if steps == 0:
        return out
    hist = np.asarray(tokens, np.int32)
    for i, n in enumerate(range(start, len(tokens))):
        ends, _ = match_candidates_ref(
            hist,
            n,
            min_window=spec.ngram_min_match_window_size,
            max_window=spec.ngram_max_match_window_size,
            breadth=breadth,
        )
        for end in list(ends) + [-1] * (breadth - len(ends)):
            follow = [end + 1 + k for k in range(steps)]
            drafts = [int(hist[f]) if end >= 0 and f <= n else PAD for f in follow]
            k = 0
            while k < steps and n + 1 + k < len(tokens) and drafts[k] == hist[n + 1 + k]:
                k += 1
            if k > 0:
                out[i] = k
                break
    return out


def record(model, prompts, names, max_new: int, shapes, spec) -> list[Trace]:
    outs = jspec.generate(model, prompts, max_new_tokens=max_new, page_size=16)
    traces = []
    for name, o in zip(names, outs):
        tokens = list(o.prompt_token_ids) + list(o.token_ids)
        start = len(o.prompt_token_ids)  # the first decode's root is the first generated token
        accept = {s: ngram_accepts(tokens, start, s, spec) for s in shapes}
        traces.append(Trace(name, start, len(o.token_ids), accept))
    return traces


def replay(traces: list[Trace], costs: CostTable, shapes, choose) -> dict:
    """Runs the traces as one batch to completion; choose(rows, bucket) -> (shape index, drafting
    rows or None, a callback fed each iteration's accepts). Returns tokens, seconds and counts."""
    pos = [0] * len(traces)  # index into each trace's positions (0: the first decode's root)
    left = [t.generated - 1 for t in traces]  # tokens each still emits (the first came from prefill)
    tokens = seconds = 0.0
    used: dict[str, int] = {}
    opted_out = 0
    while any(n > 0 for n in left):
        rows = [i for i, n in enumerate(left) if n > 0]
        b = bucket(len(rows))
        s, drafting, observe = choose(rows, b)
        shape = shapes[s]
        cost = costs.at(shape, b)
        if drafting is not None:  # only rows d drafted: that iteration's own measured cost
            cost = costs.ragged[(shape, b, sum(drafting))]
            opted_out += drafting.count(False)
        accepts = []
        for j, i in enumerate(rows):
            a = int(traces[i].accept[shape][pos[i]]) if pos[i] < len(traces[i].accept[shape]) else 0
            if drafting is not None and not drafting[j]:
                a = 0
            emitted = min(a + 1, left[i])
            left[i] -= emitted
            pos[i] += emitted
            tokens += emitted
            accepts.append(a)
        seconds += cost
        used[shape_label(shape)] = used.get(shape_label(shape), 0) + 1
        observe(rows, np.asarray(accepts), cost, drafting)
    return {
        "tokens": int(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "iterations": used,
        "rows_opted_out": opted_out,
    }


@dataclasses.dataclass
class ReplayRow:
    """What the policy keeps of a replayed request (the engine keeps it on Request)."""

    accept_alpha: float | None = None


def fixed(index: int):
    def choose(rows, b):
        return index, None, lambda rows, accepts, cost, drafting: None

    return choose


def adaptive(shapes, costs: CostTable, opt_out: bool = True):
    policy = AdaptivePolicy(tuple(shapes), costs, opt_out=opt_out)

    state: dict[int, ReplayRow] = {}

    def choose(rows, b):
        reqs = [state.setdefault(i, ReplayRow()) for i in rows]
        c = policy.choose(policy.alphas(reqs), b)
        return (
            c.shape,
            c.drafting,
            lambda rows, accepts, cost, drafting: policy.observe(c.shape, reqs, accepts, cost, drafting),
        )

    return choose


def policy_host_cost(shapes, costs: CostTable, rows=(1, 16, 64), calls: int = 2000) -> list[dict]:
    """Host time of the policy per iteration (choose, and observe of the outputs), with every
    ragged option in the table: what it adds to the loop's host work."""
    import time

    table = CostTable({s: {b: costs.at(s, b) for b in rows} for s in shapes}, "bench")
    for s in shapes:
        for b in rows:
            d = 1
            while d < b and s[0] > 0:
                table.ragged[(s, b, d)] = table.at(s, b)
                d *= 2

    out = []
    rng = np.random.default_rng(0)
    for n in rows:
        policy = AdaptivePolicy(tuple(shapes), table)
        alphas, accepts = rng.random(n), rng.integers(0, 3, n)
        reqs = [ReplayRow() for _ in range(n)]
        t0 = time.perf_counter()
        for _ in range(calls):
            policy.choose(alphas, n)
        t1 = time.perf_counter()
        for _ in range(calls):
            policy.observe(0, reqs, accepts, 0.01)
        t2 = time.perf_counter()
        out.append({"rows": n, "choose_us": (t1 - t0) / calls * 1e6, "observe_us": (t2 - t1) / calls * 1e6})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model: a quick dry run of the script")
    ap.add_argument("--cost-table", default=None, help="a cost table JSON instead of measuring one here")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batches", type=int_list, default=[6], help="rows per replayed batch (traces repeat to fill)")
    ap.add_argument(
        "--costs-only",
        metavar="PATH",
        help="measure the cost table on this device with random weights of the SmolLM2 shape (costs "
        "do not depend on the weights' values), write it to PATH and stop; replay elsewhere with --cost-table",
    )
    ap.add_argument("--max-running-requests", type=int, default=128, help="the largest bucket --costs-only measures")
    args = ap.parse_args()
    spec = jspec.SpecConfig("NGRAM", adaptive=True, adaptive_shapes=SHAPES)
    if args.costs_only:
        write_costs(args.costs_only, spec, args.max_running_requests)
        return
    if args.tiny:
        model, prompts = (TINY, random_params(TINY, jnp.float32)), TINY_PROMPTS
        args.max_new_tokens, args.batches = min(args.max_new_tokens, 24), [2]
    else:
        from jspec.checkpoint.demo import default_model_path
        from jspec.server.chat_template import render_chat

        model = jspec.load(default_model_path()[0])
        tok = model.tokenizer
        chat = lambda p: tok.encode(render_chat(tok, [{"role": "user", "content": p}]), add_special_tokens=False)  # noqa: E731
        prompts = [chat(p) for p in PROMPTS]
    shapes = spec.shapes()
    traces = record(model, prompts, [f"prompt{i}" for i in range(len(prompts))], args.max_new_tokens, shapes, spec)
    if args.cost_table:
        costs = CostTable.load(args.cost_table)
    else:
        # Every program compiles on its first (untimed) run.
        engine = jspec.Engine(model, speculative=spec, max_running_requests=max(args.batches), page_size=16)
        costs = engine.worker.measure_costs(ragged=True)
    ranked = sorted(traces, key=lambda t: -t.accept[shapes[0]].mean())
    half = len(ranked) // 2
    rows = []
    for size in args.batches:
        for name, pool in (("pays", ranked[:half]), ("never_pays", ranked[half:]), ("mixed", ranked)):
            if name == "mixed":  # half from each end, as far as the traces go
                pool = ranked[: size // 2] + ranked[half:] if size <= len(ranked) else ranked
            batch = list(itertools.islice(itertools.cycle(pool), size))
            rows.append(replay_row(name, batch, costs, shapes))
    print_rows(rows, shapes, costs)
    settings = {
        "model": "tiny random" if args.tiny else "SmolLM2-135M-Instruct (embedded)",
        "method": "NGRAM",
        "shapes": [shape_label(s) for s in shapes],
        "always_on": shape_label(shapes[0]),
        "max_new_tokens": args.max_new_tokens,
        "batches": args.batches,
        "cost_source": costs.source,
    }
    trace_summary = [
        {
            "name": t.name,
            "generated": t.generated,
            "mean_accept": {shape_label(s): float(a.mean()) for s, a in t.accept.items()},
        }
        for t in traces
    ]
    host = policy_host_cost(shapes, costs)
    results = Results(args.out, "bench_adaptive", settings)
    path = results.write(rows=rows, **costs.to_json(), traces=trace_summary, policy_host=host)
    print(f"wrote {path}\n")
    for h in host:
        print(f"policy host time, {h['rows']} rows: choose {h['choose_us']:.0f} us, observe {h['observe_us']:.0f} us")


def write_costs(path: str, spec: jspec.SpecConfig, max_rows: int):
    """The cost table of `spec`'s shapes at every bucket up to max_rows, measured here."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    model = (SMALL, random_params(SMALL, dtype))
    # A step's time does not depend on the pool's size (benchmarks/NOTES.md, pool_scaling), and a
    # pool sized from the device would make every program's compile slower.
    engine = jspec.Engine(model, speculative=spec, max_running_requests=max_rows, page_size=16, max_total_tokens=65536)
    costs = spec_costs(engine)
    device = jax.devices()[0].device_kind
    with open(path, "w") as f:
        json.dump(dict(costs.to_json(), device=device, commit=git_commit(), shape="smollm2-135m"), f, indent=1)
    for s, row in costs.seconds.items():
        print(shape_label(s), " ".join(f"B={b}: {t * 1e3:.2f} ms" for b, t in sorted(row.items())))
    print(f"wrote {path} ({device})")


def replay_row(name: str, batch: list[Trace], costs: CostTable, shapes) -> dict:
    """One workload under every fixed shape, the policy, and the policy without per-row opt-out."""
    row = {"workload": name, "rows": len(batch)}
    for i, s in enumerate(shapes):
        row[shape_label(s)] = replay(batch, costs, shapes, fixed(i))
    row["adaptive"] = replay(batch, costs, shapes, adaptive(shapes, costs))
    row["adaptive_per_batch"] = replay(batch, costs, shapes, adaptive(shapes, costs, opt_out=False))
    always = row[shape_label(shapes[0])]["tokens_per_s"]
    off = row["off"]["tokens_per_s"]
    best_fixed = max(row[shape_label(s)]["tokens_per_s"] for s in shapes)
    row["adaptive_over_better_of_on_and_off"] = row["adaptive"]["tokens_per_s"] / max(always, off)
    row["adaptive_over_best_fixed"] = row["adaptive"]["tokens_per_s"] / best_fixed
    row["per_batch_over_better_of_on_and_off"] = row["adaptive_per_batch"]["tokens_per_s"] / max(always, off)
    return row


def print_rows(rows, shapes, costs: CostTable):
    labels = [shape_label(s) for s in shapes]
    head = " ".join(f"{x:>8}" for x in labels)
    print(f"{'workload':>10} {'rows':>4} {head} {'per-batch':>9} {'adaptive':>8} {'vs max(on,off)':>14}  (tokens/s)")
    for r in rows:
        fixed_rates = " ".join(f"{r[x]['tokens_per_s']:>8.1f}" for x in labels)
        print(
            f"{r['workload']:>10} {r['rows']:>4} {fixed_rates} {r['adaptive_per_batch']['tokens_per_s']:>9.1f} "
            f"{r['adaptive']['tokens_per_s']:>8.1f} {r['adaptive_over_better_of_on_and_off']:>14.3f}"
        )
    for (shape, b, d), t in sorted(costs.ragged.items()):
        full, off = costs.at(shape, b), costs.at((0, 1, 1), b)
        print(
            f"{shape_label(shape)} B={b}, {d} rows drafting: {t * 1e3:.1f} ms "
            f"(all drafting {full * 1e3:.1f}, off {off * 1e3:.1f})"
        )


if __name__ == "__main__":
    main()
