"""One speculative interface, several methods: NGRAM and STANDALONE are lossless, NGRAM's
matcher equals a brute-force reference, and the shared code never names a method."""

import dataclasses
import hashlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import TARGET, draft_config, engine_settings, permutation_models, prompts

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.loader import init_random_params
from jspec.config.spec import SpecConfig
from jspec.speculative.ngram import match_candidates, match_candidates_ref

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.mark.parametrize("seed", range(4))
def test_ngram_matcher_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    B, C = 6, 64
    hist = rng.integers(0, 3 if seed % 2 else 5, (B, C)).astype(np.int32)  # few symbols: many matches
    n = rng.integers(0, C, B).astype(np.int32)
    lo, hi, breadth = 1 + seed % 2, 4 + seed, 3
    ends, lens = match_candidates(jnp.asarray(hist), jnp.asarray(n), min_window=lo, max_window=hi, breadth=breadth)
    for b in range(B):
        ref_ends, ref_lens = match_candidates_ref(hist[b], int(n[b]), min_window=lo, max_window=hi, breadth=breadth)
        assert list(np.asarray(ends[b])) == ref_ends and list(np.asarray(lens[b])) == ref_lens, b


# The plain engine's greedy tokens, by everything they depend on: several cases share a target,
# prompts and engine settings, and each such baseline runs once per module.
_plain_tokens: dict = {}


def plain_tokens(cfg, target, ps, max_new, kw):
    weights = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in jax.tree.leaves(target))).hexdigest()
    key = (cfg, weights, tuple(map(tuple, ps)), max_new, tuple(sorted((k, str(v)) for k, v in kw.items())))
    if key not in _plain_tokens:
        base = jspec.generate(
            (cfg, target), ps, max_new_tokens=max_new, ignore_eos=True, engine=jspec.Engine((cfg, target), **kw)
        )
        _plain_tokens[key] = [b.token_ids for b in base]
    return _plain_tokens[key]


