"""Training an EAGLE-3 draft head for a target model (EAGLE-3's training-time test).

The target answers the training prompts itself (jspec.generate); the jitted step runs the
frozen target over each sequence for its captured features and logits, then the head exactly
as inference runs it (models/eagle.py), unrolled over K steps whose attention reads the same
keys inference would. The loss is the cross-entropy against the target's distribution,
weighted 0.8**step. docs/design-details.md, "Training an EAGLE-3 head", has the derivation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.eagle_config import draft_hf_config, tiny_capture_layers, write_draft_config
from jspec.checkpoint.files import write_safetensors
from jspec.checkpoint.loader import save_params
from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.layers.norm import rms_norm
from jspec.models.common import compute_logits
from jspec.models.eagle import draft_layers, draft_logits, layer_config, target_feature
from jspec.models.llama import attention_input, decoder_layer, embed_tokens, rope_cos_sin
from jspec.server.chat_template import render_chat

# ---------------------------------------------------------------------------
# Data: the target answers the prompts
# ---------------------------------------------------------------------------


class Example(NamedTuple):
    tokens: list[int]  # prompt + response
    prompt_len: int


def chat_prompt_ids(model, prompt: str) -> list[int]:
    """The prompt as the server sends it: the chat template's text, tokenised without
    extra special tokens (the template writes BOS itself where the model wants one)."""
    text = render_chat(model.tokenizer, [{"role": "user", "content": prompt}])
    return model.tokenizer.encode(text, add_special_tokens=False)


def generate_examples(
    model,
    prompts: Sequence[str],
    max_new_tokens: int = 128,
    *,
    max_running_requests: int = 64,
    sampled_answers: int = 0,
    temperature: float = 0.8,
    seed: int = 0,
    engine=None,
    **engine_kw,
) -> list[Example]:
    """The target's greedy answer to each chat-formatted prompt, as training sequences, then
    `sampled_answers` more per prompt sampled at `temperature`: a few hundred prompts make
    too few tokens for a head, and the loss's labels are the target's own distributions at
    every position, so a sampled answer teaches as much as the greedy one. The greedy
    examples come first, in prompt order. Pass `engine` to reuse one (and its programs)."""
    ids = [chat_prompt_ids(model, p) for p in prompts]
    params = [jspec.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)] * len(ids)
    params += [
        jspec.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, seed=(seed * 1_000_003 + k * len(ids) + i) % 2**32
        )
        for k in range(sampled_answers)
        for i in range(len(ids))
    ]
    prompt_ids = ids * (1 + sampled_answers)
    engine = engine or jspec.Engine(model, max_running_requests=max_running_requests, **engine_kw)
    outs = engine.generate(prompt_ids, params)
    return [Example(list(p) + list(o.token_ids), len(p)) for p, o in zip(prompt_ids, outs)]


def speculation_check(model, spec, examples: Sequence[Example], max_new_tokens: int, **engine_kw) -> dict[str, Any]:
    """The held-out examples' prompts through the engine with a trained drafter (spec): its mean
    accept length, and how many greedy answers it left unchanged (it must leave all of them)."""
    outs = jspec.generate(
        model,
        [e.tokens[: e.prompt_len] for e in examples],
        max_new_tokens=max_new_tokens,
        speculative=spec,
        max_running_requests=len(examples),
        **engine_kw,
    )
    same = sum(o.token_ids == e.tokens[e.prompt_len :] for o, e in zip(outs, examples))
    return {
        "mean_accept_length": float(np.mean([o.mean_accept_length for o in outs])),
        "identical_outputs": f"{same}/{len(examples)}",
    }


def save_examples(
    path: str | os.PathLike, examples: Sequence[Example], vocab_size: int, meta: dict[str, Any] | None = None
) -> None:
    """Writes examples to one .npz (tokens concatenated, with offsets), so the target's answers
    can be generated once, on any machine, and trained on elsewhere (load_examples)."""
    lens = np.array([len(e.tokens) for e in examples], np.int64)
    np.savez_compressed(
        path,
        tokens=np.concatenate([np.asarray(e.tokens, np.int32) for e in examples]),
        offsets=np.concatenate([[0], np.cumsum(lens)]),
        prompt_lens=np.array([e.prompt_len for e in examples], np.int32),
        vocab_size=np.int64(vocab_size),
        meta=json.dumps(meta or {}),
    )


def load_examples(path: str | os.PathLike, vocab_size: int) -> tuple[list[Example], dict[str, Any]]:
    """(examples, meta) from save_examples' file; refuses a file made for another vocabulary."""
    with np.load(path) as f:
        tokens, offsets, prompt_lens = f["tokens"], f["offsets"], f["prompt_lens"]
        file_vocab, meta = int(f["vocab_size"]), json.loads(str(f["meta"]))
    if file_vocab != vocab_size or (tokens.size and int(tokens.max()) >= vocab_size):
        raise ValueError(f"{path}: examples of a {file_vocab}-token vocabulary, the target has {vocab_size}")
    if len(offsets) != len(prompt_lens) + 1 or np.any(prompt_lens >= np.diff(offsets)):
        raise ValueError(f"{path}: inconsistent offsets / prompt lengths")
    return [Example(tokens[a:b].tolist(), int(p)) for a, b, p in zip(offsets[:-1], offsets[1:], prompt_lens)], meta


