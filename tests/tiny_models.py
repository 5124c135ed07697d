"""Tiny randomly initialised Llama-family checkpoints (Hugging Face folders) and GGUF files for tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "héllo wörld, ça va? 你好 🙂",
]


# A Hermes-style template that renders tools and tool calls as Qwen2.5's does (in brief).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall them as <tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% for call in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def train_tokenizer(vocab_size: int = 320, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


SLIDING_WINDOW = 5  # tiny Gemma 3's (prompts and answers run far past it)


def write_tiny_model(folder: Path, model_type: str = "qwen2", seed: int = 0, tie: bool = False,
                     num_layers: int = 2, residual_scale: float = 1.0, hidden_size: int = 64,
                     tools: bool = False, rope_scaling: dict | None = None, vocab_size: int = 320,
                     gemma_as_llama_cpp: bool = False) -> Path:
    """A random model saved as config.json + model.safetensors + tokenizer files.

    residual_scale < 1 shrinks what attention and MLP add to the residual stream, so the next token
    depends mostly on the current one: greedy decoding then soon repeats itself (like real text
    often does), which gives prompt lookup something to find.
    tools: `<tool_call>` and `</tool_call>` (and fill-in-the-middle's markers) are special tokens and
    the chat template renders tools. rope_scaling: transformers' RoPE scaling dict for the config.
    vocab_size: the tokenizer's (another one than 320: another vocabulary altogether).
    gemma_as_llama_cpp: a Gemma 3 with the constants llama.cpp assumes for its files (every sixth layer
    global, local RoPE base 10000, scores scaled by head_dim^-1/2), so that its GGUF reads back the same.
    """
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size, extra_special=TOOL_TOKENS if tools else ())
    common = dict(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048 if tools else 512,  # (a tools prompt is long in a 320-token vocabulary)
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=tie, initializer_range=0.2,
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
    )
    torch.manual_seed(seed)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif model_type == "mixtral":  # 4 experts, 2 a token
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    elif model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    elif model_type == "qwen3_moe":  # 4 experts of half width, 2 a token, renormalised; the last layer dense
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
            norm_topk_prob=True, mlp_only_layers=[num_layers - 1]))
    elif model_type == "gemma3_text":  # a window of 5 keys on every layer but each third; a score scale of its own
        pattern, local_theta, scalar = (6, 10000.0, 32) if gemma_as_llama_cpp else (3, 100.0, 24)
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **{**common, "rope_theta": 1e6}, head_dim=32, query_pre_attn_scalar=scalar, sliding_window=SLIDING_WINDOW,
            layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)],
            rope_local_base_freq=local_theta, hidden_activation="gelu_pytorch_tanh"))
    elif model_type == "qwen2_moe":  # 4 experts of half width, 2 a token, a shared expert; the last layer dense
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size, norm_topk_prob=False, mlp_only_layers=[num_layers - 1]))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=False))
    with torch.no_grad():  # random biases and norms, so that every parameter matters in the comparison
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(residual_scale)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TOOL_TEMPLATE if tools else CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
    }))
    return folder


def encode_q4k(weight: np.ndarray) -> np.ndarray:
    """A simple Q4_K encoder (gguf-py has none): per 32-weight group a scale and a minimum, both
    stored as 6-bit multiples of a per-256 fp16 `d` / `dmin`. Returns bytes [rows, cols / 256 * 144]."""
    rows, cols = weight.shape
    groups = weight.astype(np.float32).reshape(-1, 8, 32)  # [blocks, 8, 32]
    low = np.minimum(groups.min(axis=-1), 0)  # Q4_K can only subtract a minimum
    spans = (groups.max(axis=-1) - low) / 15
    d = (spans.max(axis=-1) / 63).astype(np.float16)
    dmin = ((-low).max(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-8), np.maximum(dmin.astype(np.float32), 1e-8)
    sc = np.clip(np.round(spans / d32[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin32[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    minimum = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((groups + minimum[..., None]) / np.maximum(scale, 1e-8)[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
        (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ], axis=1)
    q = q.reshape(-1, 4, 2, 32)  # 4 chunks of 64 weights: first 32 -> low nibbles, next 32 -> high
    quants = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
                             packed_scales, quants], axis=1)
    return blocks.reshape(rows, -1)


def encode_q6k(weight: np.ndarray) -> np.ndarray:
    """A simple Q6_K encoder: per 16-weight sub-block an int8 scale times a per-256 fp16 `d`, weights
    6-bit (q - 32). Returns bytes [rows, cols / 256 * 210] in ggml's block_q6_K layout."""
    rows, cols = weight.shape
    blocks = weight.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, 16]
    spans = np.abs(blocks).max(axis=-1) / 31  # [blocks, 16]
    d = (spans.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.round(spans / np.maximum(d.astype(np.float32), 1e-8)[:, None]), 1, 127).astype(np.int8)
    step = np.maximum(d.astype(np.float32)[:, None] * sc, 1e-8)  # [blocks, 16]
    q = (np.clip(np.round(blocks / step[..., None]), -32, 31) + 32).astype(np.uint8)  # [blocks, 16, 16]
    q = q.reshape(-1, 2, 4, 32)  # halves of 128: chunks of 32
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)  # [b, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [b, 2, 32]
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                         axis=1)
    return out.reshape(rows, -1)