def run_pair(target, ps, spec, draft=None, page_size=16, overlap=True, max_new=16, cfg=TARGET, backend="reference"):
    kw = {**engine_settings(page_size, overlap), "attention_backend": backend}
    base = plain_tokens(cfg, target, ps, max_new, kw)
    engine = jspec.Engine((cfg, target), speculative=spec, draft=draft, **kw)
    out = jspec.generate((cfg, target), ps, max_new_tokens=max_new, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert len(out) == len(base)
    for b, o in zip(base, out):
        assert o.token_ids == b
    return float(np.mean([o.mean_accept_length for o in out]))


@pytest.mark.parametrize("page_size,overlap,breadth", [(16, True, 1), (1, False, 1), (16, False, 2), (1, True, 3)])
def test_ngram_is_lossless_and_accepts_repetitive_text(page_size, overlap, breadth):
    # A target whose greedy next token cycles 0 -> 1 -> 2 -> 0 and 3 -> 4 -> 5 -> 6 -> 3: its output
    # repeats what the prompt already holds, so the n-gram drafts are right almost every time.
    perm = [1, 2, 0, 4, 5, 6, 3] + list(range(7, 64))
    target, _, _ = permutation_models("EAGLE", perm=perm)
    ps = [[0, 1, 2, 0, 1], [3, 4, 5, 6, 3, 4], [9, 9, 9, 1, 2]]
    spec = SpecConfig("NGRAM", num_draft_tokens=1 + 4 * breadth, ngram_max_bfs_breadth=breadth)
    acc = run_pair(target, ps, spec, page_size=page_size, overlap=overlap)
    print(f"ngram repetitive breadth={breadth}: mean accept length {acc:.2f}")
    assert acc >= 3.0


def test_ngram_is_lossless_on_random_text():
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    acc = run_pair(target, prompts([3, 17, 30]), SpecConfig("NGRAM", num_draft_tokens=5))
    print(f"ngram random text: mean accept length {acc:.2f}")
    assert 1.0 <= acc < 2.0


def small_draft_config():
    import dataclasses

    return dataclasses.replace(TARGET, num_layers=2, intermediate_size=32)


@pytest.mark.parametrize(
    "page_size,overlap,steps,topk,ndt",
    [(16, True, 3, 1, None), (16, False, 1, 1, None), (4, True, 3, 2, 5), (1, False, 4, 3, 8)],
)
def test_standalone_random_draft_is_lossless(page_size, overlap, steps, topk, ndt):
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    dcfg = small_draft_config()
    draft = (dcfg, init_random_params(dcfg, jax.random.key(9), jnp.float32))
    spec = SpecConfig("STANDALONE", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    acc = run_pair(target, prompts([3, 17, 30]), spec, draft=draft, page_size=page_size, overlap=overlap)
    print(f"standalone random draft steps={steps} topk={topk}: mean accept length {acc:.2f}")
    assert acc >= 1.0


# Trees keep every candidate (1 + k + (steps - 1) k^2 nodes): with fewer, EAGLE-2's selection by
# cumulative probability may cut the deep end of the target's own path, as it should.
@pytest.mark.parametrize(
    "page_size,overlap,topk,ndt", [(16, True, 1, None), (1, False, 1, None), (4, True, 2, 11), (1, False, 3, 22)]
)
def test_standalone_draft_equal_to_target_accepts_everything(page_size, overlap, topk, ndt):
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    steps = 3
    spec = SpecConfig("STANDALONE", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    acc = run_pair(
        target,
        prompts([3, 17, 30]),
        spec,
        draft=(TARGET, target),
        page_size=page_size,
        overlap=overlap,
        max_new=4 * (steps + 1),
    )
    print(f"standalone draft == target topk={topk}: mean accept length {acc:.2f}")
    # A chain takes every draft; a tree's beams (top-k by cumulative probability) can drop the target's
    # own path on near-flat random-weight distributions now and then.
    assert acc == steps + 1 if topk == 1 else acc >= 0.9 * (steps + 1)


# Sliding windows of 5 on layers 0 and 2, narrower than the prompts: verify trees window the
# prefix, and the greedy output is the plain engine's.
TARGET_WINDOW = dataclasses.replace(TARGET, sliding_windows=(5, 0, 5, 0))


@pytest.mark.parametrize(
    "algorithm,page_size,topk,backend",
    [
        ("NGRAM", 1, 2, "reference"),
        ("STANDALONE", 16, 1, "reference"),
        ("EAGLE3", 16, 2, "pallas"),
    ],
)
def test_speculation_over_sliding_windows_is_lossless(algorithm, page_size, topk, backend):
    target = init_random_params(TARGET_WINDOW, jax.random.key(1), jnp.float32)
    draft = None
    if algorithm == "NGRAM":
        spec = SpecConfig("NGRAM", num_draft_tokens=7, ngram_max_bfs_breadth=topk)
    else:
        spec = SpecConfig(algorithm, num_steps=3, eagle_topk=topk, num_draft_tokens=None if topk == 1 else 6)
    if algorithm == "STANDALONE":
        draft = (TARGET_WINDOW, target)  # the target itself: every draft is right
    if algorithm == "EAGLE3":
        dcfg = draft_config("EAGLE3", TARGET_WINDOW)
        draft = (dcfg, init_random_draft_params(dcfg, jax.random.key(2), std=0.2))
    ps = prompts([3, 17, 30]) if algorithm != "NGRAM" else [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], *prompts([17, 30])]
    acc = run_pair(target, ps, spec, draft=draft, page_size=page_size, cfg=TARGET_WINDOW, backend=backend)
    assert acc >= 1.0
    if algorithm == "STANDALONE":
        assert acc >= 3.0


def test_trees_deeper_than_a_window_are_refused():
    target = init_random_params(TARGET_WINDOW, jax.random.key(1), jnp.float32)
    with pytest.raises(ValueError, match="num_steps=5 reaches past the target's sliding window of 5"):
        jspec.Engine((TARGET_WINDOW, target), speculative=SpecConfig("NGRAM", num_draft_tokens=6))
    with pytest.raises(ValueError, match="drafts chains only"):
        jspec.Engine(
            (TARGET, init_random_params(TARGET, jax.random.key(1), jnp.float32)),
            speculative=SpecConfig("STANDALONE", num_steps=2, eagle_topk=2, num_draft_tokens=4),
            draft=(TARGET_WINDOW, target),
        )


def test_standalone_mismatched_vocabularies_are_refused():
    import dataclasses

    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    dcfg = dataclasses.replace(small_draft_config(), vocab_size=32)
    with pytest.raises(ValueError, match="vocabulary"):
        jspec.Engine(
            (TARGET, target),
            speculative=SpecConfig("STANDALONE"),
            draft=(dcfg, init_random_params(dcfg, jax.random.key(2), jnp.float32)),
            max_total_tokens=240,
            attention_backend="reference",
        )


SHARED = [
    "jspec/scheduler",
    "jspec/speculative/verify.py",
    "jspec/speculative/method.py",
    "jspec/speculative/accept.py",
    "jspec/engine/engine.py",
    "jspec/worker/base.py",
    "jspec/engine/async_engine.py",
    "jspec/steps/plain.py",
]


def method_names_in_code(source: str) -> list[tuple[int, str]]:
    """(line, text) of every identifier or string constant (docstrings aside) that names a method."""
    import ast

    names = re.compile(r"eagle(?!_topk)|ngram|standalone", re.IGNORECASE)  # eagle_topk: the tree width flag
    tree = ast.parse(source)
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    hits = []
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = node.name
        if text is not None and names.search(text):
            hits.append((getattr(node, "lineno", 0), text))
    return hits


def test_shared_code_never_branches_on_a_method_name():
    root = pathlib.Path(__file__).resolve().parents[2]
    hits = []
    for entry in SHARED:
        p = root / entry
        for f in [p] if p.is_file() else sorted(p.rglob("*.py")):
            hits += [f"{f.relative_to(root)}:{line}: {text}" for line, text in method_names_in_code(f.read_text())]
    assert not hits, "shared code names a speculative method:\n" + "\n".join(hits)
    # The check itself catches a branch on the name, in an identifier or a string.
    assert method_names_in_code('if spec.algorithm == "NGRAM":\n    pass\n')
    assert method_names_in_code("from jspec.speculative.eagle import EagleMethod\n")
