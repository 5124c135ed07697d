"""`--suite structured`: constrained generation, plain against speculative, on the structured workload
(`structured_workload.py`: extraction, classification, tool calls, summary cards), greedy.

Batch 1: every request of the workload on every config, interleaved (the first config rotating), each
config on its own LLM; then batch 8: the whole workload as a closed loop of 8 requests in flight, in
LOOP_ROUNDS rounds interleaved like the requests (each round's first config rotating; summed), so
that no config always runs its loop first or last.
Plain decoding is constrained too: the speedups are constrained speculative over constrained plain.
Reported per config: speedup per kind and overall, the share of answers that parse and validate
against their schema (a tool call: its name one of the tools, its arguments valid against that
tool's schema), tau (tokens after the first per decoding step), outputs = plain, and structured
outputs' own time on the engine's thread per constrained step against a plain step (a 1-token pass
after 256 tokens, measured in the same run). Configs default to the drafters benchmarked by default,
adaptive, and the first of them again without forced-token drafting (`forced_drafts=false`).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from draftwise.benchmark.configs import CONTROL, LLMRecipe, config_recipes, default_configs
from draftwise.benchmark.probes import ClosedLoop, EngineCounters, ForwardCost
from draftwise.benchmark.report import SuiteReport, control_line, number, percent, ratio, table
from draftwise.benchmark.runner import lineup, run_benchmark
from draftwise.benchmark.structured_workload import KINDS, TOOLS, structured_workload
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import tokenizer_of
from draftwise.benchmark.summary import speedup, summarize
from draftwise.errors import InvalidParameterError
from draftwise.llm.closed_loop import merge_rounds
from draftwise.sampling.params import SamplingParams
from draftwise.structured.tool_calls import OPEN, split_tool_calls

BATCH = 8
LOOP_ROUNDS = 2


def run(settings: BenchSettings) -> SuiteReport:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise InvalidParameterError("the structured suite validates answers with jsonschema: "
                                    "pip install 'draftwise[bench]'") from None
    tokenizer = tokenizer_of(settings.model)
    tag = tokenizer.token_to_id(OPEN)
    items = structured_workload(tokenizer, settings.per_category or 3,
                                tags_are_tokens=tag is not None and tag in tokenizer.special_token_ids)
    max_tokens = settings.max_tokens or 256
    defaults = default_configs()
    configs = settings.configs_or(defaults + [f"{defaults[0]}:forced_drafts=false"] if defaults else [])
    base = LLMRecipe(settings.model, max_num_seqs=BATCH, max_model_len=settings.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    loop = ClosedLoop(BATCH, tuple(p for _, p, _ in items), tuple(k for k, _, _ in items), max_tokens,
                      tuple(extra for _, _, extra in items))
    probes = [loop] * LOOP_ROUNDS + [ForwardCost(sizes=(1,), context=256), EngineCounters()]
    with lineup(config_recipes(base, configs, params, settings.options), settings.isolation) as contestants:
        results = run_benchmark(contestants, items + probes, warm_up=items[0][1], progress=settings.progress)
    summary = summarize(results)
    plain_step = results[0].measures[LOOP_ROUNDS]["seconds"][1]
    loops = {result.name: merge_rounds(result.measures[:LOOP_ROUNDS]) for result in results}
    base_loop = loops[results[0].name]
    rows, batch_rows, valid_counts = [], [], {}
    for result in results:
        valid = [valid_answer(kind, tokenizer.decode(r.token_ids, skip_special_tokens=False), extra)
                 for (kind, _, extra), r in zip(items, result.requests)]
        loop, counters = loops[result.name], result.measures[-1]
        batch_valid = [valid_answer(kind, tokenizer.decode(ids, skip_special_tokens=False), extra)
                       for (kind, _, extra), ids in zip(items * LOOP_ROUNDS, loop["outputs"])]
        valid_counts[result.name] = (sum(valid), sum(batch_valid))
        per_step = counters["grammar_seconds"] / max(counters["constrained_steps"], 1)
        figures = summary[result.name]
        rows.append([result.name, *(ratio(figures[k]["speedup"]) for k in KINDS), ratio(figures["all"]["speedup"]),
                     number(figures["all"]["tau"]), f"{sum(valid)}/{len(valid)}",
                     f"{figures['all']['equal_to_plain']}/{figures['all']['requests']}",
                     f"{per_step * 1e3:.2f} ms ({percent(per_step / plain_step)})"])
        batch_rows.append([result.name, f"{loop['tokens_per_s']:.1f}",
                           ratio(speedup(loop["tokens"], loop["seconds"], base_loop["tokens"], base_loop["seconds"])),
                           f"{sum(batch_valid)}/{len(batch_valid)}",
                           f"{sum(a == b for a, b in zip(loop['outputs'], base_loop['outputs']))}/{len(loop['outputs'])}"])
    text = "\n\n".join([
        f"{settings.model}: {len(items)} requests ({', '.join(f'{k} {len(items) // len(KINDS)}' for k in KINDS)}), "
        f"greedy, up to {max_tokens} tokens, every one constrained (plain decoding too); batch 1 interleaved "
        f"request by request, then a closed loop of {BATCH} in flight ({LOOP_ROUNDS} rounds, interleaved). A plain step here: "
        f"{plain_step * 1e3:.1f} ms.",
        control_line(summary[CONTROL]["all"]["speedup"]),
        "Batch 1: speedup over constrained plain decoding per kind; tau; answers that parse and validate; "
        "outputs = plain; structured outputs' own time per constrained step on the engine's thread (masks "
        "waited for, drafts cut, forced tokens found, the grammar advanced), and its share of a plain step:",
        table(["config", *KINDS, "all", "tau", "valid", "outputs = plain", "grammar time / step"], rows),
        f"Batch {BATCH} (closed loop, {LOOP_ROUNDS} rounds): generated tokens/s, speedup over constrained plain at "
        "the same concurrency, valid answers, outputs = plain (every round's):",
        table(["config", "tokens/s", "vs plain", "valid", "outputs = plain"], batch_rows)])
    data = {"summary": summary, "valid": valid_counts, "plain_step_seconds": plain_step,
            "requests": {r.name: [asdict(q) for q in r.requests] for r in results},
            "measures": {r.name: [{k: v for k, v in m.items() if k != "outputs"} for m in r.measures]
                         for r in results}}
    return SuiteReport("structured", text, data)


def valid_answer(kind: str, text: str, extra: dict) -> bool:
    """The answer parses and follows its constraint (the end token, if any, stripped)."""
    import jsonschema

    for end in ("<|im_end|>", "<|endoftext|>"):
        text = text.removesuffix(end)
    try:
        if kind == "tool_call":
            _, calls = split_tool_calls(text)
            schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
            return bool(calls) and all(call.name in schemas and _valid(json.loads(call.arguments), schemas[call.name])
                                       for call in calls)
        return _valid(json.loads(text), extra["structured_outputs"]["json"])
    except (json.JSONDecodeError, jsonschema.SchemaError):
        return False


def _valid(value, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        return True
    except jsonschema.ValidationError:
        return False
