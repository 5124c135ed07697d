"""Self-distillation: the cache of the target's answers, the layers a head's training reads, and a run
interrupted part way that resumes after its last written chunk."""

import pytest
import torch

from draftwise import LLM
from draftwise.training import distill


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=1, progress=False)


PROMPTS = [f"def f{i}(x):" for i in range(7)]


def test_an_interrupted_run_resumes_after_its_last_chunk(llm, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK", 3)
    answered, generate = [], llm.generate

    def fails_at_the_sixth(prompt, params):
        if len(answered) == 5:
            raise KeyboardInterrupt
        answered.append(prompt)
        return generate(prompt, params)

    monkeypatch.setattr(llm, "generate", fails_at_the_sixth)
    with pytest.raises(KeyboardInterrupt):
        distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert len(list(distill.distilled_folder().glob("*.chunk-*.safetensors"))) == 1  # the first three answers
    answered.clear()
    monkeypatch.setattr(llm, "generate", lambda prompt, params: answered.append(prompt) or generate(prompt, params))
    examples, path = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert answered == PROMPTS[3:]  # resumed after the chunk
    assert not list(distill.distilled_folder().glob("*.chunk-*.safetensors")) and path.is_file()
    fresh = distill.distill(llm, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert len(examples) == len(fresh) == 7
    for got, expected in zip(examples, fresh):
        assert torch.equal(got.token_ids, expected.token_ids) and got.answer_start == expected.answer_start
        assert torch.equal(got.hidden, expected.hidden) and torch.equal(got.aux, expected.aux)
        assert got.aux.shape == (len(got.token_ids), 2 * 64) and got.aux.dtype == torch.bfloat16
    answered.clear()
    again, _ = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert not answered and len(again) == 7  # read from the cache


def test_the_layers_read_key_the_cache(llm):
    with_layers, first = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS[:2], 4, progress=False, aux_layers=(1,))
    without, second = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS[:2], 4, progress=False)
    assert first != second and with_layers[0].aux is not None and without[0].aux is None
