"""Drafting with a separate, smaller model that shares the target's vocabulary.

Context window: the draft model reads at most the last `context_window` tokens of a request (its
cache then starts at that offset). Before its first draft it must absorb the prompt, which for a
long prompt costs more than drafting can save on a short answer (a 700-token RAG prompt takes the
0.5B ~3 s on a CPU). A draft conditioned on the recent text only may be accepted less often, never
wrongly: the target verifies every token. When the backlog grows past the window (the controller
took plain steps for a while), the cache restarts from the last `context_window` tokens.

Prefix caching: where the target caches prefixes (`enable_prefix_caching`), so does the draft model,
in its own cache and by the same rule (`cache/block_manager.py`): a request starts with the draft
model's cached blocks of the longest prefix of its prompt an earlier request absorbed (a chat
template's system prompt, a conversation's earlier turns, a request sent again) and absorbs only the
rest; its catch-up, as the controller prices it (`lag`), is that rest. A window then counts from
the prompt's first token as before: a request whose uncached rest fits the window reads its whole
context. Only prompt tokens are offered (a generated token is computed by the decoding kernels).

Prompt kernels: where the target computes prompts by kernels of their own (`model/prompt_pass.py`),
the draft model follows the same rule: what its cache lacks of the prompt goes in a prompt pass of
its own before drafting, its generated tokens in decoding passes (the 0.5B's catch-up of 64-256
tokens measured 1.01-1.08x faster so on a 2-core Xeon: its layers are narrow). A drafter's numbers
need not match the target's, but under the same rule the target drafting for itself still accepts
every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.errors import InvalidParameterError
from draftwise.loading.hf_folder import load_model, resolve_quantization
from draftwise.loading.registry import DEFAULT_DRAFT
from draftwise.loading.resolve import resolve_model
from draftwise.quant.apply import check_quantization
from draftwise.runner.model_runner import ModelRunner
from draftwise.speculative.autoregressive import check_confidence, draft_autoregressively
from draftwise.speculative.cross_tokenizer import CrossTokenizerProposer
from draftwise.model.memory import module_bytes
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState
from draftwise.speculative.vocab_trim import kept_token_ids, trim_lm_head
from draftwise.speculative.vocabulary import check_same_vocabulary
from draftwise.text.tokenizer import Tokenizer


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, confidence_threshold: float = 0.0,
                 context_window: int | None = None, branches: int = 1) -> None:
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.context_window = context_window  # None: the whole context
        self.branches = branches
        self._rows: dict[str, int] = {}  # request id -> draft cache row
        self._offsets: dict[str, int] = {}  # request id -> the first token the row holds
        self._drafted: dict[str, tuple[int, list[int]]] = {}  # request id -> (committed tokens then, chain drafted)
        self._digests: dict[str, list[bytes]] = {}  # request id, before its row -> its prompt's prefix hashes

    @property
    def catch_up_window(self) -> int | None:
        return self.context_window

    def _row(self, seq: SequenceState) -> int:
        if seq.request_id not in self._rows:
            self._rows[seq.request_id] = row = self.runner.allocate()
            self._offsets[seq.request_id] = 0
            if _shares(seq):
                self.runner.share_prefix(row, _prompt(seq), seq.prefix_salt)  # (0 tokens without prefix caching)
            self._digests.pop(seq.request_id, None)
        row = self._rows[seq.request_id]
        if self.context_window is not None and self._backlog(seq) > self.context_window:
            self.runner.truncate(row, 0)  # restart from the window's start
            self._offsets[seq.request_id] = len(seq.token_ids) - self.context_window
        return row

    def _backlog(self, seq: SequenceState) -> int:
        row = self._rows.get(seq.request_id)
        if row is None and not _shares(seq):
            held = 0
        elif row is None:  # what its row would start with (the prompt's hashes taken once a request)
            if seq.request_id not in self._digests:
                self._digests[seq.request_id] = self.runner.prefix_digests(_prompt(seq), seq.prefix_salt)
            held = self.runner.cached_prefix_length(self._digests[seq.request_id])
        else:
            held = self._offsets[seq.request_id] + self.runner.length(row)
        return len(seq.token_ids) - held

    def tree_nodes(self, k: int) -> int:
        """A draft of depth k: its chain and branches - 1 leaves beside each of its tokens."""
        return k * self.branches

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        rows = [self._row(seq) for seq in seqs]
        if self.runner.prompt_kernels:
            self._feed_prompts([(seq, row) for seq, row, k in zip(seqs, rows, num_tokens) if k > 0])
        drafts = draft_autoregressively(self.runner, rows, seqs, num_tokens,
                                        offsets=[self._offsets[seq.request_id] for seq in seqs],
                                        confidence_threshold=self.confidence_threshold, branches=self.branches)
        if not self.runner.prompt_kernels:  # (the prompt went in the drafting passes)
            self._offer_prompts([(seq, row) for seq, row, k in zip(seqs, rows, num_tokens) if k > 0])
        # The chain the cache was fed: a tree's first children (`chain_with_leaves` puts the chain first); never its leaves.
        for seq, draft in zip(seqs, drafts):
            self._drafted[seq.request_id] = (len(seq.token_ids), draft.first_children().token_ids)
        return drafts

    def _feed_prompts(self, drafting: list[tuple[SequenceState, int]]) -> None:
        """What the drafting rows' caches lack of their prompts, in one prompt pass."""
        fed = []  # (row, the prompt tokens it lacks)
        for seq, row in drafting:
            held = self._offsets[seq.request_id] + self.runner.length(row)
            prompt_length = len(seq.token_ids) - len(seq.output_ids)
            if held < prompt_length:
                fed.append((row, seq.token_ids[held:prompt_length]))
        if fed:
            self.runner.forward([row for row, _ in fed], [ids for _, ids in fed], [1] * len(fed), prompt=True)
        self._offer_prompts(drafting)

    def _offer_prompts(self, drafting: list[tuple[SequenceState, int]]) -> None:
        """The prompt blocks rows read from its first token now hold become findable by later requests."""
        for seq, row in drafting:
            if self._offsets[seq.request_id] == 0 and _shares(seq):
                self.runner.register_prefix(row, _prompt(seq), seq.prefix_salt)

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        # The cache holds the old tokens and the drafted chain fed back; the drafted tokens the
        # target committed stay (up to the first that differs: a tree may have taken a leaf), the
        # rest is rolled back (all committed tokens but the newest are then cached).
        for seq in seqs:
            row = self._rows.get(seq.request_id)
            if row is not None:
                committed, chain = self._drafted.pop(seq.request_id, (len(seq.token_ids), []))
                agree = 0
                for drafted, kept in zip(chain, seq.token_ids[committed:]):
                    if drafted != kept:
                        break
                    agree += 1
                keep = min(len(seq.token_ids) - 1, committed + agree) - self._offsets[seq.request_id]
                self.runner.truncate(row, max(0, min(self.runner.length(row), keep)))

    def lag(self, seq: SequenceState) -> int:
        backlog = self._backlog(seq)
        return backlog if self.context_window is None else min(backlog, self.context_window)

    def release(self, seq: SequenceState) -> None:
        self._drafted.pop(seq.request_id, None)
        self._digests.pop(seq.request_id, None)
        row = self._rows.pop(seq.request_id, None)
        self._offsets.pop(seq.request_id, None)
        if row is not None:
            self.runner.free(row)

    def reset_prefix_cache(self) -> None:
        """No request finds an earlier one's prompt in the draft model's cache any more."""
        self.runner.blocks.reset_prefix_cache()

    def footprint(self) -> Footprint:
        return Footprint(module_bytes(self.runner.model), ModelRunner.kv_bytes_per_token(self.runner.model))


