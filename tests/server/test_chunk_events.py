"""ChunkEvents' fast paths write the same bytes as sse() of the whole chunk."""

import pytest

from jspec.server.streaming import ChunkEvents, sse

TEXTS = ["hello", "", 'quote " and \\ backslash', "new\nline\ttab\x01", "héllo 世界 🙂", "\u2028"]


@pytest.mark.parametrize("text", TEXTS)
def test_fast_paths_match_sse(text):
    head = {"id": "cmpl-0a1b", "object": "text_completion", "created": 1700000000, "model": 'tiny "m" é'}
    chunks = ChunkEvents(head)
    choice = {"index": 3, "text": text, "finish_reason": None, "logprobs": None}
    assert chunks.text(3, text) == sse({**head, "choices": [choice]}) == chunks.choice(choice)
    chat = {**head, "object": "chat.completion.chunk"}
    delta = {"index": 1, "delta": {"content": text}, "finish_reason": None, "logprobs": None}
    assert ChunkEvents(chat).content(1, text) == sse({**chat, "choices": [delta]})