class Batch(NamedTuple):
    tokens: np.ndarray  # [N, S] int32, right-padded with 0
    prompt_lens: np.ndarray  # [N] int32
    lengths: np.ndarray  # [N] int32, real tokens (<= S)


def pack_examples(examples: Sequence[Example], seq_len: int) -> Batch:
    """Pads (or truncates) every sequence to seq_len, so one compiled step serves all batches.
    Examples whose prompt leaves no room for a trained row (see row_masks) are dropped."""
    kept = [e for e in examples if e.prompt_len + 2 < min(len(e.tokens), seq_len)]
    if not kept:
        raise ValueError(f"no example has a response inside seq_len={seq_len} tokens; raise --seq-len")
    tokens = np.zeros((len(kept), seq_len), np.int32)
    lengths = np.zeros(len(kept), np.int32)
    for i, e in enumerate(kept):
        n = min(len(e.tokens), seq_len)
        tokens[i, :n] = e.tokens[:n]
        lengths[i] = n
    return Batch(tokens, np.array([e.prompt_len for e in kept], np.int32), lengths)


def batch_rows(rng: np.random.Generator, num_rows: int, batch_size: int) -> Iterator[np.ndarray]:
    """Endless batches of row indices, epoch after shuffled epoch (a set smaller than one batch
    repeated to fill it); the trainers draw one per step."""
    epoch = np.resize(np.arange(num_rows), max(num_rows, batch_size))
    while True:
        order = rng.permutation(epoch)
        for pos in range(0, len(order) - batch_size + 1, batch_size):
            yield order[pos : pos + batch_size]


def step_record(step: int, loss, t0: float, **per_row) -> dict[str, Any]:
    """A training history entry: the step, its loss, its per-row (or per-step) arrays rounded,
    the seconds since t0."""
    rounded = {name: np.asarray(v).round(4).tolist() for name, v in per_row.items()}
    return {"step": step, "loss": float(loss), **rounded, "elapsed_s": time.perf_counter() - t0}


def take(batch: Batch, rows: np.ndarray) -> Batch:
    return Batch(batch.tokens[rows], batch.prompt_lens[rows], batch.lengths[rows])


# ---------------------------------------------------------------------------
# Draft head: config, vocabulary, initialisation
# ---------------------------------------------------------------------------


def capture_layers_for(target: ModelConfig) -> tuple[int, ...]:
    """SGLang's default [2, L//2, L-3] (entering-layer convention); three distinct layers
    for targets too shallow for it."""
    return tiny_capture_layers(target.num_layers)


def draft_config_for(target: ModelConfig, draft_vocab_size: int | None = None) -> DraftConfig:
    """The head's DraftConfig: one layer with the target's shapes and RoPE, own lm_head."""
    return DraftConfig(
        algorithm="EAGLE3",
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        num_layers=1,
        capture_layers=capture_layers_for(target),
        fc_bias=False,
        has_embed=False,
        has_lm_head=True,
    )


