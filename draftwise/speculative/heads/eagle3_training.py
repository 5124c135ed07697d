"""Training an EAGLE-3 head on distilled examples: training-time test (Li et al. 2025, section 3).

For an example of S tokens x_0..x_{S-1} with the target's fused streams a_0..a_{S-1} (`Example.aux`),
step 0 is one causal pass of the head over the pairs (fc(a_t), x_{t+1}), t = 0..S-2, whose output
g^1_t drafts x_{t+2}. Step j = 1..J-1 then feeds every row its own previous output beside the next
true token, (g^j_t, x_{t+j+1}), at position t + j: row t is the head's (j+1)-th draft from position
t, reading the features it produced itself, as it will when it drafts. Its attention sees the true
context (step 0's keys at positions <= t) and its own earlier steps at row t (`Eagle3Head.unrolled`).

    loss = mean_j  CE(W_draft . norm(g^{j+1}_t), x_{t+j+2})    over answer tokens in the draft vocabulary

(the answers are the target's greedy tokens, so the labels are what verification accepts). AdamW on
the head, its output norm and LM head included (the LM head starts as the target's rows of the draft
vocabulary, the norm as ones; the embedding stays the target's, frozen), a cosine schedule, a
checkpoint after every epoch that resumes, and after every epoch the held-out split's acceptance per
position, drafting as served. Three variants were tried on 240 prompts and dropped (BENCHMARKS.md):
a feature regression at the first step, a frozen output norm and LM head, and the norm starting as
the target's final norm.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from draftwise.speculative.heads.eagle3 import Eagle3Head
from draftwise.speculative.heads.eagle_training import MAX_STARTS
from draftwise.speculative.heads.medusa_training import IGNORED, kept_index_map
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, split_heldout, train_epochs

TTT_STEPS = 3  # unrolled drafting steps per position (speculators' default)


def train_eagle3(head: Eagle3Head, embed: Callable[[torch.Tensor], torch.Tensor], examples: list[Example],
                 vocab_size: int, settings: TrainSettings, checkpoint: Path | None = None,
                 progress: bool = True) -> TrainResult:
    """Train `head` in place; embed: token ids [S] -> the target's embeddings [S, H]."""
    if any(e.aux is None for e in examples):
        raise ValueError("EAGLE-3 training needs the target's fused streams (Example.aux)")
    # (states made under inference mode cannot be saved for backward: such are copied)
    examples = [Example(e.token_ids, e.answer_start, e.hidden.clone(), e.aux.clone()) if e.hidden.is_inference()
                else e for e in examples]
    train, heldout = split_heldout(examples, settings)
    heldout = heldout or train
    index = kept_index_map(head.kept_ids, vocab_size)
    with torch.no_grad():
        embedded = {id(e): embed(e.token_ids).float().clone() for e in train + heldout}  # [S, H] each
    return train_epochs(head, train, heldout, settings, lambda e: example_loss(head, e, embedded[id(e)], index),
                        lambda: acceptance_per_position(head, heldout, embedded, embed, settings.num_heads),
                        checkpoint, progress)


def example_loss(head: Eagle3Head, example: Example, embedded: torch.Tensor, index: torch.Tensor,
                 steps: int = TTT_STEPS) -> torch.Tensor:
    """The mean over the unrolled steps of the cross-entropy on the answer tokens each step drafts."""
    ids = example.token_ids
    length = len(ids)
    rows = length - 1  # row t: the pair (feature t, token t + 1)
    # the first row serving drafts from: the prompt's last token is fed with the answer's first (the
    # target's own, from the prefill), so drafting starts one row later, at the answer's second token
    first = max(0, example.answer_start - 1)
    positions = torch.arange(rows)
    features = head.fuse(example.aux[:-1])  # [S-1, H]
    tokens = embedded[1:]  # [S-1, H]: x_{t+1}
    earlier: list[tuple[torch.Tensor, torch.Tensor]] = []
    losses = []
    for j in range(steps):
        features, kv = head.unrolled(features, tokens, positions + j, earlier)  # row t drafts x_{t+j+2}
        earlier.append(kv)
        last = length - 3 - j  # rows t <= last have a label x_{t+j+2} inside the example
        if last < first:
            break
        targets = index[ids[first + j + 2:last + j + 3]]  # [rows first..last]
        if bool((targets != IGNORED).any()):
            logits = head.logits(features[first:last + 1])  # [n, N]
            losses.append(F.cross_entropy(logits, targets, ignore_index=IGNORED))
        # the next step reads x_{t+j+2} beside g: the tokens shift left, the tail padded with the last
        tokens = torch.cat([tokens[1:], tokens[-1:]])
    return torch.stack(losses).mean() if losses else features.sum() * 0.0


@torch.no_grad()
def acceptance_per_position(head: Eagle3Head, examples: list[Example], embedded: dict[int, torch.Tensor],
                            embed: Callable, depth: int) -> list[float]:
    """[depth]: share of draft starts (from the prompt's last position on, as serving drafts) where
    the chain's tokens 1..i are all the target's, drafting as served: the head's cache of the fused
    true features, then its own."""
    head.eval()
    starts = [(e, t) for e in examples for t in range(max(0, e.answer_start - 1), len(e.token_ids) - 2)]
    if not starts:
        return [0.0] * depth
    starts = starts[::max(1, len(starts) // MAX_STARTS)]
    passes = {}
    right = torch.zeros(len(starts), depth, dtype=torch.int32)
    for s, (example, t) in enumerate(starts):
        if id(example) not in passes:
            cache = head.new_cache()
            length = len(example.token_ids)
            out = head(head.fuse(example.aux[:-1]), embedded[id(example)][1:], torch.arange(length - 1), cache)
            passes[id(example)] = (out, cache)
        out, cache = passes[id(example)]
        drafted = draft_chain(head, embed, out[t], cache.prefix(t + 1), t + 1, depth)
        truth = example.token_ids[t + 2:t + 2 + depth].tolist()
        for i, (d, x) in enumerate(zip(drafted, truth)):
            if d != x:
                break
            right[s, i] = 1
    return right.float().mean(dim=0).tolist()


def draft_chain(head: Eagle3Head, embed: Callable, predicted: torch.Tensor, cache, position: int,
                depth: int) -> list[int]:
    """Greedy chain of `depth` tokens from the head's feature [H] at `position` (the cache holds
    the positions before it); the cache grows by depth - 1 entries."""
    tokens = []
    for j in range(depth):
        token = int(head.kept_ids[head.logits(predicted).argmax()])
        tokens.append(token)
        if j + 1 < depth:
            predicted = head(predicted[None], embed(torch.tensor([token])).float(), torch.tensor([position + j]), cache)[0]
    return tokens
