"""Speculative verification with temperature > 0 is lossless.

Statistically: 200k verify outcomes over a fixed tree and fixed target logits give the
target's distribution for the first emitted token and, after an accepted child, for the
second. A deliberately wrong rule is caught by the same check. End to end: with the same
seeds, speculative sampling emits exactly the tokens plain sampling emits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.sampling import fixed_tree, reference_probs

import jspec
from jspec.config.sampling import SamplingParams
from jspec.layers.sampling import sampling_rows
from jspec.speculative.accept import sampled_accept

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

M = 200_000  # verify outcomes; TV of the empirical law stays ~sqrt(V/M) ~ 0.006 when right


TREES = {  # parents: node 0 is the root
    "chain": [-1, 0, 1, 2],
    "tree": [-1, 0, 0, 0, 1, 1, 2],
}


def draft_tokens(parents, logits):
    """Like EAGLE's top-k tree: a node's children are its parent's most likely tokens, in rank order."""
    tokens, rank = [0], {}
    for p in parents[1:]:
        r = rank.get(p, 0)
        rank[p] = r + 1
        tokens.append(int(np.argsort(-logits[p])[r]))
    return tokens


@pytest.mark.parametrize("shape", sorted(TREES))
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.95)]
)
def test_verify_outcomes_follow_the_target_distribution(shape, params):
    parents = TREES[shape]
    N, V = len(parents), 8
    logits = np.random.default_rng(0).normal(size=(N, V)).astype(np.float32) * 1.5
    tokens = draft_tokens(parents, logits)
    tree = fixed_tree(parents, tokens, M)
    rows = jax.tree.map(jnp.asarray, sampling_rows([params] * M, np.arange(M, dtype=np.uint32), M))
    run = jax.jit(sampled_accept, static_argnums=4)
    acc = run(tree, jnp.broadcast_to(logits, (M, N, V)), rows, jnp.full(M, 10, jnp.int32), N - 1)
    emitted = np.asarray(acc.tokens)
    filt = [reference_probs(logits[i], params.temperature, params.top_k, params.top_p, params.min_p) for i in range(N)]

    def tv(samples, probs):
        return 0.5 * np.abs(np.bincount(samples, minlength=V) / len(samples) - probs).sum()

    # First token: the target's distribution at the root, whatever the draft proposed.
    assert tv(emitted[:, 0], filt[0]) < 0.02
    # Second token, given the first was the root's child c: the target's distribution at c.
    children = [i for i, p in enumerate(parents) if p == 0]
    for c in children:
        sel = emitted[:, 0] == tokens[c]
        if sel.sum() > 5000:
            assert tv(emitted[sel, 1], filt[c]) < 0.03
    assert (np.asarray(acc.accept_len) > 0).mean() > 0.1  # drafts do get accepted

    # The same check catches a wrong rule: accepting the FIRST child whenever the draw is any child.
    wrong = emitted[:, 0].copy()
    first_child = tokens[children[0]]
    wrong[np.isin(wrong, [tokens[c] for c in children])] = first_child
    if len(children) > 1:
        assert tv(wrong, filt[0]) > 0.02


@pytest.mark.parametrize("topk,ndt", [(1, None), (4, 6)])
def test_seeded_speculative_sampling_equals_plain_sampling(tmp_path, topk, ndt):
    from support.models import eagle_draft

    from jspec.checkpoint.tiny import make_tiny_model

    model = jspec.load(make_tiny_model(str(tmp_path / "m"), seed=2, max_position_embeddings=512))
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=topk, num_draft_tokens=ndt)
    rng = np.random.default_rng(4)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (4, 11, 25)]
    params = [
        SamplingParams(max_new_tokens=16, temperature=t, top_p=0.9, seed=s, ignore_eos=True)
        for t, s in ((1.0, 1), (0.7, 2), (0.0, 3))
    ]
    # One decode program per sampling program: every decode pads to 4 rows.
    kw = dict(page_size=16, max_total_tokens=4080, precompile_bs_paddings=[4], attention_backend="reference")
    plain = jspec.Engine(model, **kw).generate(prompts, params)
    engine = jspec.Engine(model, speculative=spec, draft=eagle_draft(model), **kw)
    spec_out = engine.generate(prompts, params)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain]