def hot_tokens(batch: Batch, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """The draft vocabulary: the draft_vocab_size most frequent target tokens of the data
    (ties by id), sorted; all of the target's when the sizes are equal."""
    if draft_vocab_size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int32)
    real = np.arange(batch.tokens.shape[1])[None] < batch.lengths[:, None]
    counts = np.bincount(batch.tokens[real], minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")  # never-seen tokens fill up by id
    return np.sort(order[:draft_vocab_size]).astype(np.int32)


def init_draft_params(dcfg: DraftConfig, target_params, hot: np.ndarray, key: jax.Array) -> dict[str, Any]:
    """Random head (init_random_draft_params) whose lm_head starts as the target's own
    head restricted to the draft vocabulary, and d2t mapping draft id i to hot[i].

    Starting from the target's head puts the draft's output in the space the target
    reads its next token from, so the first steps are spent on the features rather
    than on learning an output embedding from nothing."""
    params = init_random_draft_params(dcfg, key, jnp.float32)
    head = target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T
    params["lm_head"] = jnp.asarray(head, jnp.float32)[:, jnp.asarray(hot)]
    params["d2t"] = jnp.asarray(hot - np.arange(len(hot)), jnp.int32)
    return params


# ---------------------------------------------------------------------------
# Attention with training-time-test key sources
# ---------------------------------------------------------------------------


def key_steps(seq_len: int, step: int) -> jax.Array:
    """[S, S] int32: for query row t and key row s, the TTT step whose K/V inference holds
    at s when it runs draft step `step` at t: max(0, step - (t - s)) (see the module docstring)."""
    t = jnp.arange(seq_len)[:, None]
    s = jnp.arange(seq_len)[None, :]
    return jnp.maximum(0, step - (t - s))


def ttt_attend(step: int, group: int, scale: float):
    """attend(q, k, v, prev) for draft_layers: causal attention of step `step`'s queries over the
    keys of steps 0..step (prev holds the (k, v) of earlier steps; the new pair is appended).
    Step 0 with no prev is plain causal attention (what the target pass uses too)."""

    def attend(q, k, v, prev):
        ks = [p[0] for p in prev] + [k]
        vs = [p[1] for p in prev] + [v]
        S = q.shape[0]
        src = key_steps(S, step)
        causal = jnp.tril(jnp.ones((S, S), bool))
        q32 = q.astype(jnp.float32) * scale
        scores = jnp.full((q.shape[1], S, S), -jnp.inf, jnp.float32)
        for i, ki in enumerate(ks):
            ki = jnp.repeat(ki, group, axis=1).astype(jnp.float32)
            si = jnp.einsum("qhd,khd->hqk", q32, ki)
            scores = jnp.where((causal & (src == i))[None], si, scores)
        p = jax.nn.softmax(scores, axis=-1)
        out = 0.0
        for i, vi in enumerate(vs):
            vi = jnp.repeat(vi, group, axis=1).astype(jnp.float32)
            out = out + jnp.einsum("hqk,khd->qhd", jnp.where((src == i)[None], p, 0.0), vi)
        return out.astype(q.dtype), tuple(prev) + ((k, v),)

    return attend


# ---------------------------------------------------------------------------
# Target and draft passes (one sequence; vmapped over the batch)
# ---------------------------------------------------------------------------


def target_pass(params, cfg: ModelConfig, tokens: jax.Array, capture_layers: tuple[int, ...]):
    """tokens [S] -> (logits [S, V] float32, features [S, C*H]): a dense causal forward whose
    features are the residual streams entering the capture layers (index L = the last layer's
    output before the final norm), concatenated low to high as speculative/eagle.py reads them."""
    if cfg.sliding_windows or cfg.attn_logit_softcap is not None or cfg.rope_layers or cfg.attention_sinks:
        raise NotImplementedError(
            "EAGLE-3 training over a target with sliding-window attention, attention logit "
            "soft-capping, attention sinks or NoPE layers is not implemented (the training pass attends densely)"
        )
    S = tokens.shape[0]
    x = embed_tokens(params, cfg, tokens)
    cos, sin = rope_cos_sin(cfg, jnp.arange(S))
    attend = ttt_attend(0, cfg.num_heads // cfg.num_kv_heads, cfg.sm_scale)

    def layer(x, lp):
        h = attention_input(cfg, lp, x)
        y, _ = decoder_layer(cfg, lp, x, h, cos, sin, attend, ())
        return y, x  # also emit the stream entering this layer

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        entering = []
        for lp in layers:
            x, e = layer(x, lp)
            entering.append(e)
        entering = jnp.stack(entering)
    else:
        x, entering = jax.lax.scan(layer, x, layers)
    streams = jnp.concatenate([entering, x[None]], axis=0)  # [L+1, S, H]
    feats = streams[jnp.asarray(capture_layers)]  # [C, S, H]
    feats = jnp.moveaxis(feats, 0, 1).reshape(S, -1)
    logits = compute_logits(params, cfg, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))
    return logits, feats


def shift_rows(x: jax.Array) -> jax.Array:
    """Row t <- row t-1 (row 0 gets zeros; no inference chain reaches it, see row_masks)."""
    return jnp.concatenate([jnp.zeros_like(x[:1]), x[:-1]], axis=0)


def draft_unroll(
    dparams, dcfg: DraftConfig, embed: jax.Array, tokens: jax.Array, feats: jax.Array, num_steps: int
) -> jax.Array:
    """tokens [S] (x_0..x_{S-1}), feats [S, 3H] -> the draft's pre-norm outputs [K, S, H].

    Row t reads token x_{t+1} at position t (the last row reads a pad token: it is never
    trained); see the module docstring for the hidden inputs and attention of each step."""
    if dcfg.num_layers != 1:
        raise ValueError("EAGLE-3 heads have one layer")
    S = tokens.shape[0]
    next_tokens = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)])
    cos, sin = rope_cos_sin(layer_config(dcfg), jnp.arange(S))
    group, scale = dcfg.num_heads // dcfg.num_kv_heads, 1.0 / math.sqrt(dcfg.head_dim)
    hidden = target_feature(dparams, dcfg, feats.astype(jnp.float32))
    kv: tuple = ()
    outs = []
    for j in range(num_steps):
        attend = ttt_attend(j, group, scale)
        out, kv = draft_layers(dparams, dcfg, embed, next_tokens, hidden, cos, sin, lambda i: attend, kv)
        outs.append(out)
        hidden = shift_rows(out)
    return jnp.stack(outs)


