"""Training a DFlash block drafter for a target model (the paper's objective, in JAX).

The data is train/eagle3.py's: the target answers the training prompts itself, and each
answer is a sequence of the target's own tokens. A step runs the frozen target over each
padded sequence for its captured states (eagle3.target_pass: the streams entering the capture
layers, i.e. the outputs of the drafter's target_layer_ids), fuses them into context features
(models/dflash.py), and drafts `anchors` blocks per sequence at random anchor positions of the
answer: block b is [x_a, mask, ..., mask] at positions a..a+B-1, sees the context of the
positions before a and every row of its own block (no causal mask inside), and row k is
trained to give x_{a+k}. The loss is the cross-entropy of rows k = 1..B-1 weighted
exp(-(k-1)/gamma): an early row's miss ends the accepted chain, so the rows down the block
matter less. dense_block_hidden is the same forward the engine's paged block runs, which
tests/speculative/test_spec_dflash.py checks block for block.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.checkpoint.dflash import dflash_config_for, init_random_dflash_params, save_dflash
from jspec.config.dflash import DFlashConfig
from jspec.config.model import ModelConfig
from jspec.models.dflash import dense_block_hidden, draft_logits
from jspec.train.eagle3 import Batch, batch_rows, make_optimizer, step_record, take, target_pass

# The decay the reference recipes pair with each block size; others get B / 2 - 1.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclasses.dataclass(frozen=True)
class DFlashTrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    block_size: int = 16
    num_layers: int = 2  # draft layers
    anchors: int = 16  # blocks drafted per sequence per step
    loss_decay_gamma: float = 0.0  # 0: DEFAULT_GAMMA's for the block size
    mask_token_id: int | None = None  # None: the target's last embedding row (see default_mask_token)
    seed: int = 0
    log_every: int = 50
    # Every this many steps the drafter is scored on the validation answers and the best
    # scoring weights are kept (0: no validation; the last step's weights are the result).
    eval_every: int = 0

    @property
    def gamma(self) -> float:
        return self.loss_decay_gamma or DEFAULT_GAMMA.get(self.block_size, max(self.block_size / 2 - 1, 1.0))


def default_mask_token(model) -> int:
    """A token the target never writes: the tokenizer's mask token, else an embedding row past
    the tokenizer's vocabulary (checkpoints pad their embedding). Otherwise name one."""
    tok = getattr(model, "tokenizer", None)
    V = model.cfg.vocab_size
    if tok is not None:
        mask = tok.token_to_id("<|MASK|>") if hasattr(tok, "token_to_id") else None
        if mask is not None and mask < V:
            return int(mask)
        if tok.vocab_size >= V:
            raise ValueError(
                "the target's embedding has no row past its tokenizer's vocabulary and the tokenizer no "
                "<|MASK|> token: name the block's mask token (--mask-token-id), a special token the target never writes"
            )
    return V - 1


