"""Prompts on kernels of their own (`model/prompt_pass.py`, `quant/kernels/amx_prompt.cpp`): the AMX
kernels compute the bf16 product of the dequantized weights, each row independently of the rows and
threads beside it; in the engine every prompt token and no generated one takes them, and a request's
tokens and log-probabilities stay bit-identical whether it runs alone or batched, plain or speculative,
fresh or found in the prefix cache, preempted or not."""

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.quant.linear import pack_int8_strips, pack_strips
from draftwise.quant.native import amx_kernels
from draftwise.quant.superblock_strips import kernel_available, pack_q4k_strips, pack_q6k_strips
from draftwise.runner.model_runner import ModelRunner
from tests.test_superblock_kernels import q4k_m_like_model, q4k_weight, q6k_weight, random_q4k, random_q6k  # noqa: F401

needs_amx = pytest.mark.skipif(amx_kernels() is None or not kernel_available("q6k_matmul_q8", 256),
                               reason="no AMX-BF16 tiles (or no VNNI super-block kernels) on this machine")



def random_int4(n: int, k: int, seed: int = 0):
    """quants 0..15, fp16 scales and minimums per group of 32 (as int4 strips hold them)"""
    generator = torch.Generator().manual_seed(seed)
    quants = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=generator) * 0.01 + 1e-3).half().float()
    minimums = (torch.randn(n, k // 32, generator=generator) * 0.05).half().float()
    return quants, scales, minimums


def int4_weight(quants, scales, minimums) -> torch.Tensor:  # float32, as the kernel's fused s q - m rounds it
    return scales.repeat_interleave(32, 1) * quants.float() - minimums.repeat_interleave(32, 1)


def random_int8(n: int, k: int, seed: int = 0):
    """values -127..127 and a bf16 scale per channel (as Int8Linear keeps them)"""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    return values, (torch.rand(n, generator=generator) * 0.01 + 1e-3).bfloat16().float()


def int8_packed(values, scales):
    return pack_int8_strips(values), torch.nn.functional.pad(scales, (0, -len(scales) % 16)).contiguous()


def int8_weight(values, scales) -> torch.Tensor:
    return scales[:, None] * values.float()


# kernel, random weights (n, k, seed), the kernel's packed arguments, the weight it computes with
FORMATS = (("q4k_matmul_amx", random_q4k, lambda *w: (pack_q4k_strips(*w),), q4k_weight),
           ("q6k_matmul_amx", random_q6k, lambda *w: (pack_q6k_strips(*w),), q6k_weight),
           ("int4_matmul_amx", random_int4, lambda *w: (pack_strips(*w),), int4_weight),
           ("int8_matmul_amx", random_int8, int8_packed, int8_weight))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 32, 45])
