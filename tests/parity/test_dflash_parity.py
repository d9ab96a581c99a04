"""DFLASH drafts what the reference implementation drafts: a tiny drafter written by jspec in
the published layout (and loaded strictly by the reference) over a tiny Qwen3 checkpoint; the reference's own speculative loop (z-lab's `dflash` package,
dflash_generate: its draft cache, crops and block positions) and jspec's engine run the same
greedy requests, and every full-size block's draft logits agree within float32 tolerance.
The drafter's scalar knobs (embedding scale, output multiplier, soft-cap) are set, so they
are checked too."""

import dataclasses
import functools
import subprocess

import jax
import numpy as np
import pytest
from support.dflash_models import recorded_blocks
from support.hf_reference import hf_python, requires_hf, run_oracle

import jspec
from jspec.checkpoint.dflash import dflash_config_for, init_random_dflash_params, save_dflash
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.testing.tiny import make_tiny_model

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

    spec = SpecConfig("DFLASH", draft_model_path=drafter)
    kw = dict(page_size=16, max_total_tokens=512, precompile_bs_paddings=[2], attention_backend="reference")
    with recorded_blocks() as records:
        engine = jspec.Engine(model, speculative=spec, **kw)
        assert engine.worker.method.dcfg == dcfg  # the published config.json read back whole
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    compared = 0
    for i, (prompt, o) in enumerate(zip(PROMPTS, out)):
        assert list(ref[f"output_ids_{i}"]) == prompt + o.token_ids  # both are the target's greedy output
        mine = {(int(p[0]), int(t[0])): lg for p, t, lg in records}
        for start, logits in zip(ref[f"starts_{i}"], ref[f"draft_logits_{i}"]):
            got = mine[(int(start), (prompt + o.token_ids)[start])][1:]  # rows 1..: the drafts
            scale = np.abs(logits).max()
            np.testing.assert_allclose(got, logits, atol=2e-5 * scale + 1e-5, rtol=0)
            compared += 1
    assert compared >= 10
