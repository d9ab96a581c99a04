"""`jspec.generate`: batch generation for JAX research code, on top of the Engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jspec.checkpoint.model import Model, as_model, load
from jspec.config.engine import EngineConfig
from jspec.config.sampling import SamplingParams
from jspec.engine.engine import Engine
from jspec.engine.outputs import GenerationOutput, as_prompt_list, tokenize_prompt

__all__ = ["EngineConfig", "GenerationOutput", "Model", "generate", "load"]

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# What Engine takes besides EngineConfig's fields: how to load the weights.
ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) | {"load"}


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    json_schema: str | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    sampling_params: SamplingParams | None = None,
    engine: Engine | None = None,
    config: EngineConfig | None = None,
    draft=None,
    **settings,
) -> list[GenerationOutput]:
    """Generates continuations of `prompts` (strings or token-id lists) with paged KV.

    `model` is a checkpoint directory, a `jspec.Model`, or `(ModelConfig, params)`. The engine
    is built from `config` and `settings` (EngineConfig's fields, e.g. `speculative=SpecConfig(...)`,
    `page_size=16`), `draft=(DraftConfig, draft_params)` giving the draft's weights in memory;
    pass `engine` to reuse one (its compiled programs and KV pool) across calls.
    json_schema (as JSON text), regex or ebnf constrain the output to that grammar.
    Any other SamplingParams field is a keyword too (top_p, top_k, n, frequency_penalty, ...).
    `sampling_params` (a SamplingParams) replaces the sampling keywords; with n > 1 there are n
    outputs per prompt, prompt by prompt.
    Returns one GenerationOutput per prompt (and completion), in order.
    """
    sampling = {k: settings.pop(k) for k in list(settings) if k in SAMPLING_FIELDS}
    if sampling_params is not None and sampling:
        raise TypeError(f"give sampling_params or sampling keywords, not both (got {sorted(sampling)} too)")
    unknown = sorted(set(settings) - ENGINE_FIELDS)
    if unknown:
        raise TypeError(f"generate() got {unknown}: neither SamplingParams' nor EngineConfig's fields")
    model = as_model(model)
    prompt_list = as_prompt_list(prompts)
    ids = [tokenize_prompt(p, model, i) for i, p in enumerate(prompt_list)]  # all errors before any work
    params = sampling_params or SamplingParams(
        **sampling,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        json_schema=json_schema,
        regex=regex,
        ebnf=ebnf,
    )
    if engine is None:
        settings.setdefault("max_top_logprobs", max(params.top_logprobs_num, EngineConfig.max_top_logprobs))
        engine = Engine(model, config, draft=draft, **settings)
    return engine.generate(ids, params)
