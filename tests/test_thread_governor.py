"""The thread governor: injected step times (no wall clock), and the bits it must not change."""

import random

import pytest
import torch

from draftwise import LLM
from draftwise.engine.thread_governor import PROBE_INTERVAL, PROBE_STEPS, ThreadGovernor, governor_for
from draftwise.sampling.params import SamplingParams


class Machine:
    """Step seconds per thread count, with 5% jitter; the count the governor sets is recorded."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds = seconds
        self.threads = 2
        self.rng = random.Random(0)

    def set(self, threads: int) -> None:
        self.threads = threads

    def step(self, governor: ThreadGovernor, num_tokens: int = 1) -> int:
        governor.before_step()
        used = self.threads
        governor.observe(num_tokens, self.seconds[used] * num_tokens ** 0.2 * self.rng.uniform(0.95, 1.05))
        return used


QUIET = {2: 0.050, 1: 0.080}
BUSY = {2: 0.250, 1: 0.100}  # two busy processes: two threads 2.5x one (measured: 2.3-3x)


def make(machine: Machine) -> ThreadGovernor:
    return ThreadGovernor(2, set_threads=machine.set, get_threads=lambda: machine.threads)


def test_a_quiet_machine_keeps_every_thread_and_probes_rarely():
    machine = Machine(QUIET)
    governor = make(machine)
    used = [machine.step(governor, num_tokens=1 + i % 4) for i in range(2000)]
    assert governor.threads == 2 and governor.switches == 0
    assert used.count(1) <= 2000 * 2 * PROBE_STEPS / PROBE_INTERVAL


def test_load_moves_to_one_thread_within_a_few_steps_and_probes_back_off():
    machine = Machine(QUIET)
    governor = make(machine)
    for _ in range(100):
        machine.step(governor)
    machine.seconds = BUSY
    used = [machine.step(governor) for _ in range(1000)]
    first_one_thread_stretch = next(i for i in range(len(used)) if used[i:i + 8] == [1] * 8)
    assert first_one_thread_stretch <= 24
    assert governor.threads == 1
    assert used.count(2) <= 24 + 8 * PROBE_STEPS  # the steps before the switch, then backed-off probes


def test_when_the_load_ends_every_thread_returns():
    machine = Machine(QUIET)
    governor = make(machine)
    for seconds, steps in ((QUIET, 100), (BUSY, 600)):
        machine.seconds = seconds
        for _ in range(steps):
            machine.step(governor)
    assert governor.threads == 1
    machine.seconds = QUIET
    used = [machine.step(governor) for _ in range(40)]  # the one-thread steps sped up: no back-off wait
    assert governor.threads == 2 and used[-8:] == [2] * 8


def test_load_from_the_start_is_found_by_the_periodic_probe():
    machine = Machine(BUSY)
    governor = make(machine)
    for _ in range(PROBE_INTERVAL + 4 * PROBE_STEPS):
        machine.step(governor)
    assert governor.threads == 1


def test_a_prefill_runs_on_the_exploited_count_never_a_probes():
    """A probe times decoding steps; a prefill that came due in the middle of one (the next request's,
    at batch 1) must not run its hundreds of tokens on the probed count (on a quiet machine one
    thread prefills ~1.6x slower): it runs on every thread, and the probe goes on after it."""
    machine = Machine(QUIET)
    governor = make(machine)
    used = []
    while 1 not in used:  # the periodic probe begins
        used.append(machine.step(governor))
    assert PROBE_STEPS > 1  # (a step of the probe is left)
    governor.before_step(is_prefill=True)
    assert machine.threads == 2
    assert machine.step(governor) == 1  # the probe's next decoding step


def test_another_engine_changing_the_process_count_is_undone_before_each_step():
    machine = Machine(QUIET)
    governor = make(machine)
    machine.step(governor)
    machine.threads = 1  # another LLM's governor, in the same process
    assert machine.step(governor) == 2


@pytest.fixture(scope="module")
def tiny_int4(tiny_qwen):
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to govern")
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=2, progress=False, quantization="int4")


def test_the_cpu_kernels_give_the_same_bits_at_any_thread_count(tiny_int4):
    assert tiny_int4.threads is not None  # governor_for compared the logits bit for bit


def test_a_model_whose_bits_depend_on_the_count_gets_no_governor(tiny_int4, monkeypatch):
    original = tiny_int4.runner.forward

    def thread_dependent(*args, **kwargs):
        result = original(*args, **kwargs)
        result.logits = result.logits + 1e-6 * torch.get_num_threads()
        return result

    monkeypatch.setattr(tiny_int4.runner, "forward", thread_dependent)
    assert governor_for(tiny_int4.runner) is None
    assert governor_for(tiny_int4.runner, enabled=False) is None


def test_outputs_do_not_depend_on_the_threads_each_step_runs_on(tiny_int4, monkeypatch):
    """A governor switching the count at every step emits what one thread alone emits, plain and
    drafting for itself."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = "def add(a, b):\n    return"
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        tiny_int4.set_speculative(None, progress=False)
        alone = tiny_int4.generate(prompt, params)[0].token_ids
        switches = iter([1, 2] * 1000)
        monkeypatch.setattr(tiny_int4.threads, "before_step",
                            lambda is_prefill=False: torch.set_num_threads(next(switches)))
        for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}):
            tiny_int4.set_speculative(speculative, progress=False)
            assert tiny_int4.generate(prompt, params)[0].token_ids == alone
    finally:
        torch.set_num_threads(previous)
        tiny_int4.set_speculative(None, progress=False)


def test_an_idle_engine_hands_back_every_thread():
    machine = Machine(QUIET)
    governor = make(machine)
    machine.seconds = BUSY
    for _ in range(PROBE_INTERVAL + 4 * PROBE_STEPS):
        machine.step(governor)
    assert governor.threads == 1 and machine.threads == 1
    governor.idle()
    assert machine.threads == 2 and governor.threads == 1  # what it learnt stays
    assert machine.step(governor) == 1


def test_every_thread_returns_when_the_load_ends_at_pass_sizes_never_timed_quiet():
    machine = Machine(QUIET)
    governor = make(machine)
    for seconds, steps in ((QUIET, 100), (BUSY, 600)):  # (plain decoding: one token a pass)
        machine.seconds = seconds
        for _ in range(steps):
            machine.step(governor)
    assert governor.threads == 1
    machine.seconds = QUIET  # quiet again, and speculation begins: passes of 6 to 40 tokens, never timed quiet
    sizes = random.Random(1).choices(range(6, 41), k=120)
    used = [machine.step(governor, num_tokens=n) for n in sizes]
    assert governor.threads == 2 and used[-8:] == [2] * 8
    assert used.index(2) <= 40 and used[used.index(2):].count(1) <= 2 * PROBE_STEPS


def test_quiet_costs_between_and_past_the_sizes_seen_are_estimated():
    governor = make(Machine(QUIET))
    assert governor._quiet_at(4) is None  # (nothing seen quiet yet)
    governor._quiet = {2: 0.04, 8: 0.10}
    assert governor._quiet_at(2) == 0.04 and governor._quiet_at(1) == 0.04
    assert abs(governor._quiet_at(4) - 0.06) < 1e-12 and abs(governor._quiet_at(16) - 0.20) < 1e-12
