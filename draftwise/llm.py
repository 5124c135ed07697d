"""The user-facing API: `LLM(model=...)`, `generate`, `chat` and `stream`, in the style of vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draftwise.adaptive.cost_model import CostModel
from draftwise.adaptive.policy import AdaptiveLength, FixedLength
from draftwise.adaptive.profile import configuration_key, load_or_measure
from draftwise.engine.engine import Drafter, Engine
from draftwise.engine.outputs import RequestOutput
from draftwise.engine.sequence import Sequence
from draftwise.errors import InvalidParameterError, ModelFormatError, PromptTooLongError
from draftwise.loading.hf_folder import load_model, resolve_quantization
from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.loading.resolve import resolve_model
from draftwise.model.runner import DEFAULT_BLOCK_SIZE, ModelRunner
from draftwise.sampling.params import SamplingParams
from draftwise.spec.config import SpeculativeConfig
from draftwise.spec.draft_model import DraftModelProposer
from draftwise.spec.layer_skip import LayerSkipProposer
from draftwise.spec.metrics import SpecMetrics
from draftwise.spec.ngram import NgramProposer
from draftwise.spec.proposer import Proposer
from draftwise.spec.vocab_trim import kept_token_ids, trim_lm_head
from draftwise.spec.vocabulary import check_same_vocabulary
from draftwise.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype must be one of {', '.join(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class StreamDelta:
    text: str  # new text since the previous delta
    token_ids: list[int]  # all generated token ids so far
    finish_reason: str | None
    output: RequestOutput | None  # set on the last delta


class LLM:
    def __init__(
        self,
        model: str = DEFAULT_TARGET,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        kv_cache_memory_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculative: SpeculativeConfig | dict | None = None,
        quantization: str = "auto",
        progress: bool = True,
    ) -> None:
        if max_model_len <= 0 or max_num_seqs <= 0:
            raise InvalidParameterError("max_model_len and max_num_seqs must be positive")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidParameterError(f"block_size must be a positive integer, got {block_size!r}")
        if kv_cache_memory_bytes is not None and (not isinstance(kv_cache_memory_bytes, int) or kv_cache_memory_bytes <= 0):
            raise InvalidParameterError(f"kv_cache_memory_bytes must be a positive integer, got {kv_cache_memory_bytes!r}")
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.model_folder = resolve_model(model, progress=progress)
        self.model_name = model
        self.tokenizer = Tokenizer(self.model_folder)
        config = SpeculativeConfig.from_value(speculative)
        draft_folder = self._check_draft(config, progress)  # before any weights load: fail fast
        self.model = load_model(self.model_folder, self.device, self.dtype, quantization=quantization)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ModelFormatError(
                f"{self.model_folder}: tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                f"embedding only {self.model.config.vocab_size}")
        self.max_model_len = min(max_model_len, self.model.config.max_position_embeddings)
        self.max_num_seqs = max_num_seqs
        num_blocks = None
        if kv_cache_memory_bytes is not None:
            num_blocks = kv_cache_memory_bytes // (block_size * ModelRunner.kv_bytes_per_token(self.model))
            if num_blocks < 1:
                raise InvalidParameterError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no block of {block_size} tokens "
                    f"({ModelRunner.kv_bytes_per_token(self.model)} bytes per token)")
        self.runner = ModelRunner(self.model, max_num_seqs, self.max_model_len, num_blocks=num_blocks,
                                  block_size=block_size)
        self._install(config, draft_folder)
        self._request_ids = itertools.count()
        self._live: dict[str, Sequence] = {}  # requests added with add_request, until they finish
        self._reported: dict[str, int] = {}  # request id -> tokens already reported by `step`

    # --- speculation ------------------------------------------------------------------------
    def set_speculative(self, speculative: SpeculativeConfig | dict | None, progress: bool = True) -> None:
        """Switch speculation (None: off) without reloading the target; resets `spec_metrics`."""
        if self.engine.has_unfinished():
            raise InvalidParameterError("cannot change speculation while requests are running")
        config = SpeculativeConfig.from_value(speculative)
        self._install(config, self._check_draft(config, progress))

    def _check_draft(self, config: SpeculativeConfig | None, progress: bool):
        if config is None or config.method != "draft":
            return None
        draft_folder = resolve_model(config.model, progress=progress)
        check_same_vocabulary(self.tokenizer, Tokenizer(draft_folder), self.model_name, config.model)
        return draft_folder

    def _install(self, config: SpeculativeConfig | None, draft_folder) -> None:
        self.speculative = config
        self.cost_model = None
        self.engine = Engine(self.runner, max_num_seqs=self.max_num_seqs,
                             default_method=config.method if config is not None else None)
        if config is not None:
            self.engine.add_drafter(config.method, self._build_drafter(config, draft_folder))
        self.spec_metrics = SpecMetrics()  # totals over every finished request

    def _build_drafter(self, config: SpeculativeConfig, draft_folder) -> Drafter:
        proposer = self._build_proposer(config, draft_folder)
        if config.adaptive:
            costs = self.measure_costs(proposer, config)
            if config.method == (self.speculative.method if self.speculative else None):
                self.cost_model = costs
            draft_length = AdaptiveLength(costs, config.num_speculative_tokens)
        else:
            draft_length = FixedLength(config.num_speculative_tokens)
        return Drafter(proposer, draft_length, config.num_speculative_tokens, config.draft_probability)

    @property
    def default_method(self) -> str | None:
        """The drafter requests use unless they say otherwise (None: plain decoding)."""
        return self.engine.default_method

    def measure_costs(self, proposer: Proposer | None, config: SpeculativeConfig | None,
                      refresh: bool = False) -> CostModel:
        """This machine's cost model for the target (and drafter): cached on disk, measured if absent."""
        drafter = "plain" if config is None else config.drafter_key()
        key = configuration_key(self.model_folder, self.model.quantization.mode, self.device, self.dtype, drafter)
        max_draft = config.num_speculative_tokens if config is not None else 0
        return load_or_measure(key, self.runner, proposer, self.tokenizer, min(max_draft, 16), refresh=refresh)

    def _build_proposer(self, config: SpeculativeConfig | None, draft_folder) -> Proposer | None:
        if config is None:
            return None
        if config.method == "ngram":
            return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        if config.method == "layer_skip":
            total = self.model.config.num_hidden_layers
            num_layers = config.num_layers or max(1, total // 2)
            if num_layers >= total:
                raise InvalidParameterError(f"layer_skip num_layers must be below the target's {total} layers")
            return LayerSkipProposer(self.runner, num_layers, config.draft_confidence_threshold)
        quantization = resolve_quantization(config.quantization, self.device, self.dtype, draft=True)
        draft_model = load_model(draft_folder, self.device, self.dtype, quantization=quantization)
        if config.draft_vocab_size is not None and config.draft_vocab_size < draft_model.config.vocab_size:
            trim_lm_head(draft_model, kept_token_ids(self.tokenizer, config.draft_vocab_size))
        # The draft model's cache holds as many tokens as the target's (it never holds more per
        # request), plus a block per request for rounding.
        draft_runner = ModelRunner(draft_model, self.max_num_seqs, self.max_model_len,
                                   num_blocks=self.runner.blocks.num_blocks + self.max_num_seqs,
                                   block_size=self.runner.blocks.block_size)
        return DraftModelProposer(draft_runner, config.draft_confidence_threshold, config.draft_context_window)

    # --- requests ---------------------------------------------------------------------------
    def _make_sequence(self, prompt: str, params: SamplingParams, segment: str | None = None) -> Sequence:
        if not isinstance(prompt, str):
            raise InvalidParameterError(f"a prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidParameterError("prompt is empty")
        prompt_ids = self.tokenizer.encode(prompt)
        if not prompt_ids:
            raise InvalidParameterError("prompt is empty after tokenization")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} "
                "(prompt and at least one generated token)")
        seq = Sequence(str(next(self._request_ids)), prompt, prompt_ids, params, self.tokenizer,
                       self.tokenizer.eos_token_ids, self.max_model_len, self.device)
        seq.method = self.engine.default_method
        if segment is not None and not isinstance(segment, str):
            raise InvalidParameterError(f"segment must be a string, got {type(segment).__name__}")
        seq.segment = segment
        return seq

    @staticmethod
    def _params(sampling_params: SamplingParams | None) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams")
        return sampling_params

    def generate(self, prompts: str | list[str], sampling_params: SamplingParams | None = None, *,
                 segment: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched); outputs come back in prompt order.
        segment: a traffic label (the adaptive controller keeps statistics per segment)."""
        params = self._params(sampling_params)
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        sequences = [self._make_sequence(prompt, params, segment) for prompt in prompt_list]  # validate all first
        for seq in sequences:
            self.engine.check(seq)
        for seq in sequences:
            self.engine.add(seq)
        try:
            while any(not seq.finished for seq in sequences):
                self.engine.step()
        finally:
            for seq in sequences:
                if not seq.finished:
                    self.engine.abort(seq)
        for seq in sequences:
            self.spec_metrics.merge(seq.metrics.spec)
        return [seq.output() for seq in sequences]

    # --- continuous batching: requests join and leave between steps ------------------------
    def add_request(self, prompt: str, sampling_params: SamplingParams | None = None, *,
                    speculative: dict | None = None, segment: str | None = None,
                    max_tokens_must_fit: bool = False) -> str:
        """Queue a request to run alongside whatever is running; returns its request id.

        speculative: this request's speculation: None (the LLM's), {"enabled": False} (plain
        decoding), or {"method": ..., "num_speculative_tokens": k} (k caps the drafter's own
        bound). "ngram" and "layer_skip" are built on first use; "draft" needs the LLM to have
        been built with a draft model. segment: a traffic label (the adaptive controller keeps
        statistics per segment). max_tokens_must_fit: refuse (rather than shorten) a max_tokens
        that the context cannot hold after the prompt, as OpenAI's API does."""
        seq = self._make_sequence(prompt, self._params(sampling_params), segment)
        if max_tokens_must_fit and seq.params.max_tokens is not None:
            total = len(seq.prompt_token_ids) + seq.params.max_tokens
            if total > self.max_model_len:
                raise PromptTooLongError(
                    f"this model's context holds {self.max_model_len} tokens, but {total} were requested "
                    f"({len(seq.prompt_token_ids)} in the prompt, {seq.params.max_tokens} to generate)")
        seq.method, seq.max_draft_tokens = self._request_speculation(speculative)
        self.engine.add(seq)
        self._live[seq.request_id] = seq
        self._reported[seq.request_id] = 0
        return seq.request_id

    def _request_speculation(self, speculative: dict | None) -> tuple[str | None, int | None]:
        """(method, cap on k) for a request's `speculative` field."""
        if speculative is None:
            return self.engine.default_method, None
        if not isinstance(speculative, dict):
            raise InvalidParameterError("speculative must be a dict")
        unknown = set(speculative) - {"enabled", "method", "num_speculative_tokens"}
        if unknown:
            raise InvalidParameterError(f"unknown per-request speculative option(s) {sorted(unknown)}")
        if speculative.get("enabled", True) is False or speculative.get("num_speculative_tokens") == 0:
            return None, None
        method = speculative.get("method") or self.engine.default_method
        if method is None:
            raise InvalidParameterError("speculation is off for this LLM: name a method (ngram or layer_skip)")
        if method not in self.engine.drafters:
            if method == "draft":
                raise InvalidParameterError("method 'draft' needs a draft model: build the LLM (or start the "
                                            "server) with speculative={'method': 'draft', ...}")
            config = SpeculativeConfig.from_value({"method": method})
            self.engine.add_drafter(method, self._build_drafter(config, None))
        k = speculative.get("num_speculative_tokens")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise InvalidParameterError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
        return method, k

    def step(self) -> list[RequestOutput]:
        """Run one engine step; outputs (so far) of the requests that received tokens in it."""
        stepped = {seq.request_id for seq in self.engine.step()}
        outputs = []
        for request_id, seq in list(self._live.items()):
            if request_id in stepped or seq.finished:  # (one may have finished during a generate call)
                output = seq.output()
                output.delta = seq.take_text_delta()
                output.num_new_tokens = len(seq.output_ids) - self._reported[request_id]
                self._reported[request_id] = len(seq.output_ids)
                outputs.append(output)
                if seq.finished:
                    self._forget(request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        self.spec_metrics.merge(self._live.pop(request_id).metrics.spec)
        del self._reported[request_id]

    def engine_stats(self) -> dict:
        """Queue lengths, KV blocks, and the mean k per drafter in the last step (for metrics)."""
        blocks = self.runner.blocks
        return {"running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                "kv_blocks": blocks.num_blocks, "kv_blocks_in_use": blocks.num_blocks - blocks.num_free_blocks,
                "current_k": dict(self.engine.last_num_tokens)}

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now, freeing its KV blocks (unknown or finished ids are ignored)."""
        seq = self._live.get(request_id)
        if seq is not None:
            self.engine.abort(seq)
            self._forget(request_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text as it is produced; the last delta carries the full output."""
        seq = self._make_sequence(prompt, self._params(sampling_params))
        self.engine.check(seq)
        self.engine.add(seq)
        try:
            while not seq.finished:
                self.engine.step()
                delta = seq.take_text_delta()
                if delta or seq.finished:
                    yield StreamDelta(delta, list(seq.output_ids), seq.finish_reason,
                                      seq.output() if seq.finished else None)
        finally:
            if not seq.finished:
                self.engine.abort(seq)
            self.spec_metrics.merge(seq.metrics.spec)
