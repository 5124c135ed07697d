"""Training an EAGLE head on distilled examples (`training/distill.py`: the target's answers and features).

For an example of S tokens x_0..x_{S-1} with features f_0..f_{S-1}, one causal pass of the head
over the pairs (f_t + noise, x_{t+1}), t = 0..S-2, predicts g_{t+1} at every position at once. Two
losses, as in EAGLE, on the positions that predict the answer:

    feature:  SmoothL1(g_{t+1}, f_{t+1})              (the head's output is its next input)
    token:    CE(W_lm . g_{t+1}, x_{t+2})             over the kept vocabulary
    loss = feature + TOKEN_WEIGHT * token

The noise (uniform, NOISE times the features' RMS) stands for the head's own errors, which it reads
back when it drafts more than one token. AdamW on the head (the embedding and the LM rows are the
target's, frozen), a cosine schedule, a checkpoint after every epoch that resumes, and after every
epoch the held-out split's acceptance per position, measured the way the head serves: from each
answer position, a chain drafted on the head's own features and cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from draftwise.speculative.heads.eagle import EagleHead, HeadKV
from draftwise.speculative.heads.medusa_training import IGNORED, kept_index_map
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, split_heldout, train_epochs

TOKEN_WEIGHT = 0.1  # EAGLE's weight of the token loss beside the feature loss
NOISE = 0.1  # uniform noise on the input features, relative to their RMS
MAX_STARTS = 512  # held-out draft starts measured per epoch (evenly spaced over the answers)


def train_eagle(head: EagleHead, lm_rows: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                examples: list[Example], vocab_size: int, settings: TrainSettings, checkpoint: Path | None = None,
                progress: bool = True) -> TrainResult:
    """Train `head` in place. lm_rows [N, H] float: the target's LM head rows of head.kept_ids;
    embed: token ids [S] -> the target's embeddings [S, H]."""
    # (features answered under inference mode cannot be saved for backward: such are copied)
    examples = [Example(e.token_ids, e.answer_start, e.hidden.clone()) if e.hidden.is_inference() else e
                for e in examples]
    train, heldout = split_heldout(examples, settings)
    heldout = heldout or train
    index = kept_index_map(head.kept_ids, vocab_size)
    with torch.no_grad():
        embedded = {id(e): embed(e.token_ids).float().clone() for e in train + heldout}  # [S, H] each
    noise = torch.Generator()  # the input features' noise, seeded by epoch (a resumed run draws the same)
    return train_epochs(head, train, heldout, settings,
                        lambda e: example_loss(head, lm_rows, e, embedded[id(e)], index, noise),
                        lambda: acceptance_per_position(head, lm_rows, heldout, embedded, embed, settings.num_heads),
                        checkpoint, progress, on_epoch=lambda epoch: noise.manual_seed(settings.seed + 1 + epoch))


def example_loss(head: EagleHead, lm_rows: torch.Tensor, example: Example, embedded: torch.Tensor,
                 index: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    features = example.hidden  # [S, H]
    ids = example.token_ids
    length = len(ids)
    noisy = features[:-1]
    if generator is not None:
        scale = NOISE * features.pow(2).mean().sqrt()
        noisy = noisy + (torch.rand(noisy.shape, generator=generator) * 2 - 1) * scale
    predicted = head(noisy, embedded[1:], torch.arange(length - 1))  # [S-1, H]: row t predicts f_{t+1}
    first = max(0, example.answer_start - 2)
    feature_loss = F.smooth_l1_loss(predicted[first:], features[first + 1:])
    targets = index[ids[first + 2:]]  # the token each row t in [first, S-3] predicts: x_{t+2}
    if targets.numel() == 0 or not bool((targets != IGNORED).any()):
        return feature_loss
    token_loss = F.cross_entropy(head.logits(predicted[first:length - 2], lm_rows), targets, ignore_index=IGNORED)
    return feature_loss + TOKEN_WEIGHT * token_loss


@torch.no_grad()
def acceptance_per_position(head: EagleHead, lm_rows: torch.Tensor, examples: list[Example],
                            embedded: dict[int, torch.Tensor], embed: Callable, depth: int) -> list[float]:
    """[depth]: share of draft starts (positions from the prompt's last on, as serving drafts: the
    first draft follows the first answer token) where the chain's tokens 1..i are all the target's,
    drafting as served: the head's cache of true features, then its own."""
    head.eval()
    # (from the prompt's last position on: the answer's first token is the target's own, never drafted)
    starts = [(e, t) for e in examples for t in range(max(0, e.answer_start - 1), len(e.token_ids) - 2)]
    if not starts:
        return [0.0] * depth
    step = max(1, len(starts) // MAX_STARTS)
    starts = starts[::step]
    passes: dict[int, tuple[torch.Tensor, HeadKV]] = {}
    right = torch.zeros(len(starts), depth, dtype=torch.int32)
    for s, (example, t) in enumerate(starts):
        if id(example) not in passes:
            cache = head.new_cache()
            out = head(example.hidden[:-1], embedded[id(example)][1:], torch.arange(len(example.token_ids) - 1), cache)
            passes[id(example)] = (out, cache)
        out, cache = passes[id(example)]
        drafted = draft_chain(head, lm_rows, embed, out[t], cache.prefix(t + 1), t + 1, depth)
        truth = example.token_ids[t + 2:t + 2 + depth].tolist()
        for i, (d, x) in enumerate(zip(drafted, truth)):
            if d != x:
                break
            right[s, i] = 1
    return right.float().mean(dim=0).tolist()


def draft_chain(head: EagleHead, lm_rows, embed: Callable, predicted: torch.Tensor, cache: HeadKV,
                position: int, depth: int) -> list[int]:
    """Greedy chain of `depth` tokens from the head's prediction [H] of the feature at `position`
    (the cache holds the positions before it); the cache grows by depth - 1 entries."""
    tokens = []
    for j in range(depth):
        token = int(head.kept_ids[head.logits(predicted, lm_rows).argmax()])
        tokens.append(token)
        if j + 1 < depth:
            predicted = head(predicted[None], embed(torch.tensor([token])).float(),
                             torch.tensor([position + j]), cache)[0]
    return tokens
