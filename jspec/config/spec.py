"""Speculative decoding settings, named as SGLang's --speculative-* flags."""

from __future__ import annotations

import dataclasses

from jspec.config.fields import setting

SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, named as SGLang's --speculative-* flags.

    algorithm: --speculative-algorithm; draft_model_path: --speculative-draft-model-path;
    num_steps: --speculative-num-steps (draft depth); eagle_topk: --speculative-eagle-topk
    (branching per step); num_draft_tokens: --speculative-num-draft-tokens (tree nodes
    verified per iteration, the root included).

    NGRAM uses --speculative-num-draft-tokens (default 8) and SGLang's
    --speculative-ngram-{min,max}-match-window-size and --speculative-ngram-max-bfs-breadth:
    the tree is `breadth` chains of (num_draft_tokens - 1) // breadth tokens each, so
    num_steps and eagle_topk are derived from them (chain length and breadth).
    """

    algorithm: str = setting(
        "EAGLE",
        "EAGLE / EAGLE3 (draft head), STANDALONE (a small model of the same "
        "tokenizer), NGRAM (drafts copied from the request's own earlier tokens)",
        choices=SPEC_ALGORITHMS,
    )
    draft_model_path: str | None = setting(None, "local draft checkpoint (EAGLE head or standalone model)")
    num_steps: int = setting(3, "draft depth per iteration")
    eagle_topk: int = setting(1, "branching per draft step (1 = chain)")
    num_draft_tokens: int | None = setting(None, "tree nodes verified per iteration")
    ngram_min_match_window_size: int = setting(1, "NGRAM: shortest suffix match that proposes drafts")
    ngram_max_match_window_size: int = setting(12, "NGRAM: longest suffix compared")
    ngram_max_bfs_breadth: int = setting(1, "NGRAM: candidate continuations verified side by side (tree branches)")

    def __post_init__(self):
        if self.algorithm not in SPEC_ALGORITHMS:
            raise ValueError(f"unknown speculative algorithm {self.algorithm!r}; choose one of {SPEC_ALGORITHMS}")
        if self.algorithm == "NGRAM":
            self._derive_ngram_tree()
            return
        if self.num_steps < 1:
            raise ValueError(f"speculative num_steps must be >= 1, got {self.num_steps}")
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
