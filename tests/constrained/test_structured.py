"""Structured outputs through the engine and the server on a tiny random model: sampled
completions of five JSON schemas, a regex and an EBNF grammar all validate, with the overlap
loop and without (the same tokens either way); free rows batched with grammar rows get the
tokens they get alone; max_tokens inside an open grammar ends with "length"; the OpenAI
surfaces (response_format, tools, a bad schema's 400) through the official client."""

import json
import re

import pytest
from support.models import tiny_model

import jspec
from jspec.config.sampling import SamplingParams

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

jsonschema = pytest.importorskip("jsonschema")

# Every decode pads to 8 rows: one decode program however the rows finish.
ENGINE = dict(
    page_size=4,
    max_total_tokens=4096,
    max_running_requests=8,
    precompile_bs_paddings=[8],
    attention_backend="reference",
)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 5}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "numbers": {
        "type": "object",
        "properties": {
            "i": {"type": "integer", "minimum": -5, "maximum": 500},
            "x": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["i", "x"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "note": {"enum": ["a", "b", None]}},
        "required": ["id"],
        "additionalProperties": False,
    },
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
EBNF = 'root ::= item ("," item)?\nitem ::= "yes" | "no" | [0-9]'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory, "structured", context=256)


@pytest.fixture(scope="module")
def engines(model):
    return {overlap: jspec.Engine(model, disable_overlap_schedule=not overlap, **ENGINE) for overlap in (True, False)}


def sampled(k: int, **grammar) -> SamplingParams:
    return SamplingParams(max_new_tokens=96, temperature=1.0, seed=1000 + k, **grammar)


K = 4  # seeded completions per grammar


def run_all(engine):
    """Every schema, the regex and the EBNF grammar, K seeded completions each, and 4 free
    rows, batched together."""
    params = [sampled(k, json_schema=json.dumps(s)) for s in SCHEMAS.values() for k in range(K)]
    params += [sampled(k, regex=REGEX) for k in range(K)] + [sampled(k, ebnf=EBNF) for k in range(K)]
    params += [SamplingParams(max_new_tokens=12, temperature=1.0, seed=k, ignore_eos=True) for k in range(4)]
    outs = engine.generate(["{"] * len(params), params)
    engine.check_idle_no_leaks()
    return outs


@pytest.fixture(scope="module")
def results(engines):
    return {overlap: run_all(e) for overlap, e in engines.items()}


@pytest.mark.parametrize("overlap", [True, False])
def test_sampled_completions_follow_their_grammars(results, overlap):
    outs = results[overlap]
    for i, schema in enumerate(SCHEMAS.values()):
        for o in outs[K * i : K * i + K]:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), schema)
    n = K * len(SCHEMAS)
    for o in outs[n : n + K]:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    for o in outs[n + K : n + 2 * K]:
        assert o.finish_reason == "stop" and re.fullmatch(r"(yes|no|[0-9])(,(yes|no|[0-9]))?", o.text), o.text
    assert all(len(o.token_ids) == 12 for o in outs[n + 2 * K :])


def test_overlap_gives_the_synchronous_tokens(results):
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]


def test_free_rows_are_untouched_by_grammar_rows(engines, results):
    """Free rows batched with grammar rows: the tokens they get alone; a batch without a
    grammar row runs the fused program, no mask."""
    e = engines[True]
    free = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=k, ignore_eos=True) for k in range(4)]
    alone = e.generate(["{"] * 4, free)
    assert [o.token_ids for o in alone] == [o.token_ids for o in results[True][-4:]]
    keys = set(e.worker.programs.compiled)
    assert any(k[0] == "decode sample" for k in keys)  # batches with grammar rows: forward, then masks
    assert any(k[0] == "decode" for k in keys)  # batches without: the one fused program, no mask


def test_length_inside_an_open_grammar(engines):
    e = engines[True]
    (o,) = e.generate(["{"], [SamplingParams(max_new_tokens=3, json_schema=json.dumps(SCHEMAS["nested"]))])
    assert o.finish_reason == "length" and len(o.token_ids) == 3 and '{"user": {"name"'.startswith(o.text)


