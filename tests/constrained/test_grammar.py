"""Structured outputs on the host: llguidance grammars over the tiny byte tokenizer (compiled
once per text, rejected with llguidance's reason), their bitmasks against the tokens the
grammar takes, the device-side mask, a request finishing where its grammar ends, and the
tool-call grammar and parsers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.checkpoint.tiny import EOS_IDS, build_byte_tokenizer
from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import GrammarCompiler, GrammarError, allow_all, mask_words
from jspec.layers.sampling import apply_vocab_mask
from jspec.scheduler.detokenize import StopChecker
from jspec.scheduler.request import Request
from jspec.server.errors import APIError
from jspec.server.tools import check_tools, parse_tool_calls, tool_call_schema

V = 300  # the model's vocabulary: past the tokenizer's 261 tokens, never allowed
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22]}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_byte_tokenizer().to_str(), V, EOS_IDS)


def allowed(mask_row) -> set[int]:
    return set(np.nonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))[0].tolist())


def test_compiled_once_per_text(compiler):
    a = compiler.matcher("json_schema", json.dumps(SCHEMA))
    hits = compiler.hits
    b = compiler.matcher("json_schema", json.dumps(SCHEMA))
    assert compiler.hits == hits + 1
    a.accept(b'{"ok": true')  # copies: one request's tokens leave the other's state alone
    assert not b.accepting and not a.accepting


@pytest.mark.parametrize(
    "kind, text, reason",
    [
        ("json_schema", '{"type": "foo"}', "foo"),
        ("json_schema", "{not json", "invalid json_schema"),
        ("json_schema", "[1, 2]", "JSON object"),
        ("regex", "[a-z", "unclosed character class"),
        ("ebnf", 'root ::= "a" undefined_rule', "undefined_rule"),
    ],
)
def test_rejected_grammar_names_the_problem(compiler, kind, text, reason):
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(kind, text)


def test_mask_is_what_the_grammar_takes(compiler):
    """Walking an accepted text byte by byte: every byte is in its mask, and each probed token
    is in the mask exactly when a fresh matcher fed the same prefix takes it."""
    text = json.dumps(SCHEMA)
    g = compiler.matcher("json_schema", text)
    row = np.zeros(mask_words(V), np.int32)
    seen: list[int] = []
    for b in b'{"ok": false, "n": 22}':
        g.fill_mask(row)
        ok = allowed(row)
        assert b in ok and max(ok) < 261
        for t in (b, ord("x"), ord("}"), ord(" "), EOS_IDS[0]):
            probe = compiler.matcher("json_schema", text)
            assert probe.accept(seen) == len(seen)
            assert (probe.accept([t]) == 1) == (t in ok), (bytes(seen), t)
        assert g.accept([b]) == 1
        seen.append(b)
    assert g.ended and g.accepting
    g.fill_mask(row)
    assert allowed(row) and allowed(row) <= set(EOS_IDS)


def test_device_mask_matches_the_bits():
    rng = np.random.default_rng(0)
    R, Vv = 3, 70
    words = rng.integers(-(2**31), 2**31, (R, mask_words(Vv)), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(R, Vv)).astype(np.float32)
    got = np.asarray(apply_vocab_mask(jnp.asarray(logits), jnp.asarray(words)))
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :Vv].astype(bool)
    np.testing.assert_array_equal(np.isneginf(got), ~bits)
    np.testing.assert_array_equal(got[bits], logits[bits])
    full = allow_all(R, Vv)
    np.testing.assert_array_equal(np.asarray(apply_vocab_mask(jnp.asarray(logits), jnp.asarray(full))), logits)


def make_request(compiler, params):
    checker = StopChecker(params.stop, params.stop_token_ids, EOS_IDS, params.ignore_eos, params.max_new_tokens)
    return Request("r", [1], params, checker, grammar=compiler.matcher(*params.grammar))


def test_request_stops_where_its_grammar_ends(compiler):
    r = make_request(compiler, SamplingParams(max_new_tokens=50, regex="ab+c"))
    r.append(list(b"ab"))
    assert not r.finished
    r.append(list(b"bc"))
    assert r.finished and r.finish_reason == "stop" and r.output == list(b"abbc")


def test_length_while_the_grammar_is_open(compiler):
    r = make_request(compiler, SamplingParams(max_new_tokens=3, regex="ab+c"))
    r.append(list(b"abb"))
    assert r.finished and r.finish_reason == "length"


def test_a_token_outside_the_grammar_fails_loudly(compiler):
    r = make_request(compiler, SamplingParams(max_new_tokens=8, regex="ab+c"))
    with pytest.raises(RuntimeError, match="left its grammar"):
        r.append(list(b"ax"))


def test_one_grammar_per_request():
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    assert SamplingParams(ebnf='root ::= "a"').grammar == ("ebnf", 'root ::= "a"')


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def test_tool_choices():
    functions, choice = check_tools(TOOLS, "required")
    schema = json.loads(tool_call_schema(functions, choice))
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "add"}})[1] == "add"
    assert check_tools(TOOLS, None)[1] == "auto" and check_tools(TOOLS, "none")[1] is None
    with pytest.raises(APIError, match="not among tools"):
        check_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(APIError, match="needs tools"):
        check_tools(None, "required")


def test_tool_call_parsers():
    functions, _ = check_tools(TOOLS, "auto")
    content, calls = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        functions,
        "auto",
    )
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": ";"}}',
        functions,
        "auto",
    )
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": ";"}]
    assert parse_tool_calls("just text {", functions, "auto") == ("just text {", [])
    assert parse_tool_calls('{"name": "unknown", "arguments": {}}', functions, "auto")[1] == []
    content, calls = parse_tool_calls('[{"name": "add", "arguments": {"a": 2}}]', functions, "required")
    assert content is None and len(calls) == 1
    assert parse_tool_calls('[{"name": "add", "argu', functions, "required") == ('[{"name": "add", "argu', [])


def test_tree_masks_follow_each_nodes_path(compiler):
    """Every node of a verify tree gets the mask of its path's state (a fresh matcher fed the
    path agrees); drafts refused where the grammar forces one token become that token; nodes
    refused elsewhere keep all-ones rows (they can never be accepted); the matcher ends where
    it began."""
    from jspec.constrained.grammar import tree_masks

    regex = "ab(c|d)[0-9]x"
    g = compiler.matcher("regex", regex)
    assert g.accept(b"a") == 1
    # root = "a"; children "b" (node 1) and "z" (node 2, refused and forced to "b"); node 3 = "c"
    # under 1, node 4 = "q" under 1 (refused, two choices: stays), node 5 = "7" under 3, node 6
    # = "x" under 5, node 7 = "d" under 2.
    parents = np.array([[-1, 0, 0, 1, 1, 3, 5, 2]])
    tokens = np.array([[ord(c) for c in "abzcq7xd"]])
    masks = tree_masks([g], tokens, parents, V)
    assert bytes(tokens[0, 1:].tolist()) == b"bbcq7xd"
    paths = {0: b"", 1: b"b", 2: b"b", 3: b"bc", 5: b"bc7", 6: b"bc7x", 7: b"bd"}
    for node, path in paths.items():
        fresh = compiler.matcher("regex", regex)
        assert fresh.accept(b"a" + path) == len(path) + 1
        row = np.zeros(mask_words(V), np.int32)
        fresh.fill_mask(row)
        assert allowed(masks[0, node]) == allowed(row), node
    assert (masks[0, 4] == -1).all()
    row = np.zeros(mask_words(V), np.int32)
    g.fill_mask(row)
    assert allowed(row) == {ord("b")}  # back at the root's state
    free = tree_masks([None], tokens.copy(), parents, V)
    assert (free == -1).all()


def test_tree_masks_stop_at_the_grammars_end(compiler):
    """A path that ends the grammar (here by EOS, which a stopped grammar's mask allows again)
    gives its children nothing to consume: they keep all-ones rows, the matcher no error."""
    from jspec.constrained.grammar import tree_masks

    g = compiler.matcher("regex", "ab")
    assert g.accept(b"a") == 1
    eos, eot = EOS_IDS
    parents = np.array([[-1, 0, 1, 2, 2]])
    tokens = np.array([[ord("a"), ord("b"), eos, eot, ord("b")]])
    masks = tree_masks([g], tokens, parents, V)
    assert allowed(masks[0, 1]) <= set(EOS_IDS) and (masks[0, 3] == -1).all() and (masks[0, 4] == -1).all()
    assert g.failure is None and g.accept(b"b") == 1 and g.ended
