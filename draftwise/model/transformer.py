"""One PyTorch implementation of the Llama family (Llama, Qwen2, Mistral, SmolLM; Qwen3; Mixtral,
Qwen2-MoE and Qwen3-MoE with mixture-of-experts feed-forward blocks, `moe.py`) and of Gemma 3 (text).

RMSNorm, rotary embedding with the file's base, grouped-query attention with optional QKV bias and
QK-norm, SwiGLU MLP, tied or separate LM head. Gemma 3 adds: embeddings scaled by sqrt(hidden), norms
on what each sublayer adds too (`SandwichDecoderLayer`), GeGLU, and sliding-window layers with their
own RoPE base beside global ones. The forward pass can stop after the first L layers
(self-speculation) and hand back the hidden states of any layers (trained drafting heads).
"""

from __future__ import annotations

import torch
from torch import nn

from draftwise.model.attention import Attention, KVCacheView
from draftwise.model.config import ModelConfig
from draftwise.model.layers import RMSNorm, SwiGLU, add_and_norm
from draftwise.model import native_decoder
from draftwise.model.part_changes import TracksPartChanges, part_changes
from draftwise.model.prompt_pass import prompt_pass
from draftwise.model.moe import SparseMoE
from draftwise.model.rope import cos_sin, inverse_frequencies


