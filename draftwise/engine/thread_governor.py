"""How many CPU threads the next step runs on: all of them, unless the machine is shared.

The engine's passes split their work across threads that meet at a barrier after every parallel
region (hundreds per step). On a quiet 2-core machine two threads decode 1.6x faster than one; with
two busy processes beside it, each core is shared, every barrier waits for a descheduled thread, and
one thread decoded 1.45x faster than two (BENCHMARKS.md, the controller issue: 7.8-8.0 against
5.3-5.6 tokens/s). The load comes and goes; the governor measures which count is faster now.

Evidence. Every decoding step's target pass is timed (the engine's `StepTiming`); its cost depends
on n, the tokens it took, so each pass becomes a ratio to the quiet cost at that n: the lowest
median of RECENT passes ever seen at n with all threads (the machine at its best). Passes at n
never seen quiet teach nothing.

Rule. With all threads, when the recent passes run SLOWER than quiet (or every PROBE_INTERVAL steps
anyway, in case the load was there from the start), the next PROBE_STEPS steps run on one thread;
one thread is kept if its probe beat the recent all-thread passes by MARGIN. On one thread, after
PROBE_BACK steps (or as soon as the one-thread passes run FASTER than when it switched: the load
has eased; one thread decodes ~25% faster on a quiet machine than beside two busy processes)
PROBE_STEPS run on all threads, and all threads return if they beat the recent
one-thread passes by MARGIN; each failed probe doubles the wait (up to PROBE_INTERVAL: under two
busy Python processes a step on two threads took 2.3-3x one on one thread, so frequent probes
cost). Quiet, the probes cost 2 slow steps in PROBE_INTERVAL (~0.5%).

The count is the process's (`torch.set_num_threads`): two LLMs in one process share it, so the
governor sets it before every step where it differs from what this engine wants.

Lossless: the outputs must not depend on the thread count. Every CPU kernel here gives each output
element to one thread whole (no reduction split across threads), so the bits are the same at any
count; `thread_invariant` checks it on the loaded model (a prefill, a step and a verification
pass at one and at all threads, logits compared bit for bit) and the governor is only used where it
holds.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

import torch

RECENT = 8  # passes per thread count and n whose median is "recent"
SLOWER = 1.3  # recent all-thread passes this much above quiet: try one thread
MARGIN = 0.1  # a probe's count is kept if its passes beat the other's by this share
PROBE_STEPS = 2  # steps a probe runs
PROBE_INTERVAL = 256  # steps on all threads between probes when nothing looks slower
PROBE_BACK = 32  # steps on one thread between probes of all threads
MIN_BETWEEN_PROBES = 16  # steps after a probe before slowness (or speed) may trigger the next
FASTER = 0.85  # one-thread passes this share of their time when it switched: probe all threads now


class ThreadGovernor:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads) -> None:
        self.max_threads = max_threads
        self.threads = max_threads  # the count being exploited
        self._set_threads = set_threads
        self._get_threads = get_threads
        self._applied = max_threads
        self._back_off = PROBE_BACK  # steps on one thread before the next probe of all threads
        self._switched_at: float | None = None  # the one-thread passes' ratio to quiet when it switched
        self._quiet: dict[int, float] = {}  # n -> lowest recent median at max threads
        self._all_threads: dict[int, deque] = {}  # n -> recent seconds of passes on all threads
        self._ratios: dict[int, deque] = {}  # threads -> recent passes' ratios to quiet (any n)
        self._probe: list[float] = []  # ratios to quiet of the probe in progress
        self._probe_left = 0
        self._since_probe = 0
        self.switches = 0  # times the exploited count changed

    @property
    def other(self) -> int:
        return 1 if self.threads == self.max_threads else self.max_threads

    def before_step(self, is_prefill: bool = False) -> None:
        """Set the thread count for the coming step. A probe times decoding steps: a prefill that
        comes due during one (at batch 1, the next request's) runs on the exploited count, never
        the probed one (its hundreds of tokens on one thread of a quiet machine took ~1.6x as long)."""
        wanted = self.other if self._probe_left and not is_prefill else self.threads
        if wanted != self._get_threads():
            self._set_threads(wanted)
        self._applied = wanted

    def idle(self) -> None:
        """Nothing is running: hand the process back its full count (a cost profile, a kernel
        choice or another engine measured now must not find one thread left over from a probe)."""
        if self._get_threads() != self.max_threads:
            self._set_threads(self.max_threads)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A decoding step's target pass over `num_tokens` tokens took `seconds` (at the count
        `before_step` set)."""
        if num_tokens < 1 or seconds <= 0:
            return
        threads = self._applied
        if threads == self.max_threads:
            recent = self._all_threads.setdefault(num_tokens, deque(maxlen=RECENT))
            recent.append(seconds)
            if len(recent) >= RECENT // 2:
                median = statistics.median(recent)
                self._quiet[num_tokens] = min(self._quiet.get(num_tokens, median), median)
        quiet = self._quiet_at(num_tokens)
        ratio = seconds / quiet if quiet is not None else None
        if ratio is not None:
            self._ratios.setdefault(threads, deque(maxlen=RECENT)).append(ratio)
        if self._probe_left:
            self._probe_left -= 1
            if ratio is not None:
                self._probe.append(ratio)
            if not self._probe_left:
                self._end_probe()
            return
        self._since_probe += 1
        if self._should_probe():
            self._probe_left, self._probe, self._since_probe = PROBE_STEPS, [], 0

    def _quiet_at(self, n: int) -> float | None:
        """The quiet cost of a pass over n tokens: as seen, or between the nearest n seen (linear),
        or past the largest n seen, that one's cost per token times n (a pass costs at most
        proportionally more: the comparison stays between counts, each pass divided by the same
        estimate). Without it, passes at an n first met on one thread (speculation beginning, a
        batch growing) would teach nothing: a probe of all threads gathers no evidence, fails, and
        one thread is kept after the load has gone (the likeliest cause of a benchmark at 8 in flight
        seen once running ~1.75x slow for minutes after a short load, BENCHMARKS.md)."""
        if n in self._quiet:
            return self._quiet[n]
        below = max((m for m in self._quiet if m < n), default=None)
        above = min((m for m in self._quiet if m > n), default=None)
        if below is None:
            return self._quiet[above] if above is not None else None  # (fewer tokens cost no more)
        if above is None:
            return self._quiet[below] * n / below
        share = (n - below) / (above - below)
        return self._quiet[below] + share * (self._quiet[above] - self._quiet[below])

    def _should_probe(self) -> bool:
        if self.threads != self.max_threads:
            current = self._current_ratio()
            if self._switched_at is None and current is not None:
                self._switched_at = current
            eased = (current is not None and self._switched_at is not None and self._since_probe >= MIN_BETWEEN_PROBES
                     and current < FASTER * self._switched_at)
            return eased or self._since_probe >= self._back_off
        if self._since_probe >= PROBE_INTERVAL:
            return True
        current = self._current_ratio()
        return self._since_probe >= MIN_BETWEEN_PROBES and current is not None and current > SLOWER

    def _current_ratio(self) -> float | None:
        """The median ratio to quiet of the exploited count's last RECENT / 2 passes (any n)."""
        recent = list(self._ratios.get(self.threads, ()))[-RECENT // 2:]
        return statistics.median(recent) if len(recent) >= RECENT // 2 else None

    def _end_probe(self) -> None:
        """Keep the probed count if it beat the exploited one's recent passes by MARGIN."""
        exploited = self._current_ratio()
        if self._probe and exploited is not None and statistics.median(self._probe) < (1 - MARGIN) * exploited:
            self.threads = self.other
            self.switches += 1
            self._back_off = PROBE_BACK
            self._switched_at = None
        elif self.threads != self.max_threads:
            self._back_off = min(2 * self._back_off, PROBE_INTERVAL)


def thread_invariant(forward_logits: Callable[[], list[torch.Tensor]], max_threads: int) -> bool:
    """Whether `forward_logits()` (passes over a fixed input) gives the same bits on one thread as
    on `max_threads`."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(max_threads)
        everything = forward_logits()
        torch.set_num_threads(1)
        one = forward_logits()
    finally:
        torch.set_num_threads(previous)
    return len(everything) == len(one) and all(torch.equal(a, b) for a, b in zip(everything, one))


def governor_for(runner, enabled: bool = True) -> ThreadGovernor | None:
    """A governor for `runner`'s passes: on the CPU, with more than one thread, where its logits
    are the same bits at one thread as at all (else None: the thread count is left alone)."""
    max_threads = torch.get_num_threads()
    probe = 10  # tokens the check below feeds one row
    if not enabled or max_threads < 2 or runner.device.type != "cpu" or runner.max_len < probe:
        return None  # (a context shorter than the check: the thread count is left alone)
    vocab = runner.model.config.vocab_size
    tokens = [(7 + 131 * i) % vocab for i in range(probe)]

    def logits() -> list[torch.Tensor]:
        row = runner.allocate()
        try:  # a prefill, a step, a verification pass
            return [runner.forward([row], [tokens[:6]], [6]).logits.clone(),
                    runner.forward([row], [tokens[6:7]], [1]).logits.clone(),
                    runner.forward([row], [tokens[7:10]], [3]).logits.clone()]
        finally:
            runner.free(row)

    return ThreadGovernor(max_threads) if thread_invariant(logits, max_threads) else None
