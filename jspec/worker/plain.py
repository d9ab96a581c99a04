"""The worker of plain decoding: one token per request per decode."""

from __future__ import annotations

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.steps.plain import PlainState, init_plain_carry, plain_decode_step, plain_prefill_step
from jspec.worker.base import WorkerBase


class PlainWorker(WorkerBase):
    """No speculation: one token per request per decode."""

    kv_margin = 1
    max_emit = 1
    prefill_step = staticmethod(plain_prefill_step)
    decode_step = staticmethod(plain_decode_step)

    def __init__(self, cfg: ModelConfig, params, *, page_size: int, num_pages: int, max_slots: int, **kw):
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots, **kw)
        self.state = self._place(
            PlainState(
                create_kv_pool(cfg, int(num_pages), page_size, self.kv_dtype),
                init_plain_carry(max_slots),
                init_penalty_state(max_slots, cfg.vocab_size),
            )
        )
