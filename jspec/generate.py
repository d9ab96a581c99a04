"""`jspec.generate`: batch generation for JAX research code.

This is the simple synchronous path: admit as many requests as the KV pool
holds, prefill them in one ragged batch (chunked), decode all running
requests one token per step, free pages as requests finish, repeat.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np

from jspec.config import ModelConfig
from jspec.paged_kv.allocator import OutOfPagesError
from jspec.runner import ModelRunner
from jspec.scheduler.batch_builder import SeqChunk


@dataclasses.dataclass
class Model:
    """A loaded model: config, param pytree and (optionally) its tokenizer."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any = None


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop token) or "length"
    text: str | None = None
    # Speculative decoding only: verify iterations run, and tokens emitted per iteration.
    spec_verify_ct: int = 0
    mean_accept_length: float | None = None


def load(path: str | os.PathLike, dtype=None) -> Model:
    from jspec.models.loader import load_model
    from jspec.models.tokenizer import load_tokenizer

    cfg, params = load_model(path, dtype=dtype)
    return Model(cfg, params, load_tokenizer(path))


def _as_model(model) -> Model:
    if isinstance(model, Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load(model)
    if isinstance(model, tuple) and len(model) in (2, 3) and isinstance(model[0], ModelConfig):
        return Model(*model)
    raise TypeError(
        f"model must be a checkpoint path, a jspec.Model or a (ModelConfig, params) tuple, got {type(model).__name__}"
    )


def _tokenize_prompts(prompts, model: Model) -> list[list[int]]:
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and not isinstance(prompts[0], (str, list, tuple, np.ndarray))
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is text but the model has no tokenizer; pass token ids")
            ids = model.tokenizer.encode(p)
        else:
            ids = []
            for j, t in enumerate(p):
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"prompt {i} token {j} is {t!r} ({type(t).__name__}), not an integer token id")
                ids.append(int(t))
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {model.cfg.vocab_size}): {bad[:8]}")
        if len(ids) >= model.cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; the model's context is "
                f"{model.cfg.max_position_embeddings} tokens, leaving no room to generate"
            )
        out.append(ids)
    return out


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    finish_reason: str | None = None
    slot: int | None = None
    verify_ct: int = 0
    spec_emitted: int = 0

    def append(self, tokens, stop_ids) -> None:
        """Appends tokens up to a stop token or the budget, and sets finish_reason then."""
        for t in tokens:
            self.output.append(int(t))
            if self.output[-1] in stop_ids:
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.max_new_tokens:
                self.finish_reason = "length"
                return


