"""Flags that choose the target model and how it runs (shared by generate, profile and serve)."""

from __future__ import annotations

import argparse

from draftwise.cli.speculative_flags import add_speculative_arguments
from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.quant.apply import QUANTIZATIONS


def add_model_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", default=DEFAULT_TARGET, help="known name, GGUF file or HF folder")
    command.add_argument("--tokenizer", default=None,
                         help="a Hugging Face tokenizer folder to read instead of the model's own (vLLM's flag)")
    add_speculative_arguments(command)
    command.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                         help="weights: auto = int4 on CPU (Q4_K kept as stored, int8 for wider types)")
    command.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                         help="dummy: random weights of the model's shape, from its config.json alone")
    command.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    command.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU)")
    command.add_argument("--enforce-eager", action="store_true",
                         help="run every pass op by op: no CUDA graph, no compiled step")
    command.add_argument("--step-mode", default="auto", choices=["auto", "eager", "compile", "graph"],
                         help="decode and verification passes: auto = CUDA graphs on CUDA, eager on the CPU")
    command.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                         help="turn off automatic prefix caching (on by default, as in vLLM)")
    command.add_argument("--prompt-kernels", default="auto", choices=["auto", "on", "off"],
                         help="prompts on kernels of their own where the CPU has them (AMX): faster prefill, "
                              "but the prefix cache then shares prompt blocks only; auto = on without prefix caching")


def model_keywords(args: argparse.Namespace) -> dict:
    """The `LLM` keywords these flags set."""
    return dict(tokenizer=getattr(args, "tokenizer", None), device=args.device, dtype=args.dtype,
                quantization=args.quantization, load_format=args.load_format,
                enforce_eager=args.enforce_eager, step_mode=args.step_mode,
                enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                prompt_kernels={"auto": None, "on": True, "off": False}[getattr(args, "prompt_kernels", "auto")])
