"""Prompts the target writes itself, to train a drafter on more than jspec's own prompt set.

An instruct model given only the opening of a user turn (its chat template up to where the
user's words go) writes a user's request, as the Magpie recipe (Xu et al., 2024) found: each
seeded sample is a new prompt in the model's own idea of what users ask. A drafter trained on
the answers to a few hundred fixed prompts memorises them within a few thousand steps; the
model's own prompts widen what it sees without a dataset from the network.
"""

from __future__ import annotations

from collections.abc import Iterable

import jspec
from jspec.server.chat_template import render_chat

# Stands in for the user's words while the chat template is rendered; the text before it is the
# opening of a user turn.
_MARKER = "\u2063user-request\u2063"


def user_turn_opening(tokenizer) -> str:
    """The chat template's text up to where a user's message begins (system turn included)."""
    text = render_chat(tokenizer, [{"role": "user", "content": _MARKER}], add_generation_prompt=False)
    if text.count(_MARKER) != 1:
        raise ValueError("the chat template does not write the user's message verbatim: no turn opening to give")
    return text[: text.index(_MARKER)]


def self_prompts(
    model,
    count: int,
    *,
    engine,
    seed: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    exclude: Iterable[str] = (),
) -> list[str]:
    """`count` distinct prompts sampled from `model` after the opening of a user turn (seeded:
    the same seed gives the same list). Blank ones and those in `exclude` (the held-out
    prompts) are dropped; a prompt cut at max_new_tokens is kept, as the target will answer it
    all the same."""
    if count <= 0:
        return []
    opening = model.tokenizer.encode(user_turn_opening(model.tokenizer), add_special_tokens=False)
    seen, prompts = set(exclude), []
    drawn = 0
    # A few more than are missing, since some come out blank or repeated; those are redrawn,
    # and a model that keeps repeating itself stops the search.
    for _ in range(8):
        missing = count - len(prompts)
        wanted = missing + missing // 8 + 1
        params = [
            jspec.SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, seed=(seed * 1_000_003 + drawn + i) % 2**32
            )
            for i in range(wanted)
        ]
        drawn += wanted
        for out in engine.generate([opening] * wanted, params):
            text = model.tokenizer.decode(out.token_ids, skip_special_tokens=True).strip()
            if text and text not in seen:
                seen.add(text)
                prompts.append(text)
        if len(prompts) >= count:
            return prompts[:count]
    raise ValueError(f"the model wrote only {len(prompts)} distinct prompts in {drawn} samples, {count} asked")