class DecoderLayer(TracksPartChanges):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_sparse(layer_index):
            self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, config.norm_topk_prob,
                                 config.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, positions, cos, sin, cache):
        x, mlp_out = self.forward_unadded(x, None, positions, cos, sin, cache)
        return x + mlp_out

    def forward_unadded(self, x, pending, positions, cos, sin, cache):
        """The layer with its last residual add left to whoever comes next: x [B, S, H] the residual
        stream, pending [B, S, H] the previous layer's MLP output not yet added to it (or None).
        Returns (the stream before this layer's MLP output is added, that output). On the GPU each add
        then shares a kernel with the norm after it (`add_and_norm`): two kernels a layer fewer,
        the same bits (the add rounds as torch's does)."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = add_and_norm(x, pending, self.input_layernorm)
        attended = self.self_attn(normed, positions, cos, sin, cache)
        x, normed = add_and_norm(x, attended, self.post_attention_layernorm)
        return x, self.mlp(normed)


class SandwichDecoderLayer(nn.Module):
    """Gemma 3's layer: each sublayer's input and output normed (Hugging Face's names)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, cos, sin, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = SandwichDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # RoPE's inverse frequencies (on the CPU; a copy per device the positions come from)
        self._inv_freq, self._rope_factor = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        self._inv_freq_on: dict[tuple[torch.device, bool], torch.Tensor] = {}
        if config.local_rope_theta is not None:  # sliding layers' own base, plain RoPE (Gemma 3)
            self._local_inv_freq, _ = inverse_frequencies(config.head_dim, config.local_rope_theta, None)
        self._local_rope = [config.is_sliding(i) and config.local_rope_theta is not None
                         for i in range(config.num_hidden_layers)]
        # layer index -> (part changes when checked, the parts, the native layer or None)
        self._native_built: dict[int, tuple[int, tuple, object]] = {}
        self.native_layers = native_decoder.wanted()  # False: every layer in Python (to compare the two)
        self._prompt_kernels = False  # prompts take the layers' prompt kernels (`prompt_pass.py`; set by its LLM)

    def _apply(self, fn, recurse=True):  # (.to(), .float(), ...: the native layers hold the old tensors)
        self._native_built.clear()
        return super()._apply(fn, recurse)

    def native_layer(self, index: int):
        """Layer `index` as one native call (`native_decoder.py`), or None where it has no native form;
        built again when its parts were replaced (quantization swaps modules), which is looked at
        only when some layer's part was assigned since (`part_changes`)."""
        built = self._native_built.get(index)
        if built is not None and built[0] == part_changes():
            return built[2]
        layer = self.layers[index]
        parts = None
        if type(layer) is DecoderLayer:
            attention, mlp = layer.self_attn, layer.mlp
            parts = (attention.qkv_proj, attention.o_proj, getattr(mlp, "gate_up_proj", None),
                     getattr(mlp, "down_proj", None), layer.input_layernorm.weight,
                     layer.post_attention_layernorm.weight)
        if built is None or parts is None or any(a is not b for a, b in zip(built[1], parts)):
            native = None if parts is None else native_decoder.build_layer(layer, self.config)
        else:
            native = built[2]
        self._native_built[index] = (part_changes(), parts or (), native)
        return native

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype, *,
               local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, S, D] for positions [B, S], with the model's RoPE scaling (local: the
        sliding layers' base, unscaled)."""
        inv_freq = self._inv_freq_on.get((positions.device, local))
        if inv_freq is None:
            inv_freq = self._local_inv_freq if local else self._inv_freq
            inv_freq = self._inv_freq_on[positions.device, local] = inv_freq.to(positions.device)
        return cos_sin(positions, inv_freq, 1.0 if local else self._rope_factor, dtype)

    def hidden_states(
        self,
        token_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        cache: KVCacheView | None = None,
        *,
        num_layers: int | None = None,
        capture_layers: tuple[int, ...] = (),
        prompt: bool = False,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the first `num_layers` layers (all by default). prompt: every token fed is a prompt's
        (computed by the layers' prompt kernels where they have them: `prompt_pass.py`).

        Returns the residual stream after the last layer run [B, S, H] (before the final norm) and
        the residual stream after each layer in `capture_layers` (0-based), also [B, S, H].
        """
        if prompt and self._prompt_kernels:
            with prompt_pass():  # (the Python layers: a native layer calls the decoding kernels)
                return self._layers(token_ids, positions, cache, num_layers, capture_layers, native=False)
        return self._layers(token_ids, positions, cache, num_layers, capture_layers, native=True)

    @property
    def prompt_kernels(self) -> bool:
        """Whether prompt tokens are computed by kernels of their own (`prompt_pass.py`)."""
        return self._prompt_kernels

    @prompt_kernels.setter
    def prompt_kernels(self, wanted: bool) -> None:
        """Asked for (by the LLM, once its layers are quantized): on where some layer has a prompt kernel."""
        self._prompt_kernels = wanted and any(getattr(module, "has_prompt_kernel", False)
                                              for module in self.layers.modules())

    def _layers(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCacheView | None,
                num_layers: int | None, capture_layers: tuple[int, ...],
                native: bool) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        x = self.embed_tokens(token_ids)  # [B, S, H]
        if self.config.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        rotations = {False: self.rotary(positions, x.dtype)}
        if any(self._local_rope):
            rotations[True] = self.rotary(positions, x.dtype, local=True)
        native_pass = self._native_pass(cache, x) if native else None
        captured: dict[int, torch.Tensor] = {}
        pending = None  # the last layer's MLP output where it is not yet added to x (the next norm adds it)
        for index in range(len(self.layers) if num_layers is None else min(num_layers, len(self.layers))):
            native_layer = None if native_pass is None else self.native_layer(index)
            layer = self.layers[index]  # (an index, not a slice: slicing a ModuleList builds a new one, every pass)
            cos, sin = rotations[self._local_rope[index]]
            # A hooked layer is called as a module (its hooks see its output): its input is settled first.
            deferred = native_layer is None and type(layer) is DecoderLayer and not (
                layer._forward_hooks or layer._forward_pre_hooks)
            if pending is not None and not deferred:
                x, pending = x + pending, None
            if deferred:
                x, pending = layer.forward_unadded(x, pending, positions, cos, sin, cache)
            elif native_layer is not None:
                x = native_layer.forward(x, cos, sin, native_pass)
            else:
                x = layer(x, positions, cos, sin, cache)
            if index in capture_layers:
                x, pending = (x if pending is None else x + pending), None
                captured[index] = x
        return (x if pending is None else x + pending), captured

    def _native_pass(self, cache: KVCacheView | None, x: torch.Tensor):
        """The pass in native form where native layers can run it: float32 on the CPU, eager, over a
        cache with the native attention kernel; else None."""
        if not self.native_layers or cache is None or x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
            return None
        plan = getattr(cache, "kernel_plan", None)
        return native_decoder.native_pass(plan()) if plan is not None else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [..., H] -> logits [..., V]."""
        return self.lm_head(self.norm(hidden))

    def forward(
        self,
        token_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        cache: KVCacheView | None = None,
        *,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] for every input position."""
        hidden, _ = self.hidden_states(token_ids, positions, cache, num_layers=num_layers)
        return self.logits(hidden)
