"""Random numbers keyed by (seed, position), for seeded requests.

A seeded request's t-th generated token is drawn with noise that depends on its seed and on t only:
not on the other rows of its batch, on how many tokens a step verified, or on whether it speculated
at all. So the same seed gives the same tokens alone or in any batch, with any drafter or none
(`draftwise/speculative/verify.py` shows why speculation then cannot change them).
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a bijective 64-bit mixer."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def position_key(seed: int, position: int) -> int:
    """A 63-bit generator seed for token `position` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ position) >> 1


def exponential_noise(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[size] i.i.d. Exponential(1) draws for token `position` of the request seeded with `seed`.

    Always drawn on the CPU (the same numbers on every device), then moved.
    """
    generator = torch.Generator().manual_seed(position_key(seed, position))
    return torch.empty(size).exponential_(generator=generator).to(device)
