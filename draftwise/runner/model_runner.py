"""The narrow interface between the engine and a model backend.

The engine hands the runner a ragged batch (each row: a sequence handle and the new token ids to
append to it) and gets back logits for the last positions of each row that it asked for. Rows keep
their own lengths; their keys and values live in a paged cache (`draftwise.cache`) whose blocks
they take as they grow and give back when rolled back (`truncate(handle, n)`) or freed. Another
backend implements the same methods without the speculation code noticing.

Passes of up to 64 new tokens per row (decoding, verification, a draft's catch-up; 1,024 in all) go
through a static-shape step (`static_step.py`) when `step_mode` names one: eager, compiled, or
replayed as a CUDA graph; prompts on prompt kernels (`model/prompt_pass.py`, however short),
layer-skipping passes and passes that capture hidden states run eagerly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from draftwise.cache import token_tree
from draftwise.cache.kv_cache import KVCache
from draftwise.errors import InvalidParameterError, PromptTooLongError
from draftwise.model.moe import SparseMoE
from draftwise.model.transformer import Transformer
from draftwise.runner.static_step import MODES as STEP_MODES, StaticStep

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [N, V]: N = sum of num_logits over rows, row after row
    cu_num_logits: list[int]  # [B + 1]: row b's logits are logits[cu[b]:cu[b+1]]
    # Passes that capture layers: layer -> [T, H] the residual stream at every token fed, row after
    # row (row b's at cu_num_tokens[b]:cu_num_tokens[b+1], in the order its tokens were given).
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    cu_num_tokens: list[int] = field(default_factory=list)  # [B + 1]


class ModelRunner:
    def __init__(self, model: Transformer, max_num_rows: int, max_len: int, *, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, step_mode: str | None = None,
                 step_buckets: dict | None = None, prefix_caching: bool = False) -> None:
        """max_num_rows * max_len tokens of cache unless `num_blocks` says how many blocks. step_mode:
        None (every pass eager) or a `StaticStep` mode ("eager", "compile", "graph"); step_buckets:
        `row_buckets` and `token_buckets` for it. prefix_caching: full blocks of committed tokens are
        shared by the sequences that start with them (`BlockManager`)."""
        self.model = model
        config = model.config
        self.device = model.norm.weight.device
        self.dtype = model.norm.weight.dtype
        self.vocab_size = config.vocab_size
        self.max_len = max_len
        if num_blocks is None:
            num_blocks = max_num_rows * -(-max_len // block_size)
        self.cache = KVCache(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                             config.head_dim, self.dtype, self.device, prefix_caching)
        self.blocks = self.cache.blocks
        self.step_mode = _resolve_step_mode(step_mode, self.cache, _routes_on_host(model))
        self.static_step = None if self.step_mode is None else StaticStep(model, self.cache, max_len, self.step_mode,
                                                                          **(step_buckets or {}))
        self._handles = itertools.count()

    @staticmethod
    def kv_bytes_per_token(model: Transformer) -> int:
        config = model.config
        return KVCache.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                                       model.norm.weight.dtype)

    # --- sequences ----------------------------------------------------------------------------
    def allocate(self) -> int:
        """A handle for a new, empty sequence (it takes blocks as it grows)."""
        handle = next(self._handles)
        self.blocks.add(handle)
        return handle

    def free(self, handle: int) -> None:
        self.blocks.free(handle)

    def length(self, handle: int) -> int:
        return self.blocks.lengths[handle]

    def truncate(self, handle: int, length: int) -> None:
        self.blocks.truncate(handle, length)

    def share_prefix(self, handle: int, token_ids: list[int], salt: bytes = b"") -> int:
        """An empty sequence starts with the cached blocks of its tokens' longest cached prefix
        under `salt` (`block_manager.prefix_salt`); returns how many tokens it holds (0 without
        prefix caching)."""
        return self.blocks.share_prefix(handle, token_ids, salt)

    def prefix_digests(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """What `cached_prefix_length` looks up for a sequence about to hold `token_ids`."""
        return self.blocks.prefix_digests(token_ids, salt)

    def cached_prefix_length(self, digests: list[bytes]) -> int:
        """The tokens `share_prefix` would give now a new sequence with these `prefix_digests`."""
        return self.blocks.cached_prefix_length(digests)

    @property
    def prompt_kernels(self) -> bool:
        """Whether prompt tokens are computed by kernels of their own (`model/prompt_pass.py`), so
        that only blocks of prompt tokens may be shared."""
        return self.model.prompt_kernels

    def register_prefix(self, handle: int, token_ids: list[int], salt: bytes = b"") -> None:
        """The sequence's full blocks of committed tokens become shareable under `salt`."""
        self.blocks.register(handle, token_ids, salt)

    def synchronize(self) -> None:
        """Wait for the work queued on the device: on a GPU `forward` returns before its pass has run
        (its logits are computed by then only when read), so a timing of passes must end here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        rows: list[int],
        token_ids: list[list[int]],
        num_logits: list[int],
        *,
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
        parents: list[list[int] | None] | None = None,
        prompt: bool = False,
    ) -> ForwardResult:
        """Append token_ids[b] to sequence rows[b] and return logits for its last num_logits[b] tokens.
        prompt: every token fed is a prompt's (`model/prompt_pass.py`: computed by prompt kernels).

        parents[b] (None: a chain) makes row b's new tokens a token tree (`draftwise.cache.token_tree`):
        each attends the cached tokens and its ancestors only. They are stored one after another;
        `keep_path` then moves a committed root path into place."""
        if parents is not None:
            for row_parents, ids in zip(parents, token_ids):
                if row_parents is not None:
                    if len(row_parents) != len(ids):
                        raise ValueError(f"a tree of {len(row_parents)} parents for {len(ids)} tokens")
                    token_tree.check_parents(row_parents)
        lengths = [self.blocks.lengths[row] for row in rows]
        counts = [len(ids) for ids in token_ids]
        for row, length, count in zip(rows, lengths, counts):
            if length + count > self.max_len:
                raise PromptTooLongError(
                    f"sequence needs {length + count} positions but the context holds {self.max_len}")
        for row, length, count in zip(rows, lengths, counts):
            self.blocks.grow(row, length + count)
        width = max(counts)
        prompt = prompt and self.prompt_kernels  # (else a prompt is computed as any other pass)
        if self.static_step is not None and num_layers is None and not capture_layers and not prompt \
                and self.static_step.fits(len(rows), width):
            result = self._static_forward(rows, token_ids, lengths, num_logits, parents)
        else:
            result = self._eager_forward(rows, token_ids, lengths, num_logits, num_layers, capture_layers, parents,
                                         prompt)
        for row, length, count in zip(rows, lengths, counts):
            self.blocks.set_length(row, length + count)
        return result

    def keep_path(self, handle: int, stored: list[int], destination: int) -> None:
        """A tree's committed root path, stored at positions `stored`, moves to destination,
        destination + 1, ...: where a chain would have put it."""
        first = next((i for i, p in enumerate(stored) if p != destination + i), None)
        if first is not None:  # (a path whose head is in place already keeps it there)
            self.cache.move(handle, stored[first:], destination + first)

    def _static_forward(self, rows: list[int], token_ids: list[list[int]], lengths: list[int],
                        num_logits: list[int], parents: list[list[int] | None] | None) -> ForwardResult:
        step = self.static_step
        bucket = step.bucket(len(rows), max(len(ids) for ids in token_ids), any(n > 1 for n in num_logits))
        logits = step.run(bucket, step.prepare(bucket, rows, token_ids, lengths, parents))  # [R'*L', V]
        _, width, per_row = bucket
        if per_row == 1:  # the real rows come first: a copy of them, no gather (a graph's logits are rewritten)
            return ForwardResult(logits[:len(rows)].clone(), _cumulative(num_logits))
        index = [b * width + len(token_ids[b]) - n + i for b, n in enumerate(num_logits) for i in range(n)]
        return ForwardResult(logits[index], _cumulative(num_logits))

    @property
    def packs_rows(self) -> bool:
        """Whether an eager pass packs its rows' tokens one after another (a kernel backend reads each
        query's row); otherwise (the SDPA paths) rows are padded to the widest."""
        return self.cache.kernel is not None

    @property
    def pads_rows(self) -> bool:
        """Whether a pass computes every row at the widest row's width: eagerly on the SDPA paths,
        and in a static step (its shape buckets)."""
        return not self.packs_rows or self.static_step is not None

    def pass_tokens(self, counts: list[int]) -> int:
        """The tokens a pass over rows of these new-token counts computes (what its time follows)."""
        return len(counts) * max(counts, default=0) if self.pads_rows else sum(counts)

    def _eager_forward(self, rows: list[int], token_ids: list[list[int]], lengths: list[int],
                       num_logits: list[int], num_layers: int | None, capture_layers: tuple[int, ...],
                       parents: list[list[int] | None] | None, prompt: bool = False) -> ForwardResult:
        """Packed ([1, N]: rows' tokens one after another, N = sum of counts) where the cache's
        attention is a kernel that reads each query's row; padded to the widest row ([B, S]) on the
        SDPA paths. Either way each token's arithmetic is the same (the kernels are row-independent)."""
        counts = [len(ids) for ids in token_ids]
        packed = self.packs_rows
        width = max(counts)
        kv_length = max(length + count for length, count in zip(lengths, counts))
        if packed:
            positions = [[length + s for s in range(count)] for length, count in zip(lengths, counts)]
        else:  # padding positions continue the row (capped inside the keys read); their outputs are dropped
            positions = [[min(length + s, kv_length - 1) for s in range(width)] for length in lengths]
        paths = None
        if parents is not None and any(p is not None for p in parents):
            paths = [None if p is None else token_tree.paths(p, length) for p, length in zip(parents, lengths)]
            for b, row_parents in enumerate(parents):
                if row_parents is not None:  # a tree's tokens sit at their depth; its padding at the start
                    depth = token_tree.depths(row_parents)
                    positions[b] = [lengths[b] + depth[s] if s < counts[b] else lengths[b]
                                    for s in range(len(positions[b]))]
        if packed:
            valid = None
            token_tensor = torch.tensor([[t for ids in token_ids for t in ids]], device=self.device)  # [1, N]
            position_tensor = torch.tensor([[p for row in positions for p in row]], device=self.device)  # [1, N]
            starts = _cumulative(counts)[:-1]  # row b's tokens at starts[b]..
        else:
            valid = None if min(counts) == width else [[s < count for s in range(width)] for count in counts]
            token_tensor = torch.tensor([ids + [0] * (width - len(ids)) for ids in token_ids], device=self.device)  # [B, S]
            position_tensor = torch.tensor(positions, device=self.device)  # [B, S]
            starts = [b * width for b in range(len(rows))]
        view = self.cache.view(rows, positions, valid, kv_length, paths)
        hidden, captured = self.model.hidden_states(token_tensor, position_tensor, view, num_layers=num_layers,
                                                    capture_layers=capture_layers, prompt=prompt)

        # Gather only the positions whose logits were asked for: the LM head is the costliest matmul.
        picked = hidden.flatten(0, 1)[[starts[b] + counts[b] - n + i for b, n in enumerate(num_logits)
                                       for i in range(n)]]  # [N_logits, H]
        logits = self.model.logits(picked)  # [N_logits, V]
        if not captured:
            return ForwardResult(logits, _cumulative(num_logits))
        fed = [starts[b] + s for b, count in enumerate(counts) for s in range(count)]
        return ForwardResult(logits, _cumulative(num_logits),
                             {layer: h.flatten(0, 1)[fed] for layer, h in captured.items()}, _cumulative(counts))