def _shares(seq: SequenceState) -> bool:
    """Whether a sequence takes part in prefix caching: a request is drafted for once its prompt pass
    gave it a first token, so its rows never roll back into its prompt; a sequence without output (the
    cost profile's, which also times a catch-up from nothing) neither finds nor offers blocks."""
    return bool(seq.output_ids)


def _prompt(seq: SequenceState) -> list[int]:
    tokens = seq.token_ids
    return tokens[:len(tokens) - len(seq.output_ids)]


@dataclass(slots=True)
class DraftModelOptions:
    model: str = option(DEFAULT_DRAFT, "the draft model: a known name, a GGUF file or a HF folder, with the "
                        "target's tokenizer (another's with --cross-tokenizer true)", flag="--draft", cost=True)
    quantization: str = option("auto", "the draft model's weights: auto (int4_all on CPU), int4, int4_all, int8, "
                               "none", flag="--draft-quantization", cost=True)
    draft_vocab_size: int | None = option(32768, "score only the N most frequent tokens in the draft's LM head "
                                          "(0: the full vocabulary)", zero_is_none=True, cost=True)
    draft_context_window: int | None = option(128, "the draft model reads only the last N tokens (0: all)",
                                              zero_is_none=True)
    draft_confidence_threshold: float = option(0.0, "stop drafting after a token drafted with less probability "
                                               "(0: never)", flag="--confidence")
    draft_branches: int = option(1, "choices per drafted position: above 1 the draft is a token tree with the "
                                    "next choices as leaves, verified as far as this machine's costs say it pays "
                                    "(1: a chain)")
    cross_tokenizer: bool = option(False, "a draft model with another tokenizer: it drafts text, which is "
                                          "tokenized again in the target's vocabulary (`cross_tokenizer.py`)",
                                   cost=True)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidParameterError(f"model must name the draft model, got {self.model!r}")
        check_quantization(self.quantization)
        if self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool)
                or self.draft_vocab_size < 16):
            raise InvalidParameterError(f"draft_vocab_size must be an integer >= 16, got {self.draft_vocab_size!r}")
        if self.draft_context_window is not None and (
                not isinstance(self.draft_context_window, int) or isinstance(self.draft_context_window, bool)
                or self.draft_context_window < 1):
            raise InvalidParameterError(
                f"draft_context_window must be a positive integer or None, got {self.draft_context_window!r}")
        check_confidence(self.draft_confidence_threshold)
        if not isinstance(self.draft_branches, int) or isinstance(self.draft_branches, bool) \
                or not 1 <= self.draft_branches <= 4:
            raise InvalidParameterError(f"draft_branches must be an integer in [1, 4], got {self.draft_branches!r}")
        if not isinstance(self.cross_tokenizer, bool):
            raise InvalidParameterError(f"cross_tokenizer must be true or false, got {self.cross_tokenizer!r}")
        if self.cross_tokenizer and self.draft_branches > 1:
            raise InvalidParameterError("cross_tokenizer drafts text, not token trees: draft_branches must be 1")


