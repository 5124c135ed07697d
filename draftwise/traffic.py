"""A user's traffic, read from JSONL: what to prompt with, how long to generate, which segment.

One request per line. The prompt is the first of:
  "prompt"   raw text, sent as is (a completion);
  "messages" an OpenAI-style chat, put through the model's chat template;
  "turns"    Spec-Bench style: the first turn as a user message (chat template).
The segment is the value of `segment_field` ("segment", else "category", else "" when absent);
"max_tokens" caps generation for that line (else the planner's default).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class TrafficItem:
    prompt: str  # text as the engine receives it (chat template applied)
    segment: str
    max_tokens: int


def read_traffic(path: str | Path, tokenizer, *, sample: int, max_tokens: int, seed: int = 0,
                 segment_field: str | None = None) -> list[TrafficItem]:
    """Up to `sample` requests of the file, drawn evenly across segments (seeded), in a fixed order."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"traffic file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    items: list[TrafficItem] = []
    try:
        with opener(path, "rb") as handle:  # (bytes, decoded line by line: a bad line is named by its number)
            for number, raw in enumerate(handle, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise InvalidParameterError(f"{path}:{number}: not UTF-8 text ({error.reason} at byte "
                                                f"{error.start})") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InvalidParameterError(f"{path}:{number}: not JSON ({error.msg})") from None
                items.append(_item(row, tokenizer, max_tokens, segment_field, f"{path}:{number}"))
    except (OSError, EOFError) as error:  # (a .gz that is not gzip, or is cut short)
        raise InvalidParameterError(f"{path}: unreadable ({error})") from None
    if not items:
        raise InvalidParameterError(f"{path}: no requests in the file")
    return _sample_by_segment(items, sample, random.Random(seed))


def _item(row: dict, tokenizer, max_tokens: int, segment_field: str | None, where: str) -> TrafficItem:
    if not isinstance(row, dict):
        raise InvalidParameterError(f"{where}: each line must be a JSON object")
    if isinstance(row.get("prompt"), str):
        prompt = row["prompt"]
    elif isinstance(row.get("messages"), list):
        if not row["messages"] or any(not isinstance(m, dict) or not isinstance(m.get("role"), str)
                                      or not isinstance(m.get("content"), str) for m in row["messages"]):
            raise InvalidParameterError(f"{where}: \"messages\" must be a non-empty list of "
                                        "{\"role\": ..., \"content\": ...} objects with text content")
        prompt = tokenizer.apply_chat_template(row["messages"])
    elif isinstance(row.get("turns"), list) and row["turns"]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": str(row["turns"][0])}])
    else:
        raise InvalidParameterError(f"{where}: needs a \"prompt\" string, \"messages\" or \"turns\"")
    if not prompt.strip():
        raise InvalidParameterError(f"{where}: the prompt is empty")
    fields = [segment_field] if segment_field else ["segment", "category"]
    segment = next((str(row[f]) for f in fields if row.get(f) is not None), "")
    limit = row.get("max_tokens", max_tokens)
    if not isinstance(limit, int) or limit <= 0:
        raise InvalidParameterError(f"{where}: max_tokens must be a positive integer, got {limit!r}")
    return TrafficItem(prompt, segment, limit)


def _sample_by_segment(items: list[TrafficItem], sample: int, rng: random.Random) -> list[TrafficItem]:
    """Round-robin over segments (each shuffled) so a rare segment is still measured."""
    by_segment: dict[str, list[TrafficItem]] = {}
    for item in items:
        by_segment.setdefault(item.segment, []).append(item)
    for group in by_segment.values():
        rng.shuffle(group)
    chosen: list[TrafficItem] = []
    while len(chosen) < min(sample, len(items)):
        for group in by_segment.values():
            if group and len(chosen) < sample:
                chosen.append(group.pop())
    return chosen
