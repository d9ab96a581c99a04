"""Host-side request state."""

from __future__ import annotations

import dataclasses
import enum

from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import GrammarMatcher
from jspec.scheduler.detokenize import IncrementalDetokenizer, StopChecker


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or retracted and waiting to be prefilled again
    PREFILLING = "prefilling"  # holds a slot and pages; some prompt chunks still to run
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity semantics: queues hold and remove this exact request
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stop_checker: StopChecker
    detokenizer: IncrementalDetokenizer | None = None  # None when the model has no tokenizer
    arrival: int = 0  # admission order key
    seed: int = 0  # sampling seed (the request's own, or one the engine drew for it)
    lora_slot: int = 0  # LoRA pool slot of params.lora_path (0: no adapter)
    cache_namespace: int = 0  # prefix-cache namespace: the loaded adapter's unique id (0: the base model)
    grammar: GrammarMatcher | None = None  # structured output: the grammar state after `output`
    error: str | None = None  # why the request fails (its grammar could not give a mask)
    output: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # streamed text so far (stop strings trimmed)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)  # if params.return_logprob
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # Prompt logprobs (params.wants_prompt_logprobs): entry j is prompt position logprob_start_len + j;
    # position 0 has none (nothing precedes it).
    input_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matched_stop: int | str | None = None

    # KV bookkeeping
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the (re-)prefill runs over
    prefilled: int = 0  # tokens of prefill_ids already in the KV
    kv_len: int = 0  # verified KV length as of the last processed step
    inflight: int = 0  # launched decodes that advance kv_len, outputs not processed yet
    inflight_outputs: int = 0  # launched steps (prefill or decode) whose outputs are not processed yet
    cached_prefix: object = None  # prefix-cache match this request holds locked
    num_shared_pages: int = 0  # leading pages read from the prefix cache (not owned)

    # statistics
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    verify_ct: int = 0
    spec_emitted: int = 0
    accept_alpha: float | None = None  # adaptive speculation's per-depth acceptance estimate
    retractions: int = 0
    last_token_time: float | None = None  # perf_counter when the engine last gave it tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def budget_left(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    def record_prompt_logprobs(self, start: int, logprobs, top_ids, top_logprobs) -> None:
        """logprobs[k] scores the prompt token at position start + 1 + k given the ones before it."""
        first = self.params.logprob_start_len
        if not self.input_logprobs:
            self.input_logprobs = [None] * (len(self.prompt) - first)
            self.input_top_logprobs = [None] * (len(self.prompt) - first)
        n = self.params.top_logprobs_num
        for k in range(len(logprobs)):
            pos = start + 1 + k
            if first <= pos < len(self.prompt):
                self.input_logprobs[pos - first] = float(logprobs[k])
                if n:
                    self.input_top_logprobs[pos - first] = [
                        (int(t), float(v)) for t, v in zip(top_ids[k][:n], top_logprobs[k][:n])
                    ]

    def append(self, tokens, logprobs=None, top_ids=None, top_logprobs=None) -> str:
        """Takes new tokens up to whatever ends the request (stop token, EOS, stop string,
        length, the grammar's end), with their logprobs when asked for; returns the new text
        safe to stream."""
        ended = False
        if self.grammar is not None and not self.finished:
            tokens = list(tokens)
            took = self.grammar.accept(tokens)
            if took < len(tokens) and not self.grammar.ended:
                # Every sampled token was masked by this grammar: a refused one is a bug, and
                # the request fails rather than return text outside its grammar.
                raise RuntimeError(
                    f"request {self.rid}: token {tokens[took]} left its grammar ({self.grammar.error or 'refused'})"
                )
            tokens, ended = tokens[:took], self.grammar.ended
        res = self.stop_checker.update(tokens, self.detokenizer)
        self.output.extend(res.token_ids)
        kept = len(res.token_ids)
        if self.params.return_logprob and logprobs is not None:
            self.output_logprobs.extend(float(x) for x in logprobs[:kept])
            n = self.params.top_logprobs_num
            for j in range(kept if n else 0):
                self.output_top_logprobs.append(
                    [(int(t), float(v)) for t, v in zip(top_ids[j][:n], top_logprobs[j][:n])]
                )
        self.text += res.text
        if res.finish_reason is not None:
            self.finish(res.finish_reason.type, res.finish_reason.matched)
        elif ended:
            # The grammar is complete and admits nothing more: a stop, as if EOS had come.
            rest = self.stop_checker.flush(self.detokenizer)
            self.text += rest
            self.finish("stop")
            return res.text + rest
        return res.text

    def finish(self, reason: str, matched=None) -> str:
        """Marks the request finished (first reason wins); returns text that was still held back."""
        if self.status is Status.FINISHED:
            return ""
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.matched_stop = matched
        rest = self.stop_checker.flush(self.detokenizer) if reason == "abort" else ""
        self.text += rest
        return rest
