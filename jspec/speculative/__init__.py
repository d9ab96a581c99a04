"""Speculative decoding: the method interface (method.py) and the steps every method runs
through (steps.py), methods (eagle.py, standalone.py, ngram.py, nextn.py), shared
verification (verify.py, accept.py) and draft trees (tree.py, beams.py)."""

from jspec.speculative.accept import AcceptResult, greedy_accept
from jspec.speculative.tree import (
    BeamStep,
    DraftCandidates,
    DraftTree,
    append_step,
    build_tree,
    candidate_count,
    expand_beams,
    start_candidates,
)

__all__ = [
    "AcceptResult",
    "BeamStep",
    "DraftCandidates",
    "DraftTree",
    "append_step",
    "build_tree",
    "candidate_count",
    "expand_beams",
    "greedy_accept",
    "start_candidates",
]
