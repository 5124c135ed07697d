"""Verification on synthetic logits, and a Monte-Carlo check that speculative sampling follows the target."""

import pytest
import torch

import draftwise.speculative.verify as verify_module
from draftwise.sampling.params import SamplingParams
from draftwise.sampling.sampler import SamplingBatch
from draftwise.speculative.verify import verify

V = 5


def batch(n, temperature=0.0, seed=None):
    return SamplingBatch.build([SamplingParams(temperature=temperature, seed=seed)] * n, [0] * n, V,
                               torch.device("cpu"))


def one_hot_logits(ids):
    """Logits whose argmax at position i is ids[i]: [1, len(ids), V]."""
    logits = torch.zeros(1, len(ids), V)
    logits[0, torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_perfect_match_gets_the_bonus():
    result = verify(torch.tensor([[1, 2, 3]]), torch.tensor([3]), one_hot_logits([1, 2, 3, 4]), None, batch(1))
    assert result.num_accepted.tolist() == [3]
    assert result.output_token_ids.tolist() == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_recovers_the_target_token():
    result = verify(torch.tensor([[1, 0, 3]]), torch.tensor([3]), one_hot_logits([1, 2, 3, 4]), None, batch(1))
    assert result.num_accepted.tolist() == [1]
    assert result.output_token_ids.tolist() == [[1, 2, -1, -1]]


def test_empty_draft_is_one_plain_step():
    result = verify(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), one_hot_logits([4]), None, batch(1))
    assert result.output_token_ids.tolist() == [[4]] and result.num_accepted.tolist() == [0]


def test_ragged_rows_ignore_padding():
    logits = torch.cat([one_hot_logits([1, 2, 3]), one_hot_logits([2, 2, 2])])
    drafts = torch.tensor([[1, 2], [2, 2]])  # row 1 drafted only one token; its second entry is padding
    result = verify(drafts, torch.tensor([2, 1]), logits, None, batch(2))
    assert result.num_accepted.tolist() == [2, 1]
    assert result.output_token_ids.tolist() == [[1, 2, 3], [2, 2, -1]]


def test_sampling_with_certain_target_accepts_and_rejects_exactly():
    logits = one_hot_logits([1, 2, 3]) * 10  # p is (numerically) a point mass
    accepted = verify(torch.tensor([[1, 2]]), torch.tensor([2]), logits, None, batch(1, temperature=1.0))
    assert accepted.output_token_ids.tolist() == [[1, 2, 3]]
    rejected = verify(torch.tensor([[1, 4]]), torch.tensor([2]), logits, None, batch(1, temperature=1.0))
    assert rejected.output_token_ids.tolist() == [[1, 2, -1]] and rejected.num_accepted.tolist() == [1]


def test_seeded_verification_accepts_exactly_the_targets_own_draws():
    """A seeded row keeps a drafted token iff it is the token the target draws there with the
    row's keyed noise; what it emits is those draws, whatever the draft was."""
    from draftwise.sampling.sampler import sample

    logits = torch.randn(1, 4, V)
    sampling = batch(1, 1.0, seed=11)
    own = sample(logits[0], sampling.repeat(4)).tolist()  # the target's draws at positions 0..3
    for draft in ([own[0], own[1], own[2]], [own[0], (own[1] + 1) % V, own[2]], [(own[0] + 1) % V, 0, 0]):
        result = verify(torch.tensor([draft]), torch.tensor([3]), logits, torch.full((1, 3, V), 1 / V), sampling)
        accepted = result.num_accepted.item()
        assert draft[:accepted] == own[:accepted] and (accepted == 3 or draft[accepted] != own[accepted])
        assert result.output_token_ids[0, :accepted + 1].tolist() == own[:accepted + 1]


# --- Monte-Carlo: emitted tokens follow the target distribution -------------------------------

TRIALS = 30_000
CHI2_CRITICAL_DF4 = 18.467  # chi-square, 4 degrees of freedom, alpha = 0.001


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=V).double()
    expected = probs.double() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


TARGET_PROBS = torch.tensor([[0.10, 0.40, 0.20, 0.25, 0.05],
                             [0.30, 0.05, 0.15, 0.20, 0.30],
                             [0.20, 0.20, 0.20, 0.20, 0.20]])  # [3, V]: positions 1, 2 and the bonus
DRAFT_PROBS = torch.tensor([[0.50, 0.10, 0.10, 0.20, 0.10],
                            [0.05, 0.40, 0.25, 0.10, 0.20]])  # [2, V]


