"""One-row projections written several ways, in a chain shaped like a model's layers without
attention: which form XLA (or a Pallas kernel) runs as one kernel a projection, and what a
layer's four projections cost at batch 1.

    python -m benchmarks.bench_one_row [--shape smollm2-135m] [--layers N] [--forms xla,xla_nk,...]
        [--tiny] [--out benchmarks/results]

Why: at one row XLA rewrites a small weight's dot into a multiply and a reduction, and for
three of SmolLM2's four projections it writes the float32 product to memory between two
kernels (benchmarks/NOTES.md, "One-row projections"). A layer of the chain is add-and-norm
(layers/norm.py: the kernel on one GPU, as in the step, since the producer of a projection's
input decides what XLA fuses with it), qkv, o, add-and-norm, gate-up, SiLU-times-up, down.

Forms:
- xla: x [1, K] @ W [K, N] into float32, the model's projection (layers/matmul.dense_f32);
- xla_nk: W stored [N, K] and contracted on its minor dimension (a row reduction for XLA);
- padded: layers/matmul.two_row_dot (x padded to two rows: XLA's GEMM path);
- pallas: kernels/skinny_matmul.py at its plan; pallas_n32: the same with 32-column tiles
  and no K split (more, shorter programs for narrow weights);
- mosaic: kernels/skinny_matmul_mgpu.py where it covers the shape (XLA's dot elsewhere).

Per form: the chain's time per call (back to back), its largest difference from the first
form's output, and on a GPU its profile (kernels a call, busy microseconds). Off a GPU the
kernels run interpreted (times meaningless); --tiny (the CPU dry run) shrinks the shape and
the layers.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import RESULTS_DIR, Results, random_params, shape, timed, tiny
from benchmarks.device_profile import print_summary, profile_calls
from jspec.kernels.skinny_matmul import skinny_matmul
from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu
from jspec.layers.matmul import two_row_dot
from jspec.layers.norm import add_rms_norm
from jspec.models.common import unstack_layers

FORMS = ("xla", "xla_nk", "padded", "pallas", "pallas_n32", "mosaic")
WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")


def project(form: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, K] times the weight w ([K, N], or [N, K] for xla_nk) -> float32 [1, N]."""
    if form == "xla_nk":
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if form == "padded":
        return two_row_dot(x, w)
    if form == "pallas":
        return skinny_matmul(x, w)
    if form == "pallas_n32":
        return skinny_matmul(x, w, block_n=32, num_splits=1)
    if form == "mosaic" and mosaic_skinny_unsupported(1, *w.shape, w.dtype) is None:
        return skinny_matmul_mgpu(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def chain(form: str, cfg, x: jax.Array, layers: list[dict]) -> jax.Array:
    """The layers' norms and projections on the residual x [1, hidden] (bf16)."""
    eps = cfg.rms_norm_eps
    delta = jnp.zeros(x.shape, jnp.float32)
    for lp in layers:
        x, h = add_rms_norm(x, delta, lp["attn_norm"], eps)
        qkv = project(form, h, lp["wqkv"])
        attn = qkv[:, : cfg.q_size].astype(x.dtype)  # stands in for attention's output
        x, h = add_rms_norm(x, project(form, attn, lp["wo"]), lp["mlp_norm"], eps)
        gate, up = jnp.split(project(form, h, lp["w_gate_up"]), 2, axis=-1)
        delta = project(form, (jax.nn.silu(gate) * up).astype(x.dtype), lp["w_down"])
    return x + delta.astype(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--layers", type=int, help="default: the shape's")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: a shrunk shape, two layers")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args()

    cfg = tiny(shape(args.shape), num_layers=2) if args.tiny else shape(args.shape)
    num_layers = args.layers or cfg.num_layers
    forms = args.forms.split(",")
    unknown = set(forms) - set(FORMS)
    if unknown:
        ap.error(f"unknown forms {sorted(unknown)}; choose from {FORMS}")
    on_gpu = jax.default_backend() == "gpu"
    settings = {"shape": args.shape, "tiny": args.tiny, "layers": num_layers, "forms": forms}
    results = Results(args.out, "bench_one_row", settings)
    params = random_params(dataclasses.replace(cfg, num_layers=num_layers), jnp.bfloat16)
    layers = unstack_layers(params)["layers"]  # per-layer arrays, as the GPU engine holds them
    del params
    x = jax.random.normal(jax.random.key(1), (1, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    reference = None
    rows = []
    for form in forms:
        form_layers = [{**lp, **{n: lp[n].T.copy() for n in WEIGHTS}} for lp in layers] if form == "xla_nk" else layers
        step = jax.jit(lambda x, ls, form=form: chain(form, cfg, x, ls))
        out = np.asarray(step(x, form_layers), np.float32)
        reference = out if reference is None else reference
        row = {
            "form": form,
            "ms": timed(lambda: step(x, form_layers), iters=20, repeats=5) * 1e3,
            "max_abs_diff_vs_first": float(np.max(np.abs(out - reference))),
        }
        if on_gpu:
            row["profile"] = profile_calls(lambda: step(x, form_layers), calls=5)
            print_summary(form, row["profile"])
        rows.append(row)
        path = results.write(rows=rows)
        print({k: v for k, v in row.items() if k != "profile"})
    print(f"\nwrote {path}\n")
    print(f"{'form':>12} {'ms':>8} {'kernels':>8} {'busy us':>8} {'max diff':>9}")
    for r in rows:
        p = r.get("profile", {})
        print(
            f"{r['form']:>12} {r['ms']:8.3f} {p.get('kernels', '-')!s:>8} {p.get('busy_us', 0):8.0f} {r['max_abs_diff_vs_first']:9.2e}"
        )


if __name__ == "__main__":
    main()
