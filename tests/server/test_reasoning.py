"""Reasoning output: a completion split into reasoning and answer as SGLang's parsers split it
(deepseek-r1: everything before </think>, the opening tag optional; qwen3: only output that
opens with <think>), streamed piece by piece into the same split whatever the cuts; and the
grammar of a structured output held behind the reasoning, with the tags as special tokens
(added tokens, as Qwen3 and DeepSeek-R1 have them) or as plain text."""

import json

import pytest

from jspec.server.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    # text, deepseek-r1's (reasoning, answer), qwen3's
    ("<think>a b</think>\n\nanswer", ("a b", "\n\nanswer"), ("a b", "\n\nanswer")),
    ("a b</think>answer", ("a b", "answer"), ("", "a b</think>answer")),
    ("just an answer", ("just an answer", ""), ("", "just an answer")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    ("<think></think>x</think>y", ("", "x</think>y"), ("", "x</think>y")),
    ("<thi", ("<thi", ""), ("", "<thi")),
    ("x <think>y</think>z", ("x <think>y", "z"), ("", "x <think>y</think>z")),
    ("", ("", ""), ("", "")),
]


@pytest.mark.parametrize("parser, which", [("deepseek-r1", 1), ("qwen3", 2)])
def test_split_whole_and_streamed_in_every_cut(parser, which):
    for case in CASES:
        text, expected = case[0], case[which]
        assert split_reasoning(parser, text) == expected, (parser, text)
        for cut in range(len(text) + 1):
            for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
                splitter = ReasoningSplitter(parser)
                got = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
                assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == expected, (parser, pieces)


def test_a_streamed_tag_is_held_back_until_it_is_whole():
    s = ReasoningSplitter("qwen3")
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>plan</th") == ("plan", "")
    assert s.feed("ink>") == ("", "")
    assert s.feed("done", final=True) == ("", "done")
    s = ReasoningSplitter("deepseek-r1")
    assert s.feed("x</") == ("x", "")
    assert s.feed("y") == ("</y", "")


def compiler(tags_special: bool | None):
    """A GrammarCompiler over the tiny byte tokenizer, with <think> and </think> added as tokens
    (tags_special: added as special; None: not added, the tags are plain text)."""
    from tokenizers import AddedToken

    from jspec.checkpoint.tiny import EOS_IDS, build_byte_tokenizer
    from jspec.constrained.grammar import GrammarCompiler

    tok = build_byte_tokenizer()
    if tags_special is not None:
        tok.add_tokens([AddedToken(t, special=tags_special, normalized=False) for t in ("<think>", "</think>")])
    return GrammarCompiler(tok.to_str(), 320, EOS_IDS), tok


def accepts(compiler_and_tok, reasoning, text: str, schema=None) -> tuple[bool, bool]:
    """(every token taken, the grammar complete) for text under the schema after reasoning."""
    comp, tok = compiler_and_tok
    schema = schema or {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"]}
    m = comp.matcher("json_schema", json.dumps(schema), reasoning)
    ids = tok.encode(text, add_special_tokens=False).ids
    took = m.accept(ids)
    return took == len(ids), m.ended


@pytest.mark.parametrize("tags_special", [False, True, None], ids=["added", "special", "text"])
def test_the_grammar_holds_only_the_text_after_the_reasoning(tags_special):
    c = compiler(tags_special)
    answer = '{"a": 1}'
    for reasoning, text, ok in [
        ("deepseek-r1", f"<think>plan {{x}}</think>\n\n{answer}", True),
        ("deepseek-r1", f"plan</think>{answer}", True),
        ("deepseek-r1", f"<think></think>{answer}", True),
        ("deepseek-r1", answer, False),  # no </think>: still reasoning, never complete
        ("deepseek-r1", "plan</think>{oops", False),
        ("qwen3", f"<think>plan</think>\n{answer}", True),
        ("qwen3", answer, True),  # no reasoning: the grammar from the start
        ("qwen3", f"plan</think>{answer}", False),
    ]:
        took, ended = accepts(c, reasoning, text)
        assert (took and ended) == ok, (reasoning, text, took, ended)
    assert accepts(c, None, answer) == (True, True)
    assert accepts(c, None, f"<think>x</think>{answer}")[0] is False


@pytest.mark.parametrize(
    "kind, text", [("regex", "ab[0-9]"), ("ebnf", 'root ::= "ab" [0-9]'), ("ebnf", 'start: "ab" /[0-9]/')]
)
def test_every_grammar_kind_follows_the_reasoning(kind, text):
    """A regex, a GBNF and a Lark grammar (llguidance gives the last two as Lark text, not JSON)."""
    comp, tok = compiler(False)
    for reasoning, output, ok in [
        ("deepseek-r1", "<think>x</think>\nab5", True),
        ("deepseek-r1", "x</think>ab5", True),
        ("deepseek-r1", "<think>x</think>12", False),
        ("qwen3", "ab5", True),
        ("qwen3", "<think>x</think>ab5", True),
    ]:
        m = comp.matcher(kind, text, reasoning)
        ids = tok.encode(output, add_special_tokens=False).ids
        assert (m.accept(ids) == len(ids) and m.ended) == ok, (kind, reasoning, output)
