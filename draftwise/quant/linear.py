"""Weight-only quantized linear layers: int4 (group-wise scale and minimum) and int8 (per channel).

int4: groups of 32 input weights share a scale and a minimum (asymmetric), weight = scale * q - minimum.
int8: one scale per output channel (symmetric), weight = scale * q.

Two kernel paths, chosen once per layer at construction:
  - native bf16 (quant/native.py, AVX-512 BF16): every weight dequantized once for all rows, so a
    forward over k+1 rows costs little more than over one; int4 weights in the kernel's own
    layout (`pack_for_native`: channel quads, pairs of groups, fp16 scales and minimums);
  - PyTorch's packed kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) everywhere
    else; int4 packed for them with bf16 scales and zeros, weight = (q - 8) * scale + zero.
Both take bf16 activations: measured on this project's AVX-512 machine for an 8960x1536 layer,
PyTorch's kernels cost 0.38 ms per row in bf16 but 11.8 ms (int4) / 5.7 ms (int8) with fp32
activations (a generic path). So activations are rounded to bf16 on the way in and the output
returns in the caller's dtype. Both paths compute every row the same way whatever the number of rows.

An int4 layer made of GGUF Q4_K tensors (`factors`: their super-block integers) takes the Q4_K
kernel instead of int4 strips wherever int8 activations are chosen: the same weights, exactly
(no fp16 rounding of d * sc), in 4.625 bits a weight instead of 5 (`superblock_strips.py`).

Both kinds may instead quantize their activations to int8 per group of 32 inputs and multiply
with byte dot products (`int4_matmul_q8`, `int8_matmul_q8`: VNNI on AVX-512, vpmaddubsw on AVX2;
weights in strips of 16 channels: `pack_strips`, `pack_int8_strips`), where that measured faster on
this machine for the layer's shape, and always on AVX2, which has no other native kernel
(`activation_choice`; one kernel per layer for every pass, so that rows stay independent).
"""

from __future__ import annotations

import torch
from torch import nn

from draftwise.model.native_decoder import NativeLinear
from draftwise.model.prompt_pass import in_prompt_pass
from draftwise.quant import native_ops
from draftwise.quant.activation_choice import NATIVE_K_MULTIPLE, int8_activations
from draftwise.quant.int8_rows import quantize_int8_rows
from draftwise.quant.native import has_bf16_kernels, kernels as native_kernels, prompt_kernels
from draftwise.quant.superblock_strips import (SUPER, kernel_available, pack_q4k_strips, rows_of_strips, strip_nibbles,
                                               unpack_q4k_strips, unstrip_nibbles)

INT4_GROUP = 32
KERNEL_DTYPE = torch.bfloat16  # activations and scales inside the kernels


# An int4 layer's packed layouts, each named by its packed state's main tensor.
Q4K_STRIPS = "q4k_strips"  # GGUF Q4_K super-blocks, int8 activations (`superblock_strips.py`)
STRIPS = "strips"  # int4 strips, int8 activations (`pack_strips`)
NIBBLES = "nibbles"  # the bf16 kernel's layout (`pack_for_native`)
PYTORCH = "packed_weight"  # PyTorch's int4 packing


def _native_layout(out_features: int, in_features: int, q4k: bool) -> str:
    """The layout this machine's kernel choice takes for an int4 layer of this shape (q4k: the weight
    is GGUF Q4_K with its super-block integers at hand)."""
    if int8_activations("int4", out_features, in_features):
        return Q4K_STRIPS if q4k and kernel_available("q4k_matmul_q8", in_features) else STRIPS
    if in_features % NATIVE_K_MULTIPLE == 0 and has_bf16_kernels():
        return NIBBLES
    return PYTORCH


