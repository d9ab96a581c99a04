"""The worker of plain decoding: one token per request per decode."""

from __future__ import annotations

import jax

from jspec.config.model import ModelConfig
from jspec.constrained.grammar import row_masks
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.steps.plain import (
    PlainState,
    init_plain_carry,
    plain_decode_forward,
    plain_decode_sample,
    plain_decode_step,
    plain_prefill_step,
)
from jspec.worker.base import PendingLaunch, WorkerBase, place_state


class PlainWorker(WorkerBase):
    """No speculation: one token per request per decode."""

    kv_margin = 1
    max_emit = 1
    prefill_step = staticmethod(plain_prefill_step)
    decode_step = staticmethod(plain_decode_step)
    supports_grammar = True
    mixes_decode_rows = True

    def __init__(self, cfg: ModelConfig, params, *, page_size: int, num_pages: int, max_slots: int, **kw):
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots, **kw)
        self.state = place_state(self.init_state(int(num_pages), max_slots), self.mesh)

    def init_state(self, num_pages: int, max_slots: int) -> PlainState:
        return PlainState(
            create_kv_pool(self.cfg, num_pages, self.page_size, self.kv_dtype),
            init_plain_carry(max_slots),
            init_penalty_state(max_slots, self.cfg.vocab_size),
        )

    def decode_masked(self, slot_ids, page_tables, rows, mode: str, lora, grammars, shape: int = 0):
        """The forward now; the sampling, masked, in the PendingLaunch: the device runs the
        forward while the host reads the previous step and advances the grammars."""
        B = slot_ids.shape[0]
        args = (self.params, self.state, slot_ids, page_tables, rows, lora)
        statics = dict(cfg=self.cfg, backend=self.backend)
        logits = self._launch(
            ("decode forward", B), lambda: (plain_decode_forward, statics, f"decode forward B={B}"), args
        )
        sample = (
            ("decode sample", B, mode, self.top_n),
            lambda: (plain_decode_sample, dict(top_n=self.top_n, sampling=mode), f"decode sample B={B} {mode}"),
        )
        if logits is None:  # warm-up records the programs: the sampling's logits have the forward's shape
            logits = jax.eval_shape(lambda *a: plain_decode_forward(*a, **statics), *args)[1]
            words = jax.ShapeDtypeStruct((B, -(-self.vocab_size // 32)), "int32")
            return self._launch(*sample, (self.state, logits, slot_ids, rows, words))

        def finish():
            masks = self._on_device(row_masks(grammars, self.vocab_size))
            return self._launch(*sample, (self.state, logits, slot_ids, rows, masks))

        return PendingLaunch(finish)
