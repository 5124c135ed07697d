"""int4 and int8 on CUDA through PyTorch's kernels (`quant/cuda_linear.py`): the weights they compute
with are the integers given (the packing's nibble order and the zero's sign checked against the
formula), a token's output does not depend on the rows beside it (1, 8 and 64 rows, the 1.5B's
shapes), and a model drafting for itself through them accepts every token with plain decoding's output."""

import json
import shutil

import pytest
import torch

from draftwise.llm import LLM
from draftwise.quant.cuda_linear import CudaInt4Linear, CudaInt8Linear, int4_supported
from draftwise.sampling.params import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES_1_5B = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # qkv, o, gate/up, down: [N, K]


def random_groups(n: int, k: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    quants = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scales = torch.rand(n, k // 32, generator=generator) * 0.01 + 0.001
    minimums = torch.rand(n, k // 32, generator=generator) * 0.08
    return quants, scales, minimums


def int4_layer(n: int, k: int, seed: int = 0) -> tuple[CudaInt4Linear, torch.Tensor]:
    """The layer, and the weight [N, K] its integers stand for, with the scales and zeros rounded to
    bf16 as the kernel takes them."""
    why = int4_supported(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)
    quants, scales, minimums = random_groups(n, k, seed)
    scale = scales.to(torch.bfloat16).float()
    zero = (8 * scales - minimums).to(torch.bfloat16).float()
    groups = quants.view(n, k // 32, 32).float()
    weight = ((groups - 8) * scale[..., None] + zero[..., None]).view(n, k)
    return CudaInt4Linear(quants, scales, minimums, None, torch.device("cuda")), weight.cuda()


@pytest.mark.parametrize("n,k", [(256, 1536), (1536, 8960)])
def test_int4_computes_with_the_integers_given(n, k):
    layer, weight = int4_layer(n, k)
    read_back = layer.dequantized()  # [N, K], through the kernel
    step = weight.abs().max() / 64  # (a misplaced nibble or zero is off by whole steps of the scale)
    torch.testing.assert_close(read_back, weight, atol=float(step) * 0.05, rtol=0.01)
    x = torch.randn(5, k, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ weight.t()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05 * float(expected.abs().max()), rtol=0.05)


def test_int8_computes_with_its_integers():
    weight = torch.randn(512, 1536, device="cuda") * 0.02
    layer = CudaInt8Linear(weight, None)
    torch.testing.assert_close(layer.dequantized(), weight, atol=float(weight.abs().max()) / 127, rtol=0)
    x = torch.randn(3, 1536, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ layer.dequantized().t()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.02 * float(expected.abs().max()), rtol=0.02)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("n,k", SHAPES_1_5B)
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kind, n, k):
    if kind == "int4":
        layer, _ = int4_layer(n, k, seed=1)
    else:
        layer = CudaInt8Linear(torch.randn(n, k, device="cuda") * 0.02, None)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    alone = torch.cat([layer(x[i:i + 1]) for i in (0, 5, 63)])
    among_8 = layer(x[:8])[[0, 5]]
    among_64 = layer(x)[[0, 5, 63]]
    assert torch.equal(alone[:2], among_8)
    assert torch.equal(alone, among_64)


SHAPE_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 2, "num_attention_heads": 12,
              "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "attention_bias": True, "tie_word_embeddings": False}


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_quantized_model_drafting_for_itself_accepts_everything(tiny_qwen, tmp_path, quantization):
    """The 1.5B's shape (2 layers, random weights) with the tiny model's tokenizer (prompts given as
    token ids of the 1.5B's vocabulary)."""
    if quantization == "int4" and int4_supported(torch.device("cuda")) is not None:
        pytest.skip(int4_supported(torch.device("cuda")))
    (tmp_path / "config.json").write_text(json.dumps(SHAPE_1_5B))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen / name, tmp_path / name)
    keywords = dict(device="cuda", quantization=quantization, load_format="dummy", max_num_seqs=4,
                    max_model_len=256, progress=False)
    plain = LLM(str(tmp_path), **keywords)
    layer_kinds = {type(module).__name__ for module in plain.model.modules()}
    assert ("CudaInt4Linear" if quantization == "int4" else "CudaInt8Linear") in layer_kinds
    prompts = [{"prompt_token_ids": [11 + i, 400 + 3 * i, 7, 90 + i] * 3} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [out.token_ids for out in plain.generate(prompts, params)]
    del plain
    draft = {"method": "draft", "model": str(tmp_path), "num_speculative_tokens": 4, "adaptive": False,
             "quantization": quantization, "draft_context_window": 0}
    own = LLM(str(tmp_path), speculative={**draft, "draft_vocab_size": 0}, **keywords)  # (the whole head: drafts
    outs = own.generate(prompts, params)  # of random weights fall outside a trimmed head's frequent tokens)
    assert [out.token_ids for out in outs] == expected
    drafted = sum(out.metrics.spec.num_draft_tokens for out in outs)
    assert drafted > 0 and sum(out.metrics.spec.num_accepted_tokens for out in outs) == drafted
    del own
    trimmed = LLM(str(tmp_path), speculative={**draft, "draft_vocab_size": 1000}, **keywords)  # a head of kept rows
    assert [out.token_ids for out in trimmed.generate(prompts, params)] == expected
