"""A drafter as the engine uses it: a proposer, the policy that sets k, and its bounds; built from
a `SpeculativeConfig` through the registry, with its cost model measured (or read from the cache)."""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.speculative.config import SpeculativeConfig
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.control.policy import AdaptiveLength, DraftLengthPolicy, FixedLength
from draftwise.speculative.control.live_costs import LiveCostModel
from draftwise.speculative.control.profile import configuration_key, load_or_measure, profile_path
from draftwise.speculative.proposer import Proposer
from draftwise.speculative.registry import Target

MAX_PROFILED_DRAFT = 16  # the drafter's cost is measured for k up to this (extrapolated beyond)


@dataclass(slots=True)
class Drafter:
    """One way of speculating: who proposes, how many tokens a row drafts, randomized drafting."""

    proposer: Proposer
    draft_length: DraftLengthPolicy
    max_tokens: int  # num_speculative_tokens: the most a row drafts in one step
    draft_probability: float = 1.0  # randomized drafting (sampled requests; see speculative.verify)
    costs: CostModel | None = None  # the cost model the adaptive policy plans with (None: fixed k)
    forced_drafts: bool = True  # rows with a grammar draft the tokens it forces (structured outputs)
    max_nodes: int = 0  # the most tokens a row's draft holds, a tree's nodes counted (0: max_tokens)

    def __post_init__(self) -> None:
        self.max_nodes = max(self.max_nodes, self.max_tokens)


def build_drafter(config: SpeculativeConfig, target: Target) -> Drafter:
    """The proposer from the registry; an adaptive policy on this machine's measured costs, or a fixed k."""
    proposer = config.spec.build(target, config.options)
    # (a drafter that can propose only so many tokens, as a head with K heads, caps k there)
    k = min(config.num_speculative_tokens, getattr(proposer, "longest_draft", None) or config.num_speculative_tokens)
    nodes = proposer.tree_nodes(k) if hasattr(proposer, "tree_nodes") else k
    if not config.adaptive:
        return Drafter(proposer, FixedLength(k), k, config.draft_probability, forced_drafts=config.forced_drafts,
                       max_nodes=nodes)
    costs = live_costs(target, proposer, config)
    return Drafter(proposer, AdaptiveLength(costs, k), k, config.draft_probability, costs, config.forced_drafts,
                   nodes)


def live_costs(target: Target, proposer: Proposer, config: SpeculativeConfig) -> LiveCostModel:
    """The measured (or cached) cost model as the prior of costs learned while serving."""
    prior = measure_costs(target, proposer, config)
    return LiveCostModel(prior, profile_path(prior.key) if prior.key else None)


def measure_costs(target: Target, proposer: Proposer | None, config: SpeculativeConfig | None,
                  refresh: bool = False) -> CostModel:
    """This machine's cost model for the target (and drafter): cached on disk, measured if absent."""
    runner = target.runner
    drafter = "plain" if config is None else config.drafter_key()
    key = configuration_key(target.folder, runner.model.quantization.mode, runner.device, runner.dtype,
                            f"step={runner.step_mode}", drafter,
                            *(("prompt kernels",) if runner.prompt_kernels else ()))  # (a draft model's catch-up)
    max_draft = config.num_speculative_tokens if config is not None else 0
    costs = load_or_measure(key, runner, proposer, target.tokenizer, min(max_draft, MAX_PROFILED_DRAFT),
                            refresh=refresh, measure_with=config.spec.profile if config is not None else None)
    costs.rows_padded = runner.pads_rows
    return costs
