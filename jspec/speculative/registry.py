"""SpecConfig -> SpecMethod: the one place that maps an algorithm's name to its implementation."""

from __future__ import annotations

import dataclasses

from jspec.checkpoint.eagle import load_draft_model
from jspec.checkpoint.hub import resolve_checkpoint
from jspec.checkpoint.loader import load_model
from jspec.checkpoint.mtp import load_mtp_params
from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.speculative.dflash import make_dflash_method
from jspec.speculative.eagle import EagleMethod
from jspec.speculative.nextn import NextnMethod
from jspec.speculative.ngram import NgramMethod
from jspec.speculative.standalone import StandaloneMethod


def make_method(spec: SpecConfig, cfg: ModelConfig, draft=None, dtype=None, target_path=None, per_layer=False):
    """-> (method, draft params or None). draft: (config, params) of a draft model already in
    memory; else spec.draft_model_path (a directory or a Hub repo id) is loaded (methods that
    need a draft model; a STANDALONE draft's layers as per-layer arrays with per_layer, as the
    target's). NEXTN reads the MTP layers of spec.draft_model_path, else of target_path (the
    target's checkpoint)."""
    _check_tree_fits_windows(spec, cfg, "target")
    if spec.algorithm in ("EAGLE", "EAGLE3"):
        if draft is None:
            draft = load_draft_model(_draft_dir(spec), cfg, dtype=dtype, algorithm=spec.algorithm)
        dcfg, dparams = draft
        return EagleMethod(spec, dcfg), dparams
    if spec.algorithm == "STANDALONE":
        if draft is None:
            draft = load_model(_draft_dir(spec), dtype=dtype, per_layer=per_layer)
        dcfg, dparams = draft
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"the STANDALONE draft's vocabulary ({dcfg.vocab_size}) differs from the target's "
                f"({cfg.vocab_size}); the draft must share the target's tokenizer"
            )
        _check_tree_fits_windows(spec, dcfg, "STANDALONE draft")
        if dcfg.sliding_windows and max(k for _, k, _ in spec.shapes()) > 1:
            raise ValueError(
                "a STANDALONE draft with sliding-window attention drafts chains only (eagle_topk=1): "
                "beam drafting does not window the draft's attention"
            )
        return StandaloneMethod(spec, dcfg), dparams
    if spec.algorithm == "NEXTN":
        if cfg.deepseek is None and not cfg.num_mtp_layers:
            raise ValueError(
                f"NEXTN drafts with the checkpoint's own multi-token-prediction layers (DeepSeek-V3, MiMo); "
                f"this {cfg.family!r} target has none"
            )
        if draft is None:
            path = _draft_dir(spec) if spec.draft_model_path else target_path
            if path is None:
                raise ValueError(
                    "NEXTN reads the MTP layers from the target's checkpoint: load the target from its path, "
                    "or pass spec.draft_model_path or draft=(cfg, mtp params)"
                )
            draft = (cfg, load_mtp_params(path, cfg, dtype=dtype))
        dcfg, dparams = draft
        return NextnMethod(spec, dcfg), dparams
    if spec.algorithm == "DFLASH":
        method, dparams = make_dflash_method(spec, cfg, draft, dtype, lambda: _draft_dir(spec))
        _check_tree_fits_windows(method.spec, cfg, "target")  # now that the block is known
        return method, dparams
    if spec.algorithm == "NGRAM":
        if draft is not None:
            raise ValueError("NGRAM speculation has no draft model; do not pass draft=")
        # The history holds every position a request can reach, plus one iteration's overshoot.
        widest = max(n for _, _, n in spec.shapes())
        return NgramMethod(spec, cfg.max_position_embeddings + 2 * widest + 2), None
    raise ValueError(f"no implementation for speculative algorithm {spec.algorithm!r}")


def _check_tree_fits_windows(spec: SpecConfig, cfg: ModelConfig, what: str) -> None:
    """Tree verification windows the prefix only; a node sees all its ancestors, so the
    deepest node of every shape the config may run must see the root."""
    window = cfg.smallest_window
    steps = max(shape[0] for shape in spec.shapes())
    if window is not None and steps >= window:
        raise ValueError(
            f"speculative num_steps={steps} reaches past the {what}'s sliding window of "
            f"{window} tokens; use num_steps < {window}"
        )


def shape_variants(method) -> tuple:
    """The method once per draft shape its config allows (speculative/adaptive.py picks among
    them per iteration); they share one device state, the first one's."""
    return tuple(dataclasses.replace(method, spec=method.spec.with_shape(s)) for s in method.spec.shapes())


def _draft_dir(spec: SpecConfig) -> str:
    """The draft checkpoint's directory (a Hub repo id is fetched, at draft_model_revision)."""
    if spec.draft_model_path is None:
        raise ValueError(f"speculative algorithm {spec.algorithm} needs spec.draft_model_path or draft=(cfg, params)")
    return resolve_checkpoint(spec.draft_model_path, "draft", spec.draft_model_revision)
