"""Training an EAGLE-3 head (jspec/train/eagle3.py) on a tiny target, end to end on the CPU.

The tiny random target answers six chat prompts with short, repetitive greedy loops, which
a head can memorise in a few dozen steps. The test checks that the loss falls, that the saved
head loads through the published layout and keeps speculative output identical to greedy,
and that it is accepted far more often than its own untrained initialisation: a head trained
with the draft's rows shifted by one position against inference would be rejected almost
always. The teacher-forced replay of acceptance must also agree with what the engine measures.
"""

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint.eagle import load_draft_model
from jspec.checkpoint.loader import restore_params
from jspec.checkpoint.tiny import make_tiny_model
from jspec.train import eagle3
from jspec.train.prompts import all_prompts, split_prompts

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

NEW_TOKENS = 24
SEQ_LEN = 128
# Every decode pads to 4 rows: one decode program for the six requests however they finish.
ENGINE_KW = dict(max_running_requests=4, precompile_bs_paddings=[4], attention_backend="reference", page_size=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_eagle")
    model = jspec.load(make_tiny_model(root / "target", seed=0, max_position_embeddings=512))
    prompts, _ = split_prompts(6, 0)
    ids = [eagle3.chat_prompt_ids(model, p) for p in prompts]
    base = jspec.generate(model, ids, max_new_tokens=NEW_TOKENS, **ENGINE_KW)
    examples = [eagle3.Example(i + o.token_ids, len(i)) for i, o in zip(ids, base)]
    data = eagle3.pack_examples(examples, SEQ_LEN)
    assert len(data.lengths) == len(examples)  # nothing cut: the replay below sees whole answers
    cfg = eagle3.TrainConfig(steps=60, batch_size=6, seq_len=SEQ_LEN, lr=4e-3, ttt_steps=3, log_every=20)
    trained = eagle3.train_eagle3(model, data, cfg, log=lambda s: None)
    untrained = eagle3.train_eagle3(
        model, data, eagle3.TrainConfig(steps=0, seq_len=SEQ_LEN, ttt_steps=3), log=lambda s: None
    )
    return dict(root=root, model=model, ids=ids, base=base, data=data, cfg=cfg, trained=trained, untrained=untrained)


def spec_run(model, ids, head_dir):
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4, draft_model_path=str(head_dir))
    return jspec.generate(model, ids, max_new_tokens=NEW_TOKENS, speculative=spec, **ENGINE_KW)


def test_prompt_set_is_deterministic_and_split():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) > 500 and prompts == all_prompts()
    train, held = split_prompts(400, 64)
    assert len(train) == 400 and len(held) == 64 and not set(train) & set(held)
    assert split_prompts(100, 64)[1] == held  # held-out set independent of the training size


def test_row_masks_follow_inference():
    # P = 3, length 8: step 0 trains rows 2..5 (label at t+1 <= 6 has a successor); step j starts at P-1+j.
    mask = np.asarray(eagle3.row_masks(np.array([3]), np.array([8]), 10, 3))[0]
    assert [list(np.nonzero(m)[0]) for m in mask] == [[2, 3, 4, 5], [3, 4, 5], [4, 5]]
    src = np.asarray(eagle3.key_steps(5, 2))
    assert list(src[4]) == [0, 0, 0, 1, 2]  # query at step 2 reads step 0 far back, then the diagonal


def test_training_reduces_loss(setup):
    hist = setup["trained"].history
    first, last = hist[0], hist[-1]
    print(f"loss {first['loss']:.3f} -> {last['loss']:.3f}, acc/step {last['step_acc']}")
    # The floor is the target's own entropy (a random tiny model is far from one-hot).
    assert last["loss"] < first["loss"] - 1.5
    assert min(last["step_acc"]) > 0.5


def test_saved_head_loads_and_is_lossless_and_accepted(setup):
    model, ids, base = setup["model"], setup["ids"], setup["base"]
    head_dir = setup["root"] / "head"

    # The untrained head first, then the trained one written over it into the same directory:
    # the same SpecConfig lets the second engine reuse the first one's compiled programs.
    accept = {}
    for name in ("untrained", "trained"):
        path = eagle3.save_head(head_dir, setup[name], model.cfg)
        out = spec_run(model, ids, path)
        assert [o.token_ids for o in out] == [b.token_ids for b in base], name  # lossless
        accept[name] = float(np.mean([o.mean_accept_length for o in out]))
    print(f"mean accept length: trained {accept['trained']:.3f}, untrained {accept['untrained']:.3f}")
    assert accept["trained"] > accept["untrained"] + 0.7

    # Published layout and orbax both give back the trained pytree exactly.
    dcfg, loaded = load_draft_model(path, model.cfg)
    assert dcfg == setup["trained"].dcfg
    for params in (loaded, restore_params(path)):
        jax.tree.map(
            lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, setup["trained"].params
        )

    # The teacher-forced replay predicts the engine's acceptance (it differs at most in the last
    # iteration of each request, which may run past the known answer).
    ev = eagle3.evaluate_head(model, setup["trained"], setup["cfg"], setup["data"])
    print(f"replayed accept length {ev['accept_length']:.3f}, per step acc {ev['step_acc']}")
    assert abs(ev["accept_length"] - accept["trained"]) < 0.35


def test_generate_examples_greedy_first_then_seeded_samples(setup):
    model, ids = setup["model"], setup["ids"][:3]
    engine = jspec.Engine(model, **ENGINE_KW)
    prompts = split_prompts(3, 0)[0]
    examples = eagle3.generate_examples(
        model, prompts, NEW_TOKENS, engine=engine, sampled_answers=2, temperature=1.0, seed=7
    )
    assert len(examples) == 9 and [e.prompt_len for e in examples] == [len(i) for i in ids] * 3
    # The greedy answers come first, in prompt order, and are the plain greedy output.
    assert [e.tokens for e in examples[:3]] == [i + o.token_ids for i, o in zip(ids, setup["base"][:3])]
    sampled = [e.tokens for e in examples[3:]]
    assert all(s[: len(i)] == i for s, i in zip(sampled, ids * 2))
    assert any(s != g.tokens for s, g in zip(sampled, examples[:3] * 2))  # temperature 1 leaves the greedy loop
    again = eagle3.generate_examples(
        model, prompts, NEW_TOKENS, engine=engine, sampled_answers=2, temperature=1.0, seed=7
    )
    assert [e.tokens for e in again] == [e.tokens for e in examples]  # seeded: the data is reproducible


def test_examples_file_round_trips_and_refuses_another_vocabulary(tmp_path):
    examples = [eagle3.Example([5, 6, 7, 8, 9], 2), eagle3.Example([1, 2, 3], 1), eagle3.Example([4, 4, 4, 4], 3)]
    path = tmp_path / "answers.npz"
    eagle3.save_examples(path, examples, vocab_size=10, meta={"sampled_answers": 7})
    back, meta = eagle3.load_examples(path, vocab_size=10)
    assert back == examples and meta == {"sampled_answers": 7}
    with pytest.raises(ValueError, match="10-token vocabulary, the target has 512"):
        eagle3.load_examples(path, vocab_size=512)
