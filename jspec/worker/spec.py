"""The worker of speculative decoding, with any SpecMethod."""

from __future__ import annotations

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.batch import bucket
from jspec.layers.penalties import init_penalty_state
from jspec.speculative.method import init_spec_state, spec_decode_step, spec_prefill_step
from jspec.speculative.registry import shape_variants
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
        self.methods = shape_variants(method)  # one per draft shape; the device state is shared
        self.num_shapes = len(self.methods)
        self.dparams = lay_out_layers(dparams, self.layer_loop)
        if mesh is not None and self.dparams is not None:
            from jspec.distributed.tensor_parallel import replicate

            self.dparams = replicate(self.dparams, mesh)
        self.kv_margin = max(m.kv_margin for m in self.methods)
        self.max_emit = max(m.spec.num_steps for m in self.methods) + 1
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

    def step_weights(self) -> tuple:
        return (self.params, self.dparams)

    def step_statics(self, shape: int = 0) -> dict:
        return dict(cfg=self.cfg, method=self.methods[shape])

    def verify_tokens(self, B: int, shape: int, drafting_rows: int) -> int:
        N = self.methods[shape].spec.num_draft_tokens
        return B + min(bucket(max(drafting_rows, 1)), B) * (N - 1)

    def measure_costs(self, repeats: int = 5):
        """Each draft shape's decode time per row bucket, timed on scratch rows (they write only
        the scratch page and slot, at a one-token context): the adaptive policy's cost table."""
        import time

        import jax

        from jspec.config.sampling import SamplingParams
        from jspec.speculative.adaptive import CostTable

        greedy = (SamplingParams(), 0)
        seconds = {m.spec.shape: {} for m in self.methods}
        for B in self.decode_buckets():
            times = [[] for _ in self.methods]
            # Shapes in turn, so that a slow moment of the machine falls on all of them.
            for rep in range(repeats + 1):
                for shape in range(self.num_shapes):
                    t0 = time.perf_counter()
                    jax.block_until_ready(self.decode([self.scratch_slot] * B, [[0]] * B, [greedy] * B, shape=shape))
                    if rep:  # the first run may compile
                        times[shape].append(time.perf_counter() - t0)
            for m, t in zip(self.methods, times):
                seconds[m.spec.shape][B] = min(t)  # interference only adds time
        self._last_decode = None
        return CostTable(
            seconds, f"measured at warm-up ({self.num_shapes} shapes x {len(self.decode_buckets())} buckets)"
        )

    def prefill_step_tokens(self, next_tokens, finish_rows) -> tuple:
        return (next_tokens, finish_rows)  # the draft's first tokens, and its rows' finishing flags
