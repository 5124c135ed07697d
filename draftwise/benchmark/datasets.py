"""Benchmark prompts: Spec-Bench, HumanEval, or any JSONL of requests, as (category, prompt) pairs.

`spec-bench`: Spec-Bench's questions (spec_bench_question.jsonl), the first turn of each in the
model's chat template (or every turn joined as one conversation with `all_turns`); its eight MT-bench
subcategories (writing ... humanities) count as one category, `mt_bench`, as Spec-Bench reports it,
taken in turn (the first of each subcategory before any second one).
`humaneval`: the HumanEval prompts (humaneval.jsonl.gz) as raw code completions.
`suffix-workload`: what drafting from earlier text is for, built from both files (`suffix_workload`).
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
SUFFIX_WORKLOAD = "suffix-workload"
CODE_EDITS = ("with clearer variable names", "with a comment above every line that does work",
              "with type hints on every local variable", "with its docstring examples moved into a comment")


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
    if dataset == SUFFIX_WORKLOAD:
        return _first_per_category(suffix_workload(tokenizer, per_category), per_category)
    from draftwise.traffic import read_traffic

    items = read_traffic(dataset, tokenizer, sample=10**9, max_tokens=max_tokens, seed=seed)
    own = next((item for item in items if item.max_tokens != max_tokens), None)
    if own is not None:  # (every prompt of a run shares one SamplingParams: a line's own would be ignored)
        raise InvalidParameterError(
            f"{dataset}: a line sets max_tokens {own.max_tokens}, which the bench does not read (every prompt runs "
            f"to --max-tokens, here {max_tokens}); remove it from the file (`draftwise plan` reads it)")
    return _first_per_category([(item.segment or "all", item.prompt) for item in items], per_category)


def suffix_workload(tokenizer, count: int) -> list[tuple[str, str]]:
    """Requests whose answers mostly repeat text seen before, `count` of each kind, kinds in turn:
    - code_edit: a HumanEval solution, given whole, to be returned rewritten (the answer copies it);
    - follow_up: a second turn after the model's (here: the reference) solution, asking for the
      function again with a change (the answer copies the first answer);
    - first_seen / seen_before: a Spec-Bench question, then the very same request again (the second
      is drafted from the first one's answer by a drafter that remembers earlier requests)."""
    problems = _jsonl(data_file("humaneval"))
    questions = [row for row in _jsonl(data_file("spec-bench"))
                 if _spec_bench_category(row["category"]) != "mt_bench"]
    pairs = []
    for i in range(count):
        problem = problems[(7 * i) % len(problems)]
        code = problem["prompt"] + problem["canonical_solution"]
        edit = [{"role": "user", "content": f"Here is a Python function:\n```python\n{code}```\nReturn the whole "
                                            f"function again, {CODE_EDITS[i % len(CODE_EDITS)]}."}]
        follow = [{"role": "user", "content": f"Complete this function:\n```python\n{problem['prompt']}```"},
                  {"role": "assistant", "content": f"```python\n{code}```"},
                  {"role": "user", "content": "Now return the complete function again with input validation "
                                              "that raises ValueError on bad arguments."}]
        question = [{"role": "user", "content": questions[(37 * i) % len(questions)]["turns"][0]}]
        pairs += [("code_edit", tokenizer.apply_chat_template(edit)),
                  ("follow_up", tokenizer.apply_chat_template(follow)),
                  ("first_seen", tokenizer.apply_chat_template(question)),
                  ("seen_before", tokenizer.apply_chat_template(question))]
    return pairs


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