def loss_weights(block_size: int, gamma: float) -> jax.Array:
    """[B - 1]: exp(-(k - 1) / gamma) for the drafted rows k = 1..B-1."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def sample_anchors(rng: np.random.Generator, batch: Batch, count: int) -> np.ndarray:
    """[N, count] int32 anchors, uniform over each answer's positions a with x_a in the sequence
    and x_{a+1} an answer token: P - 1 <= a <= length - 2 (inference's first block starts at the
    prompt's last token)."""
    lo = batch.prompt_lens.astype(np.int64) - 1
    hi = batch.lengths.astype(np.int64) - 2
    u = rng.random((len(lo), count))
    return (lo[:, None] + np.floor(u * (hi - lo + 1)[:, None])).astype(np.int32)


class StepMetrics(NamedTuple):
    loss: jax.Array  # scalar: weighted mean cross-entropy
    row_loss: jax.Array  # [B - 1] mean cross-entropy per block row
    row_acc: jax.Array  # [B - 1] top-1 agreement with the sequence per block row
    correct: jax.Array  # [N, anchors, B - 1] bool
    valid: jax.Array  # [N, anchors, B - 1] bool: the label is a real token


def block_outputs(
    dparams, dcfg: DFlashConfig, target_params, tcfg: ModelConfig, batch: Batch, anchors: jax.Array, gamma: float
) -> StepMetrics:
    """The objective on one batch, the target frozen."""
    tokens = jnp.asarray(batch.tokens)
    N, S = tokens.shape
    Bs = dcfg.block_size
    _, feats = jax.vmap(lambda x: target_pass(target_params, tcfg, x, dcfg.capture_layers))(tokens)
    feats = jax.lax.stop_gradient(feats).astype(jnp.float32)
    roots = jnp.take_along_axis(tokens, anchors, axis=1)  # [N, A]
    block = jnp.concatenate(
        [roots[..., None], jnp.full((*anchors.shape, Bs - 1), dcfg.mask_token_id, jnp.int32)], axis=-1
    )
    h = jax.vmap(lambda f, b, a: dense_block_hidden(dparams, dcfg, target_params, f, b, a))(feats, block, anchors)
    # draft_logits takes rows [T, H], as the engine passes them (a tied LM head contracts axis 1).
    drafted = h[:, :, 1:]
    logits = draft_logits(target_params, dcfg, drafted.reshape(-1, h.shape[-1])).reshape(*drafted.shape[:-1], -1)
    label_pos = anchors[..., None] + jnp.arange(1, Bs, dtype=jnp.int32)  # [N, A, B-1]
    labels = jnp.take_along_axis(tokens, jnp.clip(label_pos, 0, S - 1).reshape(N, -1), axis=1).reshape(label_pos.shape)
    valid = label_pos < jnp.asarray(batch.lengths)[:, None, None]
    ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    correct = jnp.argmax(logits, axis=-1) == labels
    w = loss_weights(Bs, gamma) * valid
    count = jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1)
    return StepMetrics(
        jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6),
        jnp.sum(jnp.where(valid, ce, 0.0), axis=(0, 1)) / count,
        jnp.sum(valid & correct, axis=(0, 1)) / count,
        correct,
        valid,
    )


def accept_length_estimate(correct: np.ndarray, valid: np.ndarray) -> float:
    """Tokens a verify would emit from each block, teacher-forced: 1 + its leading run of right
    drafts (a wrong row ends the chain), averaged over blocks with a full run of labels."""
    ok = np.cumprod(correct & valid, axis=-1)
    full = valid.all(axis=-1)
    return float((1 + ok.sum(axis=-1))[full].mean()) if full.any() else float("nan")


class TrainResult(NamedTuple):
    dcfg: DFlashConfig
    params: dict[str, Any]
    history: list[dict[str, Any]]
    kept_step: int | None = None  # the step whose weights these are, where validation chose them


def make_steps(dcfg: DFlashConfig, tcfg: ModelConfig, cfg: DFlashTrainConfig, optimizer):
    """(train_step, eval_step), jitted once: every batch has the same padded shape."""

    def objective(weights, target_params, batch, anchors):
        m = block_outputs(weights, dcfg, target_params, tcfg, batch, anchors, cfg.gamma)
        return m.loss, m

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # weights and optimizer state are updated in place
    def train_step(weights, opt_state, target_params, batch, anchors):
        (_, m), grads = jax.value_and_grad(objective, has_aux=True)(weights, target_params, batch, anchors)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, (m.loss, m.row_loss, m.row_acc)

    @jax.jit
    def eval_step(weights, target_params, batch, anchors):
        return objective(weights, target_params, batch, anchors)[1]

    return train_step, eval_step


def drafter_config(model, cfg: DFlashTrainConfig) -> DFlashConfig:
    mask = default_mask_token(model) if cfg.mask_token_id is None else cfg.mask_token_id
    return dflash_config_for(model.cfg, num_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=mask)