def row_masks(prompt_lens: jax.Array, lengths: jax.Array, seq_len: int, num_steps: int) -> jax.Array:
    """[B, K, S] bool: rows trained (and scored) at each step.

    Row t at step j starts its chain at position t-j; inference starts chains only at
    the last verified position, which is at least the prompt's last token (P-1), so
    t - j >= P - 1. Its label, the target's distribution at t+1, must sit under a real
    token that has a real successor: t + 2 <= length - 1."""
    t = jnp.arange(seq_len)[None, None, :]
    j = jnp.arange(num_steps)[None, :, None]
    P, n = prompt_lens[:, None, None], lengths[:, None, None]
    return (t - j >= P - 1) & (t + 2 <= n - 1)


# ---------------------------------------------------------------------------
# Loss and metrics
# ---------------------------------------------------------------------------


class StepMetrics(NamedTuple):
    loss: jax.Array  # scalar: weighted sum over steps
    step_loss: jax.Array  # [K] mean cross-entropy per step
    step_acc: jax.Array  # [K] top-1 agreement with the target per step
    ce: jax.Array  # [B, K, S] cross-entropy per row (meaningful where mask)
    correct: jax.Array  # [B, K, S] bool: draft top-1 == target top-1
    mask: jax.Array  # [B, K, S] bool


