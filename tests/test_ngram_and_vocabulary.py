"""The n-gram matcher and the vocabulary check as pure functions."""

import pytest

from draftwise.speculative.drafters.ngram import find_continuation
from draftwise.speculative.vocabulary import TokenizerMismatchError, check_same_vocabulary


def test_longest_suffix_most_recent_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert find_continuation(tokens, 1, 3, 2) == [7, 8]  # [2, 3] last seen before 7, 8
    assert find_continuation(tokens, 1, 1, 3) == [7, 8, 5]  # [3] most recently followed by 7
    assert find_continuation([1, 2, 1, 2, 1], 2, 2, 5) == [2, 1]  # stops at the end of the text


def test_no_match_or_nothing_to_propose():
    assert find_continuation([1, 2, 3, 4], 1, 3, 4) == []
    assert find_continuation([5], 1, 3, 4) == []
    assert find_continuation([1, 1, 1], 1, 2, 0) == []
    assert find_continuation([4, 5, 6, 4, 5], 3, 4, 2) == []  # only a 2-token match exists


class FakeTokenizer:
    def __init__(self, tokens):
        self.tokens = tokens

    def id_to_token_list(self):
        return self.tokens


def test_identical_and_padding_only_vocabularies_pass():
    base = ["a", "b", "<|im_end|>"]
    check_same_vocabulary(FakeTokenizer(base), FakeTokenizer(list(base)), "t", "d")
    check_same_vocabulary(FakeTokenizer(base + ["[PAD3]", "[PAD4]"]), FakeTokenizer(base), "t", "d")


def test_mismatch_names_both_and_the_first_differing_tokens():
    with pytest.raises(TokenizerMismatchError, match=r"'small'.*'big'.*id 1: 'b' vs 'x'"):
        check_same_vocabulary(FakeTokenizer(["a", "b", "c"]), FakeTokenizer(["a", "x", "c"]), "big", "small")
    with pytest.raises(TokenizerMismatchError, match="id 3: 'real' vs None"):
        check_same_vocabulary(FakeTokenizer(["a", "b", "c", "real"]), FakeTokenizer(["a", "b", "c"]), "t", "d")
