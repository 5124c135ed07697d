"""What int4 / int8 become on CUDA, decided here without a GPU (the layers themselves run in
`test_cuda_quantized.py`, on a GPU): asked for by name with bf16 activations, refused by name where
the GPU or the torch build has no kernel or the dtype is not bf16; no Q6_K, no int4 embedding, and
int8 for a shape PyTorch's int4 kernel does not take."""

import pytest
import torch

from draftwise.errors import InvalidParameterError
from draftwise.loading import hf_folder
from draftwise.loading.hf_folder import resolve_quantization
from draftwise.quant import apply
from draftwise.quant.cuda_linear import inner_k_tiles, int4_fits


def test_auto_keeps_the_float_weights_on_cuda():
    assert resolve_quantization("auto", "cuda", torch.bfloat16) == "none"
    assert resolve_quantization("auto", "cuda", torch.bfloat16, draft=True) == "none"
    assert resolve_quantization("auto", "cpu", torch.float32) == "int4"


@pytest.mark.parametrize("mode", ["int4", "int4_all", "int8"])
def test_named_formats_run_on_cuda_in_bf16(monkeypatch, mode):
    monkeypatch.setattr(hf_folder, "int4_supported", lambda device: None)
    assert resolve_quantization(mode, "cuda", torch.bfloat16) == mode
    with pytest.raises(InvalidParameterError, match="needs dtype bfloat16"):
        resolve_quantization(mode, "cuda", torch.float32)


def test_int4_is_refused_by_name_where_the_gpu_has_no_kernel(monkeypatch):
    monkeypatch.setattr(hf_folder, "int4_supported", lambda device: "compute capability 8.0 or later; this GPU has 7.5")
    with pytest.raises(InvalidParameterError, match=r"'int4'.*capability 8.0.*use 'int8'"):
        resolve_quantization("int4", "cuda", torch.bfloat16)
    assert resolve_quantization("int8", "cuda", torch.bfloat16) == "int8"  # (int8 has a path everywhere)


def test_the_cpu_still_wants_float32():
    with pytest.raises(InvalidParameterError, match="cpu with dtype float32, or cuda with bfloat16"):
        resolve_quantization("int4", "cpu", torch.bfloat16)


def test_int4_shapes_follow_the_kernels_tiles():
    assert inner_k_tiles(8960) == 8 and inner_k_tiles(896) == 8 and inner_k_tiles(1600) == 4  # (1,600 = 25 x 64)
    assert inner_k_tiles(96) == 2 and inner_k_tiles(80) is None
    assert int4_fits(151936, 1536) and int4_fits(1536, 8960)
    assert not int4_fits(1532, 1536)  # output channels in 8s
    assert not int4_fits(1536, 80)


def test_the_policy_on_cuda(monkeypatch):
    monkeypatch.setattr(apply, "q6k_kernel_available", lambda in_features: True)  # (a CPU with the Q6_K kernel)
    q4k = {"a.weight": None, "b.weight": None}  # names with the file's Q4_K groups
    q6k_types = {"c.weight": "Q6_K"}
    superblocks = {"c.weight": None}
    kind = apply._layer_kind
    assert kind("int4", ["a.weight", "b.weight"], (1536, 1536), q4k, {}, {}, cuda=True) == "int4"
    assert kind("int4", ["c.weight"], (1536, 8960), q4k, superblocks, q6k_types, cuda=True) == "int8"  # no Q6_K
    assert kind("int4_all", ["c.weight"], (1536, 8960), q4k, superblocks, q6k_types, cuda=True) == "int4"
    assert kind("int4_all", ["c.weight"], (1532, 8960), q4k, superblocks, q6k_types, cuda=True) == "int8"  # no tile
    assert kind("int4", ["c.weight"], (1536, 8960), q4k, superblocks, q6k_types, cuda=False) == "q6k"
    assert kind("int4", ["a.weight"], (1532, 1536), q4k, {}, {}, cuda=False) == "int4"  # (the CPU takes any N)
    assert kind("int8", ["a.weight"], (1536, 1536), q4k, {}, {}, cuda=True) == "int8"
    groups = {apply.EMBEDDING_WEIGHT: None}
    assert apply._embedding_from_file("int4", groups, cuda=False)
    assert not apply._embedding_from_file("int4", groups, cuda=True)  # the float table is read on CUDA
