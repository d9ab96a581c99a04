"""EAGLE-2 style beam drafting for any draft whose forward can attend through a closure.

Each of num_steps - 1 steps runs the draft once over topk beams: a beam at depth i
sits at position prefix_len + i - 1, attends to the draft's paged prefix (positions
< prefix_len) merged by log-sum-exp with its own ancestors, whose K/V live in a small
dense buffer (never in the pool, since most beams are discarded). EAGLE heads and
STANDALONE draft models share this loop; they differ only in `step_fn`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec.kvcache.pool import KVPool
from jspec.layers.attention import (
    dense_attention_with_lse,
    merge_attention,
    mla_decode_with_lse,
    paged_decode_with_lse,
)
from jspec.speculative.tree import DraftTree, append_step, build_tree, expand_beams, start_candidates

# step_fn(tokens [B*K], beam_state [B*K, ...], positions [B*K], attend_for_layer, anc)
#   -> (probs [B*K, K], token ids [B*K, K], new beam_state [B*K, ...], anc)
StepFn = Callable[..., tuple[jax.Array, jax.Array, Any, Any]]


def grow_beam_tree(
    root: jax.Array,
    topk_p: jax.Array,
    topk_ids: jax.Array,
    beam_state: jax.Array,
    prefix_len: jax.Array,
    page_tables: jax.Array,
    draft_kv: KVPool,
    step_fn: StepFn,
    *,
    num_steps: int,
    num_draft_tokens: int,
    backend: str,
    latent_values: int = 0,
    sm_scale: float | None = None,
) -> DraftTree:
    """root [B]; topk_p / topk_ids [B, K]: the draft's top-k after the root (step 0);
    beam_state [B, ...]: what each beam carries into its next forward (EAGLE: its hidden state).
    latent_values > 0: a latent-attention draft (MLA, absorbed queries), whose pool's V is
    empty and whose values are the first latent_values columns of its keys. sm_scale: None is
    1/sqrt(the key width)."""
    B, K = topk_p.shape
    L, _, _, Hkv, D = draft_kv.k.shape
    cands = start_candidates(topk_p, topk_ids)
    state = jnp.broadcast_to(beam_state[:, None], (B, K, *beam_state.shape[1:]))
    anc_shape = (L, B, K, max(num_steps - 1, 1), Hkv)
    anc = (
        jnp.zeros((*anc_shape, D), draft_kv.k.dtype),
        jnp.zeros((*anc_shape, draft_kv.v.shape[-1]), draft_kv.k.dtype),
    )
    beam_pages = jnp.repeat(page_tables, K, axis=0)
    beam_prefix = jnp.repeat(prefix_len, K)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale

    def mla_prefix(q, latent, _empty_v, layer, lens, tables, *, sm_scale, backend):
        return mla_decode_with_lse(
            q, latent, layer, lens, tables, kv_lora_rank=latent_values, sm_scale=sm_scale, backend=backend
        )

    for i in range(1, num_steps):

        def attend_for_layer(li, i=i):
            def attend(q, k_new, v_new, anc):
                ak = anc[0].at[li, :, :, i - 1].set(k_new.reshape(B, K, *k_new.shape[1:]))
                av = anc[1].at[li, :, :, i - 1].set(v_new.reshape(B, K, *v_new.shape[1:]))
                prefix_attention = mla_prefix if latent_values else paged_decode_with_lse
                out_p, lse_p = prefix_attention(
                    q,
                    draft_kv.k,
                    draft_kv.v,
                    jnp.int32(li),
                    beam_prefix,
                    beam_pages,
                    sm_scale=sm_scale,
                    backend=backend,
                )
                lk = ak[li].reshape(B * K, *ak.shape[3:])
                lv = av[li].reshape(B * K, *av.shape[3:])
                if latent_values:
                    lv = lk[..., :latent_values]
                visible = jnp.broadcast_to(jnp.arange(lk.shape[1]) < i, (B * K, lk.shape[1]))
                out_l, lse_l = dense_attention_with_lse(q, lk, lv, visible, sm_scale=sm_scale)
                return merge_attention(out_p, lse_p, out_l, lse_l).astype(q.dtype), (ak, av)

            return attend

        p, ids, new_state, anc = step_fn(
            cands.beam_tokens.reshape(B * K),
            state.reshape(B * K, *state.shape[2:]),
            beam_prefix + (i - 1),
            attend_for_layer,
            anc,
        )
        step = expand_beams(cands.beam_scores, p.reshape(B, K, K), ids.reshape(B, K, K))
        cands = append_step(cands, step)
        # New beams continue from their parents: carry the parents' state and ancestors.
        parent = step.beam_parent
        new_state = new_state.reshape(B, K, *new_state.shape[1:])
        state = jnp.take_along_axis(new_state, parent.reshape(B, K, *([1] * (new_state.ndim - 2))), axis=1)
        anc = tuple(jnp.take_along_axis(a, parent[None, :, :, None, None, None], axis=2) for a in anc)
    return build_tree(cands.scores, cands.tokens, cands.parents, root, num_draft_tokens)
