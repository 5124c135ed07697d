"""GGUF Q4_K blocks as 4-bit groups of 32 with a scale and a minimum: no re-quantization.

A Q4_K super-block holds 256 weights as 8 sub-blocks of 32: fp16 `d` and `dmin`, eight 6-bit
scales `sc_j` and mins `m_j`, and 4-bit quants q. Weight = (d * sc_j) * q - (dmin * m_j), which is
exactly a group-32 asymmetric 4-bit format with scale = d * sc_j and minimum = dmin * m_j.
"""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = 144  # 2 (d) + 2 (dmin) + 12 (scales) + 128 (quants) per 256 weights
BLOCK_WEIGHTS = 256
GROUP = 32


def q4k_to_groups(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw Q4_K bytes of a [rows, cols] tensor -> quants uint8 [rows, cols] (0..15),
    scales and minimums float32 [rows, cols / 32], with weight = scale * q - minimum."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
    sub_scales, sub_mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each, 6-bit integers
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 32 bytes; low nibbles first, then high
    quants = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    scales = d * sub_scales.astype(np.float32)  # [n, 8]
    minimums = dmin * sub_mins.astype(np.float32)  # [n, 8]
    return (quants.reshape(rows, cols), scales.reshape(rows, cols // GROUP),
            minimums.reshape(rows, cols // GROUP))


def q4k_factors(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """The integers and super-block scales behind `q4k_to_groups`' scales and minimums, for the
    kernel that keeps them as the file does (4.625 bits a weight instead of 5): d and dmin fp16
    [rows, cols / 256], sub_scales and sub_mins uint8 [rows, cols / 32] (6-bit), with
    scale = d * sub_scale and minimum = dmin * sub_min exactly."""
    from gguf.quants import Q4_K

    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES)
    sub_scales, sub_mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
    per_block = cols // BLOCK_WEIGHTS
    return {"d": blocks[:, 0:2].copy().view(np.float16).reshape(rows, per_block),
            "dmin": blocks[:, 2:4].copy().view(np.float16).reshape(rows, per_block),
            "sub_scales": sub_scales.astype(np.uint8).reshape(rows, cols // GROUP),
            "sub_mins": sub_mins.astype(np.uint8).reshape(rows, cols // GROUP)}
