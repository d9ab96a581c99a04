"""Grammars of structured outputs (JSON schema, regex, EBNF) compiled by llguidance.

A `GrammarCompiler` belongs to one tokenizer and vocabulary: it checks and compiles a grammar
once and keeps the compiled matcher by (kind, text, reasoning format), so a schema that many requests share is
compiled once; each request gets a cheap copy (`GrammarMatcher`), which follows the tokens the
request emits and writes the bitmask of the tokens allowed next. Bit t of a row (word t // 32,
bit t % 32) allows token t; tokens past the tokenizer's vocabulary are never allowed.

A request of a reasoning model (SamplingParams.reasoning_format) gets its grammar behind the
reasoning part: free text up to the format's end tag, then the grammar (`after_reasoning`, a
Lark grammar that refers to the request's grammar as a subgrammar).

llguidance bounds every mask computation by its lexer and parser fuel (LLParserLimits), so a
pathological grammar costs a bounded time per step; compilation is bounded the same way, and a
grammar that runs out of fuel is rejected like an invalid one, with llguidance's message.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import llguidance
import numpy as np

from jspec.config.reasoning import REASONING_FORMATS, ReasoningFormat

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")

# The JSON a schema compiles to: one separator form (Python's json.dumps default), no free
# whitespace, so a model cannot spend its tokens on blanks between values.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance rejects (invalid, unsupported or too large); the message says why."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


def row_masks(grammars, vocab_size: int) -> np.ndarray:
    """[rows, words] masks of each row's grammar (None: all allowed). A grammar that cannot
    give one (g.failure set) leaves its row all-ones: its request fails when the step's output
    comes back, and the token is never emitted."""
    out = allow_all(len(grammars), vocab_size)
    for i, g in enumerate(grammars):
        if g is not None:
            try:
                g.fill_mask(out[i])
            except GrammarError:
                out[i] = -1
    return out


def tree_masks(grammars, tokens: np.ndarray, parents: np.ndarray, vocab_size: int) -> np.ndarray:
    """[B, N, words] masks of a verify tree's nodes for each row's grammar (None: all allowed);
    tokens, parents [B, N] as the tree's (host copies; tokens gets the forced replacements)."""
    B, N = tokens.shape
    out = allow_all(B * N, vocab_size).reshape(B, N, -1)
    for b, g in enumerate(grammars):
        if g is not None:
            try:
                g.fill_tree_masks(tokens[b], parents[b], out[b])
            except GrammarError:
                out[b] = -1  # g.failure is set: the request fails when this step's output comes back
    return out


def _only_token(row: np.ndarray) -> int | None:
    """The token a mask row allows if it allows exactly one, else None."""
    words = np.flatnonzero(row)
    if len(words) != 1:
        return None
    w = int(row[words[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(words[0]) * 32 + w.bit_length() - 1


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """Bitmask rows that allow every token (the rows of requests without a grammar)."""
    return np.full((rows, mask_words(vocab_size)), -1, np.int32)


def grammar_source(kind: str, text: str) -> str:
    """llguidance's grammar for a request's grammar; GrammarError for a malformed one."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; choose one of {GRAMMAR_KINDS}")
    try:
        if kind == "json_schema":
            schema = json.loads(text) if isinstance(text, str) else text
            if not isinstance(schema, dict):
                raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        return llguidance.grammar_from("ebnf", text)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:  # a schema that is not JSON, an EBNF llguidance cannot convert
        raise GrammarError(f"invalid {kind}: {e}") from e


# A blank between the reasoning and the answer, as reasoning models write one ("</think>\n\n");
# bounded, so that a model cannot spend its tokens on blanks there.
REASONING_GAP = r"/[ \t\r\n]{1,4}/"
ANSWER_GRAMMAR = "answer_after_reasoning"


def after_reasoning(source: str, fmt: ReasoningFormat, tags: dict[str, str]) -> str:
    """llguidance's grammar for output that opens with a reasoning part in format `fmt`, free
    text up to its end tag, and then holds to grammar `source` (a grammar_source result: the
    answer is its first grammar, referred to as a subgrammar). tags: each tag as a Lark grammar
    item, `<[id]>` for a tag that is one special token of the tokenizer, else its text."""
    # grammar_source gives llguidance's JSON form, or Lark text (what an EBNF converts to).
    top = json.loads(source) if source.lstrip().startswith("{") else {"grammars": [{"lark_grammar": source}]}
    answer, *rest = top["grammars"]
    start, end = tags[fmt.start], tags[fmt.end]
    if end.startswith("<["):
        # Special tokens are never inside a terminal: the free text runs up to the end token.
        thinking = f"thinking: THINKING {end}\nTHINKING: /(?s:.*)/"
    else:
        thinking = f"thinking[suffix={end}]: /(?s:.*)/"  # lazy: ends at the first end tag
    opened = f"{start}? thinking" if fmt.opened_by_prompt else f"({start} thinking"
    lark = (
        f"start: {opened} GAP?{'' if fmt.opened_by_prompt else ')?'} @{ANSWER_GRAMMAR}\n"
        f"{thinking}\nGAP: {REASONING_GAP}\n"
    )
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, {**answer, "name": ANSWER_GRAMMAR}, *rest]})


class GrammarCompiler:
    """Compiled grammars of one tokenizer, kept by (kind, text, reasoning format) (least recently
    used dropped past cache_size). Thread-safe: the server compiles on its own threads while the
    loop runs."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids,
        *,
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        limits: dict | None = None,
    ):
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        eos = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]  # others can never be sampled
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        # Added tokens by text: a reasoning tag that is one of them is referred to by its id.
        added = json.loads(tokenizer_json).get("added_tokens") or []
        self.added_tokens = {t["content"]: int(t["id"]) for t in added if isinstance(t, dict) and "content" in t}
        # llguidance's fuel per mask and per grammar (its defaults unless given: LLParserLimits' fields).
        self.limits = llguidance.LLParserLimits(**(limits or {}))
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids, **kw) -> GrammarCompiler:
        """From a jspec Tokenizer (its checkpoint's tokenizer.json)."""
        with open(os.path.join(tokenizer.path, "tokenizer.json"), encoding="utf-8") as f:
            return cls(f.read(), vocab_size, eos_token_ids, **kw)

    def lark_tag(self, tag: str) -> str:
        """A reasoning tag as a Lark grammar item: `<[id]>` when llguidance reads it as one
        special token (it does so for every added token), else a string literal."""
        token = self.added_tokens.get(tag)
        if token is not None and token < self.vocab_size and self.tokenizer.is_special_token(token):
            return f"<[{token}]>"
        return json.dumps(tag)

    def compile(self, kind: str, text: str, reasoning: str | None = None):
        """The compiled matcher of a grammar (shared: copy it per request); reasoning: a
        REASONING_FORMATS name, whose reasoning part the grammar leaves free and follows.
        GrammarError if llguidance rejects it, or its compilation takes longer than
        compile_timeout_s."""
        key = (kind, text if isinstance(text, str) else json.dumps(text, sort_keys=True), reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        source = grammar_source(kind, text)
        if reasoning is not None:
            fmt = REASONING_FORMATS[reasoning]
            source = after_reasoning(source, fmt, {tag: self.lark_tag(tag) for tag in (fmt.start, fmt.end)})
        t0 = time.perf_counter()
        # The constructor releases the GIL while it builds the lexer: the loop keeps running.
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0, limits=self.limits)
        took = time.perf_counter() - t0
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {matcher.get_error()}")
        if took > self.compile_timeout_s:
            raise GrammarError(
                f"{kind} took {took:.1f} s to compile, more than the {self.compile_timeout_s:.0f} s allowed; simplify it"
            )
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, kind: str, text: str, reasoning: str | None = None) -> GrammarMatcher:
        """A fresh matcher of the grammar for one request."""
        return GrammarMatcher(self.compile(kind, text, reasoning).deep_copy(), self.words)


