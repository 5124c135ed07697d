"""Errors that reach users. Each names the thing that is wrong and what to do about it."""


class DraftwiseError(Exception):
    """Base class: everything draftwise raises on bad input derives from it."""


class ModelNotFoundError(DraftwiseError):
    """A model name or path that resolves to nothing."""


class ModelFormatError(DraftwiseError):
    """A model file that is corrupt, truncated or of an unsupported kind."""


class ChecksumError(DraftwiseError):
    """Assembled weights whose sha256 is not the pinned one."""


class InvalidParameterError(DraftwiseError, ValueError):
    """A sampling or engine parameter outside its allowed range."""


class PromptTooLongError(DraftwiseError, ValueError):
    """A prompt that, with its requested tokens, does not fit the context."""


class FetchError(DraftwiseError):
    """Weights that could not be obtained from their pinned packages."""


class KVCacheFullError(DraftwiseError):
    """The KV cache has no free block for a sequence (the scheduler preempts before this happens)."""


class ChatTemplateError(DraftwiseError, ValueError):
    """A conversation the model's chat template cannot render, in the template's own words (or a
    model without a chat template). It is the conversation's or the model's fault: HTTP 400."""


def check_text(value: str, what: str) -> str:
    """`value` unchanged if it is valid Unicode text; a lone surrogate (which JSON can carry as
    "\\ud800" but no tokenizer can encode) is refused naming where it is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidParameterError(
            f"{what} is not valid Unicode text: a lone surrogate U+{ord(value[error.start]):04X} at character "
            f"{error.start}") from None
    return value


class CacheNotWritableError(DraftwiseError):
    """The cache folder (DRAFTWISE_CACHE) cannot be written where a model must be fetched or converted."""
