"""Build a `tokenizers` tokenizer (tokenizer.json) from the vocabulary stored in GGUF metadata.

Two kinds: byte-level BPE with merges (`gpt2`: Qwen, Llama 3, SmolLM) and SentencePiece BPE with
scores (`llama`: Gemma, Llama 2). SentencePiece merges the adjacent pair whose merged piece scores
highest; the same order as merges ranked by the merged piece's score, so it becomes a BPE model with
those merges, spaces written as "▁", and unknown characters spelled as byte tokens (<0xNN>).
"""

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
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's "▁"


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
    """metadata: the GGUF `tokenizer.ggml.*` fields as Python values (one missing or malformed: a
    ModelFormatError naming it)."""
    try:
        return _build_tokenizer(metadata, source)
    except KeyError as missing:
        raise ModelFormatError(f"{source}: tokenizer metadata {missing} is missing") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise ModelFormatError(f"{source}: malformed tokenizer metadata ({error})") from None
    except Exception as error:
        if type(error) is not Exception:  # (the tokenizers library's own refusals are plain Exceptions)
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "refused"
        raise ModelFormatError(f"{source}: inconsistent tokenizer metadata ({first_line})") from None


def _build_tokenizer(metadata: dict, source: str) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_bpe(metadata, source)
    if kind != "gpt2":
        raise ModelFormatError(
            f"{source}: tokenizer type {kind!r} is not supported yet (byte-level BPE 'gpt2' and SentencePiece "
            "BPE 'llama' are); use a Hugging Face folder with tokenizer.json instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _pre_tokenizer(pre)
    if pre_tokenizer is None:
        raise ModelFormatError(f"{source}: pre-tokenizer {pre!r} is not supported yet")

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFormatError(f"{source}: tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} duplicate tokens")

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


def _sentencepiece_bpe(metadata: dict, source: str) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] | None = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFormatError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, token_types), fuse_unk=True,
                                     byte_fallback=True, unk_token=tokens[unknown] if unknown is not None else None))
    normalize = [normalizers.Replace(" ", _SPACE)]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        normalize.insert(0, normalizers.Prepend(_SPACE))
    tokenizer.normalizer = normalizers.Sequence(normalize)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == _CONTROL])
    tokenizer.add_tokens([  # user-defined pieces (whitespace runs among them) match the raw text whole, and decode
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED])
    return tokenizer


def _merges_by_score(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the highest-scoring merged piece first
    (ties: by the parts' ids)."""
    normal = {token: index for index, (token, kind) in enumerate(zip(tokens, token_types)) if kind == _NORMAL}
    ranked = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
