"""Draft and target must speak the same vocabulary, or drafted ids mean different tokens."""

from __future__ import annotations

import re

from draftwise.errors import DraftwiseError
from draftwise.text.tokenizer import Tokenizer

_PADDING = re.compile(r"^(\[PAD\d+\]|<pad>|<\|pad\|>|<\|extra_?\d+\|>|<unused\d+>|<\|reserved_special_token_\d+\|>)$")


class TokenizerMismatchError(DraftwiseError):
    """Draft and target tokenizers assign different tokens to the same ids."""


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """Raise unless both map every id to the same token (extra padding at the end of one is fine)."""
    target_tokens, draft_tokens = target.id_to_token_list(), draft.id_to_token_list()
    common = min(len(target_tokens), len(draft_tokens))
    differing = [i for i in range(common) if target_tokens[i] != draft_tokens[i]]
    longer = target_tokens if len(target_tokens) > len(draft_tokens) else draft_tokens
    extra = [i for i in range(common, len(longer)) if not _PADDING.match(longer[i] or "")]
    if not differing and not extra:
        return
    first = differing[:3] or extra[:3]
    shown = ", ".join(f"id {i}: {_at(target_tokens, i)!r} vs {_at(draft_tokens, i)!r}" for i in first)
    raise TokenizerMismatchError(
        f"draft model {draft_name!r} cannot draft for target {target_name!r}: their tokenizers differ "
        f"(target {len(target_tokens)} tokens, draft {len(draft_tokens)} tokens; "
        f"{len(differing) + len(extra)} ids differ; first: {shown}). Use a draft model with the target's tokenizer."
    )


def _at(tokens: list[str | None], index: int) -> str | None:
    return tokens[index] if index < len(tokens) else None
