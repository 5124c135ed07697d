"""Benchmark prompts: Spec-Bench, HumanEval, or any JSONL of requests, as (category, prompt) pairs.

`spec-bench`: Spec-Bench's questions (spec_bench_question.jsonl), the first turn of each in the
model's chat template (or every turn joined as one conversation with `all_turns`); its eight MT-bench
subcategories (writing ... humanities) count as one category, `mt_bench`, as Spec-Bench reports it,
taken in turn (the first of each subcategory before any second one).
`humaneval`: the HumanEval prompts (humaneval.jsonl.gz) as raw code completions.
Anything else is a path to a JSONL file read as planner traffic (prompt / messages / turns, and a
segment or category field).

Where the files are: $DRAFTWISE_DATA, then ./data, then ../shared/data.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from draftwise.errors import InvalidParameterError

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
FILES = {"spec-bench": "spec_bench_question.jsonl", "humaneval": "humaneval.jsonl.gz"}


def data_file(name: str) -> Path:
    folders = [os.environ.get("DRAFTWISE_DATA"), "data", "../shared/data"]
    for folder in filter(None, folders):
        path = Path(folder) / FILES[name]
        if path.is_file():
            return path
    raise InvalidParameterError(f"{FILES[name]} not found in $DRAFTWISE_DATA, ./data or ../shared/data "
                                f"(set DRAFTWISE_DATA to the folder holding it)")


def load_prompts(dataset: str, tokenizer, *, per_category: int, all_turns: bool = False,
                 max_tokens: int = 128, seed: int = 0) -> list[tuple[str, str]]:
    """(category, prompt) pairs: the first `per_category` of each category, in file order."""
    if dataset == "spec-bench":
        rows = _mt_bench_in_turn(_jsonl(data_file(dataset)))
        return _first_per_category([(_spec_bench_category(r["category"]), _chat(tokenizer, r["turns"], all_turns))
                                    for r in rows], per_category)
    if dataset == "humaneval":
        return [("humaneval", row["prompt"]) for row in _jsonl(data_file(dataset))][:per_category]
    from draftwise.traffic import read_traffic

    items = read_traffic(dataset, tokenizer, sample=10**9, max_tokens=max_tokens, seed=seed)
    return _first_per_category([(item.segment or "all", item.prompt) for item in items], per_category)


def _mt_bench_in_turn(rows: list[dict]) -> list[dict]:
    """MT-bench's questions come in blocks of ten per subcategory; reorder them to take the
    subcategories in turn (writing 1, roleplay 1, ..., humanities 1, writing 2, ...), so that a few
    MT-bench prompts cover several subcategories instead of the first few writing questions.
    Other rows keep their order, after MT-bench's."""
    rank: dict[str, int] = {}
    keyed = []
    for position, row in enumerate(rows):
        category = row["category"]
        if category in MT_BENCH:
            rank[category] = rank.get(category, 0) + 1
            keyed.append(((0, rank[category], MT_BENCH.index(category)), row))
        else:
            keyed.append(((1, position, 0), row))
    return [row for _, row in sorted(keyed, key=lambda pair: pair[0])]


def _spec_bench_category(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def _chat(tokenizer, turns: list[str], all_turns: bool) -> str:
    if not all_turns:
        return tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}])
    # later turns follow the earlier ones as user messages (the answers are not part of the benchmark)
    return tokenizer.apply_chat_template([{"role": "user", "content": "\n\n".join(turns)}])


def _first_per_category(pairs: list[tuple[str, str]], per_category: int) -> list[tuple[str, str]]:
    counts: dict[str, int] = {}
    chosen = []
    for category, prompt in pairs:
        if counts.get(category, 0) < per_category:
            counts[category] = counts.get(category, 0) + 1
            chosen.append((category, prompt))
    return chosen


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
