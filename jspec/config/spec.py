"""Speculative decoding settings, named as SGLang's --speculative-* flags."""

from __future__ import annotations

import dataclasses

from jspec.config.fields import setting

SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "NEXTN", "DFLASH")
# What --speculative-adaptive picks from by default: trees and chains for the step-by-step
# drafters, shorter blocks for the block drafter (steps,topk,draft_tokens; 0,1,1 is off).
ADAPTIVE_SHAPES = "5,4,8 3,1,4 1,1,2 0,1,1"
DFLASH_ADAPTIVE_SHAPES = "7,1,8 3,1,4 0,1,1"


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, named as SGLang's --speculative-* flags.

    algorithm: --speculative-algorithm; draft_model_path: --speculative-draft-model-path (a
    directory or a Hub repo id, at draft_model_revision);
    num_steps: --speculative-num-steps (draft depth); eagle_topk: --speculative-eagle-topk
    (branching per step); num_draft_tokens: --speculative-num-draft-tokens (tree nodes
    verified per iteration, the root included).

    NGRAM uses --speculative-num-draft-tokens (default 8) and SGLang's
    --speculative-ngram-{min,max}-match-window-size and --speculative-ngram-max-bfs-breadth:
    the tree is `breadth` chains of (num_draft_tokens - 1) // breadth tokens each, so
    num_steps and eagle_topk are derived from them (chain length and breadth). DFLASH drafts
    one chain per block of num_draft_tokens (the root and num_draft_tokens - 1 masks): its
    num_steps is derived, and None is the drafter's trained block (speculative/dflash.py).

    num_steps=0 (num_draft_tokens 1) verifies the root alone: one token per iteration, the
    draft's state still kept current, so speculation can resume losslessly. With
    --speculative-adaptive the engine picks each iteration's draft shape among
    adaptive_shapes and this config's own (speculative/adaptive.py).
    """

    algorithm: str = setting(
        "EAGLE",
        "EAGLE / EAGLE3 (draft head), STANDALONE (a small model of the same "
        "tokenizer), NGRAM (drafts copied from the request's own earlier tokens), NEXTN (the target "
        "checkpoint's own multi-token-prediction layer, DeepSeek-V3), DFLASH (a block drafter: one "
        "non-causal forward drafts a chain)",
        choices=SPEC_ALGORITHMS,
        group="speculative",
    )
    draft_model_path: str | None = setting(
        None,
        "the draft checkpoint (EAGLE head, DFlash drafter or standalone model): a directory or a Hugging Face "
        "Hub repo id",
        group="speculative",
    )
    draft_model_revision: str | None = setting(
        None, "the draft's Hub revision (branch, tag or commit; default: main)", group="speculative"
    )
    num_steps: int = setting(3, "draft depth per iteration", group="speculative")
    eagle_topk: int = setting(1, "branching per draft step (1 = chain)", group="speculative")
    num_draft_tokens: int | None = setting(
        None, "tree nodes verified per iteration (DFLASH: the block, default the drafter's own)", group="speculative"
    )
    ngram_min_match_window_size: int = setting(
        1, "NGRAM: shortest suffix match that proposes drafts", group="speculative"
    )
    ngram_max_match_window_size: int = setting(12, "NGRAM: longest suffix compared", group="speculative")
    ngram_max_bfs_breadth: int = setting(
        1, "NGRAM: candidate continuations verified side by side (tree branches)", group="speculative"
    )
    adaptive: bool = setting(
        False,
        "pick the draft shape per iteration from the batch size and the measured acceptance (0 steps = off)",
        group="speculative",
    )
    adaptive_shapes: str | None = setting(
        None,
        "the shapes --speculative-adaptive picks from: steps,topk,draft_tokens each, space-separated; "
        "0,1,1 verifies the root alone (speculation off); default: shorter chains for DFLASH "
        f"({DFLASH_ADAPTIVE_SHAPES}), else {ADAPTIVE_SHAPES}",
        group="speculative",
    )
    adaptive_cost_table: str | None = setting(
        None,
        "JSON of each shape's iteration time per batch bucket (benchmarks.bench_adaptive writes one); "
        "default: measured at warm-up",
        group="speculative",
    )

    def __post_init__(self):
        if self.algorithm not in SPEC_ALGORITHMS:
            raise ValueError(f"unknown speculative algorithm {self.algorithm!r}; choose one of {SPEC_ALGORITHMS}")
        if self.adaptive_shapes is None:
            # A block drafter drafts one chain: its shorter blocks, not trees, are its other shapes.
            default = DFLASH_ADAPTIVE_SHAPES if self.algorithm == "DFLASH" else ADAPTIVE_SHAPES
            object.__setattr__(self, "adaptive_shapes", default)
        if self.adaptive:
            self.shapes()  # fails early on a malformed list
        if self.num_draft_tokens == 1 or (self.num_steps == 0 and self.algorithm not in ("NGRAM", "DFLASH")):
            if (self.num_steps, self.eagle_topk, self.num_draft_tokens) not in ((0, 1, 1), (0, 1, None)):
                raise ValueError(
                    "a root-only shape (speculation off) is num_steps=0, eagle_topk=1, num_draft_tokens=1; "
                    f"got {self.num_steps},{self.eagle_topk},{self.num_draft_tokens}"
                )
            object.__setattr__(self, "num_draft_tokens", 1)
            return
        if self.algorithm == "NGRAM":
            self._derive_ngram_tree()
            return
        if self.algorithm == "DFLASH":
            self._derive_dflash_chain()
            return
        if self.num_steps < 1:
            raise ValueError(f"speculative num_steps must be >= 0, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"speculative eagle_topk must be >= 1, got {self.eagle_topk}")
        if self.eagle_topk == 1:
            # A chain has exactly one node per step plus the root; SGLang forces the same.
            if self.num_draft_tokens not in (None, self.num_steps + 1):
                raise ValueError(
                    f"with eagle_topk=1 num_draft_tokens must be num_steps + 1 = {self.num_steps + 1}, "
                    f"got {self.num_draft_tokens}"
                )
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        else:
            k, s = self.eagle_topk, self.num_steps
            max_nodes = 1 + k + (s - 1) * k * k
            if self.num_draft_tokens is None:
                raise ValueError("num_draft_tokens is required when eagle_topk > 1")
            if not 2 <= self.num_draft_tokens <= max_nodes:
                raise ValueError(
                    f"num_draft_tokens must be in [2, {max_nodes}] for num_steps={s}, eagle_topk={k} "
                    f"(root + {max_nodes - 1} candidates), got {self.num_draft_tokens}"
                )

    def _derive_ngram_tree(self) -> None:
        lo, hi, b = self.ngram_min_match_window_size, self.ngram_max_match_window_size, self.ngram_max_bfs_breadth
        if not 1 <= lo <= hi:
            raise ValueError(f"ngram match windows need 1 <= min ({lo}) <= max ({hi})")
        n = 8 if self.num_draft_tokens is None else self.num_draft_tokens
        if b < 1:
            raise ValueError(f"ngram_max_bfs_breadth must be >= 1, got {b}")
        if n < 1 + b:
            raise ValueError(f"num_draft_tokens={n} leaves no room for {b} ngram chains (need >= {1 + b})")
        length = (n - 1) // b
        object.__setattr__(self, "num_steps", length)
        object.__setattr__(self, "eagle_topk", b)
        object.__setattr__(self, "num_draft_tokens", 1 + b * length)

    def _derive_dflash_chain(self) -> None:
        if self.eagle_topk != 1:
            raise ValueError(
                f"DFLASH drafts one chain per block: eagle_topk (and each adaptive shape's topk) must be 1, "
                f"got {self.eagle_topk}"
            )
        if self.num_draft_tokens is not None:
            object.__setattr__(self, "num_steps", self.num_draft_tokens - 1)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(num_steps, eagle_topk, num_draft_tokens): the draft tree's shape."""
        return (self.num_steps, self.eagle_topk, self.num_draft_tokens)

    def with_shape(self, shape: tuple[int, int, int]) -> SpecConfig:
        """This config with another draft shape (NGRAM: topk is the breadth, steps the chain length)."""
        steps, topk, tokens = shape
        if self.algorithm == "NGRAM" and tokens > 1:
            return dataclasses.replace(self, num_draft_tokens=tokens, ngram_max_bfs_breadth=topk, adaptive=False)
        return dataclasses.replace(self, num_steps=steps, eagle_topk=topk, num_draft_tokens=tokens, adaptive=False)

    def shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The draft shapes an iteration may run: this config's own first, then adaptive_shapes
        (each checked by building its config); just its own without --speculative-adaptive."""
        if not self.adaptive:
            return (self.shape,)
        out = [self.shape]
        for item in self.adaptive_shapes.split():
            try:
                parts = tuple(int(x) for x in item.split(","))
            except ValueError:
                parts = ()
            if len(parts) != 3:
                raise ValueError(f"adaptive shape {item!r} is not steps,topk,draft_tokens (e.g. 3,1,4 or 0,1,1)")
            shape = self.with_shape(parts).shape
            if shape not in out:
                out.append(shape)
        return tuple(out)
