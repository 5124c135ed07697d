"""EAGLE-2's tree expansion in the head proposer, on a stub head whose children are a table: which
nodes are expanded, their scores, the positions and caches each head call sees, the order."""

import torch
from torch import nn

from draftwise.sampling.params import SamplingParams
from draftwise.speculative.heads.eagle import HeadKV
from draftwise.speculative.heads.head_proposer import HeadProposer

VOCAB = 12
CHILDREN = {  # token -> its children's probabilities (no other child)
    0: {1: 0.5, 2: 0.28, 3: 0.22},
    1: {4: 0.6, 5: 0.4},
    2: {6: 0.9, 7: 0.1},
    3: {8: 1.0},
    4: {9: 0.7, 10: 0.3},
    6: {11: 0.8, 9: 0.2},
}


class StubHead:
    """Its output at a node is the node's token, one-hot: the logits then read that token's children."""

    def __init__(self) -> None:
        self.kept_ids = torch.arange(VOCAB)
        self.calls: list[tuple[list[int], list[int], list[int]]] = []  # (tokens, positions, cache lengths)

    def step(self, features, embeddings, positions, caches):
        self.calls.append((embeddings.argmax(-1).tolist(), positions.tolist(), [c.length for c in caches]))
        for cache in caches:
            cache.append(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
        return embeddings  # [R, V]: the node's token

    def new_cache(self) -> HeadKV:
        return HeadKV(1, 2, torch.float32, torch.device("cpu"))


def logits_of(features: torch.Tensor) -> torch.Tensor:
    table = torch.zeros(VOCAB, VOCAB)
    for token, children in CHILDREN.items():
        for child, q in children.items():
            table[token, child] = q
    return (features.float() @ table).log()  # (-inf where no child)


class Row:
    request_id, params, token_ids = "r", SamplingParams(temperature=0), [7, 7, 7, 7, 7]


def test_each_level_expands_its_best_nodes_and_the_tree_goes_out_best_first():
    head = StubHead()
    proposer = HeadProposer(head, (0,), VOCAB, to_features=lambda s: s, logits=logits_of,
                            embed=nn.Embedding.from_pretrained(torch.eye(VOCAB)), device=torch.device("cpu"),
                            weights=[], kv_bytes_per_token=0, branches=2)
    cache = head.new_cache()
    for _ in range(4):  # four committed positions in the head's cache
        cache.append(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    draft = proposer._tree(Row(), torch.eye(VOCAB)[0], cache, depth=3)
    # level 0: children 1 (.5), 2 (.28); level 1 expands both: 4 (.3), 5 (.2), 6 (.252), 7 (.028);
    # level 2 expands the two best of the newest level, 4 and 6: 9 (.21), 10 (.09), 11 (.2016), 9 (.0504)
    assert head.calls == [([1, 2], [4, 4], [4, 4]), ([4, 6], [5, 5], [5, 5])]  # positions newest + level - 1
    tokens = draft.token_ids
    assert tokens == [1, 4, 2, 6, 9, 11, 5, 10, 9, 7]
    assert [tokens[p] if p >= 0 else None for p in draft.parents] == [None, 1, None, 2, 4, 6, 1, 4, 6, 2]
    assert all(a >= b for a, b in zip(draft.scores, draft.scores[1:]))
    assert abs(draft.scores[5] - 0.28 * 0.9 * 0.8) < 1e-6
    assert cache.length == 4  # the request's own cache untouched (each node drafted in a copy)
    assert draft.prefix(5).depth() == 3 and draft.first_children().token_ids == [1, 4, 9]
