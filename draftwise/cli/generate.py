"""`draftwise generate`: stream one completion to the terminal, then a line of statistics."""

from __future__ import annotations

import argparse
import sys

from draftwise.cli.model_flags import add_model_arguments, model_keywords
from draftwise.cli.speculative_flags import speculative_from_args
from draftwise.errors import InvalidParameterError


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text from a prompt, streaming it")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--chat-template", default=None,
                          help="with --chat: this template instead of the model's (a Jinja file's path, or the "
                               "template itself on one line; vLLM's flag)")
    add_model_arguments(generate)
    generate.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.sampling.params import SamplingParams
    from draftwise.text.chat_template import read_chat_template

    if args.chat_template is not None and not args.chat:
        raise InvalidParameterError("--chat-template renders chats: give --chat too")
    template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop or None)
    if args.draft_probability is not None and args.draft_probability < 1 and (params.greedy or args.seed is not None):
        raise InvalidParameterError("--draft-probability applies to sampled requests without a seed (greedy and "
                                    "seeded ones are verified by equality, where it changes nothing): give "
                                    "--temperature > 0 and no --seed, or drop it")
    llm = LLM(args.model, max_num_seqs=1, speculative=speculative_from_args(args), **model_keywords(args))
    if template is not None:
        llm.tokenizer.use_chat_template(template)
    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    final = None
    for number, delta in enumerate(llm.stream(prompt, params)):
        if number == 0 and not args.chat:  # (echoed once the request is admitted: a refused prompt is not)
            print(prompt, end="", flush=True)
        print(delta.text, end="", flush=True)
        final = delta.output
    print()
    if final is not None:
        print(f"[{final.metrics.summary()}; finish: {final.finish_reason}]", file=sys.stderr)
