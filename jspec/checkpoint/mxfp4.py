"""MXFP4 expert weights (gpt-oss's published checkpoints), dequantised on the host at load.

A quantised [E, out, in] projection is stored as `<name>_blocks` uint8 [E, out, in / 32, 16]
(32 FP4 e2m1 values per block, two per byte, the low nibble first) and `<name>_scales`
uint8 [E, out, in / 32] (one e8m0 power of two per block, biased by 127).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jspec.checkpoint.fp8 import UnsupportedQuantizationError

# The 16 e2m1 codes: sign bit 3, then exponent and mantissa.
FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
BLOCK = 32


def is_mxfp4(hf_config: Mapping[str, Any]) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def check_mxfp4_family(family: str) -> None:
    if family != "gpt_oss":
        raise UnsupportedQuantizationError(
            f"quantization_config quant_method 'mxfp4' is supported for gpt-oss experts only, not {family!r}"
        )


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., out, in / 32, 16], scales uint8 [..., out, in / 32] -> f32 [..., in, out]
    (transposed: the [in, out] layout of the unquantised gpt-oss experts)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise UnsupportedQuantizationError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, BLOCK)
    values = np.ldexp(FP4_E2M1[codes], scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)
