"""`--suite processors`: speculation with logits processors on and off, and logprobs against plain.

The same prompts (HumanEval by default) twice: free (greedy) and with penalties (presence 0.5,
frequency 0.3, repetition 1.1, greedy), every request asking for logprobs (5 alternatives); plain
decoding and the drafter configs (the registry's defaults), interleaved, each on its own LLM.
Reported per setting: the speedup over plain decoding under the same setting, tau and acceptance
(do penalties cost speculation its acceptance?), outputs = plain, and the largest difference between
a config's logprobs and plain decoding's over every token of every request (the logprobs come from
the verification pass; they should equal plain's to fp32 rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftwise.benchmark.configs import CONTROL, PLAIN, LLMRecipe, config_recipes, default_configs
from draftwise.benchmark.report import SuiteReport, control_line, number, percent, ratio, table
from draftwise.benchmark.runner import lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import summarize
from draftwise.sampling.params import SamplingParams

PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
LOGPROBS = 5
SETTINGS = {"free": {}, "penalties": PENALTIES}


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Each prompt's generated tokens and their logprobs, under one setting's parameters."""
    prompts: tuple[str, ...]
    fields: tuple[tuple[str, float], ...]
    max_tokens: int

    def measure(self, config) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, logprobs=LOGPROBS, **dict(self.fields))
        outputs = config.llm.generate(list(self.prompts), params)
        return {"tokens": [o.token_ids for o in outputs],
                "logprobs": [[entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs)] for o in outputs]}


def run(settings: BenchSettings) -> SuiteReport:
    max_tokens = settings.max_tokens or 96
    prompts = [p for _, p in prompts_for(settings, 6, max_tokens, datasets=("humaneval",))]
    items = [(name, prompt, {"logprobs": LOGPROBS, **fields}) for name, fields in SETTINGS.items() for prompt in prompts]
    probes = [Logprobs(tuple(prompts), tuple(fields.items()), max_tokens) for fields in SETTINGS.values()]
    configs = settings.configs_or(default_configs())
    base = LLMRecipe(settings.model, max_model_len=settings.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with lineup(config_recipes(base, configs, params, settings.options), settings.isolation) as contestants:
        results = run_benchmark(contestants, items + probes, warm_up=prompts[0], progress=settings.progress)
    summary = summarize(results)
    plain_measures = next(r for r in results if r.name == PLAIN).measures
    rows, differences = [], {}
    for result in results:
        for (name, _), mine, theirs in zip(SETTINGS.items(), result.measures, plain_measures):
            same = [a == b for a, b in zip(mine["tokens"], theirs["tokens"])]
            gaps = [abs(x - y) for ok, xs, ys in zip(same, mine["logprobs"], theirs["logprobs"]) if ok
                    for x, y in zip(xs, ys)]
            differences[(result.name, name)] = max(gaps, default=0.0)
        for name in SETTINGS:
            figures = summary[result.name][name]
            rows.append([result.name, name, ratio(figures["speedup"]), number(figures["tau"]),
                         percent(figures["acceptance_rate"]), f"{figures['equal_to_plain']}/{figures['requests']}",
                         f"{differences[(result.name, name)]:.1e}"])
    text = "\n\n".join([
        f"{settings.model}: {len(prompts)} HumanEval prompts, each free and with penalties "
        f"({', '.join(f'{k} {v}' for k, v in PENALTIES.items())}), greedy, up to {max_tokens} tokens, logprobs of "
        f"{LOGPROBS} alternatives for every token; configs interleaved request by request, each on its own LLM.",
        control_line(summary[CONTROL]["all"]["speedup"]),
        "Speedup over plain decoding under the same setting; tau and acceptance; outputs = plain; the largest "
        "logprob difference from plain decoding's over every token (requests whose tokens equal plain's):",
        table(["config", "setting", "vs plain", "tau", "acceptance", "outputs = plain", "max |logprob - plain|"],
              rows)])
    data = {"summary": summary, "logprob_differences": {f"{c} / {s}": d for (c, s), d in differences.items()},
            "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    return SuiteReport("processors", text, data)
