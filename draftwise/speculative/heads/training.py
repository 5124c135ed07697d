"""What training a head works with, whatever its kind: examples (a text the target wrote and its
hidden states over it), settings, and per-epoch reports."""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from draftwise.errors import InvalidParameterError
from draftwise.speculative.vocab_trim import kept_token_ids


@dataclass(slots=True)
class Example:
    token_ids: torch.Tensor  # [S] prompt + answer
    answer_start: int  # index of the answer's first token
    hidden: torch.Tensor  # [S, H] float32, after the final norm: position t predicts token t + 1
    # [S, L*H] bfloat16: the residual streams after the layers a head's training asked for
    # (`DrafterSpec.train_layers`), side by side; None: none asked for
    aux: torch.Tensor | None = None


@dataclass(slots=True)
class TrainSettings:
    num_heads: int = 4  # Medusa: heads; EAGLE: the draft depth its held-out acceptance is reported to
    epochs: int = 4
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 128  # positions per optimizer step
    heldout_share: float = 0.1  # examples kept out for acceptance per position (0: reported on the training set)
    seed: int = 0
    kept_tokens: int = 32768  # the vocabulary the head scores: the answers' tokens, then the most frequent
    head_width: int | None = None  # EAGLE: its layer's MLP width (None: 4/3 of the hidden size, at most the target's)
    # EAGLE: the head's passes under bfloat16 autocast (weights and optimizer stay float32); None: where
    # the device multiplies bfloat16 natively. Measured on an Intel Xeon with AMX, EAGLE-3 on the 1.5B:
    # an epoch 1.4x faster (with the fused optimizer 2.0x), the same loss after one epoch on 48 prompts;
    # whether a long run learns as well is not yet compared, so float32 stays the default.
    bf16: bool | None = False

    def __post_init__(self) -> None:
        for name in ("num_heads", "epochs", "batch_size", "kept_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < float("inf")):
            raise InvalidParameterError(f"learning_rate must be a positive number, got {self.learning_rate!r}")
        if not (isinstance(self.weight_decay, (int, float)) and 0 <= self.weight_decay < float("inf")):
            raise InvalidParameterError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.heldout_share, (int, float)) and 0 <= self.heldout_share < 1):
            raise InvalidParameterError(f"heldout_share must be in [0, 1), got {self.heldout_share!r}")
        if self.head_width is not None and (not isinstance(self.head_width, int) or self.head_width < 1):
            raise InvalidParameterError(f"head_width must be a positive integer, got {self.head_width!r}")


@dataclass(slots=True)
class EpochReport:
    epoch: int
    train_loss: float
    heldout_acceptance: list[float]  # [K]: share of held-out positions where heads 0..i are all right

    @property
    def mean_accepted(self) -> float:
        """Expected drafted tokens accepted per step with a chain of K: the sum over positions."""
        return sum(self.heldout_acceptance)


@dataclass(slots=True)
class TrainResult:
    settings: dict
    reports: list[EpochReport] = field(default_factory=list)
    train_positions: int = 0
    heldout_positions: int = 0


