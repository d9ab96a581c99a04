"""DFlash test models: a permutation target with a hand-built drafter that is right for part
of every block, and a recorder of the block forwards the engine runs, checked against the
drafter's dense recompute from the request's committed tokens."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.dflash import dflash_config_for, init_random_dflash_params
from jspec.config.model import ModelConfig
from jspec.models.dflash import dense_block_hidden, draft_logits
from jspec.speculative.dflash import DFlashMethod
from jspec.train.eagle3 import target_pass

V, H, D = 32, 64, 16
MASK = V - 1  # never produced: the permutation keeps it to itself and prompts avoid it
TARGET = ModelConfig(
    family="llama",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=H,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=D,
    max_position_embeddings=256,
)
# Fixed points (a block there is right all the way), 2-cycles, a 3-cycle and a long cycle.
FIXED = (0, 1, 2)
PERM = list(FIXED) + [4, 3, 6, 5, 8, 9, 7] + list(range(11, 31)) + [10, MASK]


def permutation_target(seed: int = 0):
    """Greedy next token = PERM[current]: attention and MLP write nothing, the head reads the
    token's own one-hot axis. Every layer's stream is the token's embedding (the features)."""
    rng = np.random.default_rng(seed)
    L, qkv = TARGET.num_layers, TARGET.q_size + 2 * TARGET.kv_size
    head = np.zeros((H, V), np.float32)
    head[np.arange(V), PERM] = 1.0
    return {
        "embed": jnp.eye(V, H),
        "layers": {
            "attn_norm": jnp.ones((L, H)),
            "wqkv": jnp.asarray(rng.normal(size=(L, H, qkv)) * 0.1, jnp.float32),
            "wo": jnp.zeros((L, TARGET.q_size, H)),
            "mlp_norm": jnp.ones((L, H)),
            "w_gate_up": jnp.asarray(rng.normal(size=(L, H, 2 * H)) * 0.1, jnp.float32),
            "w_down": jnp.zeros((L, H, H)),
        },
        "final_norm": jnp.ones(H),
        "lm_head": jnp.asarray(head),
    }


def agreeing_drafter(block_size: int = 8, seed: int = 0):
    """A two-layer drafter whose every mask row drafts PERM[root]: right for the first draft
    always, for the whole block at a fixed point. Layer 0's mask queries find the root's key
    (scores +6 against the root, -6 against other masks, 0 against the context: the context
    keys live in RoPE planes the query has no part in) and copy its token axis through the
    values; the context still gets ~20% of the weight, and layer 1 (small random weights)
    attends to it too, so misplaced context keys or values change the logits."""
    rng = np.random.default_rng(seed)
    dcfg = dflash_config_for(TARGET, num_layers=2, block_size=block_size, mask_token_id=MASK, target_layer_ids=(0, 2))
    params = init_random_dflash_params(dcfg, jax.random.key(seed), std=0.02)
    lc = dcfg.layers
    q, kv = lc.q_size, lc.kv_size
    wqkv = np.zeros((H, q + 2 * kv), np.float32)
    tokens, context = np.arange(V), np.arange(V, H)  # residual axes: token one-hots, context features
    wqkv[tokens[:, None], np.arange(lc.num_heads)[None] * D + 7] = 1.0  # every query on RoPE dim 7 (slowest pair)
    for h in range(lc.num_kv_heads):
        wqkv[tokens, q + h * D + 7] = np.where(tokens == MASK, -1.0, 1.0)
        plane = [d for d in range(D) if d not in (7, 15)]
        wqkv[context[:, None], q + h * D + np.asarray(plane)[None]] = rng.normal(size=(len(context), len(plane)))
    wqkv[tokens, q + kv + tokens] = 1.0  # value index t = token t (kv head t // 16)
    wqkv[context, q + kv :] = rng.normal(size=(len(context), kv)) * 0.05
    wo = np.zeros((q, H), np.float32)
    wo[np.arange(D), np.arange(D)] = 1.0  # query head 0 reads kv head 0: tokens 0..15
    wo[2 * D + np.arange(D), D + np.arange(D)] = 1.0  # query head 2 reads kv head 1: tokens 16..31
    fc = np.zeros((dcfg.feature_size, H), np.float32)
    for c in range(len(dcfg.target_layer_ids)):
        fc[c * H + tokens[:, None], context[None]] = rng.normal(size=(V, len(context)))
    layers = dict(params["layers"])
    first = {
        "attn_norm": np.ones(H),
        "wqkv": wqkv,
        "q_norm": np.full(D, 1.25),
        "k_norm": np.full(D, 1.25),
        "wo": wo,
        "mlp_norm": np.ones(H),
        "w_gate_up": np.zeros((H, 2 * lc.intermediate_size)),
        "w_down": np.zeros((lc.intermediate_size, H)),
    }
    for name, value in first.items():
        layers[name] = layers[name].at[0].set(jnp.asarray(value, jnp.float32))
    hidden_norm = np.concatenate([np.zeros(V), np.ones(H - V)]).astype(np.float32)
    params = {**params, "fc": jnp.asarray(fc), "hidden_norm": jnp.asarray(hidden_norm), "final_norm": jnp.ones(H)}
    return dcfg, {**params, "layers": layers}