def sample_drafts(point_mass: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRIALS two-token drafts [TRIALS, 2] and their distributions (None: a deterministic drafter
    that always proposes tokens 3 then 0)."""
    if point_mass:
        return torch.tensor([[3, 0]]).expand(TRIALS, 2), None
    drafts = torch.stack([torch.multinomial(DRAFT_PROBS[i], TRIALS, replacement=True) for i in range(2)], 1)
    return drafts, DRAFT_PROBS.expand(TRIALS, 2, V)


def run_speculative_sampling(point_mass: bool, seed: int = 0):
    """Statistics of each emitted position against the target's distribution there."""
    torch.manual_seed(seed)
    target_probs = TARGET_PROBS
    drafts, draft_probs_arg = sample_drafts(point_mass)
    logits = target_probs.log().expand(TRIALS, 3, V)
    result = verify(drafts, torch.full((TRIALS,), 2), logits, draft_probs_arg, batch(TRIALS, temperature=1.0))
    out, accepted = result.output_token_ids, result.num_accepted
    stats = []
    for position in range(3):
        emitted = accepted >= position  # position i is emitted when the first i drafts were accepted
        stats.append(chi_square(out[emitted, position], target_probs[position]))
    return stats


@pytest.mark.parametrize("point_mass", [False, True])
def test_speculative_sampling_follows_the_target_distribution(point_mass):
    for position, statistic in enumerate(run_speculative_sampling(point_mass)):
        assert statistic < CHI2_CRITICAL_DF4, f"position {position}: chi2 {statistic:.1f}"


@pytest.mark.parametrize("point_mass", [False, True])
def test_the_distribution_test_catches_a_wrong_residual(monkeypatch, point_mass):
    """Recovering from p instead of norm(max(0, p - q)) is a classic bug; the test must see it."""
    monkeypatch.setattr(verify_module, "residual_probs", lambda target, draft: target)
    assert max(run_speculative_sampling(point_mass)) > CHI2_CRITICAL_DF4


def test_the_distribution_test_catches_accepting_everything(monkeypatch):
    original = verify_module._uniform
    monkeypatch.setattr(verify_module, "_uniform", lambda *args: torch.zeros_like(original(*args)))
    assert max(run_speculative_sampling(point_mass=False)) > CHI2_CRITICAL_DF4


# --- Randomized drafting (see the proof in draftwise/speculative/verify.py) ---------------------------

def run_randomized_drafting(point_mass: bool, rate: float, plain_step_from_p: bool = False, seed: int = 0):
    """Per step a coin with P(heads) = rate: heads verifies the draft with the relaxed first test,
    tails takes a plain step from R = norm(max(0, p - rate q)) (or, the unsafe form, from p)."""
    torch.manual_seed(seed)
    target_probs = TARGET_PROBS
    drafts, draft_probs_arg = sample_drafts(point_mass)
    logits = target_probs.log().expand(TRIALS, 3, V)
    tails = torch.rand(TRIALS) >= rate
    num_draft = torch.full((TRIALS,), 2)
    if plain_step_from_p:  # the unsafe form: tails is an ordinary plain step
        num_draft = torch.where(tails, 0, num_draft)
        result = verify(drafts, num_draft, logits, draft_probs_arg, batch(TRIALS, temperature=1.0),
                        draft_rate=torch.full((TRIALS,), rate))
    else:
        result = verify(drafts, num_draft, logits, draft_probs_arg, batch(TRIALS, temperature=1.0),
                        draft_rate=torch.full((TRIALS,), rate), draft_skipped=tails)
    out, accepted = result.output_token_ids, result.num_accepted
    stats = [chi_square(out[accepted >= position, position], target_probs[position]) for position in range(3)]
    heads_acceptance = float((accepted[~tails] >= 1).double().mean())
    return stats, heads_acceptance


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("rate", [0.3, 0.7])
def test_randomized_drafting_follows_the_target_distribution(point_mass, rate):
    stats, heads_acceptance = run_randomized_drafting(point_mass, rate)
    for position, statistic in enumerate(stats):
        assert statistic < CHI2_CRITICAL_DF4, f"position {position}: chi2 {statistic:.1f}"
    plain_acceptance = float((run_speculative_sampling_acceptance(point_mass)))
    assert heads_acceptance > plain_acceptance + 0.05  # the relaxed test does accept more often


def run_speculative_sampling_acceptance(point_mass: bool) -> float:
    p = TARGET_PROBS[0]
    q = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]) if point_mass else DRAFT_PROBS[0]
    return float(torch.minimum(p, q).sum())  # first-position acceptance of ordinary speculative sampling


@pytest.mark.parametrize("point_mass", [False, True])
def test_the_distribution_test_catches_the_unsafe_randomized_form(point_mass):
    """Accepting with min(1, p / (a q)) while tails draws from p skews the first token."""
    stats, _ = run_randomized_drafting(point_mass, rate=0.5, plain_step_from_p=True)
    assert stats[0] > CHI2_CRITICAL_DF4
