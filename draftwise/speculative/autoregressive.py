"""Drafting k tokens one at a time with a model behind a runner (shared by draft-model and layer-skip)."""

from __future__ import annotations

import torch

from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner
from draftwise.sampling.processors import RowHistory, needs_processing, process_positions
from draftwise.sampling.sampler import SamplingBatch, sample_from_probs, sampling_probs
from draftwise.speculative.proposer import Draft
from draftwise.speculative.sequence import SequenceState
from draftwise.structured.masks import fill_masks, refusal_bias


def draft_autoregressively(runner: ModelRunner, rows: list[int], seqs: list[SequenceState], num_tokens: list[int],
                           num_layers: int | None = None, confidence_threshold: float = 0.0,
                           offsets: list[int] | None = None, branches: int = 1) -> list[Draft]:
    """Feed each row what its cache lacks of the sequence, then draft num_tokens[b] tokens
    (rows asked for none are left alone and get an empty draft). Row b's cache holds the
    sequence's tokens from offsets[b] on (default 0: from the start).

    Confidence stop: a row stops drafting after a token the drafter gave a probability below
    `confidence_threshold` (that token is still proposed: it is already paid for, and costs only
    one more position in the verification pass).

    Greedy requests take the argmax; sampled requests draw from the warped draft distribution.
    A seeded request draws with the noise the target will use at that position (the coupling
    `draftwise/speculative/verify.py` describes: it is verified by equality, so no probabilities are
    kept); an unseeded one keeps its draft probabilities for rejection sampling.
    The last drafted token is not fed back (the target's verification pass does that).

    A request with penalties, a logit bias, min_tokens or bad words drafts with them applied as the
    target will apply them (`sampling.processors`, the draft so far in the history), so its drafts
    follow the processed target.
    A request with a grammar (structured outputs) drafts inside it (`GrammarDrafting`): its logits
    keep only the tokens the grammar allows after the committed tokens and the draft so far, so its
    drafts need no cutting where they would leave it. Lossless as any proposal is: a sampled row's
    probabilities are the masked ones it drew from.

    branches > 1: each drafted position also offers its next branches - 1 choices as leaves
    beside the drafted token (greedy: the next most probable; seeded: the next in the noise race;
    unseeded: drawn without replacement, each with its renormalised distribution), and the draft
    is a token tree, best first, scored by the drafter's confidences (`chain_with_leaves`); the engine
    verifies the part of it that pays.
    """
    token_ids: list[list[int]] = [[] for _ in seqs]
    probs: list[list[torch.Tensor]] = [[] for _ in seqs]
    confidences: list[list[float]] = [[] for _ in seqs]  # [B][k] the drafter's probability of each token
    leaves: list[list[list[tuple[int, float, torch.Tensor | None]]]] = [[] for _ in seqs]  # [B][k][branches - 1]
    offsets = offsets or [0] * len(seqs)
    pending = [seq.token_ids[offset + runner.length(row):] for seq, row, offset in zip(seqs, rows, offsets)]
    num_tokens = list(num_tokens)
    grammars = GrammarDrafting(seqs)
    try:
        for step in range(max(num_tokens, default=0)):
            live = [b for b, k in enumerate(num_tokens) if step < k]
            if not live:  # every row stopped early (confidence)
                break
            result = runner.forward([rows[b] for b in live], [pending[b] for b in live], [1] * len(live),
                                    num_layers=num_layers)
            logits = grammars.masked(processed(result.logits, live, seqs, token_ids), live)  # [n, V]
            params = [seqs[b].params for b in live]
            positions = [len(seqs[b].output_ids) + step for b in live]  # the output position each draft fills
            sampling = SamplingBatch.build(params, positions, logits.shape[-1], logits.device)
            scored = confidence_threshold > 0 or branches > 1  # (else no row needs its confidences)
            plain_probs = torch.softmax(logits, dim=-1) if scored or not sampling.all_greedy else None  # [n, V]
            if sampling.all_greedy:
                next_ids = logits.argmax(dim=-1)  # [n]
                draft_probs = plain_probs
            else:
                draft_probs = torch.where(sampling.greedy[:, None], plain_probs, sampling_probs(logits, sampling))
                sampled = sample_from_probs(draft_probs, sampling)
                next_ids = torch.where(sampling.greedy, logits.argmax(dim=-1), sampled)
                for i, b in enumerate(live):
                    if not params[i].greedy and params[i].seed is None:
                        probs[b].append(draft_probs[i])
            confidence = draft_probs.gather(-1, next_ids[:, None]).squeeze(-1).tolist() if scored else [1.0] * len(live)
            for i, b in enumerate(live):
                token = int(next_ids[i])
                token_ids[b].append(token)
                confidences[b].append(confidence[i])
                if branches > 1:
                    leaves[b].append(_other_choices(draft_probs[i], token, branches - 1, params[i], sampling, i))
                pending[b] = [token]
                if confidence[i] < confidence_threshold or not grammars.advance(b, token):
                    num_tokens[b] = step + 1  # confidence stop, or a token its grammar refuses (cut by the engine)
    finally:
        grammars.rewind()  # (the engine advances it over what is committed)
    if branches > 1:
        return [chain_with_leaves(ids, confidences[b], leaves[b], probs[b]) for b, ids in enumerate(token_ids)]
    return [Draft(ids, torch.stack(p) if p else None) for ids, p in zip(token_ids, probs)]