def test_prompt_kernels_compute_the_bf16_product(rows):
    """Against float64 over the same bf16-rounded inputs and weights: only the float32 summation may
    differ (a wrong nibble, half, scale or offset would be off by far more)."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 40, 768  # (three strips: a pair and one alone; 40 is no multiple of 16)
    x = torch.randn(rows, k, generator=generator)
    for kernel, make, pack, weight_of in FORMATS:
        weights = make(n, k)
        weight = weight_of(*weights).bfloat16().double()  # [N, K]
        expected = x.bfloat16().double() @ weight.t()
        got = getattr(amx_kernels(), kernel)(x, *pack(*weights), n).double()
        assert got.shape == (rows, n)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), kernel


@needs_amx
def test_a_prompt_rows_output_depends_neither_on_the_rows_nor_on_the_threads_beside_it():
    generator = torch.Generator().manual_seed(0)
    n, k = 200, 512
    x = torch.randn(70, k, generator=generator)
    threads = torch.get_num_threads()
    for kernel, make, pack, _ in FORMATS:
        packed, matmul = pack(*make(n, k)), getattr(amx_kernels(), kernel)
        batch = matmul(x, *packed, n)
        for rows in (slice(0, 1), slice(3, 11), slice(17, 50), slice(0, 64)):
            assert torch.equal(matmul(x[rows].contiguous(), *packed, n), batch[rows]), (kernel, rows)
        try:
            torch.set_num_threads(1)
            assert torch.equal(matmul(x, *packed, n), batch), kernel
        finally:
            torch.set_num_threads(threads)


@needs_amx
def test_prompt_kernels_default_to_on_without_the_prefix_cache_and_refuse_a_non_boolean(q4k_m_like_model, tiny_qwen):
    assert not LLM(str(q4k_m_like_model), max_model_len=64, progress=False).model.prompt_kernels
    assert LLM(str(q4k_m_like_model), max_model_len=64, progress=False, enable_prefix_caching=False).model.prompt_kernels
    assert not LLM(str(tiny_qwen), max_model_len=64, progress=False, prompt_kernels=True,
                   quantization="none").model.prompt_kernels  # (float weights: no prompt kernel)
    with pytest.raises(InvalidParameterError, match="prompt_kernels"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False, prompt_kernels="yes")


PROMPTS = ["def add(a, b):\n    return a + b\n\n# now subtract\n", "class Stack:\n    def __init__(self):\n",
           "The quick brown fox jumps over the lazy dog, and then " * 3]
PARAMS = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)


def answers(llm, prompts, params=PARAMS):
    return [exactly(o) for o in llm.generate(prompts, params)]


def exactly(output):
    """An output's tokens and log-probabilities, exact floats: any change in a key or value shows."""
    return output.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in output.logprobs]


class Spy:
    """The prompt kernels, counting the rows of every call."""

    def __init__(self, kernels):
        self.kernels, self.rows = kernels, []

    def __getattr__(self, name):
        function = getattr(self.kernels, name)

        def counted(x, *args):
            self.rows.append(x.shape[0])
            return function(x, *args)
        return counted


