"""A pass's new keys and values into their cache slots as one Triton kernel: the GPU's cache write.

`index_copy_` writes the keys, then the values: two kernels a layer in a CUDA graph. Here one launch
copies both, a program per token and tensor: token n's keys and values [Hkv, D] go to slot
`slots[n]` of the layer's storage [slots, Hkv, D]. A copy, so the bits are the same as
`index_copy_`'s; padding tokens all write the scratch slot, as they do there (never read back).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: index_copy_
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _write_kernel(keys_ptr, values_ptr, slots_ptr, new_keys_ptr, new_values_ptr, stride_new_keys,
                      stride_new_values, stride_slot, width, BLOCK: tl.constexpr):
        n = tl.program_id(0)  # the token
        is_values = tl.program_id(1)  # 0: its keys, 1: its values
        columns = tl.arange(0, BLOCK)
        inside = columns < width
        slot = tl.load(slots_ptr + n)
        as_keys = inside & (is_values + columns * 0 == 0)  # [BLOCK], all alike: which tensor this program copies
        as_values = inside & (is_values + columns * 0 == 1)
        key = tl.load(new_keys_ptr + n * stride_new_keys + columns, mask=as_keys, other=0.0)
        value = tl.load(new_values_ptr + n * stride_new_values + columns, mask=as_values, other=0.0)
        tl.store(keys_ptr + slot * stride_slot + columns, key, mask=as_keys)
        tl.store(values_ptr + slot * stride_slot + columns, value, mask=as_values)


def fits(keys: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: each token's [Hkv, D] contiguous everywhere."""
    return all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (keys, new_keys, new_values)) \
        and new_keys.dtype == new_values.dtype == keys.dtype


def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor,
          new_values: torch.Tensor) -> None:
    """keys, values [slots, Hkv, D] take new_keys, new_values [N, Hkv, D] at slots [N], in place."""
    tokens, width = new_keys.shape[0], new_keys.shape[1] * new_keys.shape[2]
    _write_kernel[(tokens, 2)](keys, values, slots, new_keys, new_values, new_keys.stride(0), new_values.stride(0),
                               keys.stride(0), width, BLOCK=triton.next_power_of_2(width))
