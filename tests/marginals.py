"""The exact distribution of a request's first tokens, from the target alone by the chain rule:
P(t1) P(t2 | t1) P(t3 | t1, t2) ..., each factor the distribution a caller says a prefix gets
(the sampler's warping, a grammar's mask, logits processors), for the Monte-Carlo tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch


def chain_rule_marginals(llm, prompt_ids: list[int], num_positions: int,
                         distribution: Callable[[torch.Tensor, list[tuple[int, ...]]], torch.Tensor]
                         ) -> list[dict[int, float]]:
    """P(token at position j) for j = 1..num_positions. distribution(logits [P, V], prefixes) gives
    the probabilities [P, V] each prefix (the generated tokens before the position) samples from."""
    prefixes = {(): 1.0}  # tokens generated so far -> their probability
    marginals = []
    for _ in range(num_positions):
        keys = list(prefixes)
        tokens = torch.tensor([prompt_ids + list(key) for key in keys])  # [P, S]
        with torch.no_grad():
            logits = llm.model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))[:, -1].float()  # [P, V]
        probs = distribution(logits, keys).double()
        marginal: Counter = Counter()
        following = {}
        for key, row in zip(keys, probs):
            for token in row.nonzero().flatten().tolist():
                mass = prefixes[key] * float(row[token])
                marginal[token] += mass
                following[key + (token,)] = mass
        prefixes = following
        marginals.append(dict(marginal))
    return marginals


ALPHA = 1e-4  # per position and setting; the seeded RNG makes a run reproducible
MIN_EXPECTED = 5  # cells expecting fewer draws are pooled into one


def chi_square(observed: Counter, expected_probs: dict[int, float], total: int) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value. Cells expecting fewer than MIN_EXPECTED
    draws are pooled, together with every token the target cannot emit (a draw of one of those
    makes the statistic huge)."""
    cells = [(observed.get(token, 0), p * total) for token, p in expected_probs.items() if p * total >= MIN_EXPECTED]
    rest_observed = total - sum(o for o, _ in cells)
    rest_expected = total - sum(e for _, e in cells)
    if rest_expected > 1e-9 or rest_observed:
        cells.append((rest_observed, max(rest_expected, 1e-9)))
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value


def sampled_positions_that_fail(llm, prompt: str, settings: list, num_requests: int, num_positions: int,
                                marginals: Callable, acceptance: tuple[float, float]) -> list[str]:
    """Sample num_requests unseeded requests per setting through the engine (interleaved, added at
    once: each step runs rows of every setting), then test each position of each setting against
    marginals(llm, params) with the chi-square test; returns the failures. The speculation counters
    must lie within `acceptance` (drafts accepted and rejected, else a path goes untested)."""
    torch.manual_seed(0)
    setting_of = {llm.add_request(prompt, settings[i % len(settings)]): i % len(settings)
                  for i in range(num_requests * len(settings))}
    outputs: list[list[list[int]]] = [[] for _ in settings]
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                outputs[setting_of[output.request_id]].append(output.token_ids)
    metrics = llm.spec_metrics
    low, high = acceptance
    assert metrics.num_draft_tokens > 0 and low <= metrics.acceptance_rate < high, metrics.summary()
    failures, report = [], []
    for setting, params in enumerate(settings):
        assert all(len(ids) == num_positions for ids in outputs[setting])
        for position, expected in enumerate(marginals(llm, params)):
            observed = Counter(ids[position] for ids in outputs[setting])
            statistic, dof, p_value = chi_square(observed, expected, len(outputs[setting]))
            report.append(f"setting {setting}, token {position + 1}: chi2 {statistic:.1f}, df {dof}, p {p_value:.2g}")
            if p_value < ALPHA:
                failures.append(report[-1])
    print("\n".join([metrics.summary(), *report]))
    return failures
