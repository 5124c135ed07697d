"""The llama.cpp peer (`--peers llama.cpp`): llama.cpp's own tools, built here (`llama_cpp_build.py`),
on the same GGUF files with the same threads, run interleaved with draftwise like any contestant.

  llama.cpp plain   `llama-bench -pg P,N`: a prompt of the request's length P (its token count by
                    the GGUF's own tokenizer), then N tokens decoded one by one; random token ids,
                    which cost what the prompt's would (a dense model computes alike for any id).
                    Seconds are llama-bench's, model loading and its warm-up excluded.
  llama.cpp draft   `llama-speculative-simple` with the draft model's GGUF on the prompt's text,
                    greedy (`--temp 0`), `--spec-type draft-simple` with llama.cpp's default draft
                    settings (at most 3 tokens a draft in the pinned version); seconds are its encode
                    + decode times (prefill and generation, as draftwise's include both). It may
                    decode a few tokens past N (an accepted draft is kept whole): tokens/s counts them.

Forward passes over n tokens (the `ForwardCost` probe): `llama-bench -p n -n 0 -d CONTEXT`, the
median of its repetitions: a pass of n new tokens after a CONTEXT-token cache, like draftwise's.
Other probes are draftwise's own and answered with nothing.
Outputs are not compared (llama-bench generates no text; llama.cpp's kernels round differently).

On CPUs with AMX the weights are not repacked (`--repack 0`, `--no-repack`): the pinned version's
AMX path dies with SIGILL in prompt processing (a worker thread's `tilezero` before any tile
configuration: measured on an Intel Xeon with AMX, 2026-11-27); its one-token decoding measured the
same either way (11.4 and 11.6 tokens/s there).
"""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftwise.benchmark.probes import ForwardCost
from draftwise.benchmark.runner import RequestResult
from draftwise.errors import DraftwiseError

PLAIN = "llama.cpp plain"
DRAFT = "llama.cpp draft"
TIMEOUT_SECONDS = 900


class LlamaCppFailed(DraftwiseError):
    """One of llama.cpp's tools failed; the message says which and how (the CLI prints it, no traceback)."""


@dataclass(slots=True)
class LlamaCppConfig:
    name: str
    binaries: dict[str, Path]
    target: Path
    draft: Path | None  # the draft model's GGUF (`llama.cpp draft`), None for plain decoding
    tokenizer: object  # the target's (prompt lengths)
    max_tokens: int
    threads: int
    reference: str | None = None  # outputs are not compared
    repack: bool = True  # llama.cpp's weight repacking (its AMX path on CPUs with AMX)

    def warm_up(self, prompt: str) -> None:
        self.run(("warm-up", prompt))  # the file cache holds the weights from here on

    def run(self, item):
        if isinstance(item, ForwardCost):
            return {"seconds": self.forward_pass_seconds(item.sizes, item.context, item.repeats)}
        if not isinstance(item, tuple):
            return {}  # a probe of draftwise's own (memory, build facts)
        category, prompt = item
        prompt_tokens = len(self.tokenizer.encode(prompt))
        if self.draft is None:
            seconds = self._bench(["-p", "0", "-n", "0", "-pg", f"{prompt_tokens},{self.max_tokens}", "-r", "1"])[0]
            return RequestResult(category, self.max_tokens, seconds, float("nan"), [], 0,
                                 prompt_tokens=prompt_tokens)
        found = self._speculate(prompt)
        return RequestResult(category, found["decoded"], found["encode_seconds"] + found["decode_seconds"],
                             found["encode_seconds"], [], 0, prompt_tokens=prompt_tokens)

    def forward_pass_seconds(self, sizes: tuple[int, ...], context: int, repeats: int) -> dict[int, float]:
        """Median seconds of a pass over n new tokens after `context` cached ones, per n."""
        return {n: statistics.median(self._bench(["-p", str(n), "-n", "0", "-d", str(context), "-r", str(repeats)]))
                for n in sizes}

    def _bench(self, arguments: list[str]) -> list[float]:
        """llama-bench's per-repetition seconds of its one test."""
        output = self._call([str(self.binaries["llama-bench"]), "-m", str(self.target), "-t", str(self.threads),
                             "-o", "json", *([] if self.repack else ["--repack", "0"]), *arguments])
        try:
            tests = json.loads(output)
            return [ns / 1e9 for ns in tests[-1]["samples_ns"]]
        except (ValueError, KeyError, IndexError) as error:
            raise LlamaCppFailed(f"llama-bench printed no result ({error}): {output[-500:]}") from None

    def _speculate(self, prompt: str) -> dict:
        output = self._call([str(self.binaries["llama-speculative-simple"]), "-m", str(self.target),
                             "-md", str(self.draft), "--spec-type", "draft-simple", "-p", prompt,
                             "-n", str(self.max_tokens), "--temp", "0", "--ignore-eos", "-t", str(self.threads),
                             "-td", str(self.threads), "-c", "4096", *([] if self.repack else ["--no-repack"])],
                            stderr=True)
        return parse_speculative_simple(output)

    def _call(self, command: list[str], stderr: bool = False) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, errors="replace")
        if done.returncode < 0:
            raise LlamaCppFailed(f"{Path(command[0]).name} was killed by {signal.Signals(-done.returncode).name}: "
                                 f"{done.stderr[-800:]}")
        if done.returncode != 0:
            raise LlamaCppFailed(f"{Path(command[0]).name} exited with {done.returncode}: {done.stderr[-800:]}")
        return done.stdout + (done.stderr if stderr else "")


def parse_speculative_simple(output: str) -> dict:
    """What llama-speculative-simple reports at its end: tokens and seconds encoded and decoded."""
    found = {}
    for key, pattern in (("encode", r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
                         ("decode", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")):
        match = re.search(pattern, output)
        if match is None:
            raise LlamaCppFailed(f"llama-speculative-simple's output lacks its {key} line: {output[-800:]}")
        found[f"{key}d"], found[f"{key}_seconds"] = int(match.group(1)), float(match.group(2))
    return found


@dataclass(frozen=True, slots=True)
class LlamaCppRecipe:
    """Both llama.cpp configs (plain, and with the draft model when there is one); built in a worker
    like any recipe, the binaries built first if the cache lacks them."""
    target: str
    draft: str | None
    max_tokens: int
    threads: int

    def build(self) -> list[LlamaCppConfig]:
        from draftwise.benchmark.llama_cpp_build import llama_cpp_binaries
        from draftwise.benchmark.peers import gguf_path
        from draftwise.loading.resolve import resolve_model
        from draftwise.native import cpu_flags
        from draftwise.text.tokenizer import Tokenizer

        binaries = llama_cpp_binaries()
        target = gguf_path(self.target)
        tokenizer = Tokenizer(resolve_model(self.target, progress=False))
        repack = "amx_tile" not in cpu_flags()
        configs = [LlamaCppConfig(PLAIN, binaries, target, None, tokenizer, self.max_tokens, self.threads,
                                  repack=repack)]
        if self.draft is not None:
            configs.append(LlamaCppConfig(DRAFT, binaries, target, gguf_path(self.draft), tokenizer,
                                          self.max_tokens, self.threads, repack=repack))
        return configs
