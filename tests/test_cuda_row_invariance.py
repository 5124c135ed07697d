"""On CUDA, in bf16, at the 1.5B target's real layer shapes (random weights): a token's logits are the
same bits alone, as one of 8 tokens verified in one pass, and as one of 64 rows decoding together
through the captured graphs. This is what makes greedy speculation on the GPU lossless without
relying on the absence of near-ties; cuBLAS picks its kernels by shape, so it is checked at the
shapes that run (the layers' count does not change a kernel's choice: 2 layers of the 1.5B's width)."""

import json

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.runner.model_runner import ModelRunner

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 2, "num_attention_heads": 12,
              "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "attention_bias": True, "tie_word_embeddings": False}
ROWS, NEXT = 64, 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shape-1.5b")
    (folder / "config.json").write_text(json.dumps(SHAPE_1_5B))
    torch.manual_seed(0)
    model = load_model(folder, "cuda", torch.bfloat16, load_format="dummy")
    return ModelRunner(model, ROWS, 256, step_mode="graph")


def prompts_and_next():
    prompts = [[(31 * b + 7 * i) % 5000 + 10 for i in range(20 + b % 40)] for b in range(ROWS)]
    next_ids = [[(13 * b + 17 * i) % 5000 + 10 for i in range(NEXT)] for b in range(ROWS)]
    return prompts, next_ids


def feed(runner, rows_prompts, rows_next, window):
    """Logits [NEXT, V] a row: every row's prompt, then its next tokens `window` at a time, all rows in each pass."""
    rows = [runner.allocate() for _ in rows_prompts]
    try:
        for row, prompt in zip(rows, rows_prompts):
            runner.forward([row], [prompt], [1])
        logits = [[] for _ in rows]
        for start in range(0, NEXT, window):
            chunk = [ids[start:start + window] for ids in rows_next]
            result = runner.forward(rows, chunk, [len(c) for c in chunk])
            for b in range(len(rows)):
                logits[b].append(result.logits[result.cu_num_logits[b]:result.cu_num_logits[b + 1]].clone())
        return [torch.cat(row_logits) for row_logits in logits]
    finally:
        for row in rows:
            runner.free(row)


@torch.inference_mode()
def test_a_tokens_logits_are_the_same_alone_verified_and_among_64_rows(runner):
    prompts, next_ids = prompts_and_next()
    checked = [0, 1, 17, 63]
    alone = {b: feed(runner, [prompts[b]], [next_ids[b]], 1)[0] for b in checked}
    verified = {b: feed(runner, [prompts[b]], [next_ids[b]], NEXT)[0] for b in checked}
    together = feed(runner, prompts, next_ids, 1)
    together_verified = feed(runner, prompts[:16], next_ids[:16], NEXT)
    for b in checked:
        for name, got in (("an 8-token verify", verified[b]), ("64 rows", together[b]),
                          ("16 rows x 8 tokens", together_verified[b] if b < 16 else None)):
            if got is None:
                continue
            diff = (got.float() - alone[b].float()).abs().max().item()
            assert torch.equal(got, alone[b]), f"row {b}, {name}: max |diff| {diff:.3g} against alone"
