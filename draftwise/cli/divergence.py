"""`draftwise divergence`: is verifying k tokens bit-identical to k one-token steps on this device,
and if not, which op is the first to differ (`draftwise/runner/divergence.py`)."""

from __future__ import annotations

import argparse

from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.quant.apply import QUANTIZATIONS

DEFAULT_TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


def add_parser(commands) -> None:
    command = commands.add_parser("divergence", help="find the first op whose output differs between feeding "
                                                     "tokens one at a time and k at a time")
    command.add_argument("--model", default=DEFAULT_TARGET, help="known name, GGUF file or HF folder")
    command.add_argument("--window", type=int, default=5, help="tokens per pass in the second run (k + 1)")
    command.add_argument("--tokens", type=int, default=48, help="tokens fed after the first")
    command.add_argument("--text", default=DEFAULT_TEXT, help="the text whose tokens are fed (repeated as needed)")
    command.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    command.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    command.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    command.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU)")
    command.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.errors import InvalidParameterError
    from draftwise.llm import LLM
    from draftwise.runner.divergence import first_divergence

    if args.window < 2 or args.tokens < 1:
        raise InvalidParameterError("--window must be at least 2 and --tokens positive")
    if args.window > args.tokens:
        raise InvalidParameterError(f"--window {args.window} is more than the {args.tokens} tokens fed (--tokens): "
                                    "no pass would hold that many")
    if not args.text:
        raise InvalidParameterError("--text is empty: give the text whose tokens are fed")
    from draftwise.loading.hf_folder import read_config
    from draftwise.loading.resolve import resolve_model

    positions = read_config(resolve_model(args.model)).max_position_embeddings
    if args.tokens + 2 > positions:
        raise InvalidParameterError(f"--tokens {args.tokens} is more than this model's {positions} positions hold "
                                    f"(at most {positions - 2})")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              load_format=args.load_format, max_num_seqs=2, max_model_len=max(args.tokens + 2, min(16, positions)))
    ids = llm.tokenizer.encode(args.text)
    if not ids:
        raise InvalidParameterError("--text has no tokens")
    ids = (ids * (args.tokens // max(1, len(ids)) + 2))[:args.tokens + 1]
    found = first_divergence(llm.runner, ids, args.window)
    where = f"{llm.device}, {str(llm.dtype).removeprefix('torch.')}, {llm.model.quantization.mode}"
    if found is None:
        print(f"bit-identical: {args.tokens} tokens fed one at a time and {args.window} at a time ({where})")
    else:
        print(f"{found.describe()} ({where})")
