"""The worker of plain decoding: one token per request per decode."""

from __future__ import annotations

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.steps.plain import PlainState, init_plain_carry, plain_decode_step, plain_prefill_step
from jspec.worker.base import WorkerBase, _rows


class PlainWorker(WorkerBase):
    """No speculation: one token per request per decode."""

    kv_margin = 1
    max_emit = 1

    def __init__(self, cfg: ModelConfig, params, *, page_size: int, num_pages: int, max_slots: int, **kw):
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots, **kw)
        self.state = self._place(
            PlainState(
                create_kv_pool(cfg, int(num_pages), page_size, self.dtype),
                init_plain_carry(max_slots),
                init_penalty_state(max_slots, cfg.vocab_size),
            )
        )

    def prefill(
        self,
        chunks,
        following,
        slots,
        sampling,
        output_starts=None,
        first_chunks=None,
        with_prompt_logprobs=False,
        loras=None,
    ):
        batch, mode, next_tokens, _, slot_ids, counts = self._prefill_inputs(
            chunks, following, slots, output_starts, first_chunks
        )
        rows = _rows(sampling, slot_ids.shape[0])
        lora = self._prefill_loras(batch, chunks, loras)
        T = batch.tokens.shape[0]
        return self._launch(
            self._prefill_key(T, with_prompt_logprobs),
            lambda: (
                plain_prefill_step,
                dict(cfg=self.cfg, mode=mode, top_n=self.top_n, with_prompt_logprobs=with_prompt_logprobs),
                f"prefill T={T}{' prompt logprobs' if with_prompt_logprobs else ''}",
            ),
            (self.params, self.state, batch, next_tokens, slot_ids, counts, rows, lora),
        )

    def decode_arrays(self, slot_ids, page_tables, rows, mode: str, lora=None):
        """decode() on prebuilt (bucketed) arrays: the launch alone."""
        if lora is None and self.lora is not None:
            lora = self._decode_loras(slot_ids.shape[0], None)
        B = slot_ids.shape[0]
        return self._launch(
            ("decode", B, mode, self.top_n),
            lambda: (
                plain_decode_step,
                dict(cfg=self.cfg, backend=self.backend, top_n=self.top_n, sampling=mode),
                f"decode B={B} {mode}",
            ),
            (self.params, self.state, slot_ids, page_tables, rows, lora),
        )
