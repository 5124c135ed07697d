"""Where a context's ending occurred before in a growing token corpus, and what followed it there.

The structure behind suffix decoding (Oliaro et al., "SuffixDecoding", 2024). A suffix tree answers
"which continuations follow the longest suffix of this context that occurs in the corpus, and how
often each"; here the same answer comes from two indexes of occurrences, of every token and of every
run of LONG_KEY tokens, each occurrence extended backwards to the full match length:

    1. candidates: the positions right after each occurrence of the context's last LONG_KEY tokens,
       or where none of those can be used (never occurred, or only at the corpus's end or in dropped
       documents), of its last token (the most recent MAX_CANDIDATES of them:
       the long key finds an old document's long match among thousands of newer single-token ones);
    2. match length of a candidate p: the largest m <= max_match with corpus[p-m:p] == context[-m:];
       the occurrences of the longest match are kept (the node of the suffix tree that would be
       reached);
    3. the continuation is read off them position by position: at depth d the most frequent next
       token among the occurrences still agreeing with the continuation so far, with its empirical
       probability count / agreeing; the path's probability is the product, and the continuation
       stops where it falls below `min_probability` (the evidence stops) or no occurrence goes on.
       As a tree, the next few most frequent tokens branch off too, best first (`_expand`).

Prompt lookup is the special case of one occurrence and no frequencies. Appending a token costs one
dictionary update; a lookup costs O(MAX_CANDIDATES x max_match) comparisons at most (about 0.1 ms),
and nothing beyond one dictionary miss when the context's ending was never seen.

Documents share one corpus, separated by SEPARATOR (never a token), so no match or continuation
crosses from one document into another. Each position records its document; a lookup skips
documents that were dropped (`drop`), and `compact` rebuilds the corpus without them.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import Counter
from dataclasses import dataclass, field

LONG_KEY = 4  # tokens of the second index's key (stored as the hash of the run; a collision only
# adds a candidate, whose match is counted token by token like any other)
MAX_CANDIDATES = 64  # most recent occurrences examined per lookup
SEPARATOR = -1


@dataclass(slots=True)
class Continuation:
    token_ids: list[int]  # [k] the most frequent continuation, stopped where the evidence stops
    probabilities: list[float]  # [k] its path probability after each token (non-increasing)
    match_length: int  # tokens of the context matched (0: nothing found)
    occurrences: int  # occurrences of the match the continuation was read from
    documents: frozenset = frozenset()  # the documents those occurrences lie in
    parents: list[int] = field(default_factory=list)  # [k] each token's parent (-1: the context's end)


class SuffixIndex:
    def __init__(self) -> None:
        self.tokens = array("i")  # [T] the corpus: documents separated by SEPARATOR
        self.owners = array("q")  # [T] the document each position belongs to
        # key -> the position right after its occurrence (an int while there is one, then a list of
        # them: most keys occur once, and a list each would double what they cost). Keys: a token,
        # and the hash of a run of LONG_KEY tokens within one document.
        self.short: dict[int, int | list[int]] = {}
        self.long: dict[int, int | list[int]] = {}
        self.dropped: set[int] = set()
        self._run = 0  # tokens since the last separator

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids, document: int = 0) -> None:
        """Append tokens of `document` (the corpus's last document, or a new one after `separate`)."""
        tokens, owners = self.tokens, self.owners
        for token in token_ids:
            tokens.append(token)
            owners.append(document)
            end = len(tokens)
            _add(self.short, token, end)
            self._run += 1
            if self._run >= LONG_KEY:
                _add(self.long, hash(tuple(tokens[end - LONG_KEY:end])), end)

    def separate(self) -> None:
        """End the current document: nothing matches or continues across this point."""
        self.tokens.append(SEPARATOR)
        self.owners.append(-1)
        self._run = 0

    def drop(self, document: int) -> None:
        """Forget a document: lookups skip it from now on (`compact` reclaims its memory)."""
        self.dropped.add(document)

    def lookup(self, context: list[int], max_tokens: int, max_match: int, min_probability: float,
               max_branches: int = 1) -> Continuation:
        """The continuation of `context` read from the corpus (see the module's docstring): a chain,
        or with max_branches > 1 a tree. Where the corpus ends with the context itself (a request's
        own index), its last occurrence has nothing after it yet and is passed over."""
        if not context or max_tokens <= 0:
            return Continuation([], [], 0, 0)
        best, matches = self._longest_matches(context, max_match)
        if not matches:
            return Continuation([], [], 0, 0)
        token_ids, parents, probabilities = self._expand(matches, max_tokens, min_probability, max_branches)
        documents = frozenset(self.owners[p - 1] for p in matches)
        return Continuation(token_ids, probabilities, best, len(matches), documents, parents)

    def _longest_matches(self, context: list[int], max_match: int) -> tuple[int, list[int]]:
        """The longest match length, and the positions right after each of its occurrences: among the
        occurrences of the context's last LONG_KEY tokens, or where none of those can be used (none,
        only the context's own end, or only dropped documents), of its last token."""
        if len(context) >= LONG_KEY:
            best, matches = self._matches_among(self.long.get(hash(tuple(context[-LONG_KEY:]))), context, max_match)
            if matches:
                return best, matches
        return self._matches_among(self.short.get(context[-1]), context, max_match)

    def _matches_among(self, candidates: int | list[int] | None, context: list[int],
                       max_match: int) -> tuple[int, list[int]]:
        if candidates is None:
            return 0, []
        if isinstance(candidates, int):
            candidates = [candidates]
        tokens, owners = self.tokens, self.owners
        limit = min(max_match, len(context))
        best, matches = 0, []
        for p in reversed(candidates[-MAX_CANDIDATES:]):
            if p >= len(tokens) or (self.dropped and owners[p - 1] in self.dropped):
                continue  # nothing after it yet, or a dropped document
            m = 0
            while m < limit and p - m - 1 >= 0 and tokens[p - m - 1] == context[-m - 1]:
                m += 1
            if m > best:
                best, matches = m, [p]
            elif m == best and m:
                matches.append(p)
        return best, matches

    def _expand(self, matches: list[int], max_tokens: int, min_probability: float,
                max_branches: int) -> tuple[list[int], list[int], list[float]]:
        """The continuation tree, best first (SuffixDecoding's greedy expansion): the node with the
        highest path probability joins next, so that for its size the tree holds the most expected
        accepted tokens (the sum of its nodes' path probabilities). A node's children are the
        max_branches most frequent next tokens among the occurrences agreeing with its path, each
        with probability parent x count / agreeing; nodes below min_probability never join.
        max_branches = 1 gives the chain of the most frequent continuation."""
        tokens = self.tokens
        token_ids: list[int] = []
        parents: list[int] = []
        probabilities: list[float] = []
        order = itertools.count()  # ties: the earlier candidate first (the more frequent sibling)
        frontier: list = []  # heap of (-probability, order, parent, token, agreeing positions, depth)

        def offer_children(parent: int, probability: float, alive: list[int], depth: int) -> None:
            following = [tokens[p + depth] for p in alive if p + depth < len(tokens)]
            counts = Counter(token for token in following if token != SEPARATOR)
            for token, count in counts.most_common(max_branches):
                child = probability * count / len(alive)
                if child >= min_probability:
                    agreeing = [p for p in alive if p + depth < len(tokens) and tokens[p + depth] == token]
                    heapq.heappush(frontier, (-child, next(order), parent, token, agreeing, depth + 1))

        offer_children(-1, 1.0, matches, 0)
        while frontier and len(token_ids) < max_tokens:
            negative, _, parent, token, alive, depth = heapq.heappop(frontier)
            token_ids.append(token)
            parents.append(parent)
            probabilities.append(-negative)
            offer_children(len(token_ids) - 1, -negative, alive, depth)
        return token_ids, parents, probabilities

    def compact(self) -> None:
        """Rebuild the corpus without dropped documents."""
        kept = SuffixIndex()
        start = 0
        tokens, owners = self.tokens, self.owners
        for end in range(len(tokens) + 1):
            if end == len(tokens) or tokens[end] == SEPARATOR:
                document = owners[start] if start < end else -1
                if start < end and document not in self.dropped:
                    kept.extend(tokens[start:end], document)
                    if end < len(tokens):
                        kept.separate()
                start = end + 1
        self.tokens, self.owners, self.short, self.long = kept.tokens, kept.owners, kept.short, kept.long
        self.dropped, self._run = set(), kept._run


def _add(index: dict, key: int, position: int) -> None:
    seen = index.get(key)
    if seen is None:
        index[key] = position
    elif isinstance(seen, int):
        index[key] = [seen, position]
    else:
        seen.append(position)
