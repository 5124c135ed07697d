"""The user-facing API: `LLM(model=...)`, `generate`, `chat` and `stream`, in the style of vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draftwise.adaptive.cost_model import CostModel
from draftwise.adaptive.policy import AdaptiveLength, FixedLength
from draftwise.adaptive.profile import configuration_key, load_or_measure
from draftwise.engine.engine import Engine
from draftwise.engine.outputs import RequestOutput
from draftwise.engine.sequence import Sequence
from draftwise.errors import InvalidParameterError, ModelFormatError, PromptTooLongError
from draftwise.loading.hf_folder import load_model, resolve_quantization
from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.loading.resolve import resolve_model
from draftwise.model.runner import ModelRunner
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
        speculative: SpeculativeConfig | dict | None = None,
        quantization: str = "auto",
        progress: bool = True,
    ) -> None:
        if max_model_len <= 0 or max_num_seqs <= 0:
            raise InvalidParameterError("max_model_len and max_num_seqs must be positive")
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
        self.runner = ModelRunner(self.model, max_num_seqs, self.max_model_len)
        self._install(config, draft_folder)
        self._request_ids = itertools.count()

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
        proposer = self._build_proposer(config, draft_folder)
        self.cost_model = None
        draft_length = None
        if config is not None and config.adaptive:
            self.cost_model = self.measure_costs(proposer, config)
            draft_length = AdaptiveLength(self.cost_model, config.num_speculative_tokens)
        elif config is not None:
            draft_length = FixedLength(config.num_speculative_tokens)
        self.engine = Engine(self.runner, proposer, draft_length,
                             config.draft_probability if config is not None else 1.0)
        self.spec_metrics = SpecMetrics()  # totals over every finished request

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
        return DraftModelProposer(ModelRunner(draft_model, self.runner.cache.num_rows, self.max_model_len),
                                  config.draft_confidence_threshold, config.draft_context_window)

    # --- requests ---------------------------------------------------------------------------
    def _make_sequence(self, prompt: str, params: SamplingParams) -> Sequence:
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
        return Sequence(str(next(self._request_ids)), prompt, prompt_ids, params, self.tokenizer,
                        self.tokenizer.eos_token_ids, self.max_model_len, self.device)

    @staticmethod
    def _params(sampling_params: SamplingParams | None) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams")
        return sampling_params

    def generate(self, prompts: str | list[str], sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched); outputs come back in prompt order."""
        params = self._params(sampling_params)
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        sequences = [self._make_sequence(prompt, params) for prompt in prompt_list]  # validate all first
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

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text as it is produced; the last delta carries the full output."""
        seq = self._make_sequence(prompt, self._params(sampling_params))
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
