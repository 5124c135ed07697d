"""GGUF Q6_K blocks as their own integers: no re-quantization.

A Q6_K super-block holds 256 weights as 16 sub-blocks of 16: fp16 `d`, sixteen int8 scales `sc_h`
and 6-bit quants q (low 4 bits in `ql`, high 2 bits in `qh`). Weight = (d * sc_h) * (q - 32).
Q4_K_M files keep their most sensitive tensors (the LM head, half the down projections) in Q6_K.
"""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = 210  # 128 (ql) + 64 (qh) + 16 (scales) + 2 (d) per 256 weights
BLOCK_WEIGHTS = 256
SUB_BLOCK = 16


def q6k_values(raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """raw Q6_K bytes of a [rows, cols] tensor -> q uint8 [rows, cols] (0..63), sub_scales int8
    [rows, cols / 16] and d fp16 [rows, cols / 256], with weight = d * sub_scale * (q - 32)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, BLOCK_BYTES)
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 2, 4, 32)  # per half of 128: weights 0-31, 32-63, 64-95, 96-127
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ql | ((qh & np.uint8(0x03)) << np.uint8(4))  # [n, 2, 4, 32]
    return {"q": q.reshape(rows, cols),
            "sub_scales": blocks[:, 192:208].copy().view(np.int8).reshape(rows, cols // SUB_BLOCK),
            "d": blocks[:, 208:210].copy().view(np.float16).reshape(rows, cols // BLOCK_WEIGHTS)}
