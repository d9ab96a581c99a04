"""Helpers for tests that compare jspec with HF transformers.

transformers lives in its own venv (.venv-hf, Python 3.11 + torch CPU) since
jax 0.11.2 needs Python >= 3.12; tests/support/hf_oracle.py runs there as a
subprocess and hands back .npz arrays. Tests that need it use the `hf_python`
fixture or the `requires_hf` mark, which skip with a reason when no such
python exists.

    from hf_reference import requires_hf, hf_make_checkpoint, hf_logits

    @requires_hf
    def test_parity(tmp_path):
        path = hf_make_checkpoint(tmp_path / "m", "qwen3")
        ref = hf_logits(path, [[256, 72, 105], [256, 1, 2, 3, 4]], decode_steps=8)
        ref["prefill_logits"][0]   # [T, V] float32
        ref["generated"][1]        # [9] greedy tokens (argmax of prefill, then 8 decode steps)
        ref["decode_logits"][1]    # [8, V]
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(__file__).resolve().with_name("hf_oracle.py")

# name -> (arch, transformers config overrides). Built by transformers itself, so
# they carry transformers-5 config.json fields (rope_parameters, layer_types, dtype).
HF_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    # RoPE scalings over an original context of 12 tokens, which decoding runs past (the
    # prompts, 11 and 6 tokens, stay within it: see models/rope.py on dynamic and longrope).
    "llama_linear_rope": (
        "llama",
        {"max_position_embeddings": 12, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    ),
    "llama_dynamic_rope": (
        "llama",
        {"max_position_embeddings": 12, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    ),
    "qwen2_yarn_rope": (
        "qwen2",
        {
            "max_position_embeddings": 48,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12},
        },
    ),
    "llama_longrope": (
        "llama",
        {
            "max_position_embeddings": 48,
            "rope_scaling": {
                "rope_type": "longrope",
                "original_max_position_embeddings": 12,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 12.0, 16.0],
            },
        },
    ),
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {"attention_bias": True}),
    "smollm3": ("smollm3", {}),
    "gpt_oss": ("gpt_oss", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    # Windows narrower than the prompts: every layer (Mistral), the layers from
    # max_window_layers on (Qwen2).
    "mistral_window": ("mistral", {"sliding_window": 4}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
}
# Mixture-of-experts checkpoints (tests/models/test_moe.py): every layer sparse with HF's default
# norm_topk_prob=False; a dense layer among sparse ones with renormalised weights; Mixtral;
# Qwen2-MoE's shared expert.
HF_MOE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_mixed": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": True}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
}

NO_HF_REASON = (
    "no HF reference python: set JSPEC_HF_PYTHON or create .venv-hf with torch + transformers "
    "(bash scripts/setup.sh --with-hf)"
)


def hf_python() -> str | None:
    """The python that has torch + transformers: $JSPEC_HF_PYTHON, else
    <repo>/.venv-hf/bin/python, else None."""
    env = os.environ.get("JSPEC_HF_PYTHON")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    candidate = REPO_ROOT / ".venv-hf" / "bin" / "python"
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


requires_hf = pytest.mark.skipif(hf_python() is None, reason=NO_HF_REASON)


@pytest.fixture
def hf_py() -> str:
    py = hf_python()
    if py is None:
        pytest.skip(NO_HF_REASON)
    return py


def run_oracle(request: dict[str, Any], timeout: float = 600) -> dict[str, np.ndarray]:
    """Runs tests/support/hf_oracle.py on one request (see its docstring) and returns the .npz contents."""
    py = hf_python()
    if py is None:
        raise RuntimeError(NO_HF_REASON)
    # The oracle venv must not see this venv's packages (jax, jspec) through PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error"
    )
    with tempfile.TemporaryDirectory(prefix="jspec-oracle-") as tmp:
        request = {**request, "out": os.path.join(tmp, "out.npz")}
        req_path = os.path.join(tmp, "request.json")
        with open(req_path, "w") as f:
            json.dump(request, f)
        proc = subprocess.run(
            [py, str(ORACLE), req_path], capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"hf_oracle failed (exit {proc.returncode}) on mode {request.get('mode', 'jobs')!r}:\n"
                f"{proc.stderr[-4000:]}"
            )
        with np.load(request["out"]) as data:
            return {k: data[k] for k in data.files}


def _job_make(
    name: str,
    out_dir: str | os.PathLike,
    arch_or_variant: str,
    seed: int,
    dtype: str,
    overrides: dict[str, Any],
    dump_params: bool,
) -> dict[str, Any]:
    if arch_or_variant in HF_VARIANTS:
        arch, base = HF_VARIANTS[arch_or_variant]
    else:
        arch, base = arch_or_variant, {}
    return {
        "name": name,
        "mode": "make",
        "arch": arch,
        "out_dir": os.fspath(out_dir),
        "seed": seed,
        "dtype": dtype,
        "overrides": {**base, **overrides},
        "dump_params": dump_params,
    }


def hf_make_checkpoint(
    out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, dtype: str = "float32", **overrides: Any
) -> str:
    """A random checkpoint written by transformers' save_pretrained. `arch` is an
    arch (llama, mistral, qwen2, qwen3) or a HF_VARIANTS name; overrides are
    config kwargs (e.g. num_hidden_layers=3, tie_word_embeddings=True)."""
    job = _job_make("m", out_dir, arch, seed, dtype, overrides, False)
    del job["name"]  # a single job: no key prefix
    run_oracle(job)
    return os.fspath(out_dir)


def hf_make_checkpoints(
    root: str | os.PathLike,
    variants: dict[str, tuple] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    dump_params: bool = False,
) -> dict[str, dict[str, Any]]:
    """Several checkpoints in one oracle run (one torch start-up). A variant is
    (arch, config overrides) or (arch, config overrides, make-job options such as
    {"save_original_format": False}). Returns
    {name: {"path", "num_params", "params": {HF name: array} (if dump_params)}}."""
    variants = HF_VARIANTS if variants is None else variants
    jobs = [
        {**_job_make(name, Path(root) / name, arch, seed, dtype, ov, dump_params), **(opts[0] if opts else {})}
        for name, (arch, ov, *opts) in variants.items()
    ]
    out = run_oracle({"jobs": jobs})
    return {name: _unpack(out, name, os.fspath(Path(root) / name)) for name in variants}


def hf_inspect(paths: dict[str, str | os.PathLike]) -> dict[str, dict[str, Any]]:
    """Loads existing checkpoints with transformers (failing on any missing or
    unexpected weight); returns {name: {"path", "num_params", "params"}}."""
    jobs = [{"name": n, "mode": "inspect", "checkpoint": os.fspath(p), "dump_params": True} for n, p in paths.items()]
    out = run_oracle({"jobs": jobs})
    return {n: _unpack(out, n, os.fspath(p)) for n, p in paths.items()}


def _unpack(out: dict[str, np.ndarray], name: str, path: str) -> dict[str, Any]:
    prefix = f"{name}/"
    params = {k[len(prefix) + len("param:") :]: v for k, v in out.items() if k.startswith(prefix + "param:")}
    return {"path": path, "num_params": int(out[prefix + "num_params"][0]), "params": params}


def hf_logits_many(
    paths: dict[str, str | os.PathLike], prompts: list[list[int]], decode_steps: int = 8
) -> dict[str, dict[str, Any]]:
    """hf_logits for several checkpoints in one oracle run (one torch start-up): {name: ref}."""
    jobs = [
        {
            "name": name,
            "mode": "logits",
            "checkpoint": os.fspath(path),
            "prompts": [list(map(int, p)) for p in prompts],
            "decode_steps": decode_steps,
        }
        for name, path in paths.items()
    ]
    out = run_oracle({"jobs": jobs})
    refs = {}
    for name in paths:
        ref: dict[str, Any] = {"num_params": int(out[f"{name}/num_params"][0])}
        for key in ("prefill_logits", "decode_logits", "generated"):
            ref[key] = [out[f"{name}/{key}_{i}"] for i in range(len(prompts))]
        refs[name] = ref
    return refs


def hf_logits(
    path: str | os.PathLike, prompts: list[list[int]], decode_steps: int = 8, hidden_states: bool = False
) -> dict[str, Any]:
    """HF's float32 reference for each prompt (batch 1 each, eager attention):
    {"prefill_logits": [[T_i, V]], "decode_logits": [[decode_steps, V]],
     "generated": [[decode_steps + 1]], "prefill_hidden": [[L+1, T_i, H]] (if asked),
     "num_params": int}."""
    out = run_oracle(
        {
            "mode": "logits",
            "checkpoint": os.fspath(path),
            "prompts": [list(map(int, p)) for p in prompts],
            "decode_steps": decode_steps,
            "hidden_states": hidden_states,
        }
    )
    res: dict[str, Any] = {"num_params": int(out["num_params"][0])}
    keys = ["prefill_logits", "decode_logits", "generated"] + (["prefill_hidden"] if hidden_states else [])
    for key in keys:
        res[key] = [out[f"{key}_{i}"] for i in range(len(prompts))]
    return res
