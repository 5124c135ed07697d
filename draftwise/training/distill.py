"""Self-distillation data: the target answers the prompts, and its hidden states are read back.

What a head learns should be what verification accepts, and verification accepts the target's own
greedy tokens: so the training text is the target's answers (not a dataset's), and the features are
the target's hidden states over prompt + answer (after its final norm, as its LM head reads them).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from draftwise.llm import LLM
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.heads.training import Example


def distill(llm: LLM, prompts: list[str], max_tokens: int, progress: bool = True) -> list[Example]:
    """One example per prompt: the target's greedy answer and its hidden states over it all."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    examples = []
    for prompt in tqdm(prompts, desc="target answers", disable=not progress, unit="prompt"):
        output = llm.generate(prompt, params)[0]
        ids = list(output.prompt_token_ids) + list(output.token_ids)
        examples.append(Example(torch.tensor(ids), len(output.prompt_token_ids), hidden_states(llm, ids)))
    return examples


@torch.inference_mode()
def hidden_states(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """[S, H] the target's last hidden states over `token_ids` (teacher-forced, one pass, no cache)."""
    model = llm.model
    tokens = torch.tensor([token_ids], device=model.norm.weight.device)  # [1, S]
    positions = torch.arange(len(token_ids), device=tokens.device)[None]  # [1, S]
    hidden, _ = model.hidden_states(tokens, positions)
    return model.norm(hidden)[0].float().cpu()
