"""Token trees in the target's pass (`draftwise/cache/token_tree.py`): a tree node's logits are bit
for bit those of the same token verified at the end of a chain made of its ancestors, on every
attention path (the native kernel, the static step, the per-query SDPA path), alone and beside other
rows; and after its root path is kept (moved into chain order) the row decodes on exactly as if the
path had been fed as a chain."""

import random

import pytest
import torch

from draftwise.cache import token_tree
from draftwise.loading.hf_folder import load_model
from draftwise.runner.model_runner import ModelRunner

PROMPT = [17, 40, 9, 120, 33, 250, 61, 8, 77]
# The fed tokens: the newest committed token, then a tree of 8 drafted tokens below it.
PARENTS = [-1, 0, 0, 0, 1, 1, 4, 2, 7]
TOKENS = [5, 90, 91, 92, 140, 141, 200, 30, 31]


@pytest.fixture(scope="module", params=["native", "native-int4", "static", "per_query",
                                        pytest.param("cuda-graph", marks=pytest.mark.cuda)])
def runner(request, tiny_qwen):
    if request.param == "cuda-graph" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = "cuda" if request.param == "cuda-graph" else "cpu"
    model = load_model(tiny_qwen, device, quantization="int4" if request.param == "native-int4" else "none")
    mode = {"static": "eager", "cuda-graph": "graph"}.get(request.param)
    runner = ModelRunner(model, 4, 128, step_mode=mode)
    if request.param == "per_query":
        runner.cache.kernel = None
    return runner


def chain_logits(runner, prompt, chain):
    """Logits [len(chain), V] of the chain fed after the prompt."""
    row = runner.allocate()
    try:
        runner.forward([row], [prompt], [1])
        return runner.forward([row], [chain], [len(chain)]).logits
    finally:
        runner.free(row)


def test_chains_as_trees():
    assert token_tree.depths([-1, 0, 0, 1]) == [0, 1, 1, 2]
    assert token_tree.paths([-1, 0, 0, 1], 10) == [[10], [10, 11], [10, 12], [10, 11, 13]]
    assert token_tree.depths(token_tree.chain_parents(4)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="parents must come first"):
        token_tree.check_parents([-1, 2, 0])


@pytest.mark.parametrize("beside", [False, True])
def test_a_tree_nodes_logits_are_its_chains_bit_for_bit(runner, beside):
    rows = [runner.allocate() for _ in range(2 if beside else 1)]
    try:
        runner.forward(rows, [PROMPT] + ([PROMPT[:4]] if beside else []), [1] * len(rows))
        token_ids = [TOKENS] + ([[3, 4]] if beside else [])  # a chain row of another length beside it
        parents = [PARENTS] + ([None] if beside else [])
        result = runner.forward(rows, token_ids, [len(ids) for ids in token_ids], parents=parents)
        tree = result.logits[:len(TOKENS)]
        other = result.logits[len(TOKENS):]
    finally:
        for row in rows:
            runner.free(row)
    for s, path in enumerate(token_tree.paths(PARENTS, 0)):
        chain = [TOKENS[i] for i in path]
        assert torch.equal(tree[s], chain_logits(runner, PROMPT, chain)[-1]), f"node {s}"
    if beside:
        assert torch.equal(other, chain_logits(runner, PROMPT[:4], [3, 4]))


def test_a_kept_path_decodes_on_as_the_chain_would(runner):
    path = token_tree.paths(PARENTS, 0)[6]  # fed tokens 0, 1, 4, 6
    rng = random.Random(0)
    after = [rng.randrange(5, 300) for _ in range(3)]
    row = runner.allocate()
    try:
        runner.forward([row], [PROMPT], [1])
        start = runner.length(row)
        runner.forward([row], [TOKENS], [len(TOKENS)], parents=[PARENTS])
        runner.keep_path(row, [start + i for i in path], start)
        runner.truncate(row, start + len(path))
        kept = runner.forward([row], [after], [len(after)]).logits
    finally:
        runner.free(row)
    expected = chain_logits(runner, PROMPT, [TOKENS[i] for i in path] + after)[len(path):]
    assert torch.equal(kept, expected)
