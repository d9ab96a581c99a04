"""The speculative-method interface: what a method keeps on the device and does inside the
steps every method runs through (speculative/steps.py).

A method (EAGLE / EAGLE-3, STANDALONE, NGRAM) says:
- what device state it keeps beside the target's: `draft` (a draft KV pool, a token
  history, ...) and per-slot `extra` carry (the draft's top-k and hidden state, ...);
- what its prefill adds after the target's prefill forward;
- how it proposes the verify tree from the carry (on the device, inside the iteration);
- how its draft state follows the accepted tokens.
Everything else (the target forward over the tree, penalties, acceptance, logprobs, KV
moves, the FutureMap carry and the scheduler) is shared and never names a method.

Methods are frozen dataclasses, hashable, passed to the steps as static arguments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.spec import SpecConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.penalties import PenaltyState
from jspec.models.common import ForwardOutput
from jspec.speculative.tree import DraftTree
from jspec.speculative.verify import Verified


class SpecCarry(NamedTuple):
    """Per request slot; the last slot is scratch for padded batch rows.

    Carry convention (as steps/plain.py): the target KV holds positions 0..seq_len-1 and
    next_token = x_{seq_len} is the last verified token, the root of the next tree.
    """

    next_token: jax.Array  # [slots+1] int32
    seq_len: jax.Array  # [slots+1] int32
    extra: Any  # the method's per-slot carry: a pytree of [slots+1, ...] arrays


class SpecState(NamedTuple):
    target_kv: KVPool
    draft: Any  # the method's own device state (draft KV pool, token history, ...)
    carry: SpecCarry
    penalties: PenaltyState


class PrefillContext(NamedTuple):
    """What a method's prefill sees of the target's prefill."""

    batch: ForwardBatch
    mode: AttentionMode
    out: ForwardOutput  # the target's forward (hidden / captured layers of every token)
    next_tokens: jax.Array  # [T] the token after each token (the sampled first token at a prompt's end)
    first: jax.Array  # [B] sampled first tokens
    slot_ids: jax.Array  # [B] slot of each row whose prompt ends here, else the scratch slot
    token_slots: jax.Array  # [T] slot of each token's request (scratch for padding)


class SpecMethod:
    """Base of every method. Subclasses are frozen dataclasses with a `spec: SpecConfig` field."""

    spec: SpecConfig

    @property
    def chain(self) -> bool:
        """Static: node i of every proposed tree sits at depth i."""
        return self.spec.num_draft_tokens == self.spec.num_steps + 1 and self.spec.eagle_topk == 1

    @property
    def kv_margin(self) -> int:
        """Target KV positions past the verified length that one iteration may write."""
        return max(self.spec.num_draft_tokens, self.spec.num_steps + 1)

    capture_layers: tuple[int, ...] = ()  # target layers whose input the method reads (EAGLE-3)

    def draft_kv_bytes_per_page(self, page_size: int, dtype) -> int:
        """Bytes the method's draft state takes per KV page (sizes the shared page budget)."""
        return 0

    def init_draft(self, num_slots: int, num_pages: int, page_size: int, dtype) -> Any:
        raise NotImplementedError

    def init_extra(self, num_slots: int, dtype) -> Any:
        return ()

    def prefill(self, params, dparams, draft, ctx: PrefillContext) -> tuple[Any, Any]:
        """-> (draft, extra rows for ctx.slot_ids)."""
        raise NotImplementedError

    def propose(
        self, params, dparams, draft, c: SpecCarry, page_tables, slot_ids, backend: str
    ) -> tuple[Any, DraftTree]:
        """Gathered carry c (rows of this batch) -> (draft, the verify tree rooted at c.next_token)."""
        raise NotImplementedError

    def update(
        self, params, dparams, draft, c: SpecCarry, v: Verified, page_tables, slot_ids, backend: str
    ) -> tuple[Any, Any]:
        """After acceptance -> (draft, new extra rows for this batch)."""
        raise NotImplementedError


def init_spec_state(
    method: SpecMethod,
    target_kv: KVPool,
    num_slots: int,
    num_pages: int,
    page_size: int,
    dtype,
    penalties: PenaltyState,
) -> SpecState:
    n = num_slots + 1
    carry = SpecCarry(jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), method.init_extra(num_slots, dtype))
    return SpecState(target_kv, method.init_draft(num_slots, num_pages, page_size, dtype), carry, penalties)
