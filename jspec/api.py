"""`jspec.generate`: batch generation for JAX research code, on top of the Engine."""

from __future__ import annotations

from typing import Sequence


from jspec.engine.engine import Engine
from jspec.checkpoint.model import Model, as_model, load
from jspec.engine.outputs import GenerationOutput, as_prompt_list, tokenize_prompt
from jspec.config.sampling import SamplingParams

__all__ = ["GenerationOutput", "Model", "generate", "load"]


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
