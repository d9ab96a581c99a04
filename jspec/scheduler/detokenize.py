"""Per-request streaming text: incremental detokenization and stop conditions.

`IncrementalDetokenizer` emits only final text: it decodes a small window of emitted tokens
with the new ones and streams the difference (as vLLM and SGLang do), holding back text that
ends in U+FFFD until more tokens complete it. `StopChecker` ends a request (stop token, EOS,
stop string, length) and holds back text that could still grow into a stop string, so none
reaches the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

# Prompt tokens used as left context for the first generated tokens. 5 is what
# vLLM and SGLang use: enough for any tokenizer's leading-space rule.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens.

    Concatenating every `add()` result and the final `flush()` gives the text of
    the generated tokens as the tokenizer decodes them in context (for a
    byte-level tokenizer without a prompt: exactly `tokenizer.decode(all_ids)`).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the window [_prefix:] is kept: older tokens never influence new text.
        self._ids: list[int] = [int(t) for t in (prompt_ids or [])][-INITIAL_CONTEXT_TOKENS:]
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # tokens before this one have been emitted (or are prompt)
        self._prefix_text: str | None = None  # decode(_ids[_prefix:_read]), cached

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _diff(self) -> tuple[str, str]:
        """(context text, context + pending text) of the current window."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        return self._prefix_text, self._decode(self._ids[self._prefix :])

    def _advance(self, end: int | None = None) -> None:
        """Tokens up to `end` (default: all) are emitted: they become the next window's context."""
        self._prefix, self._read = self._read, len(self._ids) if end is None else end
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        self._prefix_text = None

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends tokens; returns the newly stable text ("" while it is held back)."""
        self._ids.extend(int(t) for t in token_ids)
        if len(self._ids) == self._read:
            return ""
        prefix_text, full_text = self._diff()
        end = len(self._ids)
        # An incomplete character at the end may be completed by a later token:
        # emit up to the last token boundary before it. A UTF-8 character has at
        # most 4 bytes, so a few steps back suffice; the bound keeps a long run
        # of invalid bytes from costing one decode per token.
        for _ in range(4):
            if not full_text.endswith(_REPLACEMENT) or end - 1 <= self._read:
                break
            end -= 1
            full_text = self._decode(self._ids[self._prefix : end])
        # Hold back when the tokens add no text yet (e.g. a skipped special token)
        # or the text still ends in an incomplete character.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        # Both decodes start at the same token, so the context's text is the head
        # of full_text (its leading-space handling included): cut by length.
        self._advance(end)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The held-back rest as the tokenizer decodes it, incomplete sequence or not."""
        if len(self._ids) == self._read:
            return ""
        prefix_text, full_text = self._diff()
        self._advance()
        return full_text[len(prefix_text) :]


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a request ended, as the OpenAI API and SGLang report it."""

    type: str  # "stop" or "length"
    matched: str | int | None = None  # the stop string or the stop/EOS token id; None for "length"
    length: int | None = None  # max_new_tokens, for "length"

    def to_json(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": self.type, "matched": self.matched}


@dataclasses.dataclass
class StopResult:
    """What one `StopChecker.update` call decided."""

    # The new output token ids that count, as SGLang's output_ids: everything up
    # to and including the token that ended the request (a stop/EOS token id is
    # included although its text is not); tokens after it are dropped.
    token_ids: list[int]
    text: str  # text safe to stream now: never any part of a matched stop string
    finish_reason: FinishReason | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Stop conditions of one request.

    Semantics (OpenAI / SGLang):
    - A token in `stop_token_ids`, or in `eos_token_ids` unless `ignore_eos`,
      ends the request with ("stop", token id). `ignore_eos` never disables an
      explicit stop token id. The token counts as generated and is kept in
      `StopResult.token_ids`, but its text is not emitted.
    - A stop string ends the request with ("stop", string) on the token whose
      text completes it; it may span several tokens. The output text ends just
      before the stop string. When several stop strings occur, the one completed
      first wins (the result does not depend on how tokens were batched);
      among those completed by the same character, the longest.
    - After `max_new_tokens` tokens the request ends with "length". A stop on
      that same last token wins (vLLM's order; SGLang reports "length" there).
    - When the request ends by token or length, text held back (a possible stop
      string prefix, an incomplete character) is released.
    Once finished, further updates return nothing: one-step-lag tokens are dropped.
    """

    def __init__(
        self,
        stop: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_new_tokens: int | None = None,
    ):
        # An empty stop string would match before any text: it is meaningless, drop it.
        self.stop = sorted({s for s in stop if s}, key=len)
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.ignore_eos = ignore_eos
        if max_new_tokens is not None and max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self.max_new_tokens = max_new_tokens
        self._ending_ids = self.stop_token_ids | (set() if ignore_eos else self.eos_token_ids)
        # Every proper prefix of a stop string: text ending in one is held back.
        self._stop_prefixes = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self.stop), default=0)
        self._pending = ""  # text received but not emitted (may start a stop string)
        self.num_tokens = 0  # generated tokens counted so far
        self.finish_reason: FinishReason | None = None
        if max_new_tokens == 0:
            self.finish_reason = FinishReason("length", length=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: Iterable[int], detokenizer: IncrementalDetokenizer | None = None) -> StopResult:
        """Feeds new tokens (any number: speculative steps accept several).

        Tokens are checked one at a time, each with the text `detokenizer`
        gives for it, so that a stop inside the batch drops the tokens after it
        and their text never reaches the detokenizer. Without a detokenizer
        only token conditions are checked (stop strings then need one).
        """
        if self.stop and detokenizer is None:
            raise ValueError("stop strings need a detokenizer")
        kept: list[int] = []
        out: list[str] = []
        for token in token_ids:
            if self.finished:
                break
            token = int(token)
            kept.append(token)
            self.num_tokens += 1
            if token in self._ending_ids:
                # The stop token's own text is never shown; what was held back before it is.
                self._finish(FinishReason("stop", matched=token), detokenizer, out)
                break
            if detokenizer is not None:
                out.append(self._scan(detokenizer.add([token])))
            if not self.finished and self.max_new_tokens is not None and self.num_tokens >= self.max_new_tokens:
                self._finish(FinishReason("length", length=self.max_new_tokens), detokenizer, out)
        return StopResult(kept, "".join(out), self.finish_reason)

    def flush(self, detokenizer: IncrementalDetokenizer | None = None) -> str:
        """The text still held back, for a request that ends otherwise (aborted,
        or out of tokens): it can no longer become a stop string."""
        out = [self._scan(detokenizer.flush())] if detokenizer is not None else []
        if not self.finished:
            out.append(self._pending)
            self._pending = ""
        return "".join(out)

    def _finish(self, reason: FinishReason, detokenizer: IncrementalDetokenizer | None, out: list[str]) -> None:
        if detokenizer is not None:
            # The detokenizer's rest precedes the ending token: it may still hold a stop string.
            out.append(self._scan(detokenizer.flush()))
        if not self.finished:
            self.finish_reason = reason
            out.append(self._pending)
            self._pending = ""

    def _scan(self, text: str) -> str:
        """Appends text; returns the part that can no longer be (part of) a stop string."""
        if not text:
            return ""
        buf = self._pending + text
        # _pending never holds a whole stop string, so any match ends inside `text`;
        # for one string, its first start is also its first end.
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.finish_reason = FinishReason("stop", matched=s)
            self._pending = ""
            return buf[: end + neg_len]
        # Hold back the longest tail that a stop string starts with.
        hold = 0
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                hold = k
                break
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]
