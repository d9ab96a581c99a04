"""The worker of speculative decoding, with any SpecMethod."""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from jspec.config.model import ModelConfig
from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import tree_masks
from jspec.distributed.tensor_parallel import replicate
from jspec.kvcache.pool import create_kv_pool
from jspec.layers.batch import bucket
from jspec.layers.penalties import init_penalty_state
from jspec.speculative.adaptive import CostTable
from jspec.speculative.method import init_spec_state
from jspec.speculative.registry import shape_variants
from jspec.speculative.steps import spec_decode_step, spec_prefill_step, spec_propose_step, spec_verify_step
from jspec.worker.base import PendingLaunch, WorkerBase, lay_out_layers, place_state


class SpecWorker(WorkerBase):
    """Speculative decoding with any SpecMethod (speculative/registry.py builds it from a SpecConfig):
    the target pool, the method's draft state and the speculative carry."""

    prefill_step = staticmethod(spec_prefill_step)
    decode_step = staticmethod(spec_decode_step)
    supports_grammar = True

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
            self.dparams = replicate(self.dparams, mesh)
        self.kv_margin = max(m.kv_margin for m in self.methods)
        self.max_emit = max(m.spec.num_steps for m in self.methods) + 1
        self.state = place_state(self.init_state(int(num_pages), max_slots), self.mesh)

    def init_state(self, num_pages: int, max_slots: int):
        return init_spec_state(
            self.method,
            create_kv_pool(self.cfg, num_pages, self.page_size, self.kv_dtype),
            max_slots,
            num_pages,
            self.page_size,
            self.dtype,
            init_penalty_state(max_slots, self.cfg.vocab_size),
        )

    def step_weights(self) -> tuple:
        return (self.params, self.dparams)

    def step_statics(self, shape: int = 0) -> dict:
        return dict(cfg=self.cfg, method=self.methods[shape])

    def verify_tokens(self, B: int, shape: int, drafting_rows: int) -> int:
        N = self.methods[shape].spec.num_draft_tokens
        return B + min(bucket(max(drafting_rows, 1)), B) * (N - 1)

    def measure_costs(self, repeats: int = 5, ragged: bool = False):
        """Each draft shape's decode time per row bucket, timed on scratch rows (they write only
        the scratch page and slot, at a one-token context): the adaptive policy's cost table.
        ragged: also each drafting shape with d < B rows drafting (d a power of two), the others
        verifying their root alone (a program per (shape, bucket, d))."""
        greedy = (SamplingParams(), 0)
        seconds = {m.spec.shape: {} for m in self.methods}
        partial = {}
        for B in self.buckets.decode_buckets():
            variants = [(shape, None) for shape in range(self.num_shapes)]
            if ragged:
                drafting_shapes = [i for i, m in enumerate(self.methods) if m.spec.num_steps > 0]
                variants += [(i, 1 << k) for i in drafting_shapes for k in range(B.bit_length() - 1)]
            times = {v: [] for v in variants}
            # Variants in turn, so that a slow moment of the machine falls on all of them.
            for rep in range(repeats + 1):
                for shape, d in variants:
                    drafting = None if d is None else [r < d for r in range(B)]
                    t0 = time.perf_counter()
                    out = self.decode([self.scratch_slot] * B, [[0]] * B, [greedy] * B, shape=shape, drafting=drafting)
                    jax.block_until_ready(out)
                    if rep:  # the first run may compile
                        times[(shape, d)].append(time.perf_counter() - t0)
            for (shape, d), t in times.items():
                # The least of the runs: interference only adds time.
                if d is None:
                    seconds[self.methods[shape].spec.shape][B] = min(t)
                else:
                    partial[(self.methods[shape].spec.shape, B, d)] = min(t)
        self.last_decode = None
        buckets = len(self.buckets.decode_buckets())
        return CostTable(seconds, f"measured at warm-up ({self.num_shapes} shapes x {buckets} buckets)", partial)

    def prefill_step_tokens(self, next_tokens, finish_rows) -> tuple:
        return (next_tokens, finish_rows)  # the draft's first tokens, and its rows' finishing flags

    def decode_masked(self, slot_ids, page_tables, rows, mode: str, lora, grammars, shape: int = 0):
        """The proposal now; in the PendingLaunch, the read of its tree, every node masked by the
        grammar state of its path (constrained.grammar.tree_masks), and verification. shape:
        the draft shape (adaptive speculation); every row verifies its tree."""
        if self.host_read is None:
            raise RuntimeError("SpecWorker.host_read (the engine's designated read) is not set")
        B = slot_ids.shape[0]
        statics = dict(self.step_statics(shape), backend=self.backend)
        args = (*self.step_weights(), self.state, slot_ids, page_tables)
        tree = self._launch(("propose", B, shape), lambda: (spec_propose_step, statics, f"propose B={B}"), args)
        vstatics = dict(self.step_statics(shape), backend=self.backend, top_n=self.top_n, sampling=mode)
        verify = (
            ("verify", B, mode, self.top_n, shape),
            lambda: (spec_verify_step, vstatics, f"verify B={B} {mode} masked" + (f" shape {shape}" if shape else "")),
        )
        if tree is None:
            # Warm-up records the programs: the verify program's tree has the proposal's shapes.
            tree = jax.eval_shape(functools.partial(spec_propose_step, **statics), *args)[1]
            masks = jax.ShapeDtypeStruct((B, tree.tokens.shape[1], -(-self.vocab_size // 32)), np.int32)
            return self._launch(
                *verify, (*self.step_weights(), self.state, tree, slot_ids, page_tables, rows, lora, masks)
            )

        def finish():
            tokens, parents = self.host_read((tree.tokens, tree.parents))
            tokens = np.array(tokens)  # a copy: on the CPU the read is a view of the device buffer
            masks = tree_masks(grammars, tokens, parents, self.vocab_size)
            # Drafts the grammar refuses where it forces one token now carry that token.
            verified = tree._replace(tokens=tokens)
            if self.mesh is None:
                masks, verified = jax.device_put((masks, verified))
            return self._launch(
                *verify, (*self.step_weights(), self.state, verified, slot_ids, page_tables, rows, lora, masks)
            )

        return PendingLaunch(finish)
