"""Output text as vLLM gives it: an output's first token decoded as it reads after the prompt (a
SentencePiece decoder strips the leading space of a text's first token), and the text held back at
the end (an incomplete character) checked for stop strings like any other."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

from draftwise.engine.sequence import Sequence
from draftwise.sampling.params import SamplingParams
from draftwise.text.tokenizer import Tokenizer


def sentencepiece_like(folder: Path) -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback, and a decoder that strips the leading
    space of the text it decodes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁The": 4, "▁capital": 5, "▁is": 6, "▁Paris": 7, ".": 8,
             "▁and": 9}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "add_bos_token": True}))
    return Tokenizer(folder)


def byte_level(folder: Path) -> Tokenizer:
    """A byte-level BPE (as Qwen's) with a few merges: a space and the first byte of "ꙮ" (0xEA) make
    one token, which ends inside a character; " STAR" is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    merges = [("Ġ", "ê"), ("Ġ", "S"), ("ĠS", "T"), ("ĠST", "A"), ("ĠSTA", "R")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Tokenizer(folder)


def run(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], params: SamplingParams):
    seq = Sequence("r", "", prompt_ids, params, tokenizer, tokenizer.eos_token_ids, 4096)
    deltas = []
    for token in output_ids:
        if not seq.finished:
            seq.append([token])
            deltas.append(seq.take_text_delta())
    return seq, deltas


def test_the_first_output_token_keeps_the_space_it_has_after_the_prompt(tmp_path):
    tokenizer = sentencepiece_like(tmp_path / "sp")
    prompt = tokenizer.encode("The capital is")
    output = [tokenizer.token_to_id(t) for t in ("▁Paris", "▁and", "▁Paris", ".")]
    seq, deltas = run(tokenizer, prompt, output, SamplingParams(max_tokens=10))
    assert seq.text == " Paris and Paris." == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
    assert "".join(deltas) == seq.text and deltas[0] == " Paris"
    stopped, _ = run(tokenizer, prompt, output, SamplingParams(max_tokens=10, stop=[" Paris"]))
    assert (stopped.text, stopped.finish_reason, len(stopped.output_ids)) == ("", "stop", 1)


def test_text_released_at_the_end_is_checked_for_stop_strings(tmp_path):
    tokenizer = byte_level(tmp_path / "bl")
    ids = tokenizer.encode("x ꙮ")
    assert tokenizer.decode(ids[:2]) == "x \ufffd"  # ("x", then a space and half a character)
    seq, deltas = run(tokenizer, tokenizer.encode("say: "), ids[:2], SamplingParams(max_tokens=2, stop=[" "]))
    assert (seq.text, seq.finish_reason) == ("x", "stop") and "".join(deltas) == "x"
    plain, _ = run(tokenizer, tokenizer.encode("say: "), ids[:2], SamplingParams(max_tokens=2))
    assert (plain.text, plain.finish_reason) == ("x \ufffd", "length")


def test_streamed_text_offsets_count_text_held_back_as_the_whole_ones_do(tmp_path):
    """A stop string's prefix is held back from the stream's text until it is known not to stop (" STAR"
    streams " ST" while "AR!" may follow); the streamed logprobs' text_offset still counts every
    listed token's whole text, as the unstreamed body does."""
    from draftwise.engine.outputs import Logprob
    from draftwise.server.logprobs import LogprobsFormat
    from draftwise.server.streaming import ChoiceStream, StreamContext

    tokenizer = byte_level(tmp_path / "bl")
    ids = tokenizer.encode("x STAR y z")
    assert tokenizer.decode(ids[1:2]) == " STAR"
    listed_as = LogprobsFormat(tokenizer, 0, False, tokenizer.eos_token_ids)
    stream = ChoiceStream(0, StreamContext("id", 0, "m", False, False, "s", None, logprobs=listed_as))
    seq = Sequence("r", "", [1], SamplingParams(max_tokens=len(ids), stop=["AR!"], logprobs=0), tokenizer,
                   tokenizer.eos_token_ids, 4096)
    streamed = []
    for token in ids:
        seq.append([token])
        seq.logprobs.append({token: Logprob(-1.0, 1)})
        output = seq.output()
        output.delta = seq.take_text_delta()
        for chunk in stream.chunks(output):
            if chunk["choices"][0]["logprobs"]:
                streamed += chunk["choices"][0]["logprobs"]["text_offset"]
    assert streamed == listed_as.body(seq.logprobs, seq.output_ids)["text_offset"] == [0, 1, 6, 7, 8, 9]