def prompts(lengths, last_tokens, seed=0):
    """Prompts of tokens 0..30 (never the mask) ending in the given tokens."""
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, V - 1, n - 1))) + [t] for n, t in zip(lengths, last_tokens)]


@contextlib.contextmanager
def recorded_blocks():
    """Records (positions [Q], tokens [Q], logits [Q, V]) of every real row (position > 0: a
    padding row drafts at 0) of every block forward run inside. jax.clear_caches() first, so
    that no program compiled earlier without the recording is reused."""
    records = []
    original = DFlashMethod.block_logits

    def keep(positions, tokens, logits, q):
        positions, tokens, logits = (np.asarray(a) for a in (positions, tokens, logits))
        for r in range(positions.shape[0] // q):
            rows = slice(r * q, (r + 1) * q)
            if positions[rows][0] > 0:
                records.append((positions[rows], tokens[rows], logits[rows]))

    def recording(self, params, dparams, dkv, block, backend):
        dkv, logits = original(self, params, dparams, dkv, block, backend)
        q = block.tokens.shape[0] // block.seq_lens.shape[0]
        jax.debug.callback(lambda p, t, lg: keep(p, t, lg, q), block.positions, block.tokens, logits)
        return dkv, logits

    jax.clear_caches()
    DFlashMethod.block_logits = recording
    try:
        yield records
    finally:
        DFlashMethod.block_logits = original


SEQ = 64  # every recomputed sequence is padded to this: one program for all of them


@functools.partial(jax.jit, static_argnames=("target_cfg", "dcfg", "q"))
def _dense_logits(target_params, dparams, sequence, n, *, target_cfg, dcfg, q):
    _, feats = target_pass(target_params, target_cfg, sequence, dcfg.capture_layers)
    block = jnp.concatenate([sequence[n][None], jnp.full((q - 1,), dcfg.mask_token_id, jnp.int32)])[None]
    h = dense_block_hidden(dparams, dcfg, target_params, feats, block, n[None])
    return draft_logits(target_params, dcfg, h[0])


def dense_logits(target_cfg, target_params, dcfg, dparams, sequence, n: int, q: int) -> np.ndarray:
    """The drafter's logits [q, V] for the block at n of `sequence` (its tokens 0..n-1
    committed, token n the root), recomputed from scratch: the context is every position
    before n (the target is causal, so the tokens after n change nothing there)."""
    padded = np.zeros(max(SEQ, len(sequence)), np.int32)
    padded[: len(sequence)] = sequence
    out = _dense_logits(
        target_params, dparams, jnp.asarray(padded), jnp.int32(n), target_cfg=target_cfg, dcfg=dcfg, q=q
    )
    return np.asarray(out)


def check_records(records, sequences, target_cfg, target_params, dcfg, dparams, atol=2e-4) -> int:
    """Every recorded block equals the dense recompute for a request it can belong to (one
    whose committed tokens reach its position and whose token there is its root). Rows of the
    overlap loop's lagging step, past the end of their request, are skipped. -> blocks checked."""
    checked, seen = 0, set()
    for positions, tokens, logits in records:
        n = int(positions[0])
        owners = [s for s in sequences if len(s) > n and s[n] == int(tokens[0])]
        key = (n, len(positions), logits.tobytes())
        if not owners or key in seen:
            continue
        seen.add(key)
        errors = [
            np.abs(dense_logits(target_cfg, target_params, dcfg, dparams, s, n, len(positions)) - logits).max()
            for s in owners
        ]
        assert min(errors) < atol, (n, errors)
        checked += 1
    return checked


def random_drafter(target_cfg, block_size=8, seed=3, **kw):
    dcfg = dflash_config_for(target_cfg, num_layers=2, block_size=block_size, **kw)
    return dcfg, init_random_dflash_params(dcfg, jax.random.key(seed), std=0.2)
