"""Self-distillation: answers made a batch at a time equal to one at a time, the cache of the target's
answers, the layers a head's training reads, and a run interrupted part way that resumes after its
last written chunk."""

import pytest
import torch

from draftwise import LLM
from draftwise.training import distill


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=4, progress=False)


PROMPTS = [f"def f{i}(x):" for i in range(7)]


def answering(llm, monkeypatch, stop_after: int | None = None) -> list[str]:
    """The prompts the target answers from now on (in order); stop_after: interrupted at the batch
    that would answer more than that many."""
    answered, generate = [], type(llm).generate

    def counted(prompts, params):
        if stop_after is not None and len(answered) + len(prompts) > stop_after:
            raise KeyboardInterrupt
        answered.extend(prompts)
        return generate(llm, prompts, params)

    monkeypatch.setattr(llm, "generate", counted)
    return answered


def chunk_files() -> list:
    return sorted(distill.distilled_folder().glob("*.chunk-*.safetensors"))


def test_answers_made_a_batch_at_a_time_equal_one_at_a_time(llm, tiny_qwen, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK", 4)
    batches = []
    generate = type(llm).generate
    monkeypatch.setattr(llm, "generate", lambda prompts, params: batches.append(len(prompts)) or generate(llm, prompts, params))
    batched = distill.distill(llm, PROMPTS, 12, progress=False, aux_layers=(1,))
    assert batches == [4, 3]
    alone = LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=1, progress=False)
    for prompt, example in zip(PROMPTS, batched):
        answer = alone.generate(prompt, distill.SamplingParams(temperature=0.0, max_tokens=12))[0]
        assert example.token_ids.tolist() == list(answer.prompt_token_ids) + list(answer.token_ids)
    again = distill.distill(alone, PROMPTS, 12, progress=False, aux_layers=(1,))  # one at a time (CHUNK 4, one row)
    for got, expected in zip(batched, again):
        assert torch.equal(got.hidden, expected.hidden) and torch.equal(got.aux, expected.aux)


def test_the_states_recorded_while_answering_are_those_of_a_pass_over_the_text(llm, monkeypatch):
    """The states recorded while answering are used (no second pass), up to an answer's EOS too, and
    agree with a teacher-forced pass over prompt + answer (another kernel path: not bit for bit); an
    answer the context cut short is read by that pass."""
    teacher_forced = distill.hidden_states
    passes = []
    monkeypatch.setattr(distill, "hidden_states", lambda *args: passes.append(args) or teacher_forced(*args))
    free = llm.generate(PROMPTS[0], distill.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    answer = list(free.token_ids)
    cut = next(i for i, token in enumerate(answer) if i >= 2 and token not in answer[:i])
    with monkeypatch.context() as patched:
        patched.setattr(llm.tokenizer, "eos_token_ids", frozenset({answer[cut]}))  # an EOS inside the first answer
        examples = distill.distill(llm, PROMPTS[:3], 12, progress=False, aux_layers=(0, 1))
    assert not passes
    assert examples[0].token_ids[examples[0].answer_start:].tolist() == answer[:cut + 1]
    for example in examples:
        hidden, aux = teacher_forced(llm, example.token_ids.tolist(), (0, 1))
        assert example.hidden.shape == hidden.shape and example.aux.shape == aux.shape
        assert torch.allclose(example.hidden, hidden, rtol=0.02, atol=0.02 * float(hidden.abs().max()))
        assert torch.allclose(example.aux.float(), aux.float(), rtol=0.02, atol=0.02 * float(aux.abs().max()))
    long_prompt = next(text for n in range(40, 128) if len(llm.tokenizer.encode(text := " ".join(["x"] * n))) >= 120)
    short = distill.distill(llm, [long_prompt], 12, progress=False, aux_layers=(0, 1))[0]
    assert len(passes) == 1 and len(short.token_ids) == 128  # the context (128 tokens) cut the answer short
    assert not set(short.token_ids[-6:].tolist()) & llm.tokenizer.eos_token_ids  # (no EOS ended it)


def test_an_interrupted_run_resumes_after_its_last_chunk(llm, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK", 3)
    answering(llm, monkeypatch, stop_after=5)
    with pytest.raises(KeyboardInterrupt):
        distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert len(chunk_files()) == 1  # the first three answers
    answered = answering(llm, monkeypatch)
    examples, path = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert answered == PROMPTS[3:]  # resumed after the chunk
    assert not chunk_files() and path.is_file()
    fresh = distill.distill(llm, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert len(examples) == len(fresh) == 7
    for got, expected in zip(examples, fresh):
        assert torch.equal(got.token_ids, expected.token_ids) and got.answer_start == expected.answer_start
        assert torch.equal(got.hidden, expected.hidden) and torch.equal(got.aux, expected.aux)
        assert got.aux.shape == (len(got.token_ids), 2 * 64) and got.aux.dtype == torch.bfloat16
    answered = answering(llm, monkeypatch)
    again, _ = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS, 6, progress=False, aux_layers=(0, 1))
    assert not answered and len(again) == 7  # read from the cache


def test_the_layers_read_key_the_cache(llm):
    with_layers, first = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS[:2], 4, progress=False, aux_layers=(1,))
    without, second = distill.distill_cached(llm, {"t": "tiny"}, PROMPTS[:2], 4, progress=False)
    assert first != second and with_layers[0].aux is not None and without[0].aux is None


def test_a_damaged_chunk_is_answered_again_and_the_numbering_stays_whole(llm, monkeypatch):
    monkeypatch.setattr(distill, "CHUNK", 2)
    answering(llm, monkeypatch, stop_after=6)
    with pytest.raises(KeyboardInterrupt):
        distill.distill_cached(llm, {"t": "damaged"}, PROMPTS, 5, progress=False)
    assert len(chunk_files()) == 3
    chunk_files()[1].write_bytes(b"torn")  # the second chunk damaged: the third must go too (its place is unknown)
    answered = answering(llm, monkeypatch, stop_after=2)
    with pytest.raises(KeyboardInterrupt):
        distill.distill_cached(llm, {"t": "damaged"}, PROMPTS, 5, progress=False)
    assert answered == PROMPTS[2:4]  # redone from the damaged chunk's first prompt, then stopped again
    answered = answering(llm, monkeypatch)
    examples, _ = distill.distill_cached(llm, {"t": "damaged"}, PROMPTS, 5, progress=False)
    assert answered == PROMPTS[4:] and len(examples) == 7  # the chunk written after the damage was kept
    assert not chunk_files()
