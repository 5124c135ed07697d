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
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from draftwise.speculative.heads.eagle3 import Eagle3Head
from draftwise.speculative.heads.eagle_training import MAX_STARTS, _answer_positions, _optimizer_groups
from draftwise.speculative.heads.medusa_training import IGNORED, kept_index_map
from draftwise.speculative.heads.training import (
    Checkpoint,
    EpochReport,
    Example,
    TrainResult,
    TrainSettings,
    split_heldout,
)

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
                loss = example_loss(head, example, embedded[id(example)], index)
                (loss * _answer_positions(example) / weight).backward()
                loss_sum += float(loss.detach()) * _answer_positions(example) / weight
            optimizer.step()
            schedule.step()
            total, steps = total + loss_sum, steps + 1
            bar.set_postfix(loss=f"{total / steps:.3f}")
        report = EpochReport(epoch, total / max(steps, 1),
                             acceptance_per_position(head, heldout, embedded, embed, settings.num_heads))
        result.reports.append(report)
        if progress:
            print(f"epoch {epoch + 1}: loss {report.train_loss:.3f}, held-out acceptance by position "
                  + " ".join(f"{a:.2f}" for a in report.heldout_acceptance))
        checkpointed.save(epoch, result)
    head.eval()
    return result


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