@needs_amx
def test_prompt_tokens_take_the_prompt_kernels_and_generated_ones_never(q4k_m_like_model, monkeypatch):
    spy = Spy(amx_kernels())
    monkeypatch.setattr("draftwise.quant.linear.prompt_kernels", lambda: spy)
    monkeypatch.setattr("draftwise.quant.q6k_linear.prompt_kernels", lambda: spy)
    llm = LLM(str(q4k_m_like_model), max_model_len=256, progress=False, prompt_kernels=True,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.runner.prompt_kernels
    prompt_lengths = [len(llm.tokenizer.encode(p)) for p in PROMPTS]
    llm.generate(PROMPTS, PARAMS)
    assert spy.rows and set(spy.rows) == set(prompt_lengths)  # every prefill, nothing else
    assert len(spy.rows) % len(PROMPTS) == 0


@needs_amx
def test_outputs_with_prompt_kernels_do_not_depend_on_batching_caching_preemption_or_drafting(q4k_m_like_model):
    def engine(**kwargs):
        return LLM(str(q4k_m_like_model), max_model_len=256, max_num_seqs=3, progress=False, prompt_kernels=True,
                   **kwargs)

    llm = engine()
    assert llm.runner.prompt_kernels
    expected = [answers(llm, [p])[0] for p in PROMPTS]  # alone, fresh
    assert answers(llm, PROMPTS) == expected  # batched, each prompt's blocks found in the cache
    assert llm.engine_stats()["prefix_cache_hits"] > 0
    speculative = engine(speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert answers(speculative, PROMPTS) == expected
    # 9 blocks of 16 for three requests of ~40 tokens that grow by 24: the newest is preempted, then
    # resumed with its prompt in a prompt pass and what it generated in a decoding pass
    small = engine(kv_cache_memory_bytes=9 * 16 * ModelRunner.kv_bytes_per_token(llm.model))
    outputs = small.generate(PROMPTS, PARAMS)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the small cache preempted nothing"
    assert [exactly(o) for o in outputs] == expected


@needs_amx
def test_only_prompt_blocks_are_shared_under_prompt_kernels(q4k_m_like_model):
    """A follow-up repeating an answer finds the prompt's blocks, not the answer's (computed by the
    decoding kernels, where the follow-up's prompt pass would compute them by the prompt's)."""
    for prompt_kernels in (True, False):
        llm = LLM(str(q4k_m_like_model), max_model_len=256, progress=False, prompt_kernels=prompt_kernels)
        first = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
        hits = llm.engine_stats()["prefix_cache_hits"]
        follow_up = first.prompt_token_ids + first.token_ids + llm.tokenizer.encode(" and so on")
        llm.generate({"prompt_token_ids": follow_up}, SamplingParams(temperature=0, max_tokens=2))
        found = llm.engine_stats()["prefix_cache_hits"] - hits
        prompt_blocks = len(first.prompt_token_ids) // 16
        if prompt_kernels:
            assert found == prompt_blocks * 16
        else:
            assert found > prompt_blocks * 16


@needs_amx
def test_a_draft_model_takes_its_prompt_on_the_prompt_kernels_so_the_target_drafting_for_itself_accepts_all(
        q4k_m_like_model, monkeypatch):
    """The draft model follows the target's rule: its catch-up over the prompt in a prompt pass, its
    drafts in decoding passes. The target as its own draft model then has every token accepted."""
    spy = Spy(amx_kernels())
    monkeypatch.setattr("draftwise.quant.linear.prompt_kernels", lambda: spy)
    monkeypatch.setattr("draftwise.quant.q6k_linear.prompt_kernels", lambda: spy)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def engine(**kwargs):
        return LLM(str(q4k_m_like_model), max_model_len=256, max_num_seqs=3, progress=False, prompt_kernels=True,
                   **kwargs)

    expected = [o.token_ids for o in engine().generate(PROMPTS, params)]
    prefill_rows, spy.rows = sum(spy.rows), []  # every layer's rows over the target's prefills
    llm = engine(speculative={"method": "draft", "model": str(q4k_m_like_model), "quantization": "int4",
                              "num_speculative_tokens": 4, "adaptive": False, "draft_vocab_size": None,
                              "draft_context_window": None})
    outputs = llm.generate(PROMPTS, params)
    assert prefill_rows > 0 and sum(spy.rows) == 2 * prefill_rows  # the same prompts again, nothing generated
    assert [o.token_ids for o in outputs] == expected
    metrics = llm.spec_metrics
    assert metrics.num_draft_tokens >= 3 * 4 and metrics.num_accepted_tokens == metrics.num_draft_tokens


@needs_amx
def test_a_short_prompt_takes_the_prompt_kernels_with_a_static_step_too(q4k_m_like_model):
    """A static-shape step computes decoding passes; a prompt short enough to fit its buckets is still
    a prompt (else a short prompt's keys would depend on whether a long one shared its pass)."""
    def engine(**kwargs):
        return LLM(str(q4k_m_like_model), max_model_len=256, max_num_seqs=3, progress=False, prompt_kernels=True,
                   **kwargs)

    short = PROMPTS[:2]  # (~10 tokens each: within the step's buckets)
    expected = [answers(engine(), [p])[0] for p in short]
    static = engine(step_mode="eager")
    assert static.runner.static_step is not None
    assert [answers(static, [p])[0] for p in short] == expected  # each alone
    assert answers(static, short + [PROMPTS[2]])[:2] == expected  # beside a prompt past the buckets


@needs_amx
def test_a_draft_model_caches_its_prompt_blocks_under_prompt_kernels(q4k_m_like_model, drafting_pays):
    from tests.test_prefix_cache import check_draft_model_prefix_cache

    check_draft_model_prefix_cache(q4k_m_like_model, prompt_kernels=True)
