"""The torch floor in pyproject.toml is the first release that has every version-sensitive API the
code calls, and the installed torch meets it.

Each entry's release is where the API first appears in PyTorch's own Python files (the macOS arm64
wheels of 2.0.0 to 2.6.0, `pip download torch==X --no-deps`): the type stubs torch/_C/*.pyi, the
meta registrations torch/_meta_registrations.py and torch/backends/cpu/__init__.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# what the code calls -> (the first release that has it, the evidence)
VERSION_SENSITIVE = {
    "torch.ops.aten._convert_weight_to_int4pack_for_cpu": (
        (2, 6), "in 2.6.0's _VariableFunctions.pyi, not 2.5.0's (pytorch/pytorch#139611 split CPU int4 packing)"),
    "torch.ops.aten._weight_int4pack_mm_for_cpu": (
        (2, 6), "in 2.6.0's _VariableFunctions.pyi, not 2.5.0's (same pull request)"),
    # (CUDA int4, quant/cuda_linear.py: these two were not checked against the wheels as the others were;
    # from PyTorch's history: the uint8 [N, K/2] packing it uses since 2.5, int32 [N, K] before)
    "torch.ops.aten._convert_weight_to_int4pack": ((2, 5), "takes uint8 [N, K/2] since 2.5 (torchao checks 2.5)"),
    "torch.ops.aten._weight_int4pack_mm": ((2, 2), "tinygemm's op, added for gpt-fast before 2.2's release"),
    "enable_gqa": ((2, 5), "scaled_dot_product_attention's argument in 2.5.0's _nn.pyi, not 2.4.0's"),
    "torch.ops.aten._weight_int8pack_mm": ((2, 3), "in 2.3.0's _VariableFunctions.pyi, not 2.2.0's"),
    "torch.backends.cpu.get_cpu_capability": ((2, 1), "torch/backends/cpu/ is in 2.1.0, not 2.0.0"),
    "torch.ops.mkldnn._linear_pointwise": (
        (2, 0), "2.0.0's meta registration has (input, weight, bias, attr, scalars, algorithm); hasattr-guarded"),
}
# How the code spells a version-sensitive API: private operators, and arguments newer than their function.
SENSITIVE_SPELLINGS = re.compile(r"torch\.ops\.\w+\.\w+|torch\.backends\.cpu\.\w+|\benable_gqa\b")


def torch_floor() -> tuple[int, int]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in dependencies if re.match(r"torch\b", d))
    match = re.fullmatch(r"torch>=(\d+)\.(\d+)(?:\.0)?", spec.split("#")[0].strip())
    assert match, f"expected 'torch>=X.Y' in pyproject.toml, got {spec!r}"
    return int(match[1]), int(match[2])


def release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def test_every_version_sensitive_api_is_listed_with_its_first_release():
    used = {match for path in (ROOT / "draftwise").rglob("*.py")
            for match in SENSITIVE_SPELLINGS.findall(path.read_text())}
    assert used == set(VERSION_SENSITIVE), "list a new version-sensitive API with its first release; drop unused ones"


def test_the_floor_is_the_newest_first_release():
    assert torch_floor() == max(first for first, _ in VERSION_SENSITIVE.values())


def test_the_installed_torch_meets_the_floor_and_has_every_listed_api():
    assert release(torch.__version__) >= torch_floor()
    assert "enable_gqa" in torch.nn.functional.scaled_dot_product_attention.__doc__
    assert torch.backends.cpu.get_cpu_capability()
    for name in VERSION_SENSITIVE:
        if name.startswith("torch.ops."):
            _, _, namespace, op = name.split(".")
            optional = namespace == "mkldnn" and not torch.backends.mkldnn.is_available()  # F.linear then
            assert optional or hasattr(getattr(torch.ops, namespace), op), name