def split_heldout(examples: list[Example], settings: TrainSettings) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples, drawn with the settings' seed. No share, or a single example:
    nothing is held out (acceptance is then reported on the training examples)."""
    order = list(range(len(examples)))
    random.Random(settings.seed).shuffle(order)
    count = min(len(examples) - 1, max(1, round(len(examples) * settings.heldout_share))) \
        if settings.heldout_share > 0 and len(examples) > 1 else 0  # (at least one example is trained on)
    heldout = [examples[i] for i in order[:count]]
    return [examples[i] for i in order[count:]] or heldout, heldout


def training_vocabulary(examples: list[Example], tokenizer, settings: TrainSettings) -> torch.Tensor:
    """[N] sorted ids a head scores: every token of the training answers (not the held-out ones: their
    tokens kept for them would make the held-out acceptance read high), then the most frequent others,
    ~settings.kept_tokens in all."""
    size = settings.kept_tokens
    answered = {int(t) for e in split_heldout(examples, settings)[0] for t in e.token_ids[e.answer_start:]}
    ranked = kept_token_ids(tokenizer, size).tolist()
    return torch.tensor(sorted(answered | set(ranked[:max(0, size - len(answered))])), dtype=torch.long)


class Checkpoint:
    """A training run's state after each epoch (weights, optimizer, schedule, reports), so that an
    interrupted run resumes from its last finished epoch. path None: nothing kept."""

    def __init__(self, path: Path | None, module: nn.Module, optimizer, schedule) -> None:
        self.path, self.module, self.optimizer, self.schedule = path, module, optimizer, schedule

    def resume(self, result: TrainResult) -> int:
        """Load the saved state if any (its reports into `result`); the first epoch left to run."""
        if self.path is None or not self.path.is_file():
            return 0
        try:
            state = torch.load(self.path, weights_only=False)
            self._refuse_another_run(state, result)
            self.module.load_state_dict(state["weights"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
            result.reports = [EpochReport(**report) for report in state["reports"]]
            return state["epoch"] + 1
        except InvalidParameterError:
            raise
        except (RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidParameterError(
                f"{self.path}: an interrupted run's checkpoint that this run cannot resume (another kind of head, "
                f"another width, or a damaged file: {first}); delete it to start afresh, or resume with the "
                f"settings it was made with") from None

    def _refuse_another_run(self, state: dict, result: TrainResult) -> None:
        """A checkpoint of a run with other settings or other examples would resume into this one (its
        schedule's length, its vocabulary's rows): refused by what differs."""
        run = {"settings": result.settings, "train_positions": result.train_positions,
               "heldout_positions": result.heldout_positions}
        saved = state.get("run")
        if saved is None:  # (written before runs were recorded)
            return
        settings = [name for name in run["settings"] if saved["settings"].get(name) != run["settings"][name]]
        differ = [f"other {', '.join(settings)}"] if settings else []
        if saved["train_positions"] != run["train_positions"] or saved["heldout_positions"] != run["heldout_positions"]:
            differ.append("other training examples")
        if differ:
            raise InvalidParameterError(
                f"{self.path}: an interrupted run's checkpoint made with {' and '.join(differ)}; resume with "
                "the same data and settings, or delete it to start afresh")

    def save(self, epoch: int, result: TrainResult) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")  # (an interrupted save leaves the last one whole)
        torch.save({"weights": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "schedule": self.schedule.state_dict(), "epoch": epoch,
                    "reports": [asdict(r) for r in result.reports],
                    "run": {"settings": result.settings, "train_positions": result.train_positions,
                            "heldout_positions": result.heldout_positions}}, partial)
        os.replace(partial, self.path)


def answer_positions(example: Example) -> int:
    """Positions whose prediction is an answer token (or the feature of one)."""
    return max(1, len(example.token_ids) - 1 - max(0, example.answer_start - 2))


def optimizer_groups(train: list[Example], positions: int) -> list[list[int]]:
    """Consecutive examples gathered until each group holds about `positions` answer positions."""
    groups, current, held = [], [], 0
    for i, example in enumerate(train):
        current.append(i)
        held += answer_positions(example)
        if held >= positions:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return groups


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware (a CPU with AVX512-BF16 or AMX, a GPU that
    supports it): where autocast to it pays."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()


def train_epochs(head: nn.Module, train: list[Example], heldout: list[Example], settings: TrainSettings,
                 example_loss: Callable[[Example], torch.Tensor], heldout_acceptance: Callable[[], list[float]],
                 checkpoint: Path | None = None, progress: bool = True,
                 on_epoch: Callable[[int], None] | None = None) -> TrainResult:
    """A one-layer head's training loop (EAGLE-1, EAGLE-3): AdamW on its trainable parameters, a cosine
    schedule over every step, an optimizer step per group of about settings.batch_size answer positions
    (gradients accumulated over the group's examples, each weighted by its positions), a checkpoint
    after every epoch that resumes, and after every epoch the held-out acceptance per position.
    on_epoch(epoch) runs before each epoch (a resumed run's first too): where a loss draws random
    numbers, it seeds them by epoch, so that a resumed run draws what the uninterrupted one would."""
    trained = [p for p in head.parameters() if p.requires_grad]
    device = trained[0].device
    # fused: one pass over each tensor per step (the unfused update's temporaries are the size of the
    # head's LM head: with the page faults of allocating them, ~30% of an EAGLE-3 epoch on the 1.5B)
    optimizer = torch.optim.AdamW(trained, lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=True)
    bf16 = native_bf16(device) if settings.bf16 is None else settings.bf16
    groups = optimizer_groups(train, settings.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, len(groups) * settings.epochs))
    result = TrainResult(asdict(settings), train_positions=sum(answer_positions(e) for e in train),
                         heldout_positions=sum(answer_positions(e) for e in heldout))
    checkpointed = Checkpoint(checkpoint, head, optimizer, schedule)
    first_epoch = checkpointed.resume(result)
    generator = torch.Generator().manual_seed(settings.seed)
    for _ in range(first_epoch):  # (a resumed run shuffles its epochs as the uninterrupted run would)
        torch.randperm(len(groups), generator=generator)
    for epoch in range(first_epoch, settings.epochs):
        head.train()
        if on_epoch is not None:
            on_epoch(epoch)
        shuffled = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
        total, steps = 0.0, 0
        bar = tqdm(shuffled, desc=f"epoch {epoch + 1}/{settings.epochs}", disable=not progress, unit="step", leave=False)
        for group in bar:
            optimizer.zero_grad()
            weight = sum(answer_positions(train[i]) for i in group)
            loss_sum = 0.0
            for i in group:
                share = answer_positions(train[i]) / weight
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = example_loss(train[i])
                (loss * share).backward()
                loss_sum += float(loss.detach()) * share
            optimizer.step()
            schedule.step()
            total, steps = total + loss_sum, steps + 1
            bar.set_postfix(loss=f"{total / steps:.3f}")
        report = EpochReport(epoch, total / max(steps, 1), heldout_acceptance())
        result.reports.append(report)
        if progress:
            print(f"epoch {epoch + 1}: loss {report.train_loss:.3f}, held-out acceptance by position "
                  + " ".join(f"{a:.2f}" for a in report.heldout_acceptance))
        checkpointed.save(epoch, result)
    head.eval()
    return result
