"""What the engine takes in and gives back: prompts as token ids, finished generations."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jspec.checkpoint.model import Model


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


def tokenize_prompt(prompt, model: Model, index: int | None = None) -> list[int]:
    """Validates one prompt (text or token ids) and returns its token ids. index: the prompt's
    place in a list, which errors name (None: a single prompt)."""
    cfg = model.cfg
    index = "" if index is None else f" {index}"
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError(f"prompt{index} is text but the model has no tokenizer; pass token ids")
        ids = model.tokenizer.encode(prompt)
    else:
        if not isinstance(prompt, (Sequence, np.ndarray)):
            raise TypeError(f"prompt{index} must be text or a list of token ids, got {type(prompt).__name__}")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"prompt{index} token {j} is {t!r} ({type(t).__name__}), not an integer token id")
            ids.append(int(t))
    if not ids:
        raise ValueError(f"prompt{index} is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt{index} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:8]}")
    if len(ids) >= cfg.max_position_embeddings:
        raise ValueError(
            f"prompt{index} has {len(ids)} tokens; the model's context is "
            f"{cfg.max_position_embeddings} tokens, leaving no room to generate"
        )
    return ids