def test_python_api_keywords(engines, model):
    (o,) = jspec.generate(model, ["{"], regex=REGEX, max_new_tokens=16, engine=engines[False])
    assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text)


def test_greedy_constrained_is_deterministic(engines):
    p = SamplingParams(max_new_tokens=64, json_schema=json.dumps(SCHEMAS["numbers"]))
    a = engines[True].generate(["{"], [p])[0]
    b = engines[False].generate(["{"], [p])[0]
    assert a.token_ids == b.token_ids and a.finish_reason == "stop"
    jsonschema.validate(json.loads(a.text), SCHEMAS["numbers"])


def test_server_surfaces(engines):
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from jspec.engine.async_engine import AsyncEngine
    from jspec.server.app import create_app

    aengine = AsyncEngine(engines[True])
    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
            chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=96)
            schema = SCHEMAS["optional"]
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            for seed in range(3):
                r = client.chat.completions.create(**chat, response_format=fmt, temperature=1.0, seed=seed)
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
            r = client.chat.completions.create(**chat, response_format={"type": "json_object"}, temperature=1.0)
            assert isinstance(json.loads(r.choices[0].message.content), dict)

            bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
            with pytest.raises(openai.BadRequestError, match="nonsense"):
                client.chat.completions.create(**chat, response_format=bad)
            r = http.post("/generate", json={"text": "{", "sampling_params": {"regex": "[a-c", "max_new_tokens": 4}})
            assert r.status_code == 400 and "unclosed character class" in r.json()["error"]["message"]
            r = http.post("/generate", json={"text": "{", "sampling_params": {"regex": REGEX, "max_new_tokens": 16}})
            assert r.status_code == 200 and re.fullmatch(REGEX, r.json()["text"])  # still serving

            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    },
                }
            ]
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                r = client.chat.completions.create(**chat, tools=tools, tool_choice=choice, temperature=1.0)
                c = r.choices[0]
                assert c.finish_reason == "tool_calls" and c.message.content is None
                assert c.message.tool_calls[0].function.name == "get_weather"
                assert json.loads(c.message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Lima")
            chunks = list(
                client.chat.completions.create(
                    **chat, tools=tools, tool_choice="required", temperature=1.0, stream=True
                )
            )
            last = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
            assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].function.name == "get_weather"
    finally:
        aengine.shutdown()


def spec_params(sampled: bool, free: bool):
    """Constrained rows (JSON, regex), and a free one if asked; greedy only, or seeded sampling
    beside a greedy row (one sampling program per case keeps the compiled programs few)."""
    t = 1.0 if sampled else 0.0
    free_row = [SamplingParams(max_new_tokens=10, temperature=t, seed=5, ignore_eos=True)] if free else []
    return [
        SamplingParams(max_new_tokens=48, json_schema=json.dumps(SCHEMAS["numbers"])),
        SamplingParams(max_new_tokens=48, temperature=t, seed=3, json_schema=json.dumps(SCHEMAS["nested"])),
        SamplingParams(max_new_tokens=24, temperature=t, seed=4, regex=REGEX),
    ] + free_row


