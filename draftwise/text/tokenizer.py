"""Text <-> token ids (chat conversations included) and incremental (streaming) detokenization."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from draftwise.text.chat_isolation import Piece, isolate_client_text
from draftwise.text.chat_template import ChatTemplate, find_chat_template
from draftwise.errors import ChatTemplateError, InvalidParameterError, ModelFormatError

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")  # fill-in-the-middle's markers
MAX_GIVEN_TEMPLATES = 8  # chat_template sources passed in, kept compiled (the oldest goes first)
# Control tokens that end a turn in common chat formats; they end generation like EOS does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>",
                      "<end_of_turn>")


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelFormatError(f"{folder}: no tokenizer.json")
        self.name = folder.name
        self.path = path
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as error:  # (the tokenizers library raises a bare Exception on a malformed file)
            raise ModelFormatError(f"{path}: not a readable tokenizer ({error})") from None
        config_path = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ModelFormatError(f"{config_path}: unreadable ({error})") from None
        if not isinstance(config, dict):
            raise ModelFormatError(f"{config_path}: not a JSON object")
        self.chat_template: str | None = find_chat_template(folder, config)  # the Jinja source
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self._chat_template = (ChatTemplate(self.chat_template, self.name, self.bos_token, self.eos_token)
                               if self.chat_template else None)
        self._given_templates: dict[str, ChatTemplate] = {}  # chat_template sources passed in, newest last
        self._control_patterns: dict[str, re.Pattern | None] = {}  # per template source
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (`token_text`)
        self.add_bos_token: bool = bool(config.get("add_bos_token", False))
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        special = {token.content: index for index, token in self._tokenizer.get_added_tokens_decoder().items()
                   if token.special}
        eos_ids = {self.token_to_id(self.eos_token)} if self.eos_token else set()
        eos_ids |= {special[t] for t in END_OF_TURN_TOKENS if t in special}  # only real control tokens
        eos_ids |= _generation_config_eos(folder)  # (vLLM's source of a model's end tokens)
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos_ids if i is not None)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def id_to_token_list(self) -> list[str | None]:
        """Token text of every id, in id order (None for an id without a token)."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, index in vocab.items():
            tokens[index] = token
        return tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, control tokens included where their text appears (for trusted text)."""
        return self._with_bos(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Plain token ids of each text (no BOS), tokenized in parallel."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's added special tokens (control tokens such as EOS)."""
        return frozenset(index for index, token in self._tokenizer.get_added_tokens_decoder().items() if token.special)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text alone, special tokens as written (a logprob's `decoded_token`), kept once
        decoded: a request listing every token's logprob decodes the vocabulary once, not at each
        position (~0.2 s a time for Qwen's 152k tokens)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token may hold part of a character)."""
        token = self.id_to_token(token_id)
        if token is not None and self._byte_level and all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        return decoder.get("type") == "ByteLevel"

    def use_chat_template(self, source: str, described: str = "--chat-template") -> None:
        """Render every chat with this template (Jinja source) instead of the model's own: a server's
        `--chat-template` (vLLM's flag), for a model without one or with one to replace. Compiled
        here, so that a template that does not parse is refused before it serves anyone."""
        template = ChatTemplate(source, self.name, self.bos_token, self.eos_token, described=described)
        template.check_syntax()
        self.chat_template, self._chat_template = source, template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> str:
        """The conversation rendered by the model's chat template, or by `chat_template` (Jinja source,
        vLLM's option) where given (raises ChatTemplateError), with the tools the model may call
        (OpenAI's `tools` list) where the template renders them, and the options of
        `ChatTemplate.render`. Its text is not safe to `encode`: message text may spell control tokens;
        use `encode_chat`."""
        return self._template(chat_template).render(messages, add_generation_prompt, tools,
                                                    continue_final_message=continue_final_message,
                                                    chat_template_kwargs=chat_template_kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, *, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
        """Token ids of the rendered conversation (`encode_chat_rendered`'s ids)."""
        return self.encode_chat_rendered(messages, add_generation_prompt, tools, continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)[0]

    def encode_chat_rendered(self, messages: list[dict], add_generation_prompt: bool = True,
                             tools: list[dict] | None = None, *, continue_final_message: bool = False,
                             chat_template_kwargs: dict | None = None,
                             chat_template: str | None = None) -> tuple[list[int], str]:
        """Token ids of the rendered conversation, in which control tokens come only from the template,
        and the rendered text (`apply_chat_template`'s), rendered once for both.

        Every string the messages, tools and chat_template_kwargs hold (content, text parts, names,
        tool-call arguments, function descriptions, variables' text) is tokenized
        as plain text, so a user writing `<|im_start|>system` gets those characters, not the control
        tokens (`chat_isolation` finds the strings in the rendering). When no string holds the text of
        a control token, the ids are exactly `encode(apply_chat_template(messages))`. Control tokens:
        the special ones, and non-special ones the template writes (`_control_text_pattern`).
        Raises ChatTemplateError if the template fails, or transforms a string that holds control-token
        text (then it cannot be isolated, and the conversation is refused).
        """
        template = self._template(chat_template)

        def render(client_text: list) -> str:  # (the same options, whatever strings the client's are)
            conversation, tool_list, variables = client_text
            return template.render(conversation, add_generation_prompt, tool_list,
                                   continue_final_message=continue_final_message, chat_template_kwargs=variables)

        client_text = [messages, tools, chat_template_kwargs]  # (the tools' descriptions are client text too)
        rendered = render(client_text)
        pieces = isolate_client_text(client_text, rendered, render,
                                     lambda text: self._find_control_text(text, template.source))
        return (self.encode(rendered) if pieces is None else self._encode_isolated(pieces)), rendered

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        """Token ids of a fill-in-the-middle prompt (prefix, suffix, middle: `<|fim_prefix|>` prefix
        `<|fim_suffix|>` suffix `<|fim_middle|>`, the Qwen2.5-Coder / StarCoder layout), the client's
        text tokenized as text. Raises InvalidParameterError where the vocabulary has no such tokens."""
        ids = [self.token_to_id(token) for token in FIM_TOKENS]
        if any(i is None for i in ids):
            raise InvalidParameterError(f"suffix: this model's vocabulary has no fill-in-the-middle tokens "
                                        f"({', '.join(FIM_TOKENS)})")
        start, hole, middle = ids
        return self._with_bos([start, *self._encode_plain(prefix), hole, *self._encode_plain(suffix), middle])

    def _encode_isolated(self, pieces: list[Piece]) -> list[int]:
        """Ids of the pieces with added tokens matched in template pieces only.

        The text between two of the template's control tokens (template text and client strings
        together) is encoded as one stretch with no token matching. The tokenizer encodes the stretches
        between added tokens independently anyway, so client text comes out as it would have had it not
        spelled a control token. Boundary caveats, where it can differ from that: an added token that
        strips whitespace (`lstrip`/`rstrip`) cannot take it from the client text beside it, and a
        Metaspace pre-tokenizer that prepends "▁" to the first stretch only prepends it to every stretch.
        """
        ids: list[int] = []
        stretch = ""
        for piece in pieces:
            if piece.from_client:
                stretch += piece.text
                continue
            encoding = self._tokenizer.encode(piece.text, add_special_tokens=False)
            cursor = 0
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
                if token_id in self._added_token_ids:
                    ids += self._encode_plain(stretch + piece.text[cursor:start])
                    ids.append(token_id)
                    stretch, cursor = "", end
            stretch += piece.text[cursor:]
        ids += self._encode_plain(stretch)
        return self._with_bos(ids)

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain_text_tokenizer.encode(text, add_special_tokens=False).ids

    def _template(self, source: str | None = None) -> ChatTemplate:
        """The model's template, or one made from `source` (kept for the next calls, a few at a time)."""
        if source is not None:
            if not isinstance(source, str) or not source.strip():
                raise InvalidParameterError("chat_template must be a template's Jinja source (a non-empty string)")
            return _remembered(self._given_templates, source, lambda: ChatTemplate(
                source, self.name, self.bos_token, self.eos_token, described="the chat_template given"))
        if self._chat_template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template (none in chat_template.jinja, tokenizer_config.json "
                "or the GGUF metadata); send plain text (generate(), or the CLI without --chat)")
        return self._chat_template

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    def _control_text_pattern(self, template: str) -> re.Pattern | None:
        """Matches the text of every control token: a special added token, or a non-special one the
        chat template (its source `template`) itself writes (Qwen's `<tool_call>`: it can steer a model
        as much as `<|im_end|>`). Other non-special added tokens are ordinary vocabulary (Gemma's runs
        of newlines and spaces, its `<code>`, `<h1>`: plain `encode` matches them in any text, as the
        model was trained), and whitespace never forges a turn."""
        def pattern() -> re.Pattern | None:
            texts = sorted({token.content for token in self._tokenizer.get_added_tokens_decoder().values()
                            if token.content.strip() and (token.special or token.content in template)},
                           key=len, reverse=True)
            return re.compile("|".join(map(re.escape, texts))) if texts else None

        return _remembered(self._control_patterns, template, pattern)

    def _find_control_text(self, text: str, template: str | None = None) -> str | None:
        """The first control token's text (`_control_text_pattern` of the template source `template`,
        the model's by default) in `text`, as written or after the tokenizer's normalizer (tokens marked
        `normalized` are matched on normalized text)."""
        pattern = self._control_text_pattern((self.chat_template or "") if template is None else template)
        if pattern is None:
            return None
        normalizer = self._tokenizer.normalizer
        for candidate in (text, normalizer.normalize_str(text) if normalizer is not None else text):
            match = pattern.search(candidate)
            if match:
                return match.group()
        return None

    @cached_property
    def _plain_text_tokenizer(self) -> HFTokenizer:
        """A copy of the tokenizer that matches no added token: all are marked special (non-special
        added tokens would still match) and special-token matching is off. A copy, so that the shared
        tokenizer is never switched while another thread encodes."""
        data = json.loads(self.path.read_text(encoding="utf-8"))
        for token in data.get("added_tokens", []):
            token["special"] = True
        plain = HFTokenizer.from_str(json.dumps(data))
        plain.encode_special_tokens = True
        return plain


def _remembered(cache: dict, key, make):
    """cache[key], made now if absent; the cache keeps MAX_GIVEN_TEMPLATES entries (the oldest goes)."""
    if key not in cache:
        if len(cache) >= MAX_GIVEN_TEMPLATES:
            cache.pop(next(iter(cache)), None)
        cache[key] = make()
    return cache[key]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, characters)}


_UNICODE_TO_BYTE = {character: byte for byte, character in _byte_to_unicode().items()}


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in some tokenizer_config.json files
        return token.get("content")
    return token


PROMPT_CONTEXT_TOKENS = 5  # the prompt's tokens an output's first tokens are decoded after


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Decodes a small window of recent tokens each time (as byte-level BPE can split a UTF-8
    character across tokens) and holds text back while it ends in an incomplete character.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    @classmethod
    def after(cls, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        """One that decodes what follows `prompt_ids`: its window starts with the prompt's last few
        tokens (as vLLM's does), so the first output token is decoded as it reads after the prompt (a
        SentencePiece decoder strips the leading space of a text's first token: " Paris" alone
        decodes "Paris"). Not where the prompt ends inside a character: its bytes would join the
        output's."""
        tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if not tail or tokenizer.decode(tail, skip_special_tokens).endswith("\ufffd"):
            return cls(tokenizer, skip_special_tokens)
        return cls(tokenizer, skip_special_tokens, tail, "", 0, len(tail))

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self.token_ids.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset], skip)
        full_text = self.tokenizer.decode(self.token_ids[self._prefix_offset:], skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


def _generation_config_eos(folder: Path) -> set[int]:
    """The end tokens a model folder's generation_config.json names (`eos_token_id`: one id or a list);
    none where it has no such file. A malformed one is a ModelFormatError."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelFormatError(f"{path}: unreadable ({error})") from None
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelFormatError(f"{path}: eos_token_id must be a token id or a list of them, got {ids!r}")
    return set(ids)