class GrammarMatcher:
    """One request's grammar state: the tokens it emitted so far, and what may follow."""

    def __init__(self, matcher, words: int):
        self._m = matcher
        self.words = words
        self.mask_s = 0.0  # host time spent computing this request's masks
        # Why a mask could not be computed (llguidance's fuel ran out, ...): the request fails.
        self.failure: str | None = None

    def fill_mask(self, row: np.ndarray) -> None:
        """Writes the bitmask of the tokens allowed next into row ([words] int32, C-contiguous)."""
        if row.dtype != np.int32 or row.shape != (self.words,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a mask row is {self.words} contiguous int32 words, got {row.dtype} {row.shape}")
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.mask_s += time.perf_counter() - t0
        if self._m.is_error():
            self.failure = f"grammar failed: {self._m.get_error()}"
            raise GrammarError(self.failure)

    def fill_tree_masks(self, tokens, parents, out: np.ndarray) -> None:
        """Masks of a verify tree: out[i] ([N, words] int32 rows) gets the tokens allowed after
        the path root..i, where tokens [N] are the nodes' tokens (node 0, the root, is the last
        token this matcher took) and parents [N] their parents (parents come first). A draft
        token that its parent's mask refuses is replaced (tokens is written) by the one token the
        mask allows, where it allows one (a forced token: the target's masked draw there is
        certain, so the node is accepted); otherwise the node can never be accepted, and it and
        its subtree keep their rows as they are. The matcher ends where it began."""
        n = len(tokens)
        valid = np.zeros(n, bool)
        stopped = np.zeros(n, bool)  # the path ends the grammar (or takes EOS): nothing follows
        path: list[int] = []  # the nodes (below the root) the matcher has taken, root first
        try:
            for i in range(n):
                if i == 0:
                    self.fill_mask(out[0])
                    valid[0] = True
                    stopped[0] = self._m.is_stopped()
                    continue
                p, t = int(parents[i]), int(tokens[i])
                if p < 0 or not valid[p] or stopped[p]:
                    continue  # below a refused node, or past the grammar's end (the request ends there)
                if not (int(out[p][t >> 5]) >> (t & 31)) & 1:
                    forced = _only_token(out[p])
                    if forced is None:
                        continue
                    tokens[i] = t = forced
                target = [i]
                while int(parents[target[-1]]) > 0:
                    target.append(int(parents[target[-1]]))
                target.reverse()
                keep = 0
                while keep < min(len(path), len(target)) and path[keep] == target[keep]:
                    keep += 1
                if keep < len(path):
                    self._m.rollback(len(path) - keep)
                    del path[keep:]
                for j in target[keep:]:
                    if not self._m.consume_token(int(tokens[j])):
                        self.failure = f"grammar failed on a draft token: {self._m.get_error()}"
                        raise GrammarError(self.failure)
                    path.append(j)
                self.fill_mask(out[i])
                valid[i] = True
                stopped[i] = self._m.is_stopped()
        finally:
            if path:
                self._m.rollback(len(path))

    def accept(self, tokens) -> int:
        """Advances over tokens; returns how many it took: up to the first one the grammar
        refuses, or through the one that ends it (nothing may follow). A refused token means
        a mask was not applied: the caller treats it as an internal error."""
        n = 0
        for t in tokens:
            if self._m.is_stopped():  # ended, or failed on an earlier token
                break
            if not self._m.consume_token(int(t)):
                break
            n += 1
        return n

    @property
    def ended(self) -> bool:
        """Nothing but the end of sequence may follow (the grammar is complete and closed)."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar."""
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()