# STANDALONE runs the same split (only its proposal differs): left out for the suite's time
# (benchmarks/bench_structured.py --check runs every method).
@pytest.mark.parametrize(
    "method, topk, overlap, sampled, free",
    [("EAGLE3", 2, True, False, False), ("NGRAM", 2, False, True, True), ("DFLASH", 1, True, False, False)],
    ids=str,
)
def test_speculation_emits_the_plain_engines_tokens(model, engines, method, topk, overlap, sampled, free):
    """Every verify-tree node masked by its path's grammar state: greedy and seeded sampled
    constrained rows (and the free row beside them) get exactly the plain engine's tokens,
    chain and tree, with and without overlap; forced tokens repair refused drafts, so the
    constrained rows accept more than one token per step."""
    from support.models import eagle_draft

    from jspec.config.spec import SpecConfig

    if method == "NGRAM":  # two chains: a tree
        spec, draft = SpecConfig("NGRAM", num_draft_tokens=7, ngram_max_bfs_breadth=topk), None
    elif method == "DFLASH":  # a random drafter reading the tiny target's layer 0
        from support.dflash_models import random_drafter

        spec, draft = SpecConfig("DFLASH", num_draft_tokens=5), random_drafter(model.cfg, target_layer_ids=(0,))
    elif method == "STANDALONE":
        spec, draft = SpecConfig("STANDALONE", num_steps=3, eagle_topk=1, num_draft_tokens=4), (model.cfg, model.params)
    else:
        spec, draft = SpecConfig(method, num_steps=3, eagle_topk=topk, num_draft_tokens=6), eagle_draft(model)
    engine = jspec.Engine(model, speculative=spec, draft=draft, disable_overlap_schedule=not overlap, **ENGINE)
    params = spec_params(sampled, free)
    out = engine.generate(["{"] * len(params), params)
    engine.check_idle_no_leaks()
    reference = engines[True].generate(["{"] * len(params), spec_params(sampled, free))
    assert [o.token_ids for o in out] == [o.token_ids for o in reference]
    for o, schema in zip(out[:2], (SCHEMAS["numbers"], SCHEMAS["nested"])):
        jsonschema.validate(json.loads(o.text), schema)
        assert o.mean_accept_length > 1.3, (method, o.mean_accept_length)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_grammar_out_of_fuel_fails_its_request_alone(engines, overlap):
    """llguidance's per-mask fuel (here 5 Earley items) bounds a grammar's work per step: the
    request whose mask runs out fails with the reason, the free request beside it finishes,
    and nothing leaks."""
    from jspec.checkpoint.tiny import EOS_IDS, build_byte_tokenizer
    from jspec.constrained.grammar import GrammarCompiler

    e = engines[overlap]
    kept = e._grammar_compiler
    e._grammar_compiler = GrammarCompiler(
        build_byte_tokenizer().to_str(), e.model.cfg.vocab_size, EOS_IDS, limits=dict(step_max_items=5)
    )
    try:
        bad = e.add_request("{", SamplingParams(max_new_tokens=16, ebnf='root ::= ("a" | "ab" | [a-z]+ " ")+'))
        good = e.add_request("{", SamplingParams(max_new_tokens=8, ignore_eos=True))
        outs = []
        while e.has_work():
            outs += e.step()
    finally:
        e._grammar_compiler = kept
    (failed,) = [o for o in outs if o.rid == bad and o.finished]
    assert failed.finish_reason == "abort" and "Too many items" in failed.error
    assert sum(len(o.new_token_ids) for o in outs if o.rid == good) == 8
    e.check_idle_no_leaks()


def test_a_warmed_engine_compiles_masked_programs_in_the_background(model):
    """After warm-up, the first grammar request waits while its masked programs compile in
    the background; the free request beside it decodes meanwhile, and both finish."""
    e = jspec.Engine(model, **dict(ENGINE, max_running_requests=1, chunked_prefill_size=16))
    e.warmup(sampling_modes=("greedy",))
    g = e.add_request("{", SamplingParams(max_new_tokens=16, regex=REGEX))
    f = e.add_request("{", SamplingParams(max_new_tokens=6, ignore_eos=True))
    first_done = None
    outs = []
    while e.has_work():
        for o in e.step():
            outs.append(o)
            if o.finished and first_done is None:
                first_done = o.rid
    assert first_done == f  # admitted first though it arrived second
    text = "".join(o.new_text for o in outs if o.rid == g)
    assert re.fullmatch(REGEX, text)
    assert e.worker.grammar_keys and all(e.worker.programs.ready(k) for k in e.worker.grammar_keys)
    e.check_idle_no_leaks()
