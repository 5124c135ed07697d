"""GGUF's Q4_K and Q6_K tensors in the int8-activation kernels' strips, as the file holds them
(q8_matmul.cpp: `q4k`, `q6k`): super-blocks of 256 inputs with fp16 factors, the sub-blocks' small
integer scales inside each group of 32. 4.625 and 6.5625 bits a weight, against 5 for int4 strips
with fp16 scales and minimums and 8 for int8 strips, so a step streams fewer bytes, and the weights
are the file's to the bit (fp16 scales round d * sc; int8 re-quantizes Q6_K).

Channels are padded to a multiple of 16 with zero weights; K is a multiple of 256 (as GGUF requires).
DRAFTWISE_SUPERBLOCK_KERNELS=0 turns these kernels off (Q4_K then in int4 strips, Q6_K in int8), to
compare the two.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from draftwise.quant.activation_choice import ACTIVATIONS_ENV
from draftwise.quant.native import kernels

SUPERBLOCKS_ENV = "DRAFTWISE_SUPERBLOCK_KERNELS"

STRIP = 16  # channels per strip
GROUP = 32  # inputs per group (the activations' quantization block)
SUPER = 256  # inputs per super-block
Q4K_BLOCK_BYTES = 64 + 8 * (256 + 32)
Q6K_BLOCK_BYTES = 32 + 8 * (256 + 128 + 32)


def kernel_available(name: str, in_features: int) -> bool:
    """Whether this machine's build has the kernel `name` ("q4k_matmul_q8", "q6k_matmul_q8": AVX-512
    VNNI) for a layer of this many inputs, with int8 activations and these kernels not turned off."""
    native = kernels()
    return (native is not None and hasattr(native, name) and in_features % SUPER == 0
            and os.environ.get(ACTIVATIONS_ENV, "1") != "0" and os.environ.get(SUPERBLOCKS_ENV, "1") != "0")


def rows_of_strips(rows: torch.Tensor, unpack: Callable[[torch.Tensor, int], torch.Tensor],
                   per_strip: int = STRIP, strips_at_once: int = 512) -> torch.Tensor:
    """Channels `rows` [R] of a layer in strips, as float [R, K], from `unpack(strips, n)` (the float
    weight [n, K] of the strips selected [S], n = S per_strip), strips_at_once at a time: a trimmed
    LM head's 32,768 most frequent of 151,936 rows lie in nearly every strip, and unpacking them all
    at once took ~400 MB for a moment (the 0.5B's int8 head) to keep 117."""
    strip = rows // per_strip  # [R]
    out = None
    for first in range(0, int(strip.max()) + 1 if len(rows) else 0, strips_at_once):
        inside = (strip >= first) & (strip < first + strips_at_once)  # [R]
        if not inside.any():
            continue
        strips = torch.unique(strip[inside])  # [S]
        local = torch.searchsorted(strips, strip[inside]) * per_strip + rows[inside] % per_strip
        values = unpack(strips, len(strips) * per_strip)[local]  # [R', K]
        if out is None:
            out = values.new_empty(len(rows), values.shape[1])
        out[inside] = values
    return out


def strip_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """uint8 [N16, K] in 0..15 -> the strips' nibble bytes [N/16, K/32, 256]: byte (t, c, j) holds
    q[c, 4t + j] low and q[c, 16 + 4t + j] high (inputs of the group)."""
    k = quants.shape[1]
    groups = quants.view(-1, STRIP, k // GROUP, 2, 4, 4)  # [N/16, 16 (c), K/32, 2 (half), 4 (t), 4 (j)]
    nibbles = groups[:, :, :, 0] | (groups[:, :, :, 1] << 4)  # [N/16, c, K/32, t, j]
    return nibbles.permute(0, 2, 3, 1, 4).reshape(-1, k // GROUP, 256)


def unstrip_nibbles(nibbles: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of `strip_nibbles`: uint8 [N16, K]."""
    grouped = nibbles.reshape(-1, k // GROUP, 4, STRIP, 4).permute(0, 3, 1, 2, 4)  # [N/16, c, K/32, t, j]
    return torch.stack([grouped & 0x0F, grouped >> 4], dim=3).reshape(-1, k)


def _pad_rows(tensor: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, 0, 0, -tensor.shape[0] % STRIP))


def _per_strip(values: torch.Tensor, per_group: int) -> torch.Tensor:
    """[N16, K/32 * per_group] (one byte, or its bytes, per channel) -> [N/16, K/32, per_group * 16]
    with the 16 channels innermost."""
    groups = values.shape[1] // per_group
    return values.view(-1, STRIP, groups, per_group).permute(0, 2, 3, 1).reshape(-1, groups, per_group * STRIP)


def _super_blocks(header: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """header bytes [N/16, K/256, H], group bytes [N/16, K/32, G] -> [N/16, K/256, H + 8 G]."""
    strips, supers = header.shape[:2]
    return torch.cat([header, groups.reshape(strips, supers, -1)], dim=-1).contiguous()


def _fp16_header(*factors: torch.Tensor) -> torch.Tensor:
    """fp16 [N16, K/256] each -> bytes [N/16, K/256, 32 per factor]: each factor's 16 channels."""
    parts = [f.half().view(-1, STRIP, f.shape[1]).transpose(1, 2).contiguous().view(torch.uint8) for f in factors]
    return torch.cat(parts, dim=-1)


def pack_q4k_strips(quants: torch.Tensor, sub_scales: torch.Tensor, sub_mins: torch.Tensor,
                    d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """quants uint8 [N, K] (0..15), sub_scales and sub_mins uint8 [N, K/32], d and dmin fp16 [N, K/256]
    (weight = d sc q - dmin m) -> uint8 [N/16, K/256, 2368]."""
    quants, sub_scales, sub_mins = (_pad_rows(t.to(torch.uint8)) for t in (quants, sub_scales, sub_mins))
    groups = torch.cat([strip_nibbles(quants), _per_strip(sub_scales, 1), _per_strip(sub_mins, 1)], dim=-1)
    return _super_blocks(_fp16_header(_pad_rows(d), _pad_rows(dmin)), groups)


def unpack_q4k_strips(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_q4k_strips`: quants, sub_scales, sub_mins, d, dmin."""
    strips, supers = packed.shape[:2]
    header = packed[..., :64].contiguous().view(torch.float16).view(strips, supers, 2, STRIP)  # [N/16, K/256, 2, c]
    d, dmin = (header[:, :, i].transpose(1, 2).reshape(-1, supers)[:n] for i in range(2))
    groups = packed[..., 64:].reshape(strips, k // GROUP, 288)
    quants = unstrip_nibbles(groups[..., :256], k)[:n]

    def per_channel(raw: torch.Tensor) -> torch.Tensor:  # [N/16, K/32, 16] -> [N, K/32]
        return raw.transpose(1, 2).reshape(-1, k // GROUP)[:n]

    return quants, per_channel(groups[..., 256:272]), per_channel(groups[..., 272:288]), d, dmin


def pack_q6k_strips(q: torch.Tensor, sub_scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..63), sub_scales int8 [N, K/16], d fp16 [N, K/256] (weight = d sc (q - 32))
    -> uint8 [N/16, K/256, 3360]."""
    q = _pad_rows(q.to(torch.uint8))
    k = q.shape[1]
    high = (q >> 4).view(-1, STRIP, k // GROUP, 2, 4, 4)  # [N/16, c, K/32, half, t, j], 2 bits each
    high = sum(high[:, :, :, :, t] << (2 * t) for t in range(4)).to(torch.uint8)  # [N/16, c, K/32, half, j]
    high = high.permute(0, 2, 3, 1, 4).reshape(-1, k // GROUP, 128)  # [N/16, K/32, half c j]
    scales = _per_strip(_pad_rows(sub_scales.to(torch.int8)).view(torch.uint8), 2)  # [N/16, K/32, half c]
    groups = torch.cat([strip_nibbles(q & 0x0F), high, scales], dim=-1)
    return _super_blocks(_fp16_header(_pad_rows(d)), groups)


def unpack_q6k_strips(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_q6k_strips`: q, sub_scales, d."""
    strips, supers = packed.shape[:2]
    d = packed[..., :32].contiguous().view(torch.float16).transpose(1, 2).reshape(-1, supers)[:n]
    groups = packed[..., 32:].reshape(strips, k // GROUP, 416)
    low = unstrip_nibbles(groups[..., :256], k)  # [N16, K]
    high = groups[..., 256:384].reshape(strips, k // GROUP, 2, STRIP, 4)  # [N/16, K/32, half, c, j]
    high = torch.stack([(high >> (2 * t)) & 3 for t in range(4)], dim=3)  # [N/16, K/32, half, t, c, j]
    high = high.permute(0, 4, 1, 2, 3, 5).reshape(-1, k)  # [N16, K]
    scales = groups[..., 384:416].reshape(strips, k // GROUP, 2, STRIP).permute(0, 3, 1, 2).reshape(-1, k // 16)
    return (low | (high << 4))[:n], scales[:n].contiguous().view(torch.int8), d
