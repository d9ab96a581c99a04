"""How reasoning models mark their thinking in the output (SGLang's --reasoning-parser names).

The server splits a chat completion into `reasoning_content` and `content` by these tags, and a
request's grammar (structured output, a forced tool call) holds only the text after the
reasoning: constrained/grammar.py builds that grammar from the same format.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    """start / end: the tags around the reasoning. opened_by_prompt: the chat template opens the
    reasoning itself (DeepSeek-R1's ends the prompt with <think>), so the output begins inside it:
    everything before `end` is reasoning, a leading `start` is dropped, and output that never
    closes it is reasoning throughout. Otherwise (Qwen3) the output is reasoning only when it
    opens with `start`."""

    start: str
    end: str
    opened_by_prompt: bool


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>", opened_by_prompt=True),
    "qwen3": ReasoningFormat("<think>", "</think>", opened_by_prompt=False),
}
