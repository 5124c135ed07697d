"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model` "llama": Gemma, Llama 2): merges
in the order of the merged pieces' scores, "▁" for spaces, byte fallback, user-defined pieces whole.
The real Gemma 3 vocabulary is checked against transformers in the real-model tests."""

from __future__ import annotations

import pytest

from draftwise.errors import ModelFormatError
from draftwise.loading.gguf_tokenizer import build_tokenizer

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6


def sentencepiece_metadata(pieces: dict[str, float], *, prefix_space: bool = False) -> dict:
    """A vocabulary: <unk>, <bos>, the 256 byte pieces, then `pieces` (score each), "  " (user-defined),
    <start> (control)."""
    tokens = ["<unk>", "<bos>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces) + ["  ", "<start>"]
    types = [CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces) + [USER_DEFINED, CONTROL]
    scores = [0.0] * 258 + list(pieces.values()) + [0.0, 0.0]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": prefix_space}


def pieces_of(tokenizer, text: str) -> list[str]:
    return tokenizer.encode(text, add_special_tokens=False).tokens


@pytest.mark.parametrize("ab_first", [True, False])
def test_the_higher_scoring_merge_goes_first(ab_first):
    scores = {"a": -1, "b": -2, "c": -3, "▁": -4, "ab": -5 if ab_first else -6, "bc": -6 if ab_first else -5}
    tokenizer = build_tokenizer(sentencepiece_metadata(scores), "test.gguf")
    assert pieces_of(tokenizer, "abc") == (["ab", "c"] if ab_first else ["a", "bc"])


def test_spaces_bytes_user_defined_pieces_and_decoding():
    tokenizer = build_tokenizer(sentencepiece_metadata(
        {"a": -1, "b": -2, "▁": -3, "ab": -4, "▁a": -5, "▁ab": -6}), "test.gguf")
    assert pieces_of(tokenizer, "ab ab") == ["ab", "▁ab"]
    assert pieces_of(tokenizer, "é") == ["<0xC3>", "<0xA9>"]  # (not in the vocabulary: its UTF-8 bytes)
    assert pieces_of(tokenizer, "a  b") == ["a", "  ", "b"]  # (a user-defined piece matches the raw text)
    assert pieces_of(tokenizer, "<start>a") == ["<start>", "a"]
    for text in ("ab ab", "é b", "a  b", " a"):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_a_prefix_space_is_added_and_removed():
    tokenizer = build_tokenizer(sentencepiece_metadata(
        {"a": -1, "b": -2, "▁": -3, "ab": -4, "▁a": -5, "▁ab": -6}, prefix_space=True), "test.gguf")
    assert pieces_of(tokenizer, "ab") == ["▁ab"]
    assert tokenizer.decode(tokenizer.encode("ab a", add_special_tokens=False).ids) == "ab a"


def test_scores_are_required():
    metadata = sentencepiece_metadata({"a": -1})
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelFormatError, match="scores"):
        build_tokenizer(metadata, "test.gguf")
