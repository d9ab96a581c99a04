"""Training a DFlash drafter (jspec/train/dflash.py) on a tiny target, on the CPU: the anchors
stay inside the answers, the row weights decay down the block, the loss falls on answers
that repeat with a short period (what a drafter can learn in a few dozen steps), the drafter
is written in the published layout and read back exactly, validation keeps the best step's
weights, and the target writes training prompts of its own."""

import jax
import numpy as np
import pytest

import jspec
from jspec.checkpoint.dflash import load_dflash_model
from jspec.checkpoint.tiny import make_tiny_model
from jspec.train import dflash, eagle3, self_prompts
from jspec.train.prompts import split_prompts, validation_prompts

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jspec.load(make_tiny_model(tmp_path_factory.mktemp("train_dflash") / "t", seed=0, num_layers=3))


def periodic_examples(count=8, prompt=8, answer=40, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        cycle = list(map(int, rng.integers(0, 256, 2 + i % 3)))
        out.append(eagle3.Example(list(map(int, rng.integers(0, 256, prompt))) + (cycle * answer)[:answer], prompt))
    return out


def test_anchors_and_weights():
    batch = eagle3.pack_examples([eagle3.Example(list(range(20)), 5), eagle3.Example(list(range(9)), 6)], 16)
    anchors = dflash.sample_anchors(np.random.default_rng(0), batch, 200)
    assert anchors[0].min() == 4 and anchors[0].max() == 14  # x_{a+1} is an answer token inside the sequence
    assert set(anchors[1]) == {5, 6, 7}
    w = np.asarray(dflash.loss_weights(16, 7.0))
    assert w[0] == 1.0 and np.allclose(w[7], np.exp(-1)) and np.all(np.diff(w) < 0)
    assert dflash.DFlashTrainConfig(block_size=8).gamma == 4.0


def test_a_tied_embedding_target_trains(tmp_path):
    """The LM head of a target that ties it to the embedding (SmolLM2 does) takes the drafted rows."""
    tied = jspec.load(make_tiny_model(tmp_path / "tied", seed=0, num_layers=3, tie_word_embeddings=True))
    assert "lm_head" not in tied.params
    cfg = dflash.DFlashTrainConfig(steps=2, batch_size=2, seq_len=48, block_size=4, num_layers=1, anchors=2)
    result = dflash.train_dflash(tied, eagle3.pack_examples(periodic_examples(count=2), 48), cfg, log=lambda s: None)
    assert len(result.history) == 2 and np.isfinite(result.history[-1]["loss"])


def test_loss_falls_and_the_drafter_round_trips(model, tmp_path):
    data = eagle3.pack_examples(periodic_examples(), 48)
    cfg = dflash.DFlashTrainConfig(
        steps=60, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=4, block_size=8, num_layers=1, anchors=8, log_every=10
    )
    result = dflash.train_dflash(model, data, cfg, log=lambda s: None)
    first, last = result.history[0], result.history[-1]
    print(f"DFlash training: loss {first['loss']:.3f} -> {last['loss']:.3f}, row accuracy {last['row_acc']}")
    assert last["loss"] < first["loss"] - 1.5
    assert result.dcfg.mask_token_id == model.cfg.vocab_size - 1  # a padding row of the tiny embedding
    ev = dflash.evaluate_drafter(model, result, cfg, data)
    assert ev["accept_length"] > 1.3 and ev["blocks"] == 64
    path = dflash.save_drafter(tmp_path / "d", result, model.cfg, meta={"eval": ev})
    dcfg, params = load_dflash_model(path, model.cfg)
    assert dcfg == result.dcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, result.params)


def test_validation_keeps_the_best_steps_weights(model):
    """With validation answers, the drafter returned is the best-scoring step's (a copy taken
    before the next step donates the weights), and its score is reproducible from it."""
    data = eagle3.pack_examples(periodic_examples(), 48)
    validation = eagle3.pack_examples(periodic_examples(count=4, seed=1), 48)
    cfg = dflash.DFlashTrainConfig(
        steps=30,
        batch_size=8,
        seq_len=48,
        lr=3e-3,
        warmup_steps=4,
        block_size=8,
        num_layers=1,
        anchors=8,
        log_every=100,
        eval_every=10,
    )
    result = dflash.train_dflash(model, data, cfg, log=lambda s: None, validation=validation)
    scored = {r["step"]: r["validation"]["accept_length"] for r in result.history if "validation" in r}
    assert sorted(scored) == [10, 20, 30]
    assert result.kept_step == max(scored, key=lambda s: (scored[s], -s))  # the first of equal bests
    assert dflash.evaluate_drafter(model, result, cfg, validation)["accept_length"] == scored[result.kept_step]
    plain = dflash.train_dflash(model, data, cfg, log=lambda s: None)
    assert plain.kept_step is None and all("validation" not in r for r in plain.history)


def test_the_target_writes_prompts_of_its_own(model):
    """Self-prompts (Magpie): sampled after the opening of a user turn, seeded, distinct, none of
    the excluded (held-out) ones; the opening is what the chat template writes before a message."""
    opening = self_prompts.user_turn_opening(model.tokenizer)
    assert opening == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    engine = jspec.Engine(model, max_running_requests=4, precompile_bs_paddings=[4], attention_backend="reference")
    kw = dict(engine=engine, seed=3, max_new_tokens=12)
    first = self_prompts.self_prompts(model, 5, **kw)
    assert len(first) == len(set(first)) == 5 and all(p.strip() == p and p for p in first)
    assert self_prompts.self_prompts(model, 5, **kw) == first
    rest = self_prompts.self_prompts(model, 4, exclude=first[:2], **kw)
    assert not set(rest) & set(first[:2]) and rest[:3] == first[2:5]
    assert self_prompts.self_prompts(model, 5, **{**kw, "seed": 4}) != first


def test_validation_prompts_sit_between_training_and_held_out():
    train, held = split_prompts(448, 64)
    val = validation_prompts(448, 32, 64)
    assert len(val) == 32 and not set(val) & (set(train) | set(held))
    with pytest.raises(ValueError, match="must be within the 544 prompts"):
        validation_prompts(448, 64, 64)
