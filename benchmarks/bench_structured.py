"""Structured outputs: what one grammar row costs a decode batch, and a check that constrained
speculation emits the plain engine's tokens for every method.

Timing (default): B greedy requests decode new_tokens tokens through the Engine loop, with no
grammar row and with one (a regex that cannot end before max_tokens, so the row runs to the
end), plain and EAGLE-3 (3,1,4), overlap on and off. Per case: the loop's iteration time,
its host time by phase (launch holds the deferred launch's finish: the masks, and under
speculation the wait for the proposal and the tree masks), and the grammar row's own tokens
per iteration. The model has random weights and a synthetic byte-level tokenizer of the shape's
vocabulary (llguidance's mask cost follows the vocabulary's size).

    python -m benchmarks.bench_structured [--tiny] [--batches 1,16] [--out benchmarks/results]
    python -m benchmarks.bench_structured --check   # every method, greedy and sampled, vs plain
    python -m benchmarks.bench_structured --validate 200   # 5 schemas x 200 sampled completions, 4 ways

GPU idle time with a grammar row ~ iteration time with one minus iteration time without
(the device's work is the same but for the mask).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (
    LLAMA_8B_CTX,
    RESULTS_DIR,
    Results,
    eagle3_head,
    int_list,
    random_params,
    tiny,
    tiny_head,
)
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.model import Model
from jspec.checkpoint.tiny import bytes_to_unicode
from jspec.engine.engine import LoopTimes


def synthetic_tokenizer(out_dir: str, vocab_size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer of vocab_size ids: the 256 bytes, prefix-closed words over
    lowercase letters, digits and JSON punctuation (each merges its prefix with its last
    character), and <eos> last. Written as tokenizer.json + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = bytes_to_unicode()  # ByteLevel's printable stand-ins for bytes 0..255 (the GPT-2 table)
    vocab = {table[b]: b for b in range(256)}
    alphabet = [table[b] for b in b'abcdefghijklmnopqrstuvwxyz0123456789{}[]:," ']
    rng = np.random.default_rng(seed)
    merges, frontier = [], list(alphabet)
    while len(vocab) < vocab_size - 1:
        prefix = frontier[int(rng.integers(len(frontier)))]
        word = prefix + alphabet[int(rng.integers(len(alphabet)))]
        if word in vocab or len(word) > 12:
            continue
        vocab[word] = len(vocab)
        merges.append((prefix, word[-1]))
        frontier.append(word)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>"}, f)
    return out_dir


def run(engine, B: int, grammar_rows: int, new_tokens: int, seed: int):
    """B greedy requests (the first grammar_rows constrained); -> (wall s, iterations, the
    grammar row's tokens, the host seconds its masks took)."""
    rng = np.random.default_rng(seed)
    rids = []
    for i in range(B):
        extra = dict(regex=f"[a-z]{{{new_tokens + 8}}}") if i < grammar_rows else dict(ignore_eos=True)
        prompt = list(map(int, rng.integers(0, 200, 32)))
        rids.append(engine.add_request(prompt, jspec.SamplingParams(max_new_tokens=new_tokens, **extra)))
    reqs = [engine.scheduler.requests[r] for r in rids]
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    mask_s = reqs[0].grammar.mask_s if grammar_rows else 0.0
    return time.perf_counter() - t0, steps, len(reqs[0].output), mask_s


def timing(args) -> None:
    cfg = tiny(LLAMA_8B_CTX) if args.tiny else LLAMA_8B_CTX
    cfg = dataclasses.replace(cfg, max_position_embeddings=512)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    new_tokens = 16 if args.tiny else 128
    batches = args.batches or ([1, 4] if args.tiny else [1, 16, 64])
    tok_dir = synthetic_tokenizer(tempfile.mkdtemp(), cfg.vocab_size)
    from jspec.checkpoint.tokenizer import Tokenizer

    model = Model(cfg, random_params(cfg, dtype), Tokenizer(tok_dir))
    head = tiny_head(cfg) if args.tiny else eagle3_head(cfg, 32000)
    dparams = init_random_draft_params(head, jax.random.key(3), dtype)
    results = Results(
        args.out, "bench_structured", {"new_tokens": new_tokens, "vocab": cfg.vocab_size}, file_name=args.name
    )
    rows = []
    for method in ("none", "eagle3"):
        spec = None if method == "none" else jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
        for B in batches:
            for overlap in (True, False):
                engine = jspec.Engine(
                    model,
                    speculative=spec,
                    draft=(head, dparams) if spec else None,
                    page_size=16,
                    max_running_requests=B,
                    max_total_tokens=B * (32 + new_tokens + 64) + 1024,
                    disable_overlap_schedule=not overlap,
                    disable_radix_cache=True,
                )
                row = dict(method=method, batch=B, overlap=overlap)
                for g in (0, 1):
                    run(engine, B, g, new_tokens, 0)  # untimed: compiles what this workload meets
                    engine.loop_times = LoopTimes()
                    wall, steps, grammar_tokens, mask_s = run(engine, B, g, new_tokens, 1)
                    engine.check_idle_no_leaks()
                    row[f"grammar{g}_iter_ms"] = wall / steps * 1e3
                    row[f"grammar{g}_host_ms"] = engine.loop_times.per_iteration_ms()
                    if g:
                        row["grammar_row_tokens_per_iter"] = grammar_tokens / steps
                        row["grammar_mask_ms_per_iter"] = mask_s / steps * 1e3
                row["extra_ms_per_iter"] = row["grammar1_iter_ms"] - row["grammar0_iter_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                results.write(rows=rows)
    print(f"wrote {results.write(rows=rows)}")


def check() -> int:
    """Every method, chain and tree, greedy and seeded sampled, overlap on and off: the
    constrained (and free) rows' tokens equal the plain engine's. Returns the mismatches."""
    from jspec.checkpoint.model import with_context_length
    from jspec.checkpoint.tiny import make_tiny_model
    from jspec.config.sampling import SamplingParams
    from jspec.config.spec import SpecConfig

    model = with_context_length(jspec.load(make_tiny_model(tempfile.mkdtemp() + "/m")), 256)
    head = eagle3_head(model.cfg, model.cfg.vocab_size)
    eagle3 = (head, init_random_draft_params(head, jax.random.key(7), jnp.float32, std=0.2))

    schema = json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 99}},
            "required": ["name", "n"],
        }
    )
    params = [
        SamplingParams(max_new_tokens=60, temperature=t, seed=i, json_schema=schema) for i, t in enumerate([0, 1, 1])
    ]
    params += [SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ebnf='root ::= ("ab" | "c")+ "."')]
    params += [SamplingParams(max_new_tokens=20, temperature=1.0, seed=9, ignore_eos=True)]
    engine = dict(page_size=4, max_total_tokens=4096, attention_backend="reference", max_running_requests=8)
    base = jspec.Engine(model, **engine).generate(["hello"] * len(params), params)
    cases = [
        ("EAGLE3 chain", SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4), eagle3),
        ("EAGLE3 tree", SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=6), eagle3),
        (
            "STANDALONE chain",
            SpecConfig("STANDALONE", num_steps=3, eagle_topk=1, num_draft_tokens=4),
            (model.cfg, model.params),
        ),
        (
            "STANDALONE tree",
            SpecConfig("STANDALONE", num_steps=3, eagle_topk=2, num_draft_tokens=6),
            (model.cfg, model.params),
        ),
        ("NGRAM", SpecConfig("NGRAM", num_draft_tokens=5), None),
        (
            "EAGLE3 adaptive",
            SpecConfig("EAGLE3", num_steps=3, num_draft_tokens=4, adaptive=True, adaptive_shapes="2,2,4 1,1,2 0,1,1"),
            eagle3,
        ),
    ]
    bad = 0
    for name, spec, draft in cases:
        for overlap in (True, False):
            e = jspec.Engine(model, speculative=spec, draft=draft, disable_overlap_schedule=not overlap, **engine)
            if e.adaptive is not None:
                # Every iteration another shape, some rows opted out: batches with grammar rows
                # keep the shape and verify every row's tree.
                from jspec.speculative.adaptive import Choice, CostTable

                cycle = itertools.cycle([Choice(0), Choice(1, [True, False] * 4), Choice(3), Choice(2), Choice(3)])
                e.adaptive.costs = CostTable({}, "unused: the shapes are forced")
                e.adaptive.choose = lambda alphas, bucket, ready=None: _fit(next(cycle), len(alphas))
            out = e.generate(["hello"] * len(params), params)
            e.check_idle_no_leaks()
            same = [o.token_ids == b.token_ids for o, b in zip(out, base)]
            bad += same.count(False)
            acc = [round(o.mean_accept_length or 0, 2) for o in out]
            print(f"{name:17} overlap={overlap!s:5} equal={same} accept={acc}", flush=True)
    return bad