def train_dflash(
    model,
    data: Batch,
    cfg: DFlashTrainConfig,
    log: Callable[[str], None] = print,
    validation: Batch | None = None,
) -> TrainResult:
    """Trains a drafter on packed sequences (eagle3.pack_examples) of `model` (a jspec.Model).

    With `validation` and cfg.eval_every, the weights returned are those of the step with the
    best validation accept length: a few hundred prompts' answers are seen many times over,
    and past some step the drafter memorises them while it drafts worse for new prompts."""
    tcfg, target_params = model.cfg, model.params
    dcfg = drafter_config(model, cfg)
    weights = init_random_dflash_params(dcfg, jax.random.key(cfg.seed), jnp.float32)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(weights)
    train_step, eval_step = make_steps(dcfg, tcfg, cfg, optimizer)
    validate = validation is not None and cfg.eval_every > 0
    best: tuple[float, int, Any] | None = None  # (accept length, step, weights)
    rng = np.random.default_rng(cfg.seed)
    batches = batch_rows(rng, len(data.lengths), cfg.batch_size)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch = take(data, next(batches))
        anchors = sample_anchors(rng, batch, cfg.anchors)
        weights, opt_state, (loss, row_loss, row_acc) = train_step(weights, opt_state, target_params, batch, anchors)
        logged = step == 1 or step % cfg.log_every == 0 or step == cfg.steps
        scored = validate and (step % cfg.eval_every == 0 or step == cfg.steps)
        if not (logged or scored):
            continue
        rec = step_record(step, loss, t0, row_loss=row_loss, row_acc=row_acc)
        acc = " ".join(f"{a:.2f}" for a in rec["row_acc"][:4])
        line = f"step {step:5d}  loss {rec['loss']:.4f}  acc rows 1-4 {acc}"
        if scored:
            ev = score_blocks(eval_step, weights, target_params, validation, cfg)
            rec["validation"] = {k: ev[k] for k in ("loss", "accept_length", "row_acc")}
            line += f"  validation accept {ev['accept_length']:.3f}"
            if best is None or ev["accept_length"] > best[0]:
                # train_step donates its weights: keep a copy of the ones worth keeping.
                best = (ev["accept_length"], step, jax.tree.map(jnp.copy, weights))
        history.append(rec)
        log(f"{line}  ({rec['elapsed_s']:.1f} s)")
    if best is None:
        return TrainResult(dcfg, weights, history)
    log(f"kept the weights of step {best[1]} (validation accept length {best[0]:.3f})")
    return TrainResult(dcfg, best[2], history, kept_step=best[1])


def score_blocks(eval_step, params, target_params, data: Batch, cfg: DFlashTrainConfig, seed: int = 1) -> dict:
    """Teacher-forced per-row agreement and loss, and the accept length they imply, over every
    sequence of `data` (anchors drawn with `seed`, so that two calls score the same blocks)."""
    rng = np.random.default_rng(seed)
    n = len(data.lengths)
    corrects, valids, losses = [], [], []
    for i in range(0, n, cfg.batch_size):
        rows = np.arange(i, i + cfg.batch_size) % n  # the last batch wraps; its repeats are dropped
        keep = np.arange(i, i + cfg.batch_size) < n
        batch = take(data, rows)
        m = eval_step(params, target_params, batch, sample_anchors(rng, batch, cfg.anchors))
        corrects.append(np.asarray(m.correct)[keep])
        valids.append(np.asarray(m.valid)[keep])
        losses.append(float(m.loss))
    correct, valid = np.concatenate(corrects), np.concatenate(valids)
    count = np.maximum(valid.sum(axis=(0, 1)), 1)
    return {
        "loss": float(np.mean(losses)),
        "row_acc": ((correct & valid).sum(axis=(0, 1)) / count).round(4).tolist(),
        "accept_length": accept_length_estimate(correct, valid),
        "blocks": int(valid[..., 0].sum()),
    }


def evaluate_drafter(model, result: TrainResult, cfg: DFlashTrainConfig, data: Batch, seed: int = 1) -> dict[str, Any]:
    """score_blocks for a trained drafter, outside training."""
    _, eval_step = make_steps(result.dcfg, model.cfg, cfg, make_optimizer(cfg))
    return score_blocks(eval_step, result.params, model.params, data, cfg, seed)


def save_drafter(
    out_dir: str | os.PathLike, result: TrainResult, target: ModelConfig, meta: dict[str, Any] | None = None
) -> str:
    """The published layout (checkpoint/dflash.py: config.json + model.safetensors), which
    --speculative-draft-model-path and the reference implementation read, plus train_meta.json."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train_meta.json"), "w") as f:
        json.dump({"history": result.history, **(meta or {})}, f, indent=2, default=str)
    return save_dflash(out_dir, result.dcfg, result.params, target)


def gamma_note(cfg: DFlashTrainConfig) -> str:
    w = np.exp(-np.arange(cfg.block_size - 1) / cfg.gamma)
    return f"gamma {cfg.gamma:g}: row weights {w[0]:.2f} .. {w[-1]:.2f} (sum {w.sum():.2f}, {math.fsum(w > 0.5):.0f} above 0.5)"
