"""`jspec.generate`: batch generation for JAX research code, on top of the Engine."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jspec.engine import Engine, Model, as_model, load
from jspec.sampling_params import SamplingParams

__all__ = ["GenerationOutput", "Model", "generate", "load"]


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length" or "abort"
    text: str | None = None
    # Speculative decoding only: verify iterations run, and tokens emitted per iteration.
    spec_verify_ct: int = 0
    mean_accept_length: float | None = None
    # With return_logprob: each output token's logprob, and the top-n (token id, logprob) pairs.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With return_logprob and logprob_start_len >= 0: prompt positions logprob_start_len.. (None at 0).
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None


def as_prompt_list(prompts) -> list:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and not isinstance(prompts[0], (str, list, tuple, np.ndarray))
    ):
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    return list(prompts)


def tokenize_prompt(prompt, model: Model, index: int = 0) -> list[int]:
    """Validates one prompt (text or token ids) and returns its token ids."""
    cfg = model.cfg
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError(f"prompt {index} is text but the model has no tokenizer; pass token ids")
        ids = model.tokenizer.encode(prompt)
    else:
        if not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt {index} must be text or a list of token ids, got {type(prompt).__name__}")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"prompt {index} token {j} is {t!r} ({type(t).__name__}), not an integer token id")
            ids.append(int(t))
    if not ids:
        raise ValueError(f"prompt {index} is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt {index} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:8]}")
    if len(ids) >= cfg.max_position_embeddings:
        raise ValueError(
            f"prompt {index} has {len(ids)} tokens; the model's context is "
            f"{cfg.max_position_embeddings} tokens, leaving no room to generate"
        )
    return ids


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    page_size: int = 16,
    num_pages: int | None = None,
    max_running_requests: int = 32,
    max_prefill_tokens: int = 2048,
    attention_backend: str | None = None,
    disable_overlap_schedule: bool = False,
    spec=None,
    draft=None,
    engine: Engine | None = None,
    sampling_params: SamplingParams | None = None,
) -> list[GenerationOutput]:
    """Generates continuations of `prompts` (strings or token-id lists) with paged KV.

    `model` is a checkpoint directory, a `jspec.Model`, or `(ModelConfig, params)`.
    `spec` (a jspec.SpecConfig) turns on EAGLE/EAGLE-3 speculative decoding with the
    draft from spec.draft_model_path, or `draft=(DraftConfig, draft_params)`.
    Pass `engine` to reuse one (its compiled programs and KV pool) across calls.
    `sampling_params` (a SamplingParams) replaces the sampling keywords above; with n > 1
    there are n outputs per prompt, prompt by prompt.
    Returns one GenerationOutput per prompt (and completion), in order.
    """
    model = as_model(model)
    prompt_list = as_prompt_list(prompts)
    ids = [tokenize_prompt(p, model, i) for i, p in enumerate(prompt_list)]  # all errors before any work
    params = sampling_params or SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                               stop=list(stop), stop_token_ids=list(stop_token_ids),
                                               ignore_eos=ignore_eos)
    if engine is None:
        engine = Engine(model, spec=spec, draft=draft, page_size=page_size, num_pages=num_pages,
                        max_running_requests=max_running_requests, chunked_prefill_size=max_prefill_tokens,
                        attention_backend=attention_backend, disable_overlap_schedule=disable_overlap_schedule,
                        max_top_logprobs=params.top_logprobs_num, seed=seed)
    return engine.generate(ids, params)
