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
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from draftwise.speculative.heads.eagle import EagleHead, HeadKV
from draftwise.speculative.heads.medusa_training import IGNORED, kept_index_map
from draftwise.speculative.heads.training import (Checkpoint, EpochReport, Example, TrainResult, TrainSettings,
                                                  split_heldout)

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
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.learning_rate,
                                  weight_decay=settings.weight_decay)
    groups = _optimizer_groups(train, settings.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, len(groups) * settings.epochs))
    result = TrainResult(asdict(settings), train_positions=sum(_answer_positions(e) for e in train),
                         heldout_positions=sum(_answer_positions(e) for e in heldout))
    checkpointed = Checkpoint(checkpoint, head, optimizer, schedule)
    first_epoch = checkpointed.resume(result)
    generator = torch.Generator().manual_seed(settings.seed)
    for epoch in range(first_epoch, settings.epochs):
        head.train()
        shuffled = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
        total, steps = 0.0, 0
        bar = tqdm(shuffled, desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not progress, unit="step", leave=False)
        for group in bar:
            optimizer.zero_grad()
            weight = sum(_answer_positions(train[i]) for i in group)
            loss_sum = 0.0
            for i in group:  # gradients accumulate over the group's examples, weighted by their positions
                example = train[i]
                loss = example_loss(head, lm_rows, example, embedded[id(example)], index, generator)
                (loss * _answer_positions(example) / weight).backward()
                loss_sum += float(loss.detach()) * _answer_positions(example) / weight
            optimizer.step()
            schedule.step()
            total, steps = total + loss_sum, steps + 1
            bar.set_postfix(loss=f"{total / steps:.3f}")
        report = EpochReport(epoch, total / max(steps, 1),
                             acceptance_per_position(head, lm_rows, heldout, embedded, embed, settings.num_heads))
        result.reports.append(report)
        if progress:
            print(f"epoch {epoch + 1}: loss {report.train_loss:.3f}, held-out acceptance by position "
                  + " ".join(f"{a:.2f}" for a in report.heldout_acceptance))
        checkpointed.save(epoch, result)
    head.eval()
    return result


def _answer_positions(example: Example) -> int:
    """Positions whose prediction is an answer token (or the feature of one)."""
    return max(1, len(example.token_ids) - 1 - max(0, example.answer_start - 2))


def _optimizer_groups(train: list[Example], positions: int) -> list[list[int]]:
    """Consecutive examples gathered until each group holds about `positions` answer positions."""
    groups, current, held = [], [], 0
    for i, example in enumerate(train):
        current.append(i)
        held += _answer_positions(example)
        if held >= positions:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return groups


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
