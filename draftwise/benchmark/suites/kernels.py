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
from draftwise.speculative.registry import all_specs

PEER = "llama.cpp"
MAX_TOKENS = 64
SIZES = (1, 2, 4, 8, 16)


def run(settings: BenchSettings) -> SuiteReport:
    unknown = [peer for peer in settings.peers if peer != PEER]
    if unknown:
        raise InvalidParameterError(f"--suite kernels runs the peer {PEER!r} only, got {', '.join(unknown)}")
    params = sampling(settings, MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for(settings, 4, params.max_tokens, datasets=("humaneval",))
    # by default the drafter that drafts with a model, the way llama-speculative-simple does
    default = [spec.name for spec in all_specs() if spec.drafts_with_model][:1]
    named = {name: parse_config(name, settings.options) for name in settings.configs_or(default)}
    draft_model = next((o["model"] for o in settings.options.values() if o.get("model")), None) or DEFAULT_DRAFT
    peers, absent = peer_recipe(settings, draft_model, params.max_tokens)
    probes = [ForwardCost(SIZES, context=256, repeats=9), ResidentMemory()]
    results = measure_prompts(settings, named, params, prompts, peers, probes)
    summary = summarize(results, compare_outputs=params.greedy)
    measures = {r.name: r.measures for r in results}
    text = "\n\n".join([header(settings, prompts, params) + " EOS ignored.",
                        control_line(summary[CONTROL]["all"]["speedup"]),
                        speed_table(summary, absent), "A forward pass over n new tokens after a 256-token context, "
                        "relative to n = 1 of the same engine (median of 9; llama.cpp: llama-bench's):",
                        cost_table(measures), memory_table(measures, gguf_bytes(settings, draft_model))])
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


def gguf_bytes(settings: BenchSettings, draft_model: str) -> dict[str, int | None]:
    """The GGUF files' sizes: "target" and "draft_model" (None: not a GGUF model)."""
    from draftwise.benchmark.peers import gguf_path

    sizes = {}
    for role, model in (("target", settings.model), ("draft_model", draft_model)):
        try:
            sizes[role] = gguf_path(model).stat().st_size
        except (InvalidParameterError, OSError):
            sizes[role] = None
    return sizes


def memory_table(measures: dict[str, list[dict]], files: dict[str, int | None]) -> str:
    """Each draftwise process's resident memory against its weights in memory and the GGUF files
    they came from (the target's, plus the draft model's for a config that loaded one)."""
    rows = []
    for name, probes in measures.items():
        m = probes[1]
        if not m:
            continue
        with_draft = m["drafter_bytes"] > 0
        gguf = files["target"] + (files["draft_model"] or 0) * with_draft if files["target"] else None
        rows.append([name, f"{m['rss_bytes'] / 2**20:.0f}", f"{m['weights_bytes'] / 2**20:.0f}",
                     "-" if gguf is None else f"{gguf / 2**20:.0f}",
                     "-" if gguf is None else f"{m['rss_bytes'] / gguf:.2f}"])
    return ("Resident memory of each draftwise process after the run, against its weights in memory and the GGUF "
            "files they came from (target, and the draft model's for a config with one):\n\n" +
            table(["config", "RSS MiB", "weights in memory MiB", "GGUF MiB", "RSS / GGUF"], rows))