def _routes_on_host(model: Transformer) -> bool:
    """Whether a pass reads values back to the host mid-way (a mixture of experts picks its experts'
    tokens there): no CUDA graph can capture it, nor a full-graph compile trace it."""
    return any(isinstance(module, SparseMoE) for module in model.modules())


def _resolve_step_mode(step_mode: str | None, cache: KVCache, routes_on_host: bool = False) -> str | None:
    if step_mode == "auto":
        captured = cache.keys.device.type == "cuda" and cache.kernel is not None and not routes_on_host
        return "graph" if captured else None
    if step_mode is not None and step_mode not in STEP_MODES:
        raise InvalidParameterError(f"step_mode must be one of auto, {', '.join(STEP_MODES)} or None, got {step_mode!r}")
    if step_mode in ("graph", "compile") and routes_on_host:
        raise InvalidParameterError(f"step_mode {step_mode!r} cannot run a mixture-of-experts model (its routing "
                                    "reads the chosen experts back to the host mid-pass): use 'eager' or auto")
    if step_mode is not None and cache.kernel is None:
        raise InvalidParameterError(
            f"step_mode {step_mode!r} needs a paged-attention kernel, and there is none for a "
            f"{cache.keys.dtype} cache on {cache.keys.device.type} here (enforce_eager=True runs without one)")
    return step_mode


def _cumulative(num_logits: list[int]) -> list[int]:
    return [0, *itertools.accumulate(num_logits)]
