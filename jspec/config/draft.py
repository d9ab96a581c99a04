"""The configuration of an EAGLE / EAGLE-3 draft head: its shapes, RoPE, vocabularies and the
target layers it reads (checkpoint/eagle.py reads it from a head's config.json and tensors;
models/eagle.py runs it)."""

from __future__ import annotations

import dataclasses

from jspec.config.model import RopeScaling

ALGORITHMS = ("EAGLE", "EAGLE3")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE (one fc over [embedding ; feature]) or EAGLE-3 (fc over the captured layers)
    head: its decoder layers have the target's kind (models/eagle.py: layer_config)."""

    algorithm: str  # "EAGLE" | "EAGLE3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int  # the target's: the draft runs over the same context
    vocab_size: int  # target vocab
    draft_vocab_size: int  # == vocab_size for EAGLE
    num_layers: int = 1
    # EAGLE3 only: the target layers whose input the head reads, in the "entering layer i" form
    capture_layers: tuple[int, ...] = ()
    fc_bias: bool = False
    has_embed: bool = False
    has_lm_head: bool = False

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown draft algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"draft num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.algorithm == "EAGLE3" and not self.capture_layers:
            raise ValueError("an EAGLE3 draft needs capture_layers")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def fc_in(self) -> int:
        n = 2 if self.algorithm == "EAGLE" else len(self.capture_layers)
        return n * self.hidden_size

    @property
    def attn_in(self) -> int:
        """Width of the attention input: EAGLE3 attends over concat(embeds, hidden)."""
        return self.hidden_size * (2 if self.algorithm == "EAGLE3" else 1)


def normalize_algorithm(algorithm: str) -> str:
    """SGLang's flag values; EAGLE2 is the EAGLE head with a dynamic tree."""
    a = algorithm.upper().replace("-", "").replace("_", "")
    a = {"EAGLE1": "EAGLE", "EAGLE2": "EAGLE"}.get(a, a)
    if a not in ALGORITHMS:
        raise ValueError(f"unknown draft algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    return a


def default_capture_layers(num_target_layers: int) -> tuple[int, ...]:
    """SGLang's and vLLM's default, already in the "entering layer i" form."""
    L = num_target_layers
    return (2, L // 2, L - 3)
