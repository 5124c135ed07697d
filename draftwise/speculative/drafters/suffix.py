"""Suffix decoding: draft what followed the context's ending before, in this request and in earlier ones.

Each request has a `SuffixIndex` over its own committed tokens (prompt and output); the drafter
also keeps a `SuffixCache`, shared by every request it serves: the ends of earlier requests' prompts
and their outputs, bounded in memory. A draft is the most frequent continuation of the longest
matched suffix (`SuffixIndex.lookup`; with `suffix_max_branches` > 1 a tree of the most frequent
continuations, best first, verified as one by `verify_tree`), from whichever of the two promises more tokens (the sum of
its path probabilities, the expected accepted length; ties to the longer match), at most
`suffix_max_spec_factor` x the match length, and it stops where the evidence does (a path
probability below `suffix_min_probability`). The defaults are Arctic Inference's for suffix decoding
(max depth 24, factor 1.0, probability 0.1); trees of up to 3 branches a node by default, as measured
(BENCHMARKS.md: never behind chains, ahead on code edits).

Model-free: a lookup costs about 0.1 ms of Python, and one dictionary miss when nothing matches.
The engine calls the drafter from its own thread only; the cache has a lock all the same (metrics
and tests read it from others). Its partitions are keyed by the request's `tenant` (the server's API
key it came with; None without keys), so that one tenant's text never shapes another's drafts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from draftwise.cache import token_tree
from draftwise.errors import InvalidParameterError
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState
from draftwise.speculative.suffix_index import Continuation, SuffixIndex

BYTES_PER_TOKEN = 184  # what a cached token costs (~180 bytes where no token repeats: tests/test_suffix.py)


CACHED_IDS_KEPT = 4096  # request ids remembered as cached (a release repeated comes right after the first)
LIVE_SHARE = 2 / 3  # of the cache's tokens held by live text; the rest is evicted text awaiting compaction


class SuffixCache:
    """Earlier requests' text, one corpus per partition, least recently matched out first. The
    corpora (live text, and evicted text until a partition is compacted) stay within `max_tokens`:
    live text takes at most LIVE_SHARE of it, so a compaction comes once every (1 - LIVE_SHARE) x
    max_tokens evicted tokens at most (while it runs, the partition's copy is held twice)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_tokens = max(0, max_bytes // BYTES_PER_TOKEN)  # live and evicted together
        self.max_live = int(self.max_tokens * LIVE_SHARE)
        self.partitions: dict[object, SuffixIndex] = {}
        self.entries: OrderedDict[tuple[object, int], int] = OrderedDict()  # (partition, document) -> tokens
        self.num_tokens = 0  # live
        self._dropped_tokens: dict[object, int] = {}  # partition -> evicted tokens still in its corpus
        self._next_document = 0
        self._lock = threading.Lock()

    def add(self, partition: object, token_ids: list[int]) -> None:
        token_ids = token_ids[-(self.max_live - 1):] if self.max_live > 1 else []
        if not token_ids:
            return
        with self._lock:
            index = self.partitions.setdefault(partition, SuffixIndex())
            document, self._next_document = self._next_document, self._next_document + 1
            index.extend(token_ids, document)
            index.separate()
            self.entries[(partition, document)] = len(token_ids) + 1
            self.num_tokens += len(token_ids) + 1
            while self.num_tokens > self.max_live:
                self._evict()
            while self.num_tokens + sum(self._dropped_tokens.values()) > self.max_tokens:
                self._compact(max(self._dropped_tokens, key=self._dropped_tokens.__getitem__))

    def corpus_tokens(self) -> int:
        """Tokens the corpora hold: live and evicted not yet compacted (what the bound is on)."""
        return sum(map(len, self.partitions.values()))

    def _evict(self) -> None:
        (partition, document), size = self.entries.popitem(last=False)
        self.num_tokens -= size
        self.partitions[partition].drop(document)
        self._dropped_tokens[partition] = self._dropped_tokens.get(partition, 0) + size

    def _compact(self, partition: object) -> None:
        """Rebuild the partition without its evicted text (gone altogether where nothing is left)."""
        del self._dropped_tokens[partition]
        index = self.partitions[partition]
        index.compact()
        if not len(index):
            del self.partitions[partition]

    def lookup(self, partition: object, context: list[int], max_tokens: int, max_match: int,
               min_probability: float, max_branches: int = 1) -> Continuation:
        with self._lock:
            index = self.partitions.get(partition)
            if index is None:
                return Continuation([], [], 0, 0)
            found = index.lookup(context, max_tokens, max_match, min_probability, max_branches)
            for document in found.documents:
                if (partition, document) in self.entries:
                    self.entries.move_to_end((partition, document))  # recently useful: kept longer
            return found


class SuffixProposer:
    catch_up_window = None

    def __init__(self, options: "SuffixOptions") -> None:
        self.options = options
        self.own: dict[str, SuffixIndex] = {}  # request id -> its committed tokens, indexed
        self._cached: OrderedDict[str, None] = OrderedDict()  # the latest requests whose text was cached
        cache_bytes = int(options.suffix_cache_mb * 2 ** 20)
        self.cache = SuffixCache(cache_bytes) if cache_bytes > 0 else None

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        return [as_draft(self.continuation(seq, k)) if k > 0 else Draft([]) for seq, k in zip(seqs, num_tokens)]

    def continuation(self, seq: SequenceState, k: int) -> Continuation:
        """At most k tokens continuing `seq`, from its own text or the cache, whichever promises more."""
        options = self.options
        context = seq.token_ids
        own = self._own_index(seq, context)
        found = self._within_factor(own.lookup(context, k, options.suffix_max_depth, options.suffix_min_probability,
                                               options.suffix_max_branches))
        if self.cache is not None:
            shared = self._within_factor(self.cache.lookup(
                seq.tenant, context, k, options.suffix_max_depth, options.suffix_min_probability,
                options.suffix_max_branches))
            if _promise(shared) > _promise(found):  # (each as it would be drafted: cut to its factor first)
                found = shared
        return found

    def _within_factor(self, found: Continuation) -> Continuation:
        """The continuation cut to suffix_max_spec_factor x its match length (best first: parents stay)."""
        limit = max(1, int(self.options.suffix_max_spec_factor * found.match_length))
        found.token_ids, found.parents = found.token_ids[:limit], found.parents[:limit]
        found.probabilities = found.probabilities[:limit]
        return found

    def _own_index(self, seq: SequenceState, context: list[int]) -> SuffixIndex:
        index = self.own.get(seq.request_id)
        if index is None or len(index) > len(context):
            index = self.own[seq.request_id] = SuffixIndex()
        index.extend(context[len(index):])  # committed tokens only grow
        return index

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass  # nothing drafted is indexed: the next lookup reads the committed tokens

    def release(self, seq: SequenceState) -> None:
        """A request leaves: the text of one that ended as it should ("stop" or "length"; not one that
        failed or was aborted) joins the cache, once (a row may be released twice: undone in a
        failed step, then retired)."""
        self.own.pop(seq.request_id, None)
        if (self.cache is not None and getattr(seq, "finish_reason", None) in ("stop", "length") and seq.output_ids
                and seq.request_id not in self._cached):
            self._cached[seq.request_id] = None
            while len(self._cached) > CACHED_IDS_KEPT:
                self._cached.popitem(last=False)
            prompt = seq.token_ids[:len(seq.token_ids) - len(seq.output_ids)]
            tail = prompt[-self.options.suffix_max_depth:]  # a later request ending the same way matches into it
            self.cache.add(seq.tenant, tail + list(seq.output_ids))

    def forget_history(self) -> None:
        """Earlier requests' text dropped (running requests keep their own indexes)."""
        if self.cache is not None:
            self.cache = SuffixCache(self.cache.max_tokens * BYTES_PER_TOKEN)

    def lag(self, seq: SequenceState) -> int:
        return 0

    def footprint(self) -> Footprint:
        cached = self.cache.max_tokens * BYTES_PER_TOKEN if self.cache is not None else 0
        return Footprint(weights_bytes=cached)


def as_draft(found: Continuation) -> Draft:
    """A continuation as a draft: a chain, or a tree scored by its path probabilities."""
    if found.parents == token_tree.chain_parents(len(found.parents)):
        return Draft(found.token_ids)
    return Draft(found.token_ids, parents=found.parents, scores=found.probabilities)


def expected_accepted(found: Continuation) -> float:
    """The tokens a continuation is expected to have accepted: the sum of its path probabilities."""
    return sum(found.probabilities)


def _promise(found: Continuation) -> tuple[float, int]:
    """Expected accepted tokens, then the match length."""
    return expected_accepted(found), found.match_length


@dataclass(slots=True)
class SuffixOptions:
    suffix_max_depth: int = option(24, "longest context suffix matched (and cached prompt tail)")
    suffix_max_spec_factor: float = option(1.0, "a draft is at most this many times the matched length")
    suffix_min_probability: float = option(0.1, "a draft stops where its path's frequency falls below this")
    suffix_cache_mb: float = option(64.0, "memory for earlier requests' text, shared by all requests (0: off)")
    suffix_max_branches: int = option(3, "children per draft node: above 1 a draft is a token tree of the most "
                                         "frequent continuations, best first (1: a chain)")

    def __post_init__(self) -> None:
        if not isinstance(self.suffix_max_depth, int) or isinstance(self.suffix_max_depth, bool) \
                or self.suffix_max_depth < 2:
            raise InvalidParameterError(f"suffix_max_depth must be an integer >= 2, got {self.suffix_max_depth!r}")
        if not isinstance(self.suffix_max_branches, int) or isinstance(self.suffix_max_branches, bool) \
                or not 1 <= self.suffix_max_branches <= 8:
            raise InvalidParameterError(f"suffix_max_branches must be an integer in [1, 8], got "
                                        f"{self.suffix_max_branches!r}")
        for name, low, high in (("suffix_max_spec_factor", 0.0, float("inf")), ("suffix_min_probability", 0.0, 1.0),
                                ("suffix_cache_mb", 0.0, float("inf"))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
                    or (name == "suffix_max_spec_factor" and value == 0):
                raise InvalidParameterError(f"{name} must be a number in ({low}, {high}], got {value!r}"
                                            if name == "suffix_max_spec_factor" else
                                            f"{name} must be a number in [{low}, {high}], got {value!r}")


def build_suffix(target: Target, options: SuffixOptions) -> SuffixProposer:
    return SuffixProposer(options)


register(DrafterSpec("suffix", "suffix decoding: the most frequent continuation of the context's ending in this "
                               "request and in earlier requests' text", SuffixOptions, build_suffix))
