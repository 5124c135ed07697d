"""Build a `tokenizers` tokenizer (tokenizer.json) from the vocabulary stored in GGUF metadata."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from draftwise.errors import ModelFormatError

# Pre-tokenizer split patterns, by the GGUF `tokenizer.ggml.pre` name (from each model's tokenizer spec).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = _QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "qwen2":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_PATTERN), "isolated"), byte_level])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), "isolated"), byte_level])
    if pre == "smollm":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in ("gpt-2", "default", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return None


def build_tokenizer(metadata: dict, source: str) -> Tokenizer:
    """metadata: the GGUF `tokenizer.ggml.*` fields as Python values."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelFormatError(
            f"{source}: tokenizer type {kind!r} is not supported yet (byte-level BPE 'gpt2' is); "
            "use a Hugging Face folder with tokenizer.json instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _pre_tokenizer(pre)
    if pre_tokenizer is None:
        raise ModelFormatError(f"{source}: pre-tokenizer {pre!r} is not supported yet")

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(token, special=kind_ == _CONTROL, normalized=False)
        for token, kind_ in zip(tokens, token_types)
        if kind_ in (_CONTROL, _USER_DEFINED)
    ])
    return tokenizer