def processed(logits: torch.Tensor, live: list[int], seqs: list[SequenceState],
              drafted: list[list[int]]) -> torch.Tensor:
    """logits [n, V] of the live rows, each row with processors processed as the target will process
    its next position (history: committed tokens, then the draft so far)."""
    rows = [i for i, b in enumerate(live) if needs_processing(seqs[b].params)]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        seq = seqs[live[i]]
        prompt = seq.token_ids[:len(seq.token_ids) - len(seq.output_ids)]
        history = RowHistory(seq.params, prompt, seq.output_ids + drafted[live[i]], seq.end_token_ids,
                             seq.bad_words_ids)
        out[i] = process_positions(logits[i][None, None], [history], [[]])[0, 0].to(out.dtype)
    return out


class GrammarDrafting:
    """The grammars of a drafting call's rows, advanced through their drafts and rewound after."""

    def __init__(self, seqs: list[SequenceState]) -> None:
        self.grammars = [getattr(seq, "grammar", None) for seq in seqs]
        self.consumed = [0] * len(seqs)
        for seq, grammar in zip(seqs, self.grammars):
            if grammar is not None:
                grammar.sync(seq.output_ids)

    def masked(self, logits: torch.Tensor, live: list[int]) -> torch.Tensor:
        """logits [n, V] of the live rows with each constrained row's refused tokens at -inf; a row
        none of whose allowed tokens the drafter can score (a trimmed head) is left as it is."""
        constrained = [i for i, b in enumerate(live) if self.grammars[b] is not None]
        if not constrained:
            return logits
        vocab = logits.shape[-1]
        bitmask = fill_masks([(self.grammars[live[i]], []) for i in constrained], 1, vocab)
        index = torch.tensor(constrained, device=logits.device)
        masked = logits[index] + refusal_bias(bitmask, vocab, logits.device)  # [c, V]: -inf where refused
        reachable = torch.isfinite(masked).any(dim=-1, keepdim=True)
        out = logits.clone()
        out[index] = torch.where(reachable, masked, logits[index])
        return out

    def advance(self, b: int, token: int) -> bool:
        """Move row b's grammar over its drafted token; False if the grammar refuses it."""
        grammar = self.grammars[b]
        if grammar is None:
            return True
        if grammar.matcher.validate_tokens([token]) != 1 or not grammar.matcher.consume_token(token):
            return False
        self.consumed[b] += 1
        return True

    def rewind(self) -> None:
        for b, grammar in enumerate(self.grammars):
            if grammar is not None and self.consumed[b]:
                grammar.matcher.rollback(self.consumed[b])
                self.consumed[b] = 0


def _other_choices(q: torch.Tensor, chosen: int, count: int, params, sampling: SamplingBatch,
                   row: int) -> list[tuple[int, float, torch.Tensor | None]]:
    """The next `count` choices after `chosen` at one position: (token, q(token), the distribution it
    was drawn from, for unseeded rows)."""
    remaining = q.clone()
    remaining[chosen] = 0
    out = []
    for _ in range(count):
        if float(remaining.sum()) <= 0:
            break
        if params.greedy:
            token, source = int(remaining.argmax()), None
        elif params.seed is not None:  # the next in the same race (the noise the target draws with)
            token, source = int(sample_from_probs(remaining[None], sampling.select([row]))[0]), None
        else:
            source = remaining / remaining.sum()
            token = int(torch.multinomial(source, 1))
        out.append((token, float(q[token]), source))
        remaining[token] = 0
    return out


def chain_with_leaves(chain: list[int], confidences: list[float], leaves: list[list[tuple]],
             probs: list[torch.Tensor]) -> Draft:
    """The drafted chain, then the leaves beside its tokens, best first. Scores are products of the
    confidences along a node's path; a leaf's own is capped at its earlier siblings' (the drafted
    token's, then the leaf drawn before it), so that siblings keep the order they were drawn in,
    which rejection sampling needs, in every prefix of the list. The chain is kept whole
    (`kept_nodes`): its length is the controller's choice, from the acceptance it has seen; the
    engine adds the leaves that pay."""
    tokens, parents, scores, distributions = [], [], [], []
    above = [1.0]  # [k + 1] the chain's path scores (above[i]: above chain token i)
    for i, token in enumerate(chain):
        above.append(above[-1] * confidences[i])
        tokens.append(token)
        parents.append(i - 1)
        scores.append(above[-1])
        distributions.append(probs[i] if probs else None)
    extra = []  # (score, depth, order among siblings, token, parent, distribution)
    for i, choices in enumerate(leaves):
        cap = confidences[i]
        for j, (leaf, leaf_q, source) in enumerate(choices, start=1):
            cap = min(cap, leaf_q)
            extra.append((above[i] * cap, i, j, leaf, i - 1, source))
    extra.sort(key=lambda node: (-node[0], node[1], node[2]))
    for score, _, _, token, parent, source in extra:
        tokens.append(token)
        parents.append(parent)
        scores.append(score)
        distributions.append(source)
    stacked = torch.stack(distributions) if probs else None
    return Draft(tokens, stacked, parents, scores, kept_nodes=len(chain))


def check_confidence(threshold: float) -> None:
    """The confidence stop's threshold (an option of every autoregressive drafter)."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold < 1.0:
        raise InvalidParameterError(f"draft_confidence_threshold must be in [0, 1), got {threshold!r}")
