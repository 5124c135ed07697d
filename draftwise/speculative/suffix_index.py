"""Where a context's ending occurred before in a growing token corpus, and what followed it there.

The structure behind suffix decoding (Oliaro et al., "SuffixDecoding", 2024). A suffix tree answers
"which continuations follow the longest suffix of this context that occurs in the corpus, and how
often each"; here the same answer comes from two indexes of occurrences, of every token and of every
run of LONG_KEY tokens, each occurrence extended backwards to the full match length:

    1. candidates: the positions right after each occurrence of the context's last LONG_KEY tokens,
       or where those never occurred, of its last token (the most recent MAX_CANDIDATES of them:
       the long key finds an old document's long match among thousands of newer single-token ones);
    2. match length of a candidate p: the largest m <= max_match with corpus[p-m:p] == context[-m:];
       the occurrences of the longest match are kept (the node of the suffix tree that would be
       reached);
    3. the continuation is read off them position by position: at depth d the most frequent next
       token among the occurrences still agreeing with the continuation so far, with its empirical
       probability count / agreeing; the path's probability is the product, and the continuation
       stops where it falls below `min_probability` (the evidence stops) or no occurrence goes on.

Prompt lookup is the special case of one occurrence and no frequencies. Appending a token costs one
dictionary update; a lookup costs O(MAX_CANDIDATES x max_match) comparisons at most (about 0.1 ms),
and nothing beyond one dictionary miss when the context's ending was never seen.

Documents share one corpus, separated by SEPARATOR (never a token), so no match or continuation
crosses from one document into another. Each position records its document; a lookup skips
documents that were dropped (`drop`), and `compact` rebuilds the corpus without them.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass

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

    def lookup(self, context: list[int], max_tokens: int, max_match: int, min_probability: float) -> Continuation:
        """The continuation of `context` read from the corpus (see the module's docstring). Where the
        corpus ends with the context itself (a request's own index), its last occurrence has nothing
        after it yet and is passed over."""
        empty = Continuation([], [], 0, 0)
        if not context or max_tokens <= 0:
            return empty
        candidates = self.long.get(hash(tuple(context[-LONG_KEY:]))) if len(context) >= LONG_KEY else None
        if candidates is None:
            candidates = self.short.get(context[-1])
        if candidates is None:
            return empty
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
        if not matches:
            return empty
        continuation, probabilities, probability, alive = [], [], 1.0, matches
        for depth in range(max_tokens):
            following = [tokens[p + depth] for p in alive if p + depth < len(tokens)]
            following = [token for token in following if token != SEPARATOR]
            if not following:
                break
            token, count = Counter(following).most_common(1)[0]
            probability *= count / len(alive)
            if probability < min_probability:
                break
            continuation.append(token)
            probabilities.append(probability)
            alive = [p for p in alive if p + depth < len(tokens) and tokens[p + depth] == token]
        documents = frozenset(owners[p - 1] for p in matches)
        return Continuation(continuation, probabilities, best, len(matches), documents)

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
