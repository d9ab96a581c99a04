"""SGLang's --speculative-* command-line flags, shared by scripts/generate.py and the server."""

from __future__ import annotations

import argparse

from jspec.config.spec import SPEC_ALGORITHMS, SpecConfig


def add_speculative_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("speculative decoding (SGLang's flag names)")
    g.add_argument("--speculative-algorithm", choices=SPEC_ALGORITHMS,
                   help="EAGLE / EAGLE3 (draft head), STANDALONE (a small model of the same tokenizer), "
                        "NGRAM (drafts copied from the request's own earlier tokens)")
    g.add_argument("--speculative-draft-model-path", help="local draft checkpoint (EAGLE head or standalone model)")
    g.add_argument("--speculative-num-steps", type=int, default=3, help="draft depth per iteration")
    g.add_argument("--speculative-eagle-topk", type=int, default=1, help="branching per draft step (1 = chain)")
    g.add_argument("--speculative-num-draft-tokens", type=int, help="tree nodes verified per iteration")
    g.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1,
                   help="NGRAM: shortest suffix match that proposes drafts")
    g.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12,
                   help="NGRAM: longest suffix compared")
    g.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=1,
                   help="NGRAM: candidate continuations verified side by side (tree branches)")


def spec_config_from_args(args: argparse.Namespace, ap: argparse.ArgumentParser) -> SpecConfig | None:
    algo = args.speculative_algorithm
    if not algo:
        return None
    if algo != "NGRAM" and not args.speculative_draft_model_path:
        ap.error(f"--speculative-algorithm {algo} needs --speculative-draft-model-path")
    try:
        return SpecConfig(
            algo, args.speculative_draft_model_path, args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens,
            ngram_min_match_window_size=args.speculative_ngram_min_match_window_size,
            ngram_max_match_window_size=args.speculative_ngram_max_match_window_size,
            ngram_max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        )
    except ValueError as e:
        ap.error(str(e))