def generate(
    model,
    prompts,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    page_size: int = 16,
    num_pages: int | None = None,
    max_prefill_tokens: int = 2048,
    attention_backend: str | None = None,
    runner=None,
    spec=None,
    draft=None,
) -> list[GenerationOutput]:
    """Generates continuations of `prompts` (strings or token-id lists) with paged KV.

    `model` is a checkpoint directory, a `jspec.Model`, or `(ModelConfig, params)`.
    `spec` (a jspec.SpecConfig) turns on EAGLE/EAGLE-3 speculative decoding with the
    draft from spec.draft_model_path, or `draft=(DraftConfig, draft_params)`.
    Returns one GenerationOutput per prompt, in order.
    """
    model = _as_model(model)
    cfg = model.cfg
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt_ids = _tokenize_prompts(prompts, model)
    if spec is not None:
        return _generate_spec(
            model, prompt_ids, spec, draft, max_new_tokens=max_new_tokens, temperature=temperature,
            ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, page_size=page_size, num_pages=num_pages,
            max_prefill_tokens=max_prefill_tokens, attention_backend=attention_backend, runner=runner,
        )
    if runner is None:
        runner = ModelRunner(
            cfg, model.params, page_size=page_size, num_pages=num_pages, attention_backend=attention_backend
        )
    S = runner.page_size
    stop_ids = _stop_ids(model, ignore_eos, stop_token_ids)
    reqs = _make_requests(model.cfg, prompt_ids, max_new_tokens, runner.allocator, S, margin=0)

    key = jax.random.key(seed)
    waiting = list(reqs)
    running: list[_Request] = []
    while waiting or running:
        # Admit what fits; each request reserves its whole budget up front here.
        admitted = []
        while waiting:
            r = waiting[0]
            need = -(-(len(r.prompt) + r.max_new_tokens) // S)
            if need > runner.allocator.num_free:
                break
            r.pages = runner.allocator.alloc(need)
            admitted.append(waiting.pop(0))
        if admitted:
            key = _prefill(runner, admitted, temperature, max_prefill_tokens, key, stop_ids)
            running.extend(admitted)
        elif running:
            key, sub = jax.random.split(key)
            chunks = [SeqChunk([r.output[-1]], len(r.prompt) + len(r.output) - 1, r.pages) for r in running]
            tokens = np.asarray(runner.step(chunks, np.full(len(chunks), temperature, np.float32), sub))
            for r, t in zip(running, tokens):
                r.append([t], stop_ids)
        else:
            raise OutOfPagesError("no request fits in the KV pool")  # unreachable after the check above
        for r in [r for r in running if r.finish_reason]:
            runner.allocator.free(r.pages)
            r.pages = []
        running = [r for r in running if not r.finish_reason]

    return _results(model, reqs)


def _stop_ids(model: Model, ignore_eos: bool, stop_token_ids) -> set[int]:
    stop_ids = set(stop_token_ids)
    if not ignore_eos:
        stop_ids |= set(model.cfg.eos_token_ids)
        if model.tokenizer is not None:
            stop_ids |= set(model.tokenizer.eos_token_ids)
    return stop_ids


def _make_requests(cfg: ModelConfig, prompt_ids, max_new_tokens: int, allocator, page_size: int, margin: int):
    reqs = []
    for i, ids in enumerate(prompt_ids):
        budget = min(max_new_tokens, cfg.max_position_embeddings - len(ids))
        pages_needed = -(-(len(ids) + budget + margin) // page_size)
        if pages_needed > allocator.num_usable:
            raise OutOfPagesError(
                f"prompt {i} needs {pages_needed} KV pages ({len(ids)} + {budget} tokens"
                f"{f' + {margin} speculative' if margin else ''} at page size {page_size}); "
                f"the pool has {allocator.num_usable}"
            )
        reqs.append(_Request(i, ids, budget))
    return reqs


def _results(model: Model, reqs) -> list[GenerationOutput]:
    results = []
    for r in reqs:
        text = model.tokenizer.decode(r.output) if model.tokenizer is not None else None
        mean_accept = r.spec_emitted / r.verify_ct if r.verify_ct else None
        results.append(GenerationOutput(r.prompt, r.output, r.finish_reason, text, r.verify_ct, mean_accept))
    return results


def _prefill(runner: ModelRunner, reqs: list[_Request], temperature: float, max_tokens: int, key, stop_ids):
    """Prefills the requests in chunks of at most max_tokens tokens, samples each first token,
    and returns the advanced PRNG key."""
    while any(r.prefilled < len(r.prompt) for r in reqs):
        budget = max_tokens
        chunks, owners = [], []
        for r in reqs:
            left = len(r.prompt) - r.prefilled
            if left == 0 or budget == 0:
                continue
            n = min(left, budget)
            chunks.append(SeqChunk(r.prompt[r.prefilled : r.prefilled + n], r.prefilled, r.pages))
            owners.append(r)
            budget -= n
        key, sub = jax.random.split(key)
        tokens = np.asarray(runner.step(chunks, np.full(len(chunks), temperature, np.float32), sub))
        for r, c, t in zip(owners, chunks, tokens):
            r.prefilled += len(c.tokens)
            if r.prefilled == len(r.prompt):
                r.append([t], stop_ids)
    return key


def _load_draft(model: Model, spec, draft):
    if draft is not None:
        return draft
    if spec.draft_model_path is None:
        raise ValueError(f"speculative algorithm {spec.algorithm} needs spec.draft_model_path or draft=(cfg, params)")
    from jspec.models.eagle_loader import load_draft_model

    return load_draft_model(spec.draft_model_path, model.cfg, dtype=model.params["embed"].dtype, algorithm=spec.algorithm)


def _generate_spec(model: Model, prompt_ids, spec, draft, *, max_new_tokens, temperature, ignore_eos, stop_token_ids,
                   page_size, num_pages, max_prefill_tokens, attention_backend, runner):
    """Speculative generation: the same admission and prefill as plain generation, then EAGLE
    iterations that each emit 1..num_steps+1 tokens per request."""
    from jspec.runner import SpecRunner
    from jspec.spec.eagle import spec_kv_margin

    if temperature != 0:
        raise ValueError(
            "speculative decoding is greedy (temperature 0) for now; rejection-sampling verification "
            "for temperature > 0 is not built yet"
        )
    if runner is None:
        dcfg, dparams = _load_draft(model, spec, draft)
        runner = SpecRunner(model.cfg, model.params, dcfg, dparams, spec, page_size=page_size, num_pages=num_pages,
                            attention_backend=attention_backend)
    S = runner.page_size
    margin = spec_kv_margin(runner.spec)
    stop_ids = _stop_ids(model, ignore_eos, stop_token_ids)
    reqs = _make_requests(model.cfg, prompt_ids, max_new_tokens, runner.allocator, S, margin=margin)

    waiting = list(reqs)
    running: list[_Request] = []
    while waiting or running:
        admitted = []
        while waiting and runner.free_slots:
            r = waiting[0]
            need = -(-(len(r.prompt) + r.max_new_tokens + margin) // S)
            if need > runner.allocator.num_free:
                break
            r.pages = runner.allocator.alloc(need)
            r.slot = runner.alloc_slot()
            admitted.append(waiting.pop(0))
        if admitted:
            _spec_prefill(runner, admitted, max_prefill_tokens, stop_ids)
            running.extend(admitted)
        elif running:
            out = runner.decode([r.slot for r in running], [r.pages for r in running])
            tokens, accept = np.asarray(out.tokens), np.asarray(out.accept_len)
            for i, r in enumerate(running):
                emitted = tokens[i, : accept[i] + 1]
                r.verify_ct += 1
                r.spec_emitted += len(emitted)
                r.append(emitted, stop_ids)
        for r in [r for r in running if r.finish_reason]:
            runner.allocator.free(r.pages)
            runner.free_slot(r.slot)
            r.pages, r.slot = [], None
        running = [r for r in running if not r.finish_reason]
    return _results(model, reqs)


def _spec_prefill(runner, reqs: list[_Request], max_tokens: int, stop_ids) -> None:
    while any(r.prefilled < len(r.prompt) for r in reqs):
        budget = max_tokens
        chunks, owners, following, slots = [], [], [], []
        for r in reqs:
            left = len(r.prompt) - r.prefilled
            if left == 0 or budget == 0:
                continue
            n = min(left, budget)
            end = r.prefilled + n
            chunks.append(SeqChunk(r.prompt[r.prefilled : end], r.prefilled, r.pages))
            following.append(r.prompt[end] if end < len(r.prompt) else None)
            slots.append(r.slot)
            owners.append(r)
            budget -= n
        first = np.asarray(runner.prefill(chunks, following, slots))
        for r, c, t in zip(owners, chunks, first):
            r.prefilled += len(c.tokens)
            if r.prefilled == len(r.prompt):
                r.append([t], stop_ids)
