"""The planner's replay of where each request's drafts were accepted (`planner/replay.py`)."""

import random

from draftwise.planner.replay import NO_PROPOSAL, Replay, match_lengths
from draftwise.planner.simulate import Policy, Request, simulate
from draftwise.speculative.control.cost_model import CostModel


def test_match_lengths_from_a_run_by_hand():
    # steps at k = 4: positions 1 (2 accepted), 4 (all 4), 9 (1), 11 (plain), 12 (0)
    steps = [(4, 2), (4, 4), (4, 1), (0, 0), (4, 0)]
    assert match_lengths(steps, 13) == (NO_PROPOSAL, 2, 1, 0,
                                        # a full acceptance runs on into the next step's run: 4 + 1 + 1
                                        6, 5, 4, 3, 2, 1, 0, NO_PROPOSAL, 0)
    # a full acceptance followed by a rejection ends where it was censored
    assert match_lengths([(2, 2), (2, 0)], 5) == (NO_PROPOSAL, 2, 1, 0, 0)
    # cut by the tokens a request had left
    assert match_lengths([(3, 3)], 3) == (NO_PROPOSAL, 3, 2)


def run_at_fixed_k(truth: list[int], k: int) -> list[tuple[int, int]]:
    """The steps (drafted, accepted) the engine takes drafting k tokens when a draft at p would have
    truth[p] tokens accepted (-1: nothing proposed)."""
    steps, position = [], 1
    while position < len(truth):
        drafted = min(k, len(truth) - position - 1)
        if truth[position] == NO_PROPOSAL or drafted == 0:
            steps.append((0, 0))
            position += 1
            continue
        accepted = min(drafted, truth[position])
        steps.append((drafted, accepted))
        position += accepted + 1
    return steps


def draft_model_truth(length: int, rng: random.Random) -> list[int]:
    """A drafter that agrees with the target up to the next disagreement point, as a greedy
    draft model does; stretches of dense and sparse disagreement."""
    disagree = [rng.random() < (0.08 if (p // 50) % 2 else 0.6) for p in range(length)] + [True]
    truth, next_point = [0] * length, length
    for p in range(length - 1, -1, -1):
        next_point = p if disagree[p] else next_point
        truth[p] = next_point - p
    truth[0] = NO_PROPOSAL
    return truth


def test_replay_reproduces_the_measured_run_and_what_the_drafter_knew():
    rng = random.Random(0)
    costs = CostModel({n: 0.05 * (1 + 0.2 * (n - 1)) for n in range(1, 16)}, {k: 0.005 * k for k in range(1, 9)})
    for _ in range(20):
        truth = draft_model_truth(rng.randint(30, 300), rng)
        steps = run_at_fixed_k(truth, 6)
        matches = match_lengths(steps, len(truth))
        # wherever the run saw the end of a stretch (a rejection, or what a rejection skipped), exact
        position = 1
        for drafted, accepted in steps:
            if accepted < drafted:
                for j in range(accepted + 1):
                    assert matches[position + j] == truth[position + j]
            position += accepted + 1
        # simulated at the measured k, the replay takes the measured run's steps, token for token
        request = Request(10, len(truth), "code")
        run = simulate(costs, [request], {}, Policy(6), 1, expected=True, replay=Replay((matches,)))
        measured = sum(costs.batch_step_seconds([d]) for d, _ in steps) + costs.target_seconds(10)
        assert abs(run.seconds - measured) < 1e-9


def test_a_copied_stretch_is_replayed_as_one():
    """Half a request copies (every draft accepted), half finds nothing: the copying half is
    drafted at full length, and adaptive drafting rides it as a fixed k does."""
    costs = CostModel({n: 0.05 * (1 + 0.1 * (n - 1)) for n in range(1, 16)}, {k: 0.0 for k in range(1, 9)})
    matches = tuple([NO_PROPOSAL] + [400 - p for p in range(1, 200)] + [NO_PROPOSAL] * 200)
    request = [Request(10, 400, "edit")]
    fixed = simulate(costs, request, {}, Policy(6), 1, replay=Replay((matches,)))
    adaptive = simulate(costs, request, {}, Policy(6, adaptive=True), 1, replay=Replay((matches,)))
    # positions 1, 8, ..., 197 draft 6 and commit 7 each (29 steps of 1.6 steps' cost), 204..399 plain
    prefill = costs.target_seconds(10)
    assert abs(fixed.seconds - (prefill + 29 * 0.05 * 1.6 + 196 * 0.05)) < 1e-9
    assert adaptive.tokens_per_second > 0.97 * fixed.tokens_per_second


def test_prefill_cost_is_the_line_through_the_timed_prefills():
    from draftwise.planner.measure import PrefillCost

    fitted = PrefillCost.fit([(n, 0.05 + 0.02 * n) for n in (10, 80, 200, 35)])
    assert abs(fitted.fixed - 0.05) < 1e-9 and abs(fitted.per_token - 0.02) < 1e-9
    assert abs(fitted.seconds(100) - 2.05) < 1e-9
    assert PrefillCost.fit([(50, 1.0), (50, 1.2)]) is None  # one length: no line
