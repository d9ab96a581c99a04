"""Frequency, presence and repetition penalties: right values, and exact under speculation.

The tree rule (each node penalised with the counts that emitting root..node one token at
a time would give) against a brute-force numpy reference; the engine's penalised greedy
decoding against a dense recompute that applies the penalties one token at a time; and
speculative decoding (chain and tree, greedy and seeded sampling) against plain decoding,
with a draft that agrees with the target so whole paths, repeats included, are accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import tiny_model
from support.sampling import fixed_tree

import jspec
from jspec.config.sampling import SamplingParams
from jspec.layers.penalties import PenaltyState, apply_tree_penalties, init_penalty_state
from jspec.layers.sampling import sampling_rows
from jspec.models.llama import dense_forward

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


def penalise_ref(logits, counts, prompt_seen, f, p, r):
    x = logits.astype(np.float64).copy()
    seen = (counts > 0) | prompt_seen
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    return x - f * counts - p * (counts > 0)


def test_tree_penalties_equal_one_token_at_a_time():
    rng = np.random.default_rng(0)
    parents = [-1, 0, 0, 1, 1, 3, 5, 2]
    B, N, V = 3, len(parents), 6  # a small vocabulary: paths repeat tokens
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    tree = fixed_tree(parents, tokens[0], B)._replace(tokens=jnp.asarray(tokens))
    logits = rng.normal(size=(B, N, V)).astype(np.float32) * 2
    counts = rng.integers(0, 3, (B + 1, V)).astype(np.int32)
    seen = rng.random((B + 1, V)) < 0.3
    params = [
        SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=-0.5, presence_penalty=1.0),
    ]
    rows = sampling_rows(params, [0, 0, 0], B)
    slot_ids = np.array([2, 0, 1], np.int32)
    got = np.asarray(
        apply_tree_penalties(
            jnp.asarray(logits),
            PenaltyState(jnp.asarray(counts), jnp.asarray(seen), *init_penalty_state(B, V)[2:]),
            jnp.asarray(slot_ids),
            jnp.asarray(rows.params),
            tree.tokens,
            tree.mask,
        )
    )
    for b in range(B):
        sp = params[b]
        for i in range(N):
            path, j = [], i
            while j > 0:  # drafted ancestors of node i, itself included; the root is counted already
                path.append(tokens[b, j])
                j = parents[j]
            c = counts[slot_ids[b]] + np.bincount(np.asarray(path, int), minlength=V)
            ref = penalise_ref(
                logits[b, i], c, seen[slot_ids[b]], sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty
            )
            np.testing.assert_allclose(got[b, i], ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=4, max_position_embeddings=512)


def test_penalised_greedy_matches_a_dense_recompute(tiny):
    prompts = [[5, 9, 2, 7, 5, 5], list(range(30, 50))]
    params = SamplingParams(
        max_new_tokens=16,
        ignore_eos=True,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        return_logprob=True,
    )
    outs = jspec.Engine(tiny, page_size=4, max_total_tokens=252, attention_backend="reference").generate(
        prompts, params
    )
    unpenalised = jspec.Engine(tiny, page_size=4, max_total_tokens=252, attention_backend="reference").generate(
        prompts, SamplingParams(max_new_tokens=16, ignore_eos=True)
    )
    # Causal, so padding after the sequence changes nothing before it: one compiled length.
    dense = jax.jit(lambda toks: dense_forward(tiny.params, tiny.cfg, toks))
    for prompt, o in zip(prompts, outs):
        seq, V = list(prompt), tiny.cfg.vocab_size
        seen = np.zeros(V, bool)
        seen[prompt] = True
        counts = np.zeros(V, np.int64)
        for j in range(16):
            logits = np.asarray(dense(np.asarray(seq + [0] * (40 - len(seq)), np.int32)))[len(seq) - 1]
            x = penalise_ref(logits, counts, seen, 0.8, 0.5, 1.3)
            tok = int(np.argmax(x))
            assert o.token_ids[j] == tok, f"token {j}"
            lsm = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert abs(o.logprobs[j] - lsm[tok]) < 1e-4  # logprobs are of the penalised distribution
            counts[tok] += 1
            seq.append(tok)
    assert [o.token_ids for o in outs] != [o.token_ids for o in unpenalised]  # the penalties did something


def test_logit_bias_after_the_penalties_matches_a_dense_recompute(tiny):
    """A request's logit_bias is added after its penalties (the logprobs are of that
    distribution); the unbiased run's first token, banned, never comes; a row without a bias in
    the same batch is untouched."""
    prompts = [[5, 9, 2, 7, 5, 5], list(range(30, 50))]
    engine = jspec.Engine(tiny, page_size=4, max_total_tokens=252, attention_backend="reference")
    free = engine.generate(prompts[:1], SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.8))
    banned, favoured = free[0].token_ids[0], 11
    bias = {banned: -100.0, favoured: 2.5, 40: -3.0}
    params = [
        SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.8, logit_bias=bias, return_logprob=True),
        SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.8, return_logprob=True),
    ]
    outs = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params[0])  # both rows biased, one batch
    dense = jax.jit(lambda toks: dense_forward(tiny.params, tiny.cfg, toks))
    for prompt, sp, o in zip(prompts, params, outs):
        seq, V = list(prompt), tiny.cfg.vocab_size
        add = np.zeros(V)
        for t, v in (sp.logit_bias or {}).items():
            add[t] = v
        counts = np.zeros(V, np.int64)
        for j in range(16):
            logits = np.asarray(dense(np.asarray(seq + [0] * (40 - len(seq)), np.int32)))[len(seq) - 1]
            x = penalise_ref(logits, counts, np.zeros(V, bool), 0.8, 0.0, 1.0) + add
            tok = int(np.argmax(x))
            assert o.token_ids[j] == tok, f"token {j}"
            lsm = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert abs(o.logprobs[j] - lsm[tok]) < 1e-4
            counts[tok] += 1
            seq.append(tok)
    assert banned not in outs[0].token_ids and banned not in together[0].token_ids
    assert together[0].token_ids == outs[0].token_ids
    engine.check_idle_no_leaks()


PERM = [1, 2, 0] + list(range(4, 64)) + [3]  # a 3-cycle 0 -> 1 -> 2 -> 0: drafted paths repeat tokens


@pytest.mark.parametrize("steps,topk,ndt", [(5, 1, None), (3, 2, 5)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_speculative_penalties_equal_plain(steps, topk, ndt, temperature):
    from support.models import TARGET, permutation_models

    target, dcfg, draft = permutation_models("EAGLE3", perm=PERM)
    # Scale the one-hot logits so that penalties reorder tokens within a few repeats.
    target = dict(target, lm_head=target["lm_head"] * 0.5)  # the final norm makes e_x 8 e_x: logits 4
    # Frequency penalties of 1.1 and 1.3 push a cycle token below the rest in the middle of a
    # drafted path (dropping the per-node correction in apply_tree_penalties fails this test).
    ps = [[0, 1], [2], [1, 2, 0]]
    sampling = [
        SamplingParams(
            max_new_tokens=20,
            ignore_eos=True,
            temperature=temperature,
            seed=s,
            frequency_penalty=fp,
            presence_penalty=pp,
            repetition_penalty=rp,
        )
        for s, (fp, pp, rp) in enumerate([(1.1, 0.0, 1.0), (1.3, 0.5, 1.0), (1.1, 0.0, 1.5)])
    ]
    # A logit_bias on every tree node alike: the cycle's next token pushed down, another up.
    sampling[2].logit_bias = {1: -1.5, 7: 0.8}
    kw = dict(page_size=4, max_total_tokens=380, max_running_requests=4, attention_backend="reference")
    plain = jspec.Engine((TARGET, target), **kw)
    base = [plain.generate([p], sp)[0] for p, sp in zip(ps, sampling)]
    spec = jspec.SpecConfig("EAGLE3", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    engine = jspec.Engine((TARGET, target), speculative=spec, draft=(dcfg, draft), **kw)
    outs = [engine.generate([p], sp)[0] for p, sp in zip(ps, sampling)]
    engine.check_idle_no_leaks()
    for b, o in zip(base, outs):
        assert o.token_ids == b.token_ids
    # Penalties broke the permutation's cycle, and the draft still got whole stretches accepted.
    assert all(len(set(b.token_ids)) > 3 for b in base)
    acc = np.mean([o.mean_accept_length for o in outs])
    print(f"penalties under speculation steps={steps} topk={topk} T={temperature}: mean accept {acc:.2f}")
    assert acc > 1.3


def test_penalties_survive_retraction_and_skip_the_prefix_cache(tiny):
    params = SamplingParams(
        max_new_tokens=40, ignore_eos=True, frequency_penalty=0.7, repetition_penalty=1.2, logit_bias={3: 1.5}
    )
    prompts = [list(range(10 + 7 * i, 40 + 7 * i)) for i in range(6)]
    # test_engine.py's retraction settings and workload: the same programs, compiled once.
    kw = dict(page_size=4, max_running_requests=8, precompile_bs_paddings=[8], attention_backend="reference")
    big = jspec.Engine(tiny, max_total_tokens=1020, **kw)
    ref = big.generate(prompts, params)
    small = jspec.Engine(tiny, max_total_tokens=156, **kw)
    got = small.generate(prompts, params)
    assert small.scheduler.num_retractions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    # Same prompt again on the warm engine: penalised requests prefill their whole prompt.
    before = big.scheduler.prefilled_tokens
    again = big.generate(prompts[:1], params)
    assert big.scheduler.prefilled_tokens - before == len(prompts[0])
    assert again[0].token_ids == ref[0].token_ids
    small.check_idle_no_leaks()
    big.check_idle_no_leaks()


@pytest.mark.parametrize(
    "bad",
    [
        dict(frequency_penalty=2.5),
        dict(presence_penalty=-3),
        dict(repetition_penalty=0),
        dict(repetition_penalty=2.1),
        dict(frequency_penalty="1"),
    ],
)
def test_bad_penalties_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
