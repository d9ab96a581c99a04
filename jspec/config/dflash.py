"""DFlashConfig: what a DFlash block drafter is (checkpoint/dflash.py reads it from config.json)."""

from __future__ import annotations

import dataclasses

from jspec.config.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter: Qwen3-style decoder layers (`layers`, a ModelConfig so the target's
    layer code runs them) that borrow the target's embedding and LM head.

    target_layer_ids are the published field's values: hidden states AFTER those target
    layers (HF's hidden_states[id + 1]), concatenated in the listed order; capture_layers is
    the same in jspec's "residual stream entering layer i" convention. block_size is the
    block the drafter was trained on: the root (the last verified token) and block_size - 1
    mask tokens, all drafted in one non-causal forward.
    """

    layers: ModelConfig  # the draft's layers; vocab and context are the target's
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    input_embedding_scale: float = 1.0  # the block's (raw) target embeddings times this
    output_multiplier: float = 1.0  # the draft logits times this
    final_logit_softcap: float | None = None  # then c * tanh(logits / c)

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the root and at least one mask: block_size {self.block_size}")
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"DFlash target_layer_ids must be distinct and non-empty, got {self.target_layer_ids}")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise ValueError(
                f"DFlash mask_token_id {self.mask_token_id} is not a row of the target's "
                f"{self.layers.vocab_size}-token embedding"
            )

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features fc reads."""
        return len(self.target_layer_ids) * self.hidden_size


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published default when config.json names none: the middle layer for a one-layer
    drafter, else num_draft_layers layers spread evenly from layer 1 to layer L - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash's default target layers need a target of at least 4 layers, got {num_target_layers}")
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))