def _stacked_experts(tensors: dict, config: dict) -> dict[str, np.ndarray]:
    """Pop a mixture of experts' tensors from an HF checkpoint and return them as llama.cpp names and
    stacks them: the router, each expert kind as one [E, out, in] tensor, a shared expert and its gate."""
    import re

    out: dict[str, np.ndarray] = {}
    kinds = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name in list(tensors):
        match = re.fullmatch(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.(.+)", name)
        if not match:
            continue
        layer, rest = int(match.group(1)), match.group(2)
        expert = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", rest)
        shared = re.fullmatch(r"shared_expert\.(\w+)\.weight", rest)
        if expert:
            stacks.setdefault((layer, kinds[expert.group(2)]), {})[int(expert.group(1))] = tensors.pop(name)
        elif shared:
            out[f"blk.{layer}.ffn_{kinds[shared.group(1)]}_shexp.weight"] = tensors.pop(name)
        elif rest == "gate.weight":
            out[f"blk.{layer}.ffn_gate_inp.weight"] = tensors.pop(name)
        elif rest == "shared_expert_gate.weight":
            out[f"blk.{layer}.ffn_gate_inp_shexp.weight"] = tensors.pop(name).reshape(-1)
    for (layer, kind), experts in stacks.items():
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([experts[e] for e in sorted(experts)])
    return out


def write_tiny_gguf(hf_folder: Path, path: Path, quantize_q8: bool = False, quantize_q4k: bool = False,
                    q4k_except: tuple[str, ...] = (), q6k_for: tuple[str, ...] = (),
                    chat_template: str | None = CHAT_TEMPLATE,
                    metadata: dict | None = None, extra_tensors: dict | None = None,
                    plain_metadata: dict | None = None) -> Path:
    """Write the HF folder's model as a GGUF file the way llama.cpp's converter lays it out.

    q4k_except: weight names containing one of these stay out of Q4_K (Q8_0 if quantize_q8), the
    way a Q4_K_M file keeps some tensors wider.
    q6k_for: weight names containing one of these are stored as Q6_K (as Q4_K_M does the LM head and
    half the down projections).
    chat_template: stored as `tokenizer.chat_template` (None: the file has none).
    plain_metadata: keys written as they are (not under the architecture): str or int values.
    """
    import gguf
    from safetensors.numpy import load_file

    from draftwise.loading.gguf_file import _GEMMA3_TENSORS, _GLOBAL_TENSORS, _LAYER_TENSORS, permute_rotary

    from draftwise.loading.hf_folder import read_config

    config = json.loads((hf_folder / "config.json").read_text())
    config["rope_theta"] = read_config(hf_folder).rope_theta
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3"}.get(
        config["model_type"], config["model_type"])
    layer_tensors = _GEMMA3_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    tensors = load_file(str(hf_folder / "model.safetensors"))
    expert_tensors = _stacked_experts(tensors, config)  # (a mixture of experts, as llama.cpp lays it out)
    to_gguf = {hf: g for g, hf in _GLOBAL_TENSORS.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "gemma3":  # (llama.cpp fixes the layer pattern, the local RoPE base and the score scale itself)
        writer.add_sliding_window(config["sliding_window"])
    vocab = json.loads((hf_folder / "tokenizer.json").read_text())
    ordered = sorted(vocab["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in ordered])
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token, _ in ordered])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["model"]["merges"]])
    writer.add_eos_token_id(dict(ordered)["<|im_end|>"])
    writer.add_bos_token_id(dict(ordered)["<|endoftext|>"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():  # e.g. {"rope.scaling.type": "yarn"} under the architecture
        (writer.add_string if isinstance(value, str) else writer.add_float32)(f"{arch}.{key}", value)
    for key, value in (plain_metadata or {}).items():  # e.g. {"split.count": 2}
        (writer.add_string if isinstance(value, str) else writer.add_uint32)(key, value)
    for gguf_name, array in (extra_tensors or {}).items():  # e.g. rope_freqs.weight
        writer.add_tensor(gguf_name, np.asarray(array, dtype=np.float32))
    if expert_tensors:
        experts = config.get("num_local_experts") or config["num_experts"]
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"])
        for gguf_name, array in expert_tensors.items():
            if quantize_q4k and array.ndim == 3 and array.shape[2] % 256 == 0:
                blocks = np.stack([encode_q4k(e) for e in array])
                writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            else:
                writer.add_tensor(gguf_name, array.astype(np.float32))
    for name, array in tensors.items():
        short = name.removeprefix("model.")
        if name in to_gguf:
            gguf_name = to_gguf[name]
        else:
            parts = short.split(".")  # layers.{i}.{rest}
            rest = ".".join(parts[2:])
            gguf_name = f"blk.{parts[1]}.{next(g for g, h in layer_tensors.items() if h == rest)}"
        array = array.astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # (llama.cpp's converter stores Gemma's 1 + w)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            array = permute_rotary(array, heads)
        wider = any(part in name for part in q4k_except)
        if any(part in name for part in q6k_for) and array.ndim == 2 and array.shape[1] % 256 == 0:
            writer.add_tensor(gguf_name, encode_q6k(array), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif quantize_q4k and array.ndim == 2 and array.shape[1] % 256 == 0 and not wider:
            writer.add_tensor(gguf_name, encode_q4k(array), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif quantize_q8 and array.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
