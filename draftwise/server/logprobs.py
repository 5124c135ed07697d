"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` (token, logprob, bytes and the
top alternatives) and completions' legacy `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset). A request's end token (EOS or a stop token id) is not part of its text, so it is not
listed."""

from __future__ import annotations

from draftwise.engine.outputs import SampleLogprobs


def chat_logprobs(logprobs: SampleLogprobs, token_ids: list[int], tokenizer, top: int,
                  end_ids: frozenset[int] = frozenset()) -> dict:
    content = []
    for token, entry in _listed(logprobs, token_ids, end_ids):
        alternatives = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top), key=lambda item: item[1].rank)
        content.append({**_token(token, entry[token].logprob, tokenizer),
                        "top_logprobs": [_token(t, lp.logprob, tokenizer) for t, lp in alternatives[:top]]})
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: SampleLogprobs, token_ids: list[int], tokenizer, top: int,
                        end_ids: frozenset[int] = frozenset(), text_offset: int = 0) -> dict:
    """(An entry may be None: a prompt's first token, which nothing predicts; its logprob is null.)"""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in _listed(logprobs, token_ids, end_ids):
        text = tokenizer.decode([token], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry[token].logprob)
        alternatives = [] if entry is None else sorted(((t, lp) for t, lp in entry.items() if lp.rank <= top),
                                                       key=lambda item: item[1].rank)
        tops.append(None if entry is None else
                    {tokenizer.decode([t], skip_special_tokens=False): lp.logprob for t, lp in alternatives[:top]})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _listed(logprobs: SampleLogprobs, token_ids: list[int], end_ids: frozenset[int]):
    for token, entry in zip(token_ids, logprobs):
        if token not in end_ids:
            yield token, entry


def _token(token: int, logprob: float, tokenizer) -> dict:
    return {"token": tokenizer.decode([token], skip_special_tokens=False), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token))}


class LogprobsFormat:
    """How one request's logprobs are written (chat or completions, how many alternatives)."""

    def __init__(self, tokenizer, top: int, chat: bool, end_ids: frozenset[int]) -> None:
        self.tokenizer, self.top, self.chat, self.end_ids = tokenizer, top, chat, end_ids

    def body(self, logprobs: SampleLogprobs, token_ids: list[int], text_offset: int = 0) -> dict:
        if self.chat:
            return chat_logprobs(logprobs, token_ids, self.tokenizer, self.top, self.end_ids)
        return completion_logprobs(logprobs, token_ids, self.tokenizer, self.top, self.end_ids, text_offset)
