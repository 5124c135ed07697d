"""`--suite drafting-options`: drafting options measured on their own, each against plain decoding in
the same run, on HumanEval prompts, batch 1. The drafters are the configs' methods (default: those
benchmarked by default); each option is measured on the drafters whose registered options take it:

1. The draft LM head (`draft_vocab_size`): the full head against the trimmed one (the drafter's
   default, or `--draft-vocab-size`), adaptive k <= 4, greedy: the drafter's propose time for 1 and 3
   tokens from its measured cost model, acceptance, speedup.
2. Confidence stop (`draft_confidence_threshold`): off against the threshold given (`--confidence`;
   default 0.5), at a fixed k = 4 so that the stop alone shortens drafts, greedy: acceptance,
   drafted tokens per draft, tau, speedup.
3. Randomized drafting (`draft_probability`, which every drafter takes): sampling (temperature 0.8,
   top-p 0.95, seed 1) at a fixed k = 2, drafting with probability a = 1, 0.7 and 0.5 per step,
   against plain sampling: first-position acceptance, acceptance, share of decode steps without a
   draft, speedup. The output distribution is the target's in every case (tests/test_verify.py).
Parts 1 and 2 share one greedy run (its plain baseline and control); part 3 is a sampled run with
its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

from draftwise.benchmark.configs import CONTROL, config_method, default_configs
from draftwise.benchmark.probes import BuildInfo
from draftwise.benchmark.report import SuiteReport, control_line, number, percent, ratio, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import header, measure_prompts, prompts_for
from draftwise.benchmark.summary import summarize
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.registry import drafter_spec

HEAD, STOP = "draft_vocab_size", "draft_confidence_threshold"
DEFAULT_THRESHOLD = 0.5
RATES = (1.0, 0.7, 0.5)


def option_default(method: str, option: str):
    """The drafter's default for `option`; `dataclasses.MISSING` if it does not take it."""
    return next((f.default for f in dataclasses.fields(drafter_spec(method).options) if f.name == option),
                dataclasses.MISSING)


def run(settings: BenchSettings) -> SuiteReport:
    methods = list(dict.fromkeys(config_method(c) for c in settings.configs_or(default_configs())))
    max_tokens = settings.max_tokens or 96
    prompts = prompts_for(settings, 8, max_tokens, datasets=("humaneval",))
    head, stop, greedy = {}, {}, {}
    for method in methods:
        given = settings.options.get(method, {})
        trimmed = given.get(HEAD, option_default(method, HEAD))
        if trimmed not in (None, dataclasses.MISSING):
            spec = {"method": method, "num_speculative_tokens": 4, "adaptive": True, **given}
            head[method] = (f"{method}:k<=4 full head", f"{method}:k<=4 head {trimmed}")
            greedy |= {head[method][0]: {**spec, HEAD: None}, head[method][1]: {**spec, HEAD: trimmed}}
        if option_default(method, STOP) is not dataclasses.MISSING:
            threshold = given.get(STOP) or DEFAULT_THRESHOLD
            spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False, **given}
            stop[method] = (f"{method}:k=4 no stop", f"{method}:k=4 stop below {threshold}")
            greedy |= {stop[method][0]: {**spec, STOP: 0.0}, stop[method][1]: {**spec, STOP: threshold}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=settings.seed)
    parts, data = [], {}
    if greedy:
        results = measure_prompts(settings, greedy, params, prompts, probes=[BuildInfo()])
        summary = summarize(results)
        builds = {r.name: r.measures[0] for r in results}
        parts += [header(settings, prompts, params), control_line(summary[CONTROL]["all"]["speedup"])]
        if head:
            parts += ["Draft LM head (greedy, adaptive k <= 4): the drafter's propose time from its measured cost "
                      "model, acceptance, and speedup over plain decoding:", _head_table(head, summary, builds)]
        if stop:
            parts += ["Confidence stop (greedy, fixed k = 4): acceptance, drafted tokens per draft, tau, and "
                      "speedup over plain decoding:", _stop_table(stop, summary)]
        data["greedy"] = {"summary": summary, "builds": builds,
                          "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=max_tokens)
    randomized = {f"{m}:k=2 a={a}": {"method": m, "num_speculative_tokens": 2, "adaptive": False,
                                     "draft_probability": a, **settings.options.get(m, {})}
                  for m in methods for a in RATES}
    results = measure_prompts(settings, randomized, sampled, prompts)
    summary = summarize(results, compare_outputs=False)
    parts += [header(settings, prompts, sampled), control_line(summary[CONTROL]["all"]["speedup"]),
              "Randomized drafting under sampling (temperature 0.8, top-p 0.95, seed 1; fixed k = 2): first-position "
              "acceptance, overall acceptance, share of decode steps without a draft, speedup over plain sampling:",
              _randomized_table(summary)]
    data["randomized"] = {"summary": summary, "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    return SuiteReport("drafting-options", "\n\n".join(parts), data)


def _head_table(head: dict, summary: dict, builds: dict) -> str:
    rows = []
    for method, names in head.items():
        for name in names:
            a, draft = summary[name]["all"], builds[name]["draft_seconds"] or {}
            rows.append([name, *(number(draft[k] * 1e3 if k in draft else None, 1) for k in (1, 3)),
                         percent(a["acceptance_rate"]), ratio(a["speedup"])])
    return table(["config", "propose 1 token ms", "propose 3 tokens ms", "acceptance", "speedup"], rows)


def _stop_table(stop: dict, summary: dict) -> str:
    rows = []
    for names in stop.values():
        for name in names:
            a = summary[name]["all"]
            per_draft = a["num_draft_tokens"] / a["num_drafts"] if a["num_drafts"] else None
            rows.append([name, percent(a["acceptance_rate"]), number(per_draft), number(a["tau"]),
                         ratio(a["speedup"]), f"{a['equal_to_plain']}/{a['requests']}"])
    return table(["config", "acceptance", "drafted tokens per draft", "tau", "speedup", "outputs = plain"], rows)


def _randomized_table(summary: dict) -> str:
    rows = []
    for name, by_category in summary.items():
        a = by_category["all"]
        steps = a["num_drafts"] + a["num_plain_steps"]
        rows.append([name, percent(a["first_position_acceptance"]), percent(a["acceptance_rate"]),
                     percent(a["num_plain_steps"] / steps if steps else None), ratio(a["speedup"])])
    return table(["config", "accepted at position 1", "acceptance", "steps without draft", "speedup"], rows)
