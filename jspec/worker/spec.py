"""The worker of speculative decoding, with any SpecMethod."""

from __future__ import annotations

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.speculative.method import init_spec_state, spec_decode_step, spec_prefill_step
from jspec.worker.base import WorkerBase, _rows, lay_out_layers


class SpecWorker(WorkerBase):
    """Speculative decoding with any SpecMethod (speculative/registry.py builds it from a SpecConfig):
    the target pool, the method's draft state and the speculative carry."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        method,
        dparams,
        *,
        page_size: int,
        num_pages: int,
        max_slots: int,
        mesh=None,
        **kw,
    ):
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots, mesh=mesh, **kw)
        self.method, self.spec = method, method.spec
        self.dparams = lay_out_layers(dparams, self.layer_loop)
        if mesh is not None and self.dparams is not None:
            from jspec.distributed.tensor_parallel import replicate

            self.dparams = replicate(self.dparams, mesh)
        self.kv_margin = method.kv_margin
        self.max_emit = method.spec.num_steps + 1
        self.state = self._place(
            init_spec_state(
                method,
                create_kv_pool(cfg, int(num_pages), page_size, self.dtype),
                max_slots,
                int(num_pages),
                page_size,
                self.dtype,
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
        batch, mode, draft_tokens, finish_rows, slot_ids, counts = self._prefill_inputs(
            chunks, following, slots, output_starts, first_chunks
        )
        rows = _rows(sampling, slot_ids.shape[0])
        lora = self._prefill_loras(batch, chunks, loras)
        T = batch.tokens.shape[0]
        return self._launch(
            self._prefill_key(T, with_prompt_logprobs),
            lambda: (
                spec_prefill_step,
                dict(
                    cfg=self.cfg,
                    method=self.method,
                    mode=mode,
                    top_n=self.top_n,
                    with_prompt_logprobs=with_prompt_logprobs,
                ),
                f"prefill T={T}{' prompt logprobs' if with_prompt_logprobs else ''}",
            ),
            (self.params, self.dparams, self.state, batch, draft_tokens, finish_rows, slot_ids, counts, rows, lora),
        )

    def decode_arrays(self, slot_ids, page_tables, rows, mode: str, lora=None):
        """decode() on prebuilt (bucketed) arrays: the launch alone."""
        if lora is None and self.lora is not None:
            lora = self._decode_loras(slot_ids.shape[0], None)
        B = slot_ids.shape[0]
        return self._launch(
            ("decode", B, mode, self.top_n),
            lambda: (
                spec_decode_step,
                dict(cfg=self.cfg, method=self.method, backend=self.backend, top_n=self.top_n, sampling=mode),
                f"decode B={B} {mode}",
            ),
            (self.params, self.dparams, self.state, slot_ids, page_tables, rows, lora),
        )