def check_draft_model(options: DraftModelOptions, target_tokenizer: Tokenizer, target_name: str,
                      progress: bool) -> None:
    """Before the target's weights load: the draft model exists and speaks the target's vocabulary
    (or drafts across vocabularies, when told to)."""
    folder = resolve_model(options.model, progress=progress, load_format="dummy")  # (its tokenizer only: no weights)
    if not options.cross_tokenizer:
        check_same_vocabulary(target_tokenizer, Tokenizer(folder), target_name, options.model)


def build_draft_model(target: Target, options: DraftModelOptions) -> DraftModelProposer | CrossTokenizerProposer:
    runner = target.runner
    quantization = resolve_quantization(options.quantization, runner.device, runner.dtype, draft=True)
    folder = resolve_model(options.model, progress=target.progress, load_format=target.load_format)
    draft_model = load_model(folder, runner.device, runner.dtype, quantization=quantization,
                             load_format=target.load_format)
    if options.cross_tokenizer:  # (its whole vocabulary: a trimmed head would rank the target's ids)
        return CrossTokenizerProposer(_draft_runner(draft_model, target), Tokenizer(folder), target.tokenizer,
                                      options.draft_context_window)
    target_vocab = runner.model.config.vocab_size
    if options.draft_vocab_size is not None and options.draft_vocab_size < draft_model.config.vocab_size:
        trim_lm_head(draft_model, kept_token_ids(target.tokenizer, options.draft_vocab_size), target_vocab)
    elif draft_model.config.vocab_size > target_vocab:  # (an embedding padded past the target's: its extra
        trim_lm_head(draft_model, torch.arange(target_vocab), target_vocab)  # ids are no tokens of the target)
    return DraftModelProposer(_draft_runner(draft_model, target), options.draft_confidence_threshold,
                              options.draft_context_window, options.draft_branches)


def _draft_runner(draft_model, target: Target) -> ModelRunner:
    """The draft model's cache holds as many tokens as the target's (it never holds more per
    request), plus a block per request for rounding."""
    runner = target.runner
    draft_model.prompt_kernels = runner.prompt_kernels  # (the target's rule: `DraftModelProposer`)
    return ModelRunner(draft_model, target.max_num_seqs, target.max_model_len,
                       num_blocks=runner.blocks.num_blocks + target.max_num_seqs,
                       block_size=runner.blocks.block_size, step_mode=runner.step_mode,
                       prefix_caching=runner.blocks.prefix_caching)


register(DrafterSpec("draft", "a smaller model with the same tokenizer (checked at start-up), or another one with "
                                "cross_tokenizer", DraftModelOptions,
                     build_draft_model, check=check_draft_model, per_request=False, drafts_with_model=True,
                     vllm_names=("draft_model",), vllm_model_option="model", vllm_model_default=True))
