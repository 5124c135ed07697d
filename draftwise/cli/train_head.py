"""`draftwise train-head`: train a head that drafts from the target's hidden states."""

from __future__ import annotations

import argparse

from draftwise.loading.registry import DEFAULT_TARGET
from draftwise.quant.apply import QUANTIZATIONS


def add_parser(commands) -> None:
    parser = commands.add_parser("train-head", help="train a drafting head on the target's own answers")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="known name, GGUF file or HF folder")
    parser.add_argument("--kind", required=True, help="the head's drafter (one with a trainable head)")
    parser.add_argument("--data", required=True, help="JSONL of prompts (prompt, messages or turns)")
    parser.add_argument("--out", default=None, help="folder for the head (default: the cache, where the drafter "
                                                    "finds it)")
    parser.add_argument("--sample", type=int, default=64, help="prompts used (drawn evenly across segments)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens of each answer the target writes")
    parser.add_argument("--num-heads", type=int, default=4, help="Medusa: heads; EAGLE: depth of the held-out "
                                                                 "acceptance report")
    parser.add_argument("--head-width", type=int, default=None, help="EAGLE: the layer's MLP width (default: 4/3 "
                                                                     "of the hidden size, at most the target's)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--kept-tokens", type=int, default=32768, help="vocabulary the heads score")
    parser.add_argument("--heldout-share", type=float, default=0.1, help="prompts kept out to report acceptance")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "auto"),
                        help="EAGLE: the head's passes in float32, or under bfloat16 autocast (about 1.4x "
                             "faster on CPUs with AMX; auto: bf16 where the device multiplies it natively)")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS))
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if present)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.speculative.heads.training import TrainSettings
    from draftwise.training.train_head import train_head

    settings = TrainSettings(num_heads=args.num_heads, epochs=args.epochs, learning_rate=args.lr,
                             batch_size=args.batch_size, kept_tokens=args.kept_tokens,
                             heldout_share=args.heldout_share, head_width=args.head_width,
                             bf16={"auto": None, "bf16": True, "fp32": False}[args.precision])
    folder, result = train_head(args.target, args.kind, args.data, args.out, settings=settings, sample=args.sample,
                                max_tokens=args.max_tokens, quantization=args.quantization, device=args.device)
    last = result.reports[-1]
    print(f"written: {folder} ({result.train_positions} training positions; held-out acceptance by position "
          + " ".join(f"{a:.2f}" for a in last.heldout_acceptance) + f", {last.mean_accepted:.2f} tokens a step)")
