"""Per-request sampling parameters, named as SGLang's and OpenAI's."""

from __future__ import annotations

import dataclasses
import math

from jspec.config.reasoning import REASONING_FORMATS

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# The most tokens one request may bias (logit_bias): the device keeps that many per request, a
# fixed width, so that a biased request compiles no program of its own.
MAX_LOGIT_BIAS_TOKENS = 128
# OpenAI's range of a logit bias.
LOGIT_BIAS_LIMIT = 100.0


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 (or -1, as SGLang) = all tokens
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    frequency_penalty: float = 0.0  # in [-2, 2]: minus f x times the token was generated
    presence_penalty: float = 0.0  # in [-2, 2]: minus p if the token was generated at all
    repetition_penalty: float = 1.0  # in (0, 2]: tokens of the prompt or output scaled by 1/r (1 = off)
    seed: int | None = None  # same seed -> same tokens, whatever else is batched with it
    return_logprob: bool = False  # each output token's logprob (after the temperature transform)
    top_logprobs_num: int = 0  # and the target's top-n alternatives at each position
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this position (-1: none)
    n: int = 1  # completions per prompt (jspec.generate and the server fan out; seeds seed, seed+1, ...)
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    # token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's logit_bias;
    # after the penalties; -100 bans a token in practice, +100 all but forces it)
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    lora_path: str | None = None  # SGLang's name: the LoRA adapter (its loaded name) this request runs with
    # Structured output (SGLang's names; at most one): the output is a sentence of this grammar.
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None  # GBNF / EBNF (llama.cpp's dialect) or Lark
    # The output opens with a reasoning part in this format (config/reasoning.py: deepseek-r1,
    # qwen3): a grammar above holds only the text after it.
    reasoning_format: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 for no limit, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {r!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32
        ):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if (
            not isinstance(self.top_logprobs_num, int)
            or isinstance(self.top_logprobs_num, bool)
            or self.top_logprobs_num < 0
        ):
            raise ValueError(f"top_logprobs_num must be an integer >= 0, got {self.top_logprobs_num!r}")
        if (
            not isinstance(self.logprob_start_len, int)
            or isinstance(self.logprob_start_len, bool)
            or self.logprob_start_len < -1
        ):
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {self.logprob_start_len!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 128:
            raise ValueError(f"n must be an integer in [1, 128], got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logit_bias is not None:
            self.logit_bias = checked_logit_bias(self.logit_bias)
        if self.lora_path is not None and (not isinstance(self.lora_path, str) or not self.lora_path):
            raise ValueError(f"lora_path must be a loaded adapter's name or None, got {self.lora_path!r}")
        grammars = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise ValueError(f"at most one of json_schema, regex and ebnf may be given, got {grammars}")
        for k in grammars:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise ValueError(f"{k} must be a non-empty string, got {getattr(self, k)!r}")
        if self.reasoning_format is not None and self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(
                f"reasoning_format {self.reasoning_format!r} is unknown; choose one of {sorted(REASONING_FORMATS)}"
            )

    def completions(self) -> list[SamplingParams]:
        """The n single completions this asks for: seeds seed, seed+1, ... (each drawn apart when
        no seed is given)."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + k) % 2**32)
            for k in range(self.n)
        ]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, None for free text."""
        for k in GRAMMAR_FIELDS:
            if getattr(self, k) is not None:
                return k, getattr(self, k)
        return None

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def checked_logit_bias(bias) -> dict[int, float] | None:
    """bias (token ids, or their decimal strings as JSON keys, -> values) as {int: float}; None
    when empty. ValueError naming what is wrong."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to values, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    out = {}
    for k, v in bias.items():
        if isinstance(k, bool) or not (isinstance(k, int) or (isinstance(k, str) and k.isdigit())):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
            raise ValueError(
                f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {v!r} for token {k}"
            )
        out[int(k)] = float(v)
    return out or None
