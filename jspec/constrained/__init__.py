"""Constrained decoding on the host: grammars compiled by llguidance, per-request matchers and
the vocabulary bitmasks a step applies to its logits."""
