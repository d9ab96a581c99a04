"""--reasoning-parser: a chat completion's reasoning part, split from its answer as SGLang and
vLLM return it (`message.reasoning_content` beside `content`; `delta.reasoning_content` when
streamed).

The formats are config/reasoning.py's. deepseek-r1: the output begins inside the reasoning (the
chat template opened it), so everything before the first </think> is reasoning and a leading
<think> is dropped; output that never closes it is reasoning throughout. qwen3: the output is
reasoning only when it opens with <think>, up to </think>; otherwise it is all answer. The text
after </think> is the answer as written.

One ReasoningSplitter per completion takes its text piece by piece: the pieces it returns join
into what splitting the whole text at once returns, whatever the cuts (a tag cut in two is
held back until it is whole or cannot be one).
"""

from __future__ import annotations

from jspec.config.reasoning import REASONING_FORMATS


class ReasoningSplitter:
    def __init__(self, parser: str):
        self.fmt = REASONING_FORMATS[parser]
        self.state = "opening"  # opening: the start tag may still come; reasoning; answer
        self.held = ""  # text not yet returned: a possible tag, cut short

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) pieces of the next text; final: the completion ends with it."""
        fmt, held = self.fmt, self.held + text
        reasoning = answer = ""
        if self.state == "opening":
            if held.startswith(fmt.start):
                held, self.state = held[len(fmt.start) :], "reasoning"
            elif fmt.start.startswith(held) and not final:
                self.held = held  # "<thi": may still open the reasoning
                return "", ""
            else:
                self.state = "reasoning" if fmt.opened_by_prompt else "answer"
        if self.state == "reasoning":
            end = held.find(fmt.end)
            if end >= 0:
                reasoning, held, self.state = held[:end], held[end + len(fmt.end) :], "answer"
            else:
                keep = 0 if final else _partial_tag(held, fmt.end)
                self.held = held[len(held) - keep :]
                return held[: len(held) - keep], ""
        self.held = ""
        answer = held if self.state == "answer" else ""
        return reasoning, answer


def split_reasoning(parser: str, text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole completion."""
    return ReasoningSplitter(parser).feed(text, final=True)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (and is not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
