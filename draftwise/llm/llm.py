"""The user-facing API: `LLM(model=...)`, `generate`, `chat` and `stream`, in the style of vLLM."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from tqdm import tqdm

from draftwise.cache.block_manager import prefix_salt
from draftwise.engine.engine import Engine
from draftwise.engine.hidden_states import HiddenRecorder
from draftwise.engine.outputs import RequestOutput
from draftwise.engine.sequence import Sequence
from draftwise.engine.thread_governor import governor_for
from draftwise.errors import DraftwiseError, InvalidParameterError, KVCacheFullError, ModelFormatError
from draftwise.llm.devices import on_device, pick_device, pick_dtype, use_device
from draftwise.llm.host_memory import release_freed_memory
from draftwise.llm.kernel_builds import start_kernel_builds
from draftwise.llm.prompt_logprobs import prompt_logprobs
from draftwise.llm.random_stream import RandomStream
from draftwise.llm.samples import gathered, per_sample, sample_count
from draftwise.llm.requests import (TokensPrompt, check_against_vocabulary, check_allowed_tokens, check_chat_options,
                                    check_logprobs_asked, check_max_tokens_fit, check_messages, check_prompt_ids,
                                    prompt_parts, request_speculation, truncated, without_idle_top_k)
from draftwise.loading.hf_folder import load_model, read_config
from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.loading.resolve import resolve_model, tokenizer_folder
from draftwise.runner.model_runner import DEFAULT_BLOCK_SIZE, ModelRunner
from draftwise.sampling.params import MAX_LOGPROBS, SamplingParams, check_seed
from draftwise.sampling.processors import bad_word_ids
from draftwise.speculative.config import SpeculativeConfig, from_vllm
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.drafter import build_drafter, measure_costs
from draftwise.speculative.metrics import SpecMetrics
from draftwise.speculative.proposer import Proposer
from draftwise.speculative.registry import Target
from draftwise.structured.compiler import GrammarCompiler
from draftwise.text.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 4096  # (or the model's positions, if fewer)


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
        tokenizer: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        kv_cache_memory_bytes: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        speculative: SpeculativeConfig | dict | None = None,
        speculative_config: dict | None = None,
        quantization: str = "auto",
        load_format: str = "auto",
        enforce_eager: bool = False,
        step_mode: str | None = "auto",
        adaptive_threads: bool = True,
        enable_prefix_caching: bool = True,
        prompt_kernels: bool | None = None,
        seed: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        progress: bool = True,
    ) -> None:
        """enforce_eager (vLLM's name): every pass op by op, no CUDA graph or compiled step. step_mode:
        how decode and verification passes run (`draftwise.runner.static_step`): "auto" (CUDA graphs on
        CUDA, eager on the CPU), "eager", "compile", "graph", or None (the plain eager path).
        adaptive_threads: on the CPU, drop to one thread while that runs faster (a machine shared with
        busy processes; `engine.thread_governor`), where the model's bits do not depend on the count.
        enable_prefix_caching (vLLM's name): requests that start with tokens an earlier one committed
        share that one's KV blocks and compute only the rest. prompt_kernels: prompts computed by
        kernels of their own where the CPU has them (AMX tiles: prefill 1.15-1.5x faster, BENCHMARKS.md),
        generated tokens by the decoding kernels, so that outputs stay independent of batching
        (`model/prompt_pass.py`); the prefix cache then shares blocks of prompt tokens only, not a
        previous answer a follow-up repeats. None (default): on where the prefix cache is off.
        seed (vLLM's name): requests without a seed of their own draw from a random stream seeded with
        it (`RandomStream`): the same calls on LLMs built with the same seed give the same tokens. (vLLM
        seeds its worker's generators; here the stream is the LLM's own, whatever else the process
        draws.) A request with its own SamplingParams.seed draws from noise keyed by that, as before.
        speculative_config: vLLM's name and form of `speculative` (`speculative.config.from_vllm`).
        tokenizer (vLLM's name): a Hugging Face tokenizer folder read instead of the model's own
        tokenizer (its vocabulary must fit the model's embedding); None or the model's name: the model's.
        max_logprobs (vLLM's name): the most logprobs or prompt_logprobs a request may ask for (-1: no
        cap, so a request's -1, every token of the vocabulary at each position, is taken).
        tensor_parallel_size (vLLM's name): 1 only; a model runs on one device here (more throughput
        comes from replicas: `draftwise serve --replicas`). trust_remote_code (vLLM's name): taken as
        vLLM scripts pass it; draftwise never runs code that comes with a model, so it changes nothing."""
        check_seed(seed)
        if not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool) or max_logprobs < -1:
            raise InvalidParameterError(f"max_logprobs must be an integer >= 0, or -1 for no cap, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        if tensor_parallel_size != 1 or isinstance(tensor_parallel_size, bool):
            raise InvalidParameterError(f"tensor_parallel_size {tensor_parallel_size!r}: draftwise runs a model on "
                                        "one device (for more throughput, replicas: draftwise serve --replicas N)")
        if not isinstance(trust_remote_code, bool):
            raise InvalidParameterError(f"trust_remote_code must be true or false, got {trust_remote_code!r}")
        if speculative_config is not None:
            if speculative is not None:
                raise InvalidParameterError("pass speculative or speculative_config (vLLM's name), not both")
            speculative = from_vllm(speculative_config)
        for name, value in (("max_model_len", DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len),
                            ("max_num_seqs", max_num_seqs), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if kv_cache_memory_bytes is not None and (not isinstance(kv_cache_memory_bytes, int) or kv_cache_memory_bytes <= 0):
            raise InvalidParameterError(f"kv_cache_memory_bytes must be a positive integer, got {kv_cache_memory_bytes!r}")
        for name, value in (("adaptive_threads", adaptive_threads), ("enable_prefix_caching", enable_prefix_caching),
                            ("prompt_kernels", enable_prefix_caching if prompt_kernels is None else prompt_kernels)):
            if not isinstance(value, bool):
                raise InvalidParameterError(f"{name} must be true or false, got {value!r}")
        if not isinstance(enforce_eager, bool):
            raise InvalidParameterError(f"enforce_eager must be true or false, got {enforce_eager!r}")
        if enforce_eager and step_mode not in ("auto", None, "eager"):
            raise InvalidParameterError(f"enforce_eager=True runs no {step_mode!r} step: pass one or the other")
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        use_device(self.device)  # (this thread's current GPU: Triton launches and graph captures go there)
        kernel_builds = start_kernel_builds(self.device.type, progress)  # beside fetching and converting
        self.model_folder = resolve_model(model, progress=progress, load_format=load_format)  # (an error here does not wait for them)
        self.model_name = model
        self.tokenizer = Tokenizer(tokenizer_folder(tokenizer, model, self.model_folder))
        positions = read_config(self.model_folder).max_position_embeddings
        if max_model_len is not None and max_model_len > positions:  # (vLLM's rule: said, not shortened)
            raise InvalidParameterError(f"max_model_len {max_model_len} is more than the {positions} positions this "
                                        f"model was made for (max_position_embeddings in "
                                        f"{self.model_folder / 'config.json'})")
        config = SpeculativeConfig.from_value(speculative)
        self._check_drafter(config, progress)  # before any weights load: fail fast
        kernel_builds.wait()
        self.model = load_model(self.model_folder, self.device, self.dtype, quantization=quantization,
                                load_format=load_format)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ModelFormatError(
                f"{self.model_folder}: tokenizer has {self.tokenizer.vocab_size} tokens but the model's "
                f"embedding only {self.model.config.vocab_size}")
        self.model.prompt_kernels = not enable_prefix_caching if prompt_kernels is None else prompt_kernels
        self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions) if max_model_len is None else max_model_len
        self.max_num_seqs = max_num_seqs
        num_blocks = None
        if kv_cache_memory_bytes is not None:
            num_blocks = kv_cache_memory_bytes // (block_size * ModelRunner.kv_bytes_per_token(self.model))
            if num_blocks < 1:
                raise InvalidParameterError(
                    f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds no block of {block_size} tokens "
                    f"({ModelRunner.kv_bytes_per_token(self.model)} bytes per token)")
        self.runner = ModelRunner(self.model, max_num_seqs, self.max_model_len, num_blocks=num_blocks,
                                  block_size=block_size, step_mode=None if enforce_eager else step_mode,
                                  prefix_caching=enable_prefix_caching)
        self.target = Target(model, self.model_folder, self.tokenizer, self.runner, max_num_seqs,
                             self.max_model_len, progress, load_format)
        self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)  # structured outputs
        self.timing_listeners: list = []  # callables taking every engine step's `StepTiming` (any engine)
        self.threads = governor_for(self.runner, adaptive_threads)  # kept across changes of drafter
        # One engine operation at a time (a step, adding or aborting a request): generate, stream and
        # the step API may be called from several threads, each call's requests advancing in the
        # steps any of them runs.
        self._lock = threading.RLock()
        self._in_step = False  # (an engine step is running: `_abort_soon`)
        self._pending_aborts: deque[Sequence] = deque()  # requests to abort once the running step ends
        self._install(config)
        release_freed_memory()  # what loading read and let go
        self._random = RandomStream(seed, self.device) if seed is not None else None
        self._request_ids = itertools.count()
        self._live: dict[str, Sequence] = {}  # requests added with add_request, until they finish
        self._reported: dict[str, int] = {}  # request id -> tokens already reported by `step`

    # --- speculation ------------------------------------------------------------------------
    def set_speculative(self, speculative: SpeculativeConfig | dict | None, progress: bool = True) -> None:
        """Switch speculation (None: off) without reloading the target; resets `spec_metrics`. A
        config that cannot be built raises and leaves the current one in place."""
        with self._lock:
            if self.engine.has_unfinished():
                raise InvalidParameterError("cannot change speculation while requests are running")
            config = SpeculativeConfig.from_value(speculative)
            self._check_drafter(config, progress)
            self._install(config)
        release_freed_memory()  # the drafter replaced, and what building this one read and let go

    def check_speculative(self, speculative: SpeculativeConfig | dict | None) -> None:
        """Refuse a config as `set_speculative` would (bad options, a missing draft model, another
        vocabulary), without installing it: for commands that will install several in turn."""
        self._check_drafter(SpeculativeConfig.from_value(speculative), progress=False)

    def _check_drafter(self, config: SpeculativeConfig | None, progress: bool) -> None:
        if config is not None and config.spec.check is not None:
            config.spec.check(config.options, self.tokenizer, self.model_name, progress)

    def _install(self, config: SpeculativeConfig | None) -> None:
        """The engine for `config`: its drafter built first, so that a build that fails leaves the
        LLM as it was (the old drafter stays, speculating as before)."""
        drafter = build_drafter(config, self.target) if config is not None else None
        engine = Engine(self.runner, max_num_seqs=self.max_num_seqs,
                        default_method=config.method if config is not None else None, threads=self.threads)
        engine.timing_listeners = self.timing_listeners  # shared: they outlive a change of drafter
        if drafter is not None:
            engine.add_drafter(config.method, drafter)
        self.speculative, self.engine = config, engine
        self.cost_model: CostModel | None = drafter.costs if drafter is not None else None
        self.spec_metrics = SpecMetrics()  # totals over every finished request

    @contextmanager
    def listening(self, listener: Callable | None):
        """Every engine step's `StepTiming` also goes to `listener` (None: to nobody more) within the block."""
        if listener is None:
            yield
            return
        self.timing_listeners.append(listener)
        try:
            yield
        finally:
            self.timing_listeners.remove(listener)

    @contextmanager
    def recording_hidden(self, layers: tuple[int, ...]) -> Iterator[HiddenRecorder]:
        """Within the block, the target's residual streams after `layers` (0-based) are kept for every
        position of every request, from the passes decoding runs anyway (`recorder.take(request_id)`);
        prompts are fed whole (no prefix is shared), so every position has its state."""
        recorder = HiddenRecorder(layers)
        self.engine.recorder = recorder
        try:
            yield recorder
        finally:
            self.engine.recorder = None

    def prepare_drafter(self, method: str, options: dict | None = None) -> None:
        """Build the drafter that requests naming `method` use (with these of its options, else its
        defaults), if not built yet; the server does this at start-up so that no request waits for
        a build."""
        with self._lock:
            if method not in self.engine.drafters:
                config = SpeculativeConfig.from_value({**(options or {}), "method": method})
                if not config.spec.per_request:
                    raise InvalidParameterError(
                        f"method {method!r} loads a model of its own: build the LLM (or start the server) with "
                        f"speculative={{'method': {method!r}, ...}}")
                try:
                    drafter = build_drafter(config, self.target)
                except KVCacheFullError as error:  # (its costs are timed in the target's cache, running requests beside)
                    raise KVCacheFullError(
                        f"method {method!r} is built on first use, and timing this machine's costs for it needs room "
                        f"in the KV cache that running requests hold now ({error}): call "
                        f"LLM.prepare_drafter({method!r}) before requests run (the server does), or add the request "
                        "when some have finished") from None
                self.engine.add_drafter(method, drafter)

    @property
    def default_method(self) -> str | None:
        """The drafter requests use unless they say otherwise (None: plain decoding)."""
        return self.engine.default_method

    def measure_costs(self, proposer: Proposer | None, config: SpeculativeConfig | None,
                      refresh: bool = False) -> CostModel:
        """This machine's cost model for the target (and drafter): cached on disk, measured if absent."""
        return measure_costs(self.target, proposer, config, refresh)

    # --- requests ---------------------------------------------------------------------------
    def _sequences(self, prompts: list, index: int, params: SamplingParams, segment: str | None) -> list[Sequence]:
        """The requests of prompts[index] (one per sample); a bad prompt among several is named by its place."""
        try:
            return [self._make_sequence(prompts[index], sample, segment) for sample in per_sample(params)]
        except DraftwiseError as error:
            if len(prompts) == 1:
                raise
            raise type(error)(f"prompts[{index}]: {error}") from None

    def _make_sequence(self, prompt: str | TokensPrompt, params: SamplingParams,
                       segment: str | None = None, tenant: str | None = None) -> Sequence:
        text, prompt_ids, cache_salt = prompt_parts(prompt)
        if prompt_ids is None:
            prompt_ids = self.tokenizer.encode(text)
        prompt_ids = truncated(prompt_ids, params, self.max_model_len)
        check_prompt_ids(prompt_ids, self.max_model_len)
        check_against_vocabulary(prompt_ids, params, self.model.config.vocab_size)
        check_logprobs_asked(params, self.max_logprobs, self.model.config.vocab_size)
        params = without_idle_top_k(params, self.model.config.vocab_size)
        for name, label in (("segment", segment), ("tenant", tenant)):
            if label is not None and not isinstance(label, str):
                raise InvalidParameterError(f"{name} must be a string, got {type(label).__name__}")
        seq = Sequence(str(next(self._request_ids)), text, prompt_ids, params, self.tokenizer,
                       self.tokenizer.eos_token_ids, self.max_model_len)
        seq.method = self.engine.default_method
        seq.segment, seq.tenant = segment, tenant
        seq.prefix_salt = prefix_salt(tenant, cache_salt)  # (one tenant never times another's prefixes)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.request_grammar(params.structured_outputs)
        if params.bad_words:
            seq.bad_words_ids = bad_word_ids(params.bad_words, lambda text: self.tokenizer.encode_batch([text])[0])
        check_allowed_tokens(params, seq.bad_words_ids, seq.end_token_ids)
        if params.prompt_logprobs is not None:  # (a pass of its own over the prompt, before the request runs)
            with on_device(self.device):
                seq.prompt_logprobs = prompt_logprobs(self.model, prompt_ids, params.prompt_logprobs, seq.decode_token)
        return seq

    @staticmethod
    def _params(sampling_params: SamplingParams | None, one_sample: bool = False) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidParameterError("sampling_params must be a SamplingParams")
        if one_sample and sample_count(sampling_params) > 1:
            raise InvalidParameterError("n and best_of above 1 are served by generate() (and the server); "
                                        "stream() and add_request() take one sample per request")
        return sampling_params

    def generate(self, prompts: str | TokensPrompt | list[str | TokensPrompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 segment: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt (text, or {"prompt_token_ids": [...]}) to completion, batched; outputs
        come back in prompt order. sampling_params: one for every prompt, or a list of one per
        prompt (vLLM's forms). A request that fails ends alone with finish_reason "error" and
        its `error`; the others finish as they would have. segment: a traffic label (the adaptive
        controller keeps statistics per segment). With n > 1 (or best_of), every prompt's samples run
        as requests of their own and its output gathers them (`outputs`: vLLM's shape). use_tqdm
        (vLLM's name; off by default here): a progress bar of the finished requests on stderr."""
        if not isinstance(use_tqdm, bool):
            raise InvalidParameterError(f"use_tqdm must be true or false, got {use_tqdm!r}")
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise InvalidParameterError(f"prompts must be a string, a {{'prompt_token_ids': [...]}} dict or a list of "
                                        f"them, got {type(prompts).__name__}")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise InvalidParameterError(f"{len(sampling_params)} sampling_params for {len(prompt_list)} prompts: "
                                            "give one for all, or one per prompt")
            params_list = [self._params(params) for params in sampling_params]
        else:
            params_list = [self._params(sampling_params)] * len(prompt_list)
        groups = [self._sequences(prompt_list, i, params, segment)  # (validate all first)
                  for i, params in enumerate(params_list)]
        sequences = [seq for group in groups for seq in group]
        with self._lock:
            for seq in sequences:
                seq.method = self.engine.default_method  # (this engine's: set_speculative may have swapped it)
                self.engine.check(seq)
            for seq in sequences:
                self.engine.add(seq)
        bar = tqdm(total=len(sequences), desc="requests", unit="req", disable=not use_tqdm)
        try:
            while any(not seq.finished for seq in sequences):
                self._step()
                if use_tqdm:
                    bar.update(sum(seq.finished for seq in sequences) - bar.n)
        finally:
            bar.close()
            with self._lock:
                for seq in sequences:
                    if not seq.finished:
                        self.engine.abort(seq)
                for seq in sequences:  # (the totals are shared with every other thread's calls)
                    self.spec_metrics.merge(seq.metrics.spec)
        return [gathered([seq.output() for seq in group], params) for group, params in zip(groups, params_list)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template: str | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.
        Message text is tokenized as text: control tokens come only from the template. vLLM's options:
        add_generation_prompt opens the assistant's turn; continue_final_message (with
        add_generation_prompt=False) has the model go on with the final message's text; tools are
        rendered for the model (its calls come back as text); chat_template_kwargs are more variables
        for the template; chat_template, a template's Jinja source to render with instead of the
        model's. The template must read what it is given: tools or a variable it would ignore are
        refused."""
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages):
            conversations = messages
        else:
            raise InvalidParameterError("messages must be a conversation (a non-empty list of {'role': ..., "
                                        "'content': ...} dicts) or a list of them, got "
                                        f"{type(messages).__name__}" + (" (empty)" if messages == [] else ""))
        for c, conversation in enumerate(conversations):
            check_messages(conversation, f"messages[{c}]" if len(conversations) > 1 else "messages")
        check_chat_options(add_generation_prompt, continue_final_message, tools, chat_template_kwargs)
        prompts = [self.chat_prompt(conversation, add_generation_prompt, tools,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name for `tokenizer`."""
        return self.tokenizer

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    *, continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    chat_template: str | None = None) -> TokensPrompt:
        """A conversation as a tokens prompt (`Tokenizer.encode_chat`, with chat's options), with its
        rendered text."""
        options = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                   "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs,
                   "chat_template": chat_template}
        token_ids, text = self.tokenizer.encode_chat_rendered(messages, **options)
        return {"prompt_token_ids": token_ids, "prompt": text}

    def stream(self, prompt: str | TokensPrompt,
               sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text as it is produced; the last delta carries the full output (a failed request's
        last delta has finish_reason "error" and the output's `error` says why)."""
        seq = self._make_sequence(prompt, self._params(sampling_params, one_sample=True))
        with self._lock:
            seq.method = self.engine.default_method  # (this engine's: set_speculative may have swapped it)
            self.engine.check(seq)
            self.engine.add(seq)
        try:
            done = False
            while not done:
                if not seq.finished:  # (another call's steps may have run it to its end)
                    self._step()
                with self._lock:  # (another thread's step must not commit between these reads)
                    done = seq.finished
                    delta = seq.take_text_delta()
                    update = StreamDelta(delta, list(seq.output_ids), seq.finish_reason,
                                         seq.output() if done else None)
                if delta or done:
                    yield update
        finally:
            if not seq.finished:
                self._abort_soon(seq)
            with self._lock:  # (the totals are shared with every other thread's calls)
                self.spec_metrics.merge(seq.metrics.spec)

    def _step(self) -> list[Sequence]:
        with self._lock, self._drawing():
            return self._engine_step()

    def _engine_step(self) -> list[Sequence]:
        """One engine step (the lock held); then the aborts that came while it ran."""
        self._in_step = True
        try:
            return self.engine.step()
        finally:
            self._in_step = False
            self._take_pending_aborts()

    def _take_pending_aborts(self) -> None:
        while self._pending_aborts:
            seq = self._pending_aborts.popleft()
            if not seq.finished:  # (it may have ended in the step it waited for)
                self.engine.abort(seq)

    def _abort_soon(self, seq: Sequence) -> None:
        """Abort a request now, or right after the step that is running. (A stream abandoned
        mid-request is closed by its finalizer, which the garbage collector may run inside a step,
        in the stepping thread, which holds the re-entrant lock: aborting there would free a row
        of the running batch.)"""
        if self._in_step:
            self._pending_aborts.append(seq)
            if self._in_step:  # (still stepping: that step takes it; else take it here)
                return
        with self._lock:
            self._take_pending_aborts()
            if not seq.finished:
                self.engine.abort(seq)

    @contextmanager
    def _drawing(self):
        """Where the step runs and its random draws come from: on this LLM's GPU (whichever thread
        steps it), from this LLM's stream if it was seeded."""
        with on_device(self.device), self._random.drawing() if self._random is not None else nullcontext():
            yield

    # --- continuous batching: requests join and leave between steps ------------------------
    def add_request(self, prompt: str | TokensPrompt, sampling_params: SamplingParams | None = None, *,
                    speculative: dict | None = None, segment: str | None = None, tenant: str | None = None,
                    max_tokens_must_fit: bool = False) -> str:
        """Queue a request to run alongside whatever is running; returns its request id.

        speculative: this request's speculation: None (the LLM's), {"enabled": False} (plain
        decoding), or {"method": ..., "num_speculative_tokens": k} (k caps the drafter's own
        bound); a method that needs no model of its own is built on first use (`prepare_drafter`).
        segment: a traffic label (the adaptive controller keeps statistics per segment).
        tenant: whose request (the server passes its API key's tenant): drafters that learn from
        earlier requests' text (suffix decoding's cache) use only the same tenant's.
        max_tokens_must_fit: refuse (rather than shorten) a max_tokens that the context cannot
        hold after the prompt, as OpenAI's API does."""
        seq = self._make_sequence(prompt, self._params(sampling_params, one_sample=True), segment, tenant)
        if max_tokens_must_fit:
            check_max_tokens_fit(len(seq.prompt_token_ids), seq.params.max_tokens, self.max_model_len)
        with self._lock:
            seq.method, seq.max_draft_tokens = request_speculation(speculative, self.engine.default_method,
                                                                   self.prepare_drafter)
            self.engine.add(seq)
            self._live[seq.request_id] = seq
            self._reported[seq.request_id] = 0
        return seq.request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; outputs (so far) of the requests that received tokens in it."""
        with self._lock:
            return self._step_outputs()

    def _step_outputs(self) -> list[RequestOutput]:
        with self._drawing():
            stepped = {seq.request_id for seq in self._engine_step()}
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

    def forget_drafter_history(self) -> None:
        """Drafters drop what earlier requests left them (suffix decoding's cache of their text): the
        next requests are drafted as on a fresh LLM, with models, kernels and cost models kept warm.
        Benchmarks call it so that a warm-up or an earlier phase is not drafted from as seen before."""
        for drafter in self.engine.drafters.values():
            forget = getattr(drafter.proposer, "forget_history", None)
            if forget is not None:
                forget()

    def reset_prefix_cache(self) -> None:
        """vLLM's name: no request finds an earlier one's tokens cached any more (the blocks are
        kept as free memory). Benchmarks call it so that requests run before are not prefilled from
        the cache when they are served again as new traffic. Drafters with a prefix cache of their
        own (a draft model's) reset theirs too."""
        with self._lock:  # (between steps: a step takes and frees blocks while it runs)
            self.runner.blocks.reset_prefix_cache()
            for drafter in self.engine.drafters.values():
                reset = getattr(drafter.proposer, "reset_prefix_cache", None)
                if reset is not None:
                    reset()

    def engine_stats(self) -> dict:
        """Queue lengths, KV blocks, and the mean k per drafter in the last step (for metrics)."""
        blocks = self.runner.blocks
        return {"running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                "kv_blocks": blocks.num_blocks, "kv_blocks_in_use": blocks.num_blocks - blocks.num_free_blocks,
                "prefix_cache_queries": blocks.prefix_queries, "prefix_cache_hits": blocks.prefix_hits,
                "current_k": dict(self.engine.last_num_tokens),
                "decode_steps": self.engine.counters.decode_steps,
                "drafting_steps": self.engine.counters.drafting_steps,
                "predicted_over_observed": self.engine.counters.drain_ratios()}

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now, freeing its KV blocks (unknown or finished ids are ignored)."""
        with self._lock:
            seq = self._live.get(request_id)
            if seq is not None:
                self.engine.abort(seq)
                self._forget(request_id)