def ttt_outputs(
    dparams,
    dcfg: DraftConfig,
    target_params,
    tcfg: ModelConfig,
    hot: jax.Array,
    batch: Batch,
    num_steps: int,
    decay: float,
) -> StepMetrics:
    """The whole objective on one batch (target pass frozen)."""
    tokens = jnp.asarray(batch.tokens)
    B, S = tokens.shape
    tlogits, feats = jax.vmap(lambda x: target_pass(target_params, tcfg, x, dcfg.capture_layers))(tokens)
    tlogits, feats = jax.lax.stop_gradient(tlogits), jax.lax.stop_gradient(feats)
    # Row t's label is the target's distribution at position t+1.
    label_logits = jnp.concatenate([tlogits[:, 1:], jnp.zeros_like(tlogits[:, :1])], axis=1)
    full_vocab = dcfg.draft_vocab_size == dcfg.vocab_size  # then hot is the identity
    label_p = jax.nn.softmax(label_logits if full_vocab else label_logits[..., hot], axis=-1)  # [B, S, Vd]
    label_top = jnp.argmax(label_logits, axis=-1)  # [B, S] target ids

    embed = target_params["embed"].astype(jnp.float32)
    outs = jax.vmap(lambda x, f: draft_unroll(dparams, dcfg, embed, x, f, num_steps))(tokens, feats)  # [B, K, S, H]
    dlogits = draft_logits(dparams, dcfg, target_params, outs)  # [B, K, S, Vd]
    # -sum p log softmax(z) = logsumexp(z) - sum p z (p sums to 1): no [B, K, S, Vd] log-softmax kept.
    ce = jax.nn.logsumexp(dlogits, axis=-1) - jnp.einsum("bsv,bksv->bks", label_p, dlogits)  # [B, K, S]
    draft_top = jnp.argmax(dlogits, axis=-1)
    correct = (draft_top if full_vocab else hot[draft_top]) == label_top[:, None]

    mask = row_masks(jnp.asarray(batch.prompt_lens), jnp.asarray(batch.lengths), S, num_steps)
    count = jnp.maximum(jnp.sum(mask, axis=(0, 2)), 1)
    step_loss = jnp.sum(jnp.where(mask, ce, 0.0), axis=(0, 2)) / count
    step_acc = jnp.sum(mask & correct, axis=(0, 2)) / count
    weights = decay ** jnp.arange(num_steps, dtype=jnp.float32)
    return StepMetrics(jnp.sum(weights * step_loss), step_loss, step_acc, ce, correct, mask)


def simulate_accept_lengths(
    correct: np.ndarray, mask: np.ndarray, prompt_lens: np.ndarray, lengths: np.ndarray, num_steps: int | None = None
) -> np.ndarray:
    """Per sequence, the mean accept length (tokens emitted per verify iteration, as
    GenerationOutput.mean_accept_length counts them) of greedy chain speculation with K drafts,
    replayed from teacher-forced correctness [B, K, S]: prefill emits x_P; an iteration that
    starts at the last verified row s accepts the leading steps j whose row s+j is right and
    emits them plus the target's token, so the next one starts at s + accepted + 1. Draft step j
    at row s+j is right at inference exactly when it is right teacher-forced and steps 0..j-1
    were accepted (their tokens are then the target's), so this replays the engine; only the
    last iteration, which can run past the known response, is cut short. num_steps: drafts per
    iteration (--speculative-num-steps), at most the K trained."""
    K = correct.shape[1] if num_steps is None else num_steps
    ok = correct[:, :K] & mask[:, :K]
    S = ok.shape[2]
    out = np.zeros(len(lengths))
    for b, (P, n) in enumerate(zip(prompt_lens, lengths)):
        s, emitted, iters = P - 1, 0, 0
        while s + 2 <= n - 1:
            m = 0
            while m < K and s + m < S and ok[b, m, s + m]:
                m += 1
            emitted, iters, s = emitted + m + 1, iters + 1, s + m + 1
        out[b] = emitted / iters if iters else np.nan
    return out


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 4  # K: draft steps unrolled (covers --speculative-num-steps up to K)
    step_decay: float = 0.8
    draft_vocab_size: int = 0  # 0: the target's whole vocabulary
    seed: int = 0
    log_every: int = 50