def _closed(properties: dict, required: list[str]) -> dict:
    # No extra keys: a random-weight model would otherwise wander into an endless extra key
    # (a real model stops; the grammar allows it either way) and end by length.
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


VALIDATE_SCHEMAS = {
    "nested": _closed(
        {
            "user": _closed(
                {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}}, ["name", "age"]
            )
        },
        ["user"],
    ),
    "array": _closed({"ids": {"type": "array", "items": {"type": "integer", "maximum": 999}, "maxItems": 4}}, ["ids"]),
    "enum": _closed(
        {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}, ["color", "size"]
    ),
    "numbers": _closed({"x": {"type": "number", "minimum": -1, "maximum": 1}, "n": {"type": "integer"}}, ["x", "n"]),
    "optional": _closed(
        {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}, ["id"]
    ),
}


def validate(completions: int) -> int:
    """The issue's acceptance run: `completions` sampled completions (temperature 1.0) of each
    of five JSON schemas through the official openai client against an in-process server, with
    speculation (EAGLE-3, a random head) on and off and the overlap loop on and off; each
    validated with jsonschema. Returns the failures."""
    import jsonschema
    import openai
    from fastapi.testclient import TestClient

    from jspec.checkpoint.model import with_context_length
    from jspec.checkpoint.tiny import make_tiny_model
    from jspec.engine.async_engine import AsyncEngine
    from jspec.server.app import create_app

    model = with_context_length(jspec.load(make_tiny_model(tempfile.mkdtemp() + "/m")), 512)
    head = eagle3_head(model.cfg, model.cfg.vocab_size)
    draft = (head, init_random_draft_params(head, jax.random.key(7), jnp.float32, std=0.2))
    failures = 0
    for spec_on in (False, True):
        for overlap in (True, False):
            spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=6) if spec_on else None
            engine = jspec.Engine(
                model,
                speculative=spec,
                draft=draft if spec_on else None,
                page_size=16,
                max_running_requests=32,
                max_total_tokens=32 * 512,
                disable_overlap_schedule=not overlap,
            )
            aengine = AsyncEngine(engine)
            t0, bad, n = time.perf_counter(), 0, 0
            try:
                with TestClient(create_app(aengine, "tiny")) as http:
                    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
                    for name, schema in VALIDATE_SCHEMAS.items():
                        left = completions
                        while left:
                            k = min(left, 100)
                            r = client.chat.completions.create(
                                model="tiny",
                                messages=[{"role": "user", "content": f"a {name} object"}],
                                response_format={
                                    "type": "json_schema",
                                    "json_schema": {"name": name, "schema": schema},
                                },
                                temperature=1.0,
                                max_tokens=256,
                                n=k,
                                seed=left,
                            )
                            for c in r.choices:
                                n += 1
                                try:
                                    jsonschema.validate(json.loads(c.message.content), schema)
                                except (ValueError, jsonschema.ValidationError) as e:
                                    bad += 1
                                    print(f"  {name}: {c.finish_reason} {c.message.content!r}: {e}", flush=True)
                            left -= k
            finally:
                aengine.shutdown()
            engine.check_idle_no_leaks()
            print(
                f"speculation={'EAGLE3' if spec_on else 'off':6} overlap={overlap!s:5} {n} completions, "
                f"{bad} invalid, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            failures += bad
    return failures


def _fit(choice, rows: int):
    from jspec.speculative.adaptive import Choice

    return choice if choice.drafting is None else Choice(choice.shape, choice.drafting[:rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument("--batches", type=int_list, help="e.g. 1,16,64")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--name", default="bench_structured", help="JSON file name under --out")
    ap.add_argument("--check", action="store_true", help="the token-equality check of every method instead")
    ap.add_argument(
        "--validate", type=int, metavar="N", help="N sampled completions per schema through the openai client instead"
    )
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check() else 0)
    if args.validate:
        sys.exit(1 if validate(args.validate) else 0)
    timing(args)


if __name__ == "__main__":
    main()
