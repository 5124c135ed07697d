"""Drafting with a model whose tokenizer differs from the target's: the draft model drafts text in its
own vocabulary, and the text is tokenized again in the target's.

Each step the committed tokens are decoded to text and encoded in the draft model's vocabulary (the
draft cache keeps the prefix the new encoding shares with what it holds, and reads the rest); the
draft model drafts greedily; its tokens are decoded, appended to the last few committed tokens'
text and encoded in the target's vocabulary. That encoding must begin with those committed tokens
(a safe boundary: the drafted text did not merge into them); what follows, but its last token
(which more text could still change), is the draft.

What the draft model reads is bounded. It reads the text from a start point (an index into the
committed target tokens) that stays put while it can, so the draft cache keeps its prefix. The start
moves up to the last W = `context_window` tokens once the text since it is 2W tokens long, or where
its encoding would hold more draft tokens than the request has target tokens (the draft's cache is
sized by the target's), W halved until the encoding fits.

Lossless for every request: the draft is a point mass the target verifies (greedy and seeded rows
by equality with the target's own token; sampled rows by rejection sampling, which accepts a point
mass at x with probability p(x) and otherwise draws from p without x: exactly p, whatever proposed
x; `verify.py`). A draft in another vocabulary has no probabilities over the target's tokens, so no
rule needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftwise.runner.model_runner import ModelRunner
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.autoregressive import draft_autoregressively
from draftwise.model.memory import module_bytes
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.sequence import SequenceState
from draftwise.text.tokenizer import Tokenizer

TAIL_TOKENS = 4  # committed target tokens re-encoded with the drafted text (the boundary check)
EXTRA_DRAFT_TOKENS = 2  # drafted beyond k in the draft's vocabulary (its tokens may be shorter)
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(slots=True)
class _DraftSide:
    """What the draft model reads of a request: its text in the draft's vocabulary (drafted greedily)."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    output_ids: list[int] = field(default_factory=list)
    grammar: None = None
    bad_words_ids: list = field(default_factory=list)
    end_token_ids: frozenset = frozenset()
    row: int | None = None
    segment: str | None = None
    tenant: str | None = None
    prefix_salt: bytes = b""
    finish_reason: str | None = None


class CrossTokenizerProposer:
    catch_up_window = None

    def __init__(self, runner: ModelRunner, draft_tokenizer: Tokenizer, target_tokenizer: Tokenizer,
                 context_window: int | None = None) -> None:
        self.runner = runner
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.context_window = context_window  # target tokens the draft reads at least (None: all that fit)
        self._rows: dict[str, int] = {}  # request id -> draft cache row
        self._held: dict[str, list[int]] = {}  # request id -> the draft-vocabulary ids its row holds
        self._starts: dict[str, int] = {}  # request id -> the first committed target token the draft reads

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        sides, rows = [], []
        asked = [k + EXTRA_DRAFT_TOKENS if k else 0 for k in num_tokens]
        for seq, extra in zip(seqs, asked):
            ids = self._draft_ids(seq, room=min(self.runner.max_len - extra, len(seq.token_ids)) - 1)
            row = self._rows.get(seq.request_id)
            if row is None:
                row = self._rows[seq.request_id] = self.runner.allocate()
            held = self._held.get(seq.request_id, [])
            shared = 0
            while shared < min(len(held), len(ids) - 1) and held[shared] == ids[shared]:
                shared += 1
            self.runner.truncate(row, min(shared, self.runner.length(row)))
            sides.append(_DraftSide(seq.request_id, ids))
            rows.append(row)
        drafted = draft_autoregressively(self.runner, rows, sides, asked)
        drafts = []
        for seq, side, row, draft, k in zip(seqs, sides, rows, drafted, num_tokens):
            # The cache now holds the context and the draft but its last token: keep the context.
            self.runner.truncate(row, min(self.runner.length(row), len(side.token_ids)))
            self._held[seq.request_id] = side.token_ids[:self.runner.length(row)]
            drafts.append(Draft(self._in_target_vocabulary(seq, draft.token_ids)[:k]) if k else Draft([]))
        return drafts

    def _draft_ids(self, seq: SequenceState, room: int) -> list[int]:
        """The request's committed text from its start point in the draft model's vocabulary, at most
        `room` tokens (the start moved up where it would be more; see the module's docstring)."""
        start = self._starts.get(seq.request_id, 0)
        window = self.context_window
        ids = self._encode(seq.token_ids[start:])
        if len(ids) > room or (window is not None and len(seq.token_ids) - start > 2 * window):
            keep = min(window or len(seq.token_ids), len(seq.token_ids))
            while True:
                start = len(seq.token_ids) - keep
                ids = self._encode(seq.token_ids[start:])
                if len(ids) <= room or keep == 1:
                    break
                keep //= 2
            self._starts[seq.request_id] = start
        return ids[-max(room, 1):]

    def _encode(self, target_ids: list[int]) -> list[int]:
        return self.draft_tokenizer.encode(self.target_tokenizer.decode(target_ids, skip_special_tokens=False))

    def _in_target_vocabulary(self, seq: SequenceState, draft_ids: list[int]) -> list[int]:
        """The drafted text as target tokens after the committed ones, up to a safe boundary."""
        text = self.draft_tokenizer.decode(draft_ids, skip_special_tokens=False)
        text = text.split("\ufffd", 1)[0]  # (a character the draft cut in half)
        if not text:
            return []
        tail = seq.token_ids[-TAIL_TOKENS:]
        ids = self.target_tokenizer.encode_batch([self.target_tokenizer.decode(tail, skip_special_tokens=False)
                                                  + text])[0]
        if ids[:len(tail)] != tail:  # the drafted text merged into the committed tokens
            return []
        return ids[len(tail):-1]  # (the last: more text could still change it)

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass  # (the next draft encodes the committed text again and keeps what its cache shares)

    def lag(self, seq: SequenceState) -> int:
        """Roughly the draft's backlog: the committed tokens its cache does not hold (counted in the
        target's tokens, which the draft vocabulary's lengths only approximate)."""
        return max(1, len(seq.token_ids) - len(self._held.get(seq.request_id, [])))

    def release(self, seq: SequenceState) -> None:
        self._held.pop(seq.request_id, None)
        self._starts.pop(seq.request_id, None)
        row = self._rows.pop(seq.request_id, None)
        if row is not None:
            self.runner.free(row)

    def footprint(self) -> Footprint:
        return Footprint(module_bytes(self.runner.model), ModelRunner.kv_bytes_per_token(self.runner.model))