class TrainResult(NamedTuple):
    dcfg: DraftConfig
    params: dict[str, Any]
    history: list[dict[str, Any]]


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = min(cfg.warmup_steps, max(cfg.steps // 10, 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.adamw(schedule, weight_decay=cfg.weight_decay))


def split_trainable(dparams: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
    """(float weights, d2t): d2t is the fixed vocabulary map, not a weight."""
    return {k: v for k, v in dparams.items() if k != "d2t"}, dparams["d2t"]


def make_steps(dcfg: DraftConfig, tcfg: ModelConfig, cfg: TrainConfig, optimizer):
    """(train_step, eval_step), jitted once: every batch has the same padded shape."""

    def objective(weights, d2t, target_params, hot, batch):
        m = ttt_outputs({**weights, "d2t": d2t}, dcfg, target_params, tcfg, hot, batch, cfg.ttt_steps, cfg.step_decay)
        return m.loss, m

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # weights and optimizer state are updated in place
    def train_step(weights, opt_state, d2t, target_params, hot, batch):
        (_, m), grads = jax.value_and_grad(objective, has_aux=True)(weights, d2t, target_params, hot, batch)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, (m.loss, m.step_loss, m.step_acc)

    @jax.jit
    def eval_step(weights, d2t, target_params, hot, batch):
        return objective(weights, d2t, target_params, hot, batch)[1]

    return train_step, eval_step


def evaluate(eval_step, weights, d2t, target_params, hot, data: Batch, batch_size: int) -> dict[str, Any]:
    """Teacher-forced metrics over all of `data` (padded up to whole batches)."""
    n = len(data.lengths)
    ces, corrects, masks = [], [], []
    for i in range(0, n, batch_size):
        rows = np.arange(i, i + batch_size) % n  # the last batch wraps; its repeats are dropped below
        keep = np.arange(i, i + batch_size) < n
        m = eval_step(weights, d2t, target_params, hot, take(data, rows))
        ces.append(np.asarray(m.ce)[keep])
        corrects.append(np.asarray(m.correct)[keep])
        masks.append(np.asarray(m.mask)[keep])
    ce, correct, mask = np.concatenate(ces), np.concatenate(corrects), np.concatenate(masks)
    count = np.maximum(mask.sum(axis=(0, 2)), 1)
    per_seq = simulate_accept_lengths(correct, mask, data.prompt_lens, data.lengths)
    return {
        "step_loss": (np.where(mask, ce, 0.0).sum(axis=(0, 2)) / count).tolist(),
        "step_acc": ((correct & mask).sum(axis=(0, 2)) / count).tolist(),
        "accept_length": float(np.nanmean(per_seq)),
        "accept_lengths": per_seq.tolist(),
        "rows": int(count[0]),
    }


def train_eagle3(model, data: Batch, cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Trains a head on packed sequences (pack_examples) of `model` (a jspec.Model)."""
    tcfg, target_params = model.cfg, model.params
    dcfg = draft_config_for(tcfg, cfg.draft_vocab_size or None)
    hot = hot_tokens(data, tcfg.vocab_size, dcfg.draft_vocab_size)
    dparams = init_draft_params(dcfg, target_params, hot, jax.random.key(cfg.seed))
    weights, d2t = split_trainable(dparams)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(weights)
    train_step, _ = make_steps(dcfg, tcfg, cfg, optimizer)
    hot_dev = jnp.asarray(hot)

    rng = np.random.default_rng(cfg.seed)
    # Epochs of shuffled rows; data smaller than a batch is repeated to fill one.
    batches = batch_rows(rng, len(data.lengths), cfg.batch_size)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        weights, opt_state, (loss, step_loss, step_acc) = train_step(
            weights, opt_state, d2t, target_params, hot_dev, take(data, next(batches))
        )
        if step == 1 or step % cfg.log_every == 0 or step == cfg.steps:
            rec = step_record(step, loss, t0, step_loss=step_loss, step_acc=step_acc)
            history.append(rec)
            log(f"step {step:5d}  loss {rec['loss']:.4f}  acc/step {fmt(rec['step_acc'])}  ({rec['elapsed_s']:.1f} s)")
    return TrainResult(dcfg, {**weights, "d2t": d2t}, history)


def evaluate_head(model, result: TrainResult, cfg: TrainConfig, data: Batch) -> dict[str, Any]:
    """Teacher-forced per-step top-1 agreement, loss and chain accept-length estimate on `data`."""
    weights, d2t = split_trainable(result.params)
    _, eval_step = make_steps(result.dcfg, model.cfg, cfg, make_optimizer(cfg))
    hot = jnp.arange(result.dcfg.draft_vocab_size, dtype=jnp.int32) + d2t
    return evaluate(eval_step, weights, d2t, model.params, hot, data, cfg.batch_size)


def fmt(xs: Sequence[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


# ---------------------------------------------------------------------------
# Saving: the published EAGLE-3 layout (+ orbax)
# ---------------------------------------------------------------------------


def eagle3_tensors(dparams: dict[str, Any], dcfg: DraftConfig) -> dict[str, np.ndarray]:
    """The draft pytree -> SafeAILab / SGLang tensor names in nn.Linear's [out, in] layout (the
    inverse of eagle_loader.convert_draft_params), float32; d2t int64 and t2d bool as released."""
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    lp = {k: np.asarray(v[0], np.float32) for k, v in dparams["layers"].items()}
    q, kv, I = dcfg.q_size, dcfg.kv_size, dcfg.intermediate_size
    wqkv, w_gate_up = lp["wqkv"], lp["w_gate_up"]
    p = "midlayer."
    t = {
        "fc.weight": f32(np.asarray(dparams["fc"]).T),
        p + "self_attn.q_proj.weight": f32(wqkv[:, :q].T),
        p + "self_attn.k_proj.weight": f32(wqkv[:, q : q + kv].T),
        p + "self_attn.v_proj.weight": f32(wqkv[:, q + kv :].T),
        p + "self_attn.o_proj.weight": f32(lp["wo"].T),
        p + "post_attention_layernorm.weight": f32(lp["mlp_norm"]),
        p + "mlp.gate_proj.weight": f32(w_gate_up[:, :I].T),
        p + "mlp.up_proj.weight": f32(w_gate_up[:, I:].T),
        p + "mlp.down_proj.weight": f32(lp["w_down"].T),
        p + "input_layernorm.weight": f32(lp["attn_norm"]),
        p + "hidden_norm.weight": f32(lp["hidden_norm"]),
        "norm.weight": f32(dparams["final_norm"]),
        "lm_head.weight": f32(np.asarray(dparams["lm_head"]).T),
    }
    d2t = np.asarray(dparams["d2t"]).astype(np.int64)
    t["d2t"] = d2t
    t2d = np.zeros(dcfg.vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    t["t2d"] = t2d
    return t


def save_head(
    out_dir: str | os.PathLike, result: TrainResult, target: ModelConfig, meta: dict[str, Any] | None = None
) -> str:
    """Writes the head so that load_draft_model and --speculative-draft-model-path read it
    (config.json + model.safetensors), the exact pytree with orbax (out_dir/params, read back
    by jspec.checkpoint.loader.restore_params), and train_meta.json (settings, curve, eval)."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    dcfg = result.dcfg
    hf = draft_hf_config(
        target,
        "EAGLE3",
        draft_vocab_size=dcfg.draft_vocab_size,
        capture_layers=dcfg.capture_layers,
        fc_bias=False,
        dtype="float32",
    )
    write_safetensors(out_dir, eagle3_tensors(result.params, dcfg))
    save_params(result.params, out_dir)
    with open(os.path.join(out_dir, "train_meta.json"), "w") as f:
        json.dump({"history": result.history, **(meta or {})}, f, indent=2)
    return write_draft_config(out_dir, hf)  # last: its presence means the directory is complete
