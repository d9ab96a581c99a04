"""DFLASH drafts what the reference implementation drafts: a tiny drafter written by jspec in
the published layout (and loaded strictly by the reference) over a tiny Qwen3 checkpoint. The
reference's own speculative loop (z-lab's `dflash` package, dflash_generate: its draft cache,
crops and block positions) runs greedy requests; for every full-size block it drafted, jspec's
drafter, read from the same directory and recomputed from the committed tokens, gives the same
draft logits within float32 tolerance. The drafter's scalar knobs (embedding scale, output
multiplier, soft-cap) are set, so they are checked too."""

import dataclasses
import functools
import subprocess

import jax
import numpy as np
import pytest
from support.dflash_models import dense_logits
from support.hf_reference import hf_python, requires_hf, run_oracle

import jspec
from jspec.checkpoint.dflash import dflash_config_for, init_random_dflash_params, load_dflash_model, save_dflash
from jspec.checkpoint.tiny import make_tiny_model
from jspec.models.llama import dense_forward

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

BLOCK = 8
NEW = 16
VOCAB = 320  # the oracle's tiny checkpoints
PROMPTS = [list(map(int, np.random.default_rng(1).integers(0, VOCAB - 1, n))) for n in (9, 14)]


@functools.cache
def reference_missing() -> str | None:
    py = hf_python()
    probe = subprocess.run([py, "-c", "import dflash.model"], capture_output=True, text=True) if py else None
    if probe is None or probe.returncode:
        return "the HF venv has no `dflash` package (bash scripts/setup.sh --with-hf installs z-lab's from PyPI)"
    return None


@requires_hf
def test_draft_logits_match_the_reference_implementation(tmp_path):
    if reference_missing():
        pytest.skip(reference_missing())
    # jspec's own tiny writer (transformers loads it strictly in the oracle): one torch start-up.
    target_dir = make_tiny_model(tmp_path / "target", "qwen3", num_layers=4, max_position_embeddings=256)
    model = jspec.load(target_dir)
    dcfg = dflash_config_for(
        model.cfg, num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2)
    )
    dcfg = dataclasses.replace(dcfg, input_embedding_scale=1.5, output_multiplier=0.8, final_logit_softcap=20.0)
    drafter = save_dflash(
        tmp_path / "drafter", dcfg, init_random_dflash_params(dcfg, jax.random.key(4), std=0.15), model.cfg
    )
    ref = run_oracle(
        {
            "mode": "dflash_generate",
            "checkpoint": target_dir,
            "drafter": drafter,
            "prompts": PROMPTS,
            "max_new_tokens": NEW,
        }
    )

    # jspec reads the same directory; its drafter recomputed from scratch for each block the
    # reference drafted (the engine's paged blocks equal this recompute: test_spec_dflash.py).
    loaded_cfg, loaded = load_dflash_model(drafter, model.cfg)
    assert loaded_cfg == dcfg
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        sequence = [int(t) for t in ref[f"output_ids_{i}"]]
        assert sequence[: len(prompt)] == prompt and len(sequence) == len(prompt) + NEW
        for start, logits in zip(ref[f"starts_{i}"], ref[f"draft_logits_{i}"]):
            mine = dense_logits(model.cfg, model.params, loaded_cfg, loaded, sequence, int(start), BLOCK)[1:]
            np.testing.assert_allclose(mine, logits, atol=2e-5 * np.abs(logits).max() + 1e-5, rtol=0)
            compared += 1
    assert compared >= 10
    # The reference's greedy tokens are the target's own.
    full = np.asarray(dense_forward(model.params, model.cfg, np.asarray(sequence[:-1], np.int32)))
    assert sequence[len(PROMPTS[-1]) :] == list(np.argmax(full, axis=-1)[len(PROMPTS[-1]) - 1 :])
