"""`--suite kernels`: what the kernels make of plain decoding, verification and speculation, beside
llama.cpp on the same GGUF files with the same threads (`--peers llama.cpp`; its tools are built
once into the cache: `llama_cpp_build.py`).

Configs: draftwise plain (the default int4 path), draftwise with the draft model (adaptive; other
configs by `--configs`), the control; with the peer, llama.cpp plain and llama.cpp with the same
draft model (`llama_cpp.py`). Items, interleaved: HumanEval prompts (4 a category by default),
greedy, 64 tokens each with EOS ignored (every config generates the same number of tokens); then a
forward pass over n = 1, 2, 4, 8, 16 new tokens after a 256-token context (`ForwardCost`, llama.cpp
timing its own with llama-bench) and each draftwise process's resident memory.

Tables: tokens/s with the speedup over draftwise plain and over llama.cpp plain, and the tokens a
draftwise config drafted per step (what the adaptive controller chose on this cost curve); the
forward-pass curve relative to n = 1 of the same engine (the issue's goal: 8 tokens <= 1.4 steps,
16 <= 2.0); resident memory against the weights.
"""

from __future__ import annotations

from dataclasses import asdict

from draftwise.benchmark.configs import CONTROL, PLAIN, parse_config
from draftwise.benchmark.llama_cpp import PLAIN as LLAMA_PLAIN
from draftwise.benchmark.llama_cpp import LlamaCppRecipe
from draftwise.benchmark.probes import ForwardCost, ResidentMemory
from draftwise.benchmark.report import SuiteReport, control_line, number, ratio, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import header, measure_prompts, prompts_for, sampling
from draftwise.benchmark.summary import summarize
from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_DRAFT

PEER = "llama.cpp"
MAX_TOKENS = 64
DEFAULT_CONFIGS = ("draft",)
SIZES = (1, 2, 4, 8, 16)


def run(settings: BenchSettings) -> SuiteReport:
    unknown = [peer for peer in settings.peers if peer != PEER]
    if unknown:
        raise InvalidParameterError(f"--suite kernels runs the peer {PEER!r} only, got {', '.join(unknown)}")
    params = sampling(settings, MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for(settings, 4, params.max_tokens, datasets=("humaneval",))
    named = {name: parse_config(name, settings.options) for name in settings.configs_or(list(DEFAULT_CONFIGS))}
    draft_model = next((o["model"] for o in settings.options.values() if o.get("model")), None) or DEFAULT_DRAFT
    peers, absent = peer_recipe(settings, draft_model, params.max_tokens)
    probes = [ForwardCost(SIZES, context=256), ResidentMemory()]
    results = measure_prompts(settings, named, params, prompts, peers, probes)
    summary = summarize(results, compare_outputs=params.greedy)
    measures = {r.name: r.measures for r in results}
    text = "\n\n".join([header(settings, prompts, params) + " EOS ignored.",
                        control_line(summary[CONTROL]["all"]["speedup"]),
                        speed_table(summary, absent), "A forward pass over n new tokens after a 256-token context, "
                        "relative to n = 1 of the same engine (llama.cpp: llama-bench's, median of 5):",
                        cost_table(measures), memory_table(measures)])
    data = {"summary": summary, "absent": absent, "measures": measures,
            "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    return SuiteReport("kernels", text, data)


def peer_recipe(settings: BenchSettings, draft_model: str, max_tokens: int) -> tuple[list, dict[str, str]]:
    """llama.cpp's recipe (building its tools here first, before anything is timed), or why it is absent."""
    if PEER not in settings.peers:
        return [], {f"{PEER} plain / draft": f"--peers {PEER} runs it"}
    import torch

    from draftwise.benchmark.llama_cpp_build import LlamaCppUnavailable, llama_cpp_binaries

    try:
        llama_cpp_binaries()
    except LlamaCppUnavailable as error:
        return [], {f"{PEER} plain / draft": str(error).splitlines()[0]}
    return [LlamaCppRecipe(settings.model, draft_model, max_tokens, torch.get_num_threads())], {}


def speed_table(summary: dict, absent: dict[str, str]) -> str:
    peer_plain = summary.get(LLAMA_PLAIN, {}).get("all")
    rows = []
    for name, figures in summary.items():
        a = figures["all"]
        steps = a["num_drafts"] + a["num_plain_steps"]
        versus_peer = a["tokens_per_s"] / peer_plain["tokens_per_s"] if peer_plain else None
        rows.append([name, number(a["tokens_per_s"]), ratio(a["speedup"]), ratio(versus_peer),
                     number(a["num_draft_tokens"] / steps) if steps else "-",
                     "-" if a["equal_to_plain"] is None else f"{a['equal_to_plain']}/{a['requests']}"])
    rows += [[name, f"not run ({why})", "-", "-", "-", "-"] for name, why in absent.items()]
    return ("Tokens/s over all prompts (prefill included); drafted per step: draftwise's drafted tokens per "
            "decoding step (the controller's k); outputs = plain: equal to draftwise plain's tokens (llama.cpp's "
            "are not compared):\n\n" +
            table(["config", "tokens/s", f"vs {PLAIN}", f"vs {LLAMA_PLAIN}", "drafted per step", "outputs = plain"],
                  rows))


def cost_table(measures: dict[str, list[dict]]) -> str:
    rows = []
    for name, probes in measures.items():
        seconds = {int(n): s for n, s in probes[0]["seconds"].items()}
        rows.append([name, f"{seconds[1] * 1000:.1f}", *(f"{seconds[n] / seconds[1]:.2f}" for n in SIZES)])
    return table(["config", "n=1 ms", *(f"n={n}" for n in SIZES)], rows)


def memory_table(measures: dict[str, list[dict]]) -> str:
    rows = [[name, f"{m['rss_bytes'] / 2**20:.0f}", f"{m['weights_bytes'] / 2**20:.0f}",
             f"{m['rss_bytes'] / m['weights_bytes']:.2f}"]
            for name, probes in measures.items() for m in [probes[1]] if m]
    return ("Resident memory of each draftwise process after the run, against its weights (target, and draft "
            "model where it has one):\n\n" + table(["config", "RSS MiB", "weights MiB", "RSS / weights"], rows))
