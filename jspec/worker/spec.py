"""The worker of speculative decoding, with any SpecMethod."""

from __future__ import annotations

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.speculative.method import init_spec_state, spec_decode_step, spec_prefill_step
from jspec.worker.base import WorkerBase, lay_out_layers


class SpecWorker(WorkerBase):
    """Speculative decoding with any SpecMethod (speculative/registry.py builds it from a SpecConfig):
    the target pool, the method's draft state and the speculative carry."""

    prefill_step = staticmethod(spec_prefill_step)
    decode_step = staticmethod(spec_decode_step)

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
                create_kv_pool(cfg, int(num_pages), page_size, self.kv_dtype),
                max_slots,
                int(num_pages),
                page_size,
                self.dtype,
                init_penalty_state(max_slots, cfg.vocab_size),
            )
        )

    def step_weights(self) -> tuple:
        return (self.params, self.dparams)

    def step_statics(self) -> dict:
        return dict(cfg=self.cfg, method=self.method)

    def prefill_step_tokens(self, next_tokens, finish_rows) -> tuple:
        return (next_tokens, finish_rows)  # the draft's first tokens, and its rows' finishing flags