class Int4Linear(nn.Module):
    def __init__(self, quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None, *, native: bool = True, factors: dict[str, torch.Tensor] | None = None) -> None:
        """quants uint8 [N, K] in 0..15; scales, minimums float32 [N, K/32]; weight = scale * q - minimum.
        native=False keeps PyTorch's kernel even where the native ones are available. factors: where
        the weight is GGUF Q4_K, its sub_scales, sub_mins uint8 [N, K/32] and d, dmin fp16 [N, K/256]
        with scale = d * sub_scale and minimum = dmin * sub_min."""
        super().__init__()
        self.out_features, self.in_features = quants.shape
        self.bias = bias
        native = native and native_kernels() is not None
        self.layout = _native_layout(*quants.shape, factors is not None) if native else PYTORCH
        self.kernels = native_kernels() if self.layout != PYTORCH else None
        if self.layout == Q4K_STRIPS:
            self.q4k_strips = pack_q4k_strips(quants, factors["sub_scales"], factors["sub_mins"],
                                              factors["d"], factors["dmin"])
        elif self.layout == STRIPS:
            self.strips = pack_strips(quants, scales, minimums)
        elif self.layout == NIBBLES:
            self.nibbles, self.scale_min = pack_for_native(quants, scales, minimums)
        else:
            self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quants.to(torch.int32), 2)
            zeros = 8 * scales - minimums  # (q - 8) * scale + zero == scale * q - minimum
            self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()  # [K/32, N, 2]

    @property
    def int8_activations(self) -> bool:
        return self.layout in (Q4K_STRIPS, STRIPS)

    @property
    def has_prompt_kernel(self) -> bool:
        """Whether prompt tokens take a kernel of their own here (`model/prompt_pass.py`)."""
        return self.int8_activations and prompt_kernels() is not None

    @classmethod
    def from_packed(cls, state: dict[str, torch.Tensor], bias: torch.Tensor | None) -> "Int4Linear":
        """Rebuild a layer from `packed_state()` (the packed-weight cache), without repacking where the
        cached layout is the one this machine's kernel choice takes."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.bias = bias
        if PYTORCH in state:
            layer.kernels, layer.layout = None, PYTORCH
            layer.packed_weight, layer.scales_and_zeros = state["packed_weight"], state["scales_and_zeros"]
            layer.in_features = layer.scales_and_zeros.shape[0] * INT4_GROUP
            layer.out_features = layer.scales_and_zeros.shape[1]
            return layer
        if native_kernels() is None:
            raise ValueError("packed for the native kernels, which are not available")
        n, k = (int(v) for v in state["shape"])
        cached = next(layout for layout in (Q4K_STRIPS, STRIPS, NIBBLES) if layout in state)
        if _native_layout(n, k, cached == Q4K_STRIPS) != cached:  # measured again since: another layout
            return cls(*_unpacked(state, n, k), bias)  # (or no bf16 kernel here: PyTorch's)
        layer.kernels, layer.out_features, layer.in_features, layer.layout = native_kernels(), n, k, cached
        for key in state.keys() - {"shape"}:
            setattr(layer, key, state[key])
        return layer

    def packed_state(self) -> dict[str, torch.Tensor]:
        if self.layout == PYTORCH:
            return {"packed_weight": self.packed_weight, "scales_and_zeros": self.scales_and_zeros}
        keys = {Q4K_STRIPS: ("q4k_strips",), STRIPS: ("strips",), NIBBLES: ("nibbles", "scale_min")}[self.layout]
        return {**{key: getattr(self, key) for key in keys}, "shape": torch.tensor([self.out_features, self.in_features])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K], quantized per group by the kernel
            prompt = in_prompt_pass() and self.has_prompt_kernel
            if prompt and self.layout == Q4K_STRIPS:
                out = prompt_kernels().q4k_matmul_amx(flat, self.q4k_strips, self.out_features)  # [M, N] float32
            elif prompt:
                out = prompt_kernels().int4_matmul_amx(flat, self.strips, self.out_features)  # [M, N] float32
            elif self.layout == Q4K_STRIPS:
                out = native_ops.q4k_q8(flat, self.q4k_strips, self.out_features)  # [M, N] float32
            else:
                out = native_ops.int4_q8(flat, self.strips, self.out_features)  # [M, N] float32
        elif self.layout == NIBBLES:
            flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [M, K]
            out = native_ops.int4(flat, self.nibbles, self.scale_min, self.out_features)  # [M, N] float32
        else:
            flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [M, K]
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, INT4_GROUP, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def native_linear(self) -> NativeLinear | None:
        """This layer's native matmul, for native decoder layers (None: PyTorch's kernel, which has none)."""
        if self.layout == PYTORCH or not float_bias(self.bias):
            return None
        entry, bias = self.kernels.entry_points, detached(self.bias)
        if self.layout == Q4K_STRIPS:
            return NativeLinear("q4k_q8", entry["q4k_matmul_q8"], (self.q4k_strips,), bias, self.out_features)
        if self.layout == STRIPS:
            return NativeLinear("int4_q8", entry["int4_matmul_q8"], (self.strips,), bias, self.out_features)
        return NativeLinear("int4_bf16", entry["int4_matmul"], (self.nibbles, self.scale_min), bias, self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] this layer computes with (for tests), or its rows `rows` [R] only, [R, K]
        (a trimmed LM head's: made in float from those rows alone)."""
        if self.layout != PYTORCH:
            if rows is not None:  # the strips holding the rows, a few at a time
                per_strip = 4 if self.layout == NIBBLES else STRIP
                state = {key: value for key, value in self.packed_state().items() if key != "shape"}
                return rows_of_strips(rows, lambda strips, n: self._weight({key: value[strips] for key, value
                                                                            in state.items()}, n), per_strip)
            return self._weight(self.packed_state(), self.out_features)
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        weight = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed_weight, INT4_GROUP, self.scales_and_zeros).t().float()
        return (weight if rows is None else weight[rows]).contiguous()

    def _weight(self, state: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """The float weight [n, K] of a packed state (a native layout's; all of it or some strips)."""
        quants, scales, minimums = _unpacked(state, n, self.in_features)
        groups = quants.view(n, -1, INT4_GROUP).double()  # [n, K/32, 32]
        weight = scales.double()[..., None] * groups - minimums.double()[..., None]
        if not self.int8_activations:  # the bf16 kernel's fused multiply-subtract rounds to float32, then bf16
            weight = weight.float().to(KERNEL_DTYPE)
        return weight.float().view(n, self.in_features)


def float_bias(bias: torch.Tensor | None) -> bool:
    return bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")


def detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()


def _unpacked(state: dict[str, torch.Tensor], n: int, k: int) -> tuple[torch.Tensor, ...]:
    """quants, scales, minimums of a native layer's packed state (any layout)."""
    if Q4K_STRIPS in state:
        quants, sub_scales, sub_mins, d, dmin = unpack_q4k_strips(state["q4k_strips"], n, k)
        return (quants, d.float().repeat_interleave(SUPER // INT4_GROUP, 1) * sub_scales.float(),
                dmin.float().repeat_interleave(SUPER // INT4_GROUP, 1) * sub_mins.float())
    if "strips" in state:
        return unpack_strips(state["strips"], n, k)
    return unpack_from_native(state["nibbles"], state["scale_min"], n, k)


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, native: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_int8, self.scales = quantize_int8_rows(weight)  # int8 [N, K], bf16 [N]
        self.bias = bias
        self._use_kernels(native)

    def _use_kernels(self, native: bool, strips: torch.Tensor | None = None) -> None:
        """Keeps the int8 weights in the layout of the kernel this machine's choice takes (`strips`:
        already packed for the int8-activation kernel, as a cache holds them)."""
        native_ok = native and self.in_features % NATIVE_K_MULTIPLE == 0
        self.kernels = native_kernels() if native_ok else None
        self.int8_activations = self.kernels is not None and int8_activations("int8", self.out_features, self.in_features)
        if not self.int8_activations and not has_bf16_kernels():
            self.kernels = None  # (an AVX2 build has the int8-activation kernel only: PyTorch's then)
        self.scales_float = self.scales.float()  # [N], what the native kernels take
        if self.int8_activations:
            self.strips = strips if strips is not None else pack_int8_strips(self.weight_int8)
            self.scales_float = torch.nn.functional.pad(self.scales_float, (0, -self.out_features % STRIP))  # [N16]
            vars(self).pop("weight_int8", None)
        elif strips is not None:
            self.weight_int8 = unpack_int8_strips(strips, self.out_features, self.in_features)

    @classmethod
    def from_packed(cls, state: dict[str, torch.Tensor], bias: torch.Tensor | None) -> "Int8Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.scales, layer.bias = state["scales"], bias
        layer.out_features, layer.in_features = (int(v) for v in state["shape"])
        if "weight_int8" in state:
            layer.weight_int8 = state["weight_int8"]
        layer._use_kernels(True, state.get("strips"))
        return layer

    @property
    def has_prompt_kernel(self) -> bool:
        """Whether prompt tokens take a kernel of their own here (`model/prompt_pass.py`)."""
        return self.int8_activations and prompt_kernels() is not None

    def packed_state(self) -> dict[str, torch.Tensor]:
        shape = torch.tensor([self.out_features, self.in_features])
        if self.int8_activations:
            return {"strips": self.strips, "scales": self.scales, "shape": shape}
        return {"weight_int8": self.weight_int8, "scales": self.scales, "shape": shape}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K], quantized per group by the kernel
            if in_prompt_pass() and self.has_prompt_kernel:
                out = prompt_kernels().int8_matmul_amx(flat, self.strips, self.scales_float, self.out_features)  # [M, N]
            else:
                out = native_ops.int8_q8(flat, self.strips, self.scales_float, self.out_features)  # [M, N] float32
        elif self.kernels is not None:
            flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [M, K]
            out = native_ops.int8(flat, self.weight_int8, self.scales_float)  # [M, N] float32
        else:
            flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()  # [M, K]
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def native_linear(self) -> NativeLinear | None:
        """This layer's native matmul, for native decoder layers (None: PyTorch's kernel, which has none)."""
        if self.kernels is None or not float_bias(self.bias):
            return None
        entry = self.kernels.entry_points
        if self.int8_activations:
            return NativeLinear("int8_q8", entry["int8_matmul_q8"], (self.strips, self.scales_float), detached(self.bias),
                                self.out_features)
        return NativeLinear("int8_bf16", entry["int8_matmul"], (self.weight_int8, self.scales_float), detached(self.bias),
                            self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] (or its rows `rows` [R] only: [R, K])."""
        every = slice(None) if rows is None else rows
        if not self.int8_activations:
            return self.weight_int8[every].float() * self.scales.float()[every, None]
        if rows is None:
            values = unpack_int8_strips(self.strips, self.out_features, self.in_features)  # [N, K]
            return values.float() * self.scales.float()[:, None]
        values = rows_of_strips(rows, lambda strips, n: unpack_int8_strips(self.strips[strips], n, self.in_features)
                                .float())  # the strips holding the rows, a few at a time
        return values * self.scales.float()[rows, None]


def pack_for_native(quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quants uint8 [N, K], scales and minimums [N, K/32] -> the native kernel's int4 layout:
    nibbles uint8 [N/4, K/64, 4, 32] and scale_min fp16 [N/4, K/64, 4, 4] (see lowbit_matmul.cpp).
    Output channels are padded to a multiple of 4 with zero weights."""
    n, k = quants.shape
    pad = -n % 4
    quants = torch.nn.functional.pad(quants.to(torch.uint8), (0, 0, 0, pad))  # [N4, K]
    scales = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad))  # [N4, K/32]
    minimums = torch.nn.functional.pad(minimums.float(), (0, 0, 0, pad))
    pairs = quants.view(-1, 4, k // 64, 2, INT4_GROUP)  # [N/4, 4, K/64, 2, 32]
    nibbles = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).transpose(1, 2).contiguous()  # [N/4, K/64, 4, 32]
    scale_min = torch.stack([scales.view(-1, 4, k // 64, 2), minimums.view(-1, 4, k // 64, 2)], dim=3)  # [N/4, 4, K/64, 2, 2]
    scale_min = scale_min.transpose(1, 2).reshape(-1, k // 64, 4, 4).half().contiguous()  # [N/4, K/64, 4, 4]
    return nibbles, scale_min


def unpack_from_native(nibbles: torch.Tensor, scale_min: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_for_native`: quants uint8 [N, K], scales and minimums float32 [N, K/32]."""
    halves = nibbles.transpose(1, 2)  # [N/4, 4, K/64, 32]
    quants = torch.stack([halves & 0x0F, halves >> 4], dim=3).reshape(-1, k)[:n]  # [N, K]
    sm = scale_min.float().view(-1, k // 64, 4, 2, 2).transpose(1, 2)  # [N/4, 4, K/64, 2 (scale, min), 2 (a, b)]
    scales = sm[:, :, :, 0].reshape(-1, k // INT4_GROUP)[:n]
    minimums = sm[:, :, :, 1].reshape(-1, k // INT4_GROUP)[:n]
    return quants, scales, minimums


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh asymmetric group-32 quantization of a float weight [N, K] (for tensors not stored as Q4_K)."""
    groups = weight.float().view(weight.shape[0], -1, INT4_GROUP)  # [N, K/32, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    steps = groups - low[..., None]  # (one float temporary, worked in place: a 32,768-row head's took 2x more)
    quants = steps.div_(scales[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return quants.view(weight.shape), scales, -low  # weight ~ scale * q - minimum with minimum = -low


STRIP = 16  # channels per strip in the int8-activation int4 layout


def pack_strips(quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """quants uint8 [N, K], scales and minimums [N, K/32] -> the int8-activation kernel's int4 layout
    (int4_q8_matmul.cpp): uint8 [N/16, K/32, 320], per strip of 16 channels and group, nibbles
    [4 (t), 16 (channel), 4 (j)] holding q[c, 4t + j] low and q[c, 16 + 4t + j] high, then fp16
    scales [16] and minimums [16]. Channels padded to a multiple of 16 with zero weights."""
    n, k = quants.shape
    pad = -n % STRIP
    nibbles = strip_nibbles(torch.nn.functional.pad(quants.to(torch.uint8), (0, 0, 0, pad)))  # [N/16, K/32, t c j]

    def per_strip(values: torch.Tensor) -> torch.Tensor:  # [N, K/32] -> fp16 bytes [N/16, K/32, 32]
        values = torch.nn.functional.pad(values.float(), (0, 0, 0, pad)).half()
        return values.view(-1, STRIP, k // INT4_GROUP).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, per_strip(scales), per_strip(minimums)], dim=-1).contiguous()


def unpack_strips(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    """The inverse of `pack_strips`: quants uint8 [N, K], scales and minimums float32 [N, K/32]."""
    quants = unstrip_nibbles(packed[..., :256], k)[:n]  # [N, K]

    def per_channel(raw: torch.Tensor) -> torch.Tensor:  # fp16 bytes [N/16, K/32, 32] -> float [N, K/32]
        return raw.contiguous().view(torch.float16).transpose(1, 2).reshape(-1, k // INT4_GROUP)[:n].float()

    return quants, per_channel(packed[..., 256:288]), per_channel(packed[..., 288:320])


def pack_int8_strips(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the int8-activation kernel's int8 layout (q8_matmul.cpp): uint8 [N/16, K/32, 512],
    byte (h, t, c, j) of a strip's group holding v[c, 16h + 4t + j] + 128. Channels padded with zeros."""
    n, k = weight_int8.shape
    padded = torch.nn.functional.pad(weight_int8, (0, 0, 0, -n % STRIP))  # [N16, K]
    unsigned = (padded.to(torch.int16) + 128).to(torch.uint8)
    groups = unsigned.view(-1, STRIP, k // INT4_GROUP, 2, 4, 4)  # [N/16, c, K/32, h, t, j]
    return groups.permute(0, 2, 3, 4, 1, 5).reshape(-1, k // INT4_GROUP, 512).contiguous()


def unpack_int8_strips(strips: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_int8_strips`: int8 [N, K]."""
    groups = strips.view(-1, k // INT4_GROUP, 2, 4, STRIP, 4).permute(0, 4, 1, 2, 3, 5)  # [N/16, c, K/32, h, t, j]
    return (groups.reshape(-1, k)[:n].to(torch.int16) - 128).to(torch.int8)
