"""`--suite gpu`: the engine's step on one device (`--device cuda` on a GPU; any device runs it), in
one process, every figure measured in this run:

1. a plain decoding step at R rows (`--levels`, default 1, 8, 32, 64): the step under test
   (`--step-mode`, default auto: CUDA graphs on CUDA), the eager path (`enforce_eager`), the eager
   path again (the control: the same config built twice), a reference step script where one is
   given (`--reference ../shared/gpu/graph_step.py`, CUDA only) and Hugging Face transformers'
   eager forward (`--peers hf`); beside them the memory-bandwidth bound (a large copy's bandwidth
   over the weights' bytes);
2. the verification curve: one row, n = 1..64 new tokens, each pass's cost over a one-token step;
3. self-drafting: the target drafting for itself (k = 4, greedy, EOS ignored) at 1, 8 and 32 rows:
   acceptance must be 100% and every output equal to plain decoding's (bit-exact batch invariance);
4. cost models measured here (plain, and each drafter in `--configs`, default: those built per
   request, which cost no model of their own: prompt lookup today),
   written to `<output>/costs/`, from which `draftwise plan --from-plan PLAN.json --costs DIR`
   predicts speculation on this device with acceptance measured elsewhere (with real weights).

With `--load-format dummy` the weights are random, of the model's real shape (where real weights
cannot travel); acceptance then means nothing but self-drafting, which must be 100% whatever the
weights.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import torch

from draftwise.benchmark.configs import config_method
from draftwise.benchmark.device_probes import copy_bandwidth, forward_seconds, hf_step_seconds, reference_step
from draftwise.benchmark.report import SuiteReport, number, percent, ratio, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.llm import LLM
from draftwise.llm.devices import pick_device
from draftwise.model.memory import bytes_read_per_step
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.config import SpeculativeConfig
from draftwise.speculative.registry import all_specs

LEVELS = (1, 8, 32, 64)
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
SELF_DRAFT_ROWS = (1, 8, 32)
CONTEXT = 256
REPEATS = 10
PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):", "class Stack:\n    def __init__(self):",
           "# Sort a list of dicts by a key\n", "def is_prime(n: int) -> bool:", "SELECT name FROM users WHERE",
           "async def fetch(url):", "The quick brown fox"]


def run(settings: BenchSettings) -> SuiteReport:
    device = pick_device(settings.device)
    levels = settings.levels or LEVELS
    rows_needed = max(max(levels), *SELF_DRAFT_ROWS)
    common = dict(device=device, dtype=settings.dtype, load_format=settings.load_format, progress=settings.progress,
                  max_num_seqs=rows_needed, max_model_len=CONTEXT + max(VERIFY_SIZES) + 16)
    llms = {"step": LLM(settings.model, step_mode=settings.step_mode, **common),
            "eager": LLM(settings.model, enforce_eager=True, **common),
            "eager (control)": LLM(settings.model, enforce_eager=True, **common)}
    target = llms["step"]
    runners = {name: llm.runner for name, llm in llms.items()}
    step_name = f"draftwise, step mode {target.runner.step_mode or 'none (eager path)'}"

    # Each figure is said as it is measured: a run cut short keeps them.
    say = _say if settings.progress else _quiet
    weights = bytes_read_per_step(target.model)
    bandwidth = copy_bandwidth(device, megabytes=1024 if device.type == "cuda" else 256)
    say("bandwidth", f"{bandwidth / 1e9:.0f} GB/s; {weights / 2**30:.2f} GiB read per step")
    steps = {rows: say(f"step, {rows} rows", forward_seconds(runners, rows, 1, CONTEXT, REPEATS), True)
             for rows in levels}
    verify = {n: say(f"verify, n = {n}", forward_seconds(runners, 1, n, CONTEXT, REPEATS), True) for n in VERIFY_SIZES}
    reference = say("reference", _reference(settings, target, device))
    hf = (hf_step_seconds(target.model_folder, device, target.dtype, levels, CONTEXT, say=say)
          if "hf" in settings.peers else None)
    self_drafting = {rows: say(f"self-drafting, {rows} rows", _self_drafting(settings, target, rows, common))
                     for rows in SELF_DRAFT_ROWS if rows <= rows_needed}
    costs = _write_costs(settings, target)

    data = {"device": _device_name(device), "dtype": str(target.dtype), "weights_bytes": weights,
            "bandwidth_bytes_per_second": bandwidth, "step_mode": target.runner.step_mode,
            "step_seconds": steps, "verify_seconds": verify, "reference": reference,
            "hf_step_seconds": hf, "self_drafting": self_drafting, "costs": costs}
    text = "\n\n".join([
        f"Device: {data['device']}; {settings.model} ({settings.load_format} weights, {target.dtype}, "
        f"{weights / 2**30:.2f} GiB read per step: the embedding table's unread rows not counted); bandwidth {bandwidth / 1e9:.0f} GB/s (a large copy, read + written); "
        f"context {CONTEXT} tokens; medians of {REPEATS} passes, the configs taking turns.",
        _control(steps, verify),
        "Plain decoding step, R rows x 1 token (tokens/s; the bound: bandwidth / weight bytes x R, the KV cache "
        "not counted):", _step_table(step_name, steps, reference, hf, bandwidth / weights, levels),
        "Verification: one row, n new tokens; a pass's cost over a one-token step of the same config:",
        _verify_table(step_name, verify),
        "Self-drafting (the target as its own draft model, k = 4, greedy): every draft must be accepted and every "
        "output must equal plain decoding's:", _self_drafting_table(self_drafting),
        f"Cost models measured here: {', '.join(costs)} in `{settings.output / 'costs'}`."])
    return SuiteReport("gpu", text, data)


def _quiet(label: str, value, seconds: bool = False):
    return value


def _say(label: str, value, seconds: bool = False):
    """One measurement on stderr as it comes (`seconds`: shown as ms); returns the value."""
    as_ms = lambda v: f"{v * 1e3:.3f} ms" if seconds else v  # noqa: E731
    shown = {name: as_ms(v) for name, v in value.items()} if isinstance(value, dict) else as_ms(value)
    print(f"gpu suite: {label}: {shown}", file=sys.stderr, flush=True)
    return value


def _control(steps: dict, verify: dict) -> str:
    ratios = [s["eager (control)"] / s["eager"] for s in (*steps.values(), *verify.values())]
    return (f"Control: `eager (control)` is `eager` built again and measured beside it: its passes took "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x of `eager`'s: differences of that size are this run's noise.")


def _step_table(step_name: str, steps: dict, reference: dict | None, hf: dict | None, bound_per_row: float,
                levels) -> str:
    rows = []
    for r in levels:
        s = steps[r]
        graph = (reference or {}).get(f"B{r}_S1")
        rows.append([r, f"{number(s['step'] * 1e3)} ms", f"{r / s['step']:.1f}", f"{r / s['eager']:.1f}",
                     f"{r / s['eager (control)']:.1f}",
                     f"{graph['graph_tok_s']}" if graph else _absent(reference),
                     f"{r / hf[r]:.1f}" if hf else "not run (--peers hf)",
                     f"{r * bound_per_row:.0f}", percent(r / s["step"] / (r * bound_per_row))])
    return table(["rows", f"{step_name}: ms/step", "tok/s", "eager tok/s", "eager (control) tok/s",
                  "reference graph step tok/s", "HF eager tok/s", "bound tok/s", "step / bound"], rows)


def _absent(reference: dict | None) -> str:
    if reference is None:
        return "not run"
    return f"failed: {reference['error'][:80]}" if "error" in reference else "-"


def _verify_table(step_name: str, verify: dict) -> str:
    rows = [[n, f"{number(v['step'] * 1e3)} ms", ratio(v["step"] / verify[1]["step"]),
             f"{number(v['eager'] * 1e3)} ms", ratio(v["eager"] / verify[1]["eager"])] for n, v in verify.items()]
    return table(["n", step_name, "÷ n = 1", "eager", "÷ n = 1"], rows)


def _self_drafting_table(results: dict) -> str:
    rows = [[r, percent(v["acceptance"]), f"{v['equal']}/{v['requests']}", v["drafted"]] for r, v in results.items()]
    return table(["rows", "accepted", "outputs = plain", "drafted tokens"], rows)


def _reference(settings: BenchSettings, target: LLM, device: torch.device) -> dict | None:
    if settings.reference is None:
        return None
    if device.type != "cuda":
        return {"error": "the reference step needs CUDA"}
    return reference_step(Path(settings.reference), target.model_folder / "config.json")


def _self_drafting(settings: BenchSettings, target: LLM, rows: int, common: dict) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(rows)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.token_ids for o in target.generate(prompts, params)]
    spec = next(spec for spec in all_specs() if spec.drafts_with_model)
    options = {"model": settings.model, "quantization": target.model.quantization.mode,
               "draft_vocab_size": None, "draft_context_window": None}
    known = {f.name for f in fields(spec.options)}
    target.set_speculative({"method": spec.name, "num_speculative_tokens": 4, "adaptive": False,
                            **{name: value for name, value in options.items() if name in known}}, progress=False)
    try:
        outputs = target.generate(prompts, params)
        metrics = target.spec_metrics
        return {"requests": rows, "equal": sum(o.token_ids == e for o, e in zip(outputs, expected)),
                "drafted": metrics.num_draft_tokens,
                "acceptance": metrics.num_accepted_tokens / max(1, metrics.num_draft_tokens)}
    finally:
        target.set_speculative(None, progress=False)


def _write_costs(settings: BenchSettings, target: LLM) -> dict[str, str]:
    """Plain and each drafter's cost model on this device, as `draftwise plan --costs` reads them."""
    folder = settings.output / "costs"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    target.measure_costs(None, None, refresh=True).write(folder / "plain.json")
    written["plain"] = str(folder / "plain.json")
    cheap = [spec.name for spec in all_specs() if spec.per_request and spec.benchmark_by_default]
    for method in dict.fromkeys(config_method(c) for c in settings.configs_or(cheap) if c != "plain"):
        target.set_speculative({"method": method, "adaptive": False, **settings.options.get(method, {})},
                               progress=False)
        config = SpeculativeConfig.from_value({"method": method, "num_speculative_tokens": 8,
                                               **settings.options.get(method, {})})
        proposer = target.engine.drafters[method].proposer
        target.measure_costs(proposer, config, refresh=True).write(folder / f"{method}.json")
        written[method] = str(folder / f"{method}.json")
        target.set_speculative(None, progress=False)
    return written


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from draftwise.benchmark.report import machine

    return machine()
