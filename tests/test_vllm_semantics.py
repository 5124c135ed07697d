"""Where a vLLM user's code meets the same meaning here: stop strings wait for min_tokens, the ending
token's text is kept with include_stop_str_in_output, cumulative_logprob is there for one sample too,
vLLM's None defaults are accepted, a bad prompt among several is named by its place, and a context
longer than the model's is refused rather than shortened."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError, PromptTooLongError

PROMPT = "The quick brown fox"


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **extra)


def test_stop_strings_are_looked_for_only_from_min_tokens_on(tiny_llm):
    full = tiny_llm.generate(PROMPT, greedy())[0]
    tokens = full.token_ids
    early = tiny_llm.tokenizer.decode(tokens[:3])
    stop = next(early[i:i + 2] for i in range(len(early) - 1)
                if early[i:i + 2].strip() and "\ufffd" not in early[i:i + 2])
    assert tiny_llm.generate(PROMPT, greedy(stop=[stop]))[0].finish_reason == "stop"
    later = tiny_llm.generate(PROMPT, greedy(stop=[stop], min_tokens=10))[0]
    assert len(later.token_ids) >= 10  # (stopped at 3 or fewer tokens before)
    assert later.token_ids == tokens[:len(later.token_ids)]


def test_include_stop_str_in_output_keeps_the_stop_tokens_text(tiny_llm):
    tokens = tiny_llm.generate(PROMPT, greedy())[0].token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i]
              and tiny_llm.tokenizer.decode([tokens[i]]).strip())
    without = tiny_llm.generate(PROMPT, greedy(stop_token_ids=[tokens[at]]))[0]
    kept = tiny_llm.generate(PROMPT, greedy(stop_token_ids=[tokens[at]], include_stop_str_in_output=True))[0]
    assert without.token_ids == kept.token_ids == tokens[:at + 1]
    assert without.text == tiny_llm.tokenizer.decode(tokens[:at])
    assert kept.text == tiny_llm.tokenizer.decode(tokens[:at + 1])


def test_cumulative_logprob_is_given_for_one_sample(tiny_llm):
    out = tiny_llm.generate(PROMPT, greedy(logprobs=2))[0]
    total = sum(entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total) and total < 0
    assert tiny_llm.generate(PROMPT, greedy())[0].outputs[0].cumulative_logprob is None


def test_vllms_none_defaults_and_wrong_types_are_named():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    with pytest.raises(InvalidParameterError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(InvalidParameterError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={"\u00b2": 1})  # (a digit to str.isdigit, not to int())


def test_a_bad_prompt_among_several_is_named_by_its_place(tiny_llm):
    with pytest.raises(PromptTooLongError, match=r"^prompts\[1\]: prompt has"):
        tiny_llm.generate(["ok", PROMPT * 200], greedy())
    with pytest.raises(InvalidParameterError, match="prompts must be a string"):
        tiny_llm.generate(None, greedy())
    assert not tiny_llm.engine.has_unfinished()


def test_a_context_longer_than_the_models_is_refused(tiny_qwen):
    positions = json.loads((tiny_qwen / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(InvalidParameterError, match=f"max_model_len {positions + 1} is more than the {positions}"):
        LLM(str(tiny_qwen), max_model_len=positions + 1, progress=False)
    assert LLM(str(tiny_qwen), progress=False).max_model_len == min(4096, positions)


def test_a_draft_model_with_a_padded_embedding_drafts_only_the_targets_ids(tiny_qwen, tmp_path):
    """A draft model whose embedding and head have rows past the target's vocabulary (padding): those
    ids are no tokens of the target, so its head is cut to the target's ids (before, every request
    failed with an index error in the target's embedding)."""
    padded = tmp_path / "padded"
    shutil.copytree(tiny_qwen, padded)
    weights = load_file(str(padded / "model.safetensors"))
    config = json.loads((padded / "config.json").read_text())
    vocab = config["vocab_size"]
    for name, tensor in list(weights.items()):
        if tensor.dim() == 2 and tensor.shape[0] == vocab:
            extra = torch.zeros(32, tensor.shape[1], dtype=tensor.dtype)
            extra[:, 0] = 50.0  # (rows that would win every argmax were they kept)
            weights[name] = torch.cat([tensor, extra]).contiguous()
    save_file(weights, str(padded / "model.safetensors"), metadata={"format": "pt"})
    (padded / "config.json").write_text(json.dumps({**config, "vocab_size": vocab + 32}))
    plain = LLM(str(tiny_qwen), progress=False).generate(PROMPT, greedy())[0]
    llm = LLM(str(tiny_qwen), progress=False, speculative={
        "method": "draft", "model": str(padded), "num_speculative_tokens": 3, "adaptive": False,
        "quantization": "none", "draft_vocab_size": 0})
    out = llm.generate(PROMPT, greedy())[0]
    assert out.finish_reason == "length" and out.token_ids == plain.token_ids
