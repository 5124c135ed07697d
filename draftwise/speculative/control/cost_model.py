"""What a speculation step costs on this machine, measured rather than assumed.

Two tables, both in seconds:
  target[n]  one target forward over n new tokens (batch 1, a 256-token context), n = 1..64;
             a plain decoding step is target[1], verifying k drafted tokens is target[k + 1];
  draft[k]   one call of the drafter proposing k tokens, its overheads included (k = 1..K);
and catch_up, the seconds per token a drafter with its own cache (a draft model) spends absorbing
a backlog of committed tokens: the whole prompt before its first draft, or the tokens of plain
steps taken meanwhile. A step with k drafted tokens is modelled as draft[k] + target[k + 1] (plus the sampler, which is
in both and cancels out). Tables are measured once per machine and configuration (see
`profile.py`) and cached on disk; between measured points, and past the last one, costs are
interpolated / extrapolated linearly.

Batches: a step over B rows where row b drafts k_b tokens is modelled as one target pass over all
sum(k_b + 1) tokens where the runner packs a pass's rows (the weights are read once for all rows;
on a CPU the linear layers dominate, so n tokens cost the same in one row or in many: measured,
8 rows x 2 tokens = 1 row x 16), or over B x (max k_b + 1) where it pads rows to the widest
(`rows_padded`: the SDPA paths, static CUDA steps), plus the drafter's rounds: round j runs over the
rows still drafting and is assumed to grow with rows as the target's forward does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class CostModel:
    target: dict[int, float]  # n new tokens -> seconds of one target forward
    draft: dict[int, float] = field(default_factory=dict)  # k drafted tokens -> seconds of one propose call
    catch_up: float = 0.0  # seconds per backlog token the drafter absorbs before drafting
    key: str = ""  # what was measured: models, quantization, device, dtype, threads, torch
    spread: float = 1.0  # the largest slowest/fastest ratio between repeats of one point when measured
    rows_padded: bool = True  # the runner pads a pass's rows to the widest (set from it; not stored)

    def target_seconds(self, num_tokens: int) -> float:
        return _interpolate(self.target, num_tokens)

    def draft_seconds(self, num_tokens: int) -> float:
        return 0.0 if num_tokens <= 0 or not self.draft else _interpolate(self.draft, num_tokens)

    def catch_up_seconds(self, backlog: int) -> float:
        """Extra time of the first draft after the drafter fell `backlog` tokens behind (1 is normal)."""
        return self.catch_up * max(0, backlog - 1)

    def step_seconds(self, num_draft_tokens: int) -> float:
        """A step that drafts k tokens and verifies them (k = 0: a plain decoding step)."""
        return self.draft_seconds(num_draft_tokens) + self.target_seconds(num_draft_tokens + 1)

    def batch_draft_seconds(self, num_draft_tokens: list[int]) -> float:
        """The drafter's part of a batch step whose row b drafts k_b tokens: round j runs over the
        rows still drafting, growing with them as the target's forward does."""
        plain = self.target_seconds(1)
        drafting = 0.0
        for j in range(1, max(num_draft_tokens, default=0) + 1):
            rows = sum(k >= j for k in num_draft_tokens)
            drafting += (self.draft_seconds(j) - self.draft_seconds(j - 1)) * self.target_seconds(rows) / plain
        return drafting

    def pass_seconds(self, counts: list[int]) -> float:
        """One target pass in which row b feeds counts[b] tokens: their sum where the runner packs
        rows, rows x the widest where it pads them (measured padded: a row verifying 8 drafts beside
        7 plain rows cost 72 tokens' work)."""
        return self.target_seconds(len(counts) * max(counts, default=0) if self.rows_padded else sum(counts))

    def batch_step_seconds(self, num_draft_tokens: list[int]) -> float:
        """A step of a batch whose row b drafts k_b tokens (one row: `step_seconds`): its drafting and
        one target pass over every row's k_b + 1 tokens."""
        return self.batch_draft_seconds(num_draft_tokens) + self.pass_seconds([k + 1 for k in num_draft_tokens])

    # --- persistence ------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        del data["rows_padded"]  # (the runner's, not the measurement's)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        data = json.loads(text)
        return cls({int(n): float(s) for n, s in data["target"].items()},
                   {int(k): float(s) for k, s in data.get("draft", {}).items()},
                   float(data.get("catch_up", 0.0)), data.get("key", ""), float(data.get("spread", 1.0)))

    @classmethod
    def read(cls, path: Path) -> "CostModel | None":
        try:
            return cls.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(self.to_json())
            partial.replace(path)
        except OSError:
            pass  # a read-only cache: measure again next time

    def table(self) -> str:
        """Markdown: each n with its cost relative to a plain step."""
        plain = self.target_seconds(1)
        lines = ["| n | target forward ms | x plain step | drafter propose(n) ms |", "|---|---|---|---|"]
        for n in sorted(set(self.target) | set(self.draft)):
            target = f"{self.target[n] * 1e3:.1f} | {self.target[n] / plain:.2f}" if n in self.target else " | "
            draft = f"{self.draft[n] * 1e3:.1f}" if n in self.draft else ""
            lines.append(f"| {n} | {target} | {draft} |")
        lines.append(f"\nDrafter catch-up: {self.catch_up * 1e3:.2f} ms per token of backlog.")
        return "\n".join(lines)


def _interpolate(table: dict[int, float], n: int) -> float:
    points = sorted(table)
    if n in table:
        return table[n]
    if n <= points[0]:
        return table[points[0]] * n / points[0]
    below = max(p for p in points if p < n)
    above = min((p for p in points if p > n), default=None)
    if above is None:  # extrapolate along the last segment (or proportionally with one point)
        if len(points) == 1:
            return table[below] * n / below
        before = points[-2]
        slope = (table[below] - table[before]) / (below - before)
        return table[below] + max(slope, 0.0) * (n - below)
    fraction = (n - below) / (above - below)
    return table[below] + fraction * (table[above] - table[below])
