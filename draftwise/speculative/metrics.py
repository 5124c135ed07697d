"""Speculation counters per request and in total, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecMetrics:
    num_drafts: int = 0  # verification steps that carried at least one drafted token
    num_plain_steps: int = 0  # decode steps without a draft (k = 0 chosen, or the drafter found nothing)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: drafts that had a token i
    # (a token tree: positions are depths; its nodes all count as draft tokens)
    draft_seconds: float = 0.0  # time in the drafter (for batched steps: the step's time)
    verify_seconds: float = 0.0  # time in the target's verification pass and the sampler
    # This request's decode steps in order, (drafted depth, accepted); (0, 0): a plain step. Per
    # request only: `merge` leaves it out. The planner replays it (`planner/replay.py`).
    steps: list[tuple[int, int]] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int, depth: int | None = None) -> None:
        """One verification of num_draft_tokens drafted tokens (a tree: nodes, `depth` deep)."""
        if num_draft_tokens == 0:  # a plain step: counted by `record_plain`
            return
        depth = num_draft_tokens if depth is None else depth
        self.steps.append((depth, num_accepted))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        _grow(self.drafted_per_position, depth)
        _grow(self.accepted_per_position, depth)
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    def record_plain(self) -> None:
        """A decode step without a draft (k = 0 chosen, or the drafter found nothing)."""
        self.num_plain_steps += 1
        self.steps.append((0, 0))

    def merge(self, other: "SpecMetrics") -> None:
        self.num_drafts += other.num_drafts
        self.num_plain_steps += other.num_plain_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            _grow(mine, len(theirs))
            for i, count in enumerate(theirs):
                mine[i] += count
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification step that carried a draft, COUNTING the recovered or
        bonus token (so 1.0 means nothing accepted; k + 1 means everything)."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def summary(self) -> str:
        return (f"acceptance {self.acceptance_rate:.0%} ({self.num_accepted_tokens}/{self.num_draft_tokens} "
                f"drafted), mean acceptance length {self.mean_acceptance_length:.2f} incl. bonus, "
                f"draft {self.draft_seconds:.2f} s / verify {self.verify_seconds:.2f} s")


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * (length - len(values)))
