"""Training Medusa heads on distilled examples (`training/distill.py`: the target's answers and hidden states).

From each answer position t (and the prompt's last, which predicts the answer's first token), head
i learns token t + 2 + i: cross-entropy over the kept vocabulary, averaged over heads (a target off
the kept list or past the text's end is skipped). AdamW on the residual blocks only (the LM rows are
the target's, frozen), a cosine schedule over all steps, a checkpoint after every epoch (a run
interrupted resumes from the last one), and after every epoch the held-out split's acceptance per
position: the share of positions where heads 0..i are all right, which is what a chain of i + 1
drafted tokens would have accepted.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from draftwise.speculative.heads.medusa import MedusaHeads
from draftwise.speculative.heads.training import (Checkpoint, EpochReport, Example, TrainResult, TrainSettings,
                                                  split_heldout)

IGNORED = -100  # a target position with nothing to learn


def positions(examples: list[Example], kept_index: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [P, H] and targets [P, K] (kept-vocabulary indices or IGNORED) of every answer position."""
    inputs, targets = [], []
    for example in examples:
        length = len(example.token_ids)
        start = max(0, example.answer_start - 1)
        ahead = torch.full((length - start, num_heads), IGNORED, dtype=torch.long)
        for i in range(num_heads):
            source = torch.arange(start, length) + 2 + i  # the token head i predicts from position t
            valid = source < length
            ahead[valid, i] = kept_index[example.token_ids[source[valid]]]
        inputs.append(example.hidden[start:])
        targets.append(ahead)
    return torch.cat(inputs), torch.cat(targets)


def kept_index_map(kept_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V]: a token's index among the kept ids, IGNORED if it is not kept."""
    index = torch.full((vocab_size,), IGNORED, dtype=torch.long)
    index[kept_ids] = torch.arange(len(kept_ids))
    return index


def train_medusa(heads: MedusaHeads, lm_rows: torch.Tensor, examples: list[Example], vocab_size: int,
                 settings: TrainSettings, checkpoint: Path | None = None, progress: bool = True) -> TrainResult:
    """Train `heads` in place; lm_rows [N, H] float: the target's LM head rows of heads.kept_ids."""
    train, heldout = split_heldout(examples, settings)
    index = kept_index_map(heads.kept_ids, vocab_size)
    train_x, train_y = positions(train, index, heads.num_heads)
    held_x, held_y = positions(heldout, index, heads.num_heads) if heldout else (train_x, train_y)
    steps_per_epoch = math.ceil(len(train_x) / settings.batch_size)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=settings.learning_rate,
                                  weight_decay=settings.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, steps_per_epoch * settings.epochs))
    result = TrainResult(asdict(settings), train_positions=len(train_x), heldout_positions=len(held_x))
    checkpointed = Checkpoint(checkpoint, heads, optimizer, schedule)
    first_epoch = checkpointed.resume(result)
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(first_epoch):  # (a resumed run shuffles its epochs as the uninterrupted run would)
        torch.randperm(len(train_x), generator=generator)
    for epoch in range(first_epoch, settings.epochs):
        heads.train()
        permutation = torch.randperm(len(train_x), generator=generator)
        total, batches = 0.0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not progress,
                   unit="step", leave=False)
        for step in bar:
            batch = permutation[step * settings.batch_size:(step + 1) * settings.batch_size]
            if not bool((train_y[batch] != IGNORED).any()):
                continue  # (every target off the kept vocabulary or past the end)
            loss = head_loss(heads, lm_rows, train_x[batch], train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total, batches = total + float(loss.detach()), batches + 1
            bar.set_postfix(loss=f"{total / batches:.3f}")
        report = EpochReport(epoch, total / max(batches, 1), acceptance_per_position(heads, lm_rows, held_x, held_y))
        result.reports.append(report)
        if progress:
            print(f"epoch {epoch + 1}: loss {report.train_loss:.3f}, held-out acceptance by position "
                  + " ".join(f"{a:.2f}" for a in report.heldout_acceptance))
        checkpointed.save(epoch, result)
    heads.eval()
    return result


def head_loss(heads: MedusaHeads, lm_rows: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over heads and positions with something to learn."""
    logits = heads.logits(inputs, lm_rows)  # [P, K, N]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED)


@torch.no_grad()
def acceptance_per_position(heads: MedusaHeads, lm_rows: torch.Tensor, inputs: torch.Tensor,
                            targets: torch.Tensor, chunk: int = 512) -> list[float]:
    """[K]: share of positions where heads 0..i all name the target's token (a position whose
    targets run past the text counts as a miss there)."""
    heads.eval()
    right = []
    for start in range(0, len(inputs), chunk):
        predicted = heads.logits(inputs[start:start + chunk], lm_rows).argmax(dim=-1)  # [P, K]
        right.append(predicted == targets[start:start + chunk])
    if not right:
        return [0.0] * heads.num_heads
    chained = torch.cumprod(torch.cat(right).int(), dim=1)  # [P, K]: 1 while every head so far was right
    return chained.float().mean(dim=0).tolist()
