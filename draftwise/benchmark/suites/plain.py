"""`--suite plain`: plain decoding speed per weight format and kernel path (`formats.py`; default: the
default path, `auto`, against fp32, `none`), on HumanEval prompts, EOS ignored. Per format: load
time, tokens/s with prefill and its ratio to the first format, decode and prefill tokens/s, and the
cost of one forward pass over n = 1, 2, 4, 8, 16 new tokens after a 256-token context, relative to
n = 1: what speculation's economics rest on (verifying k drafted tokens is a pass over k + 1); and
the same n tokens as a token tree relative to a chain (what tree verification adds to the curve)."""

from __future__ import annotations

from draftwise.benchmark.report import SuiteReport, control_line
from draftwise.benchmark.probes import ForwardCost
from draftwise.benchmark.configs import control_name
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.formats import (cost_table, formats_data, header, measure_formats, speed_table,
                                                tree_cost_table)

FORMATS = ("auto", "none")


def run(settings: BenchSettings) -> SuiteReport:
    formats = list(settings.formats or FORMATS)
    prompts, results, summary = measure_formats(settings, formats, [ForwardCost(trees=True)], per_category=4)
    first = results[0].name
    text = "\n\n".join([
        header(settings, len(prompts)),
        control_line(summary[control_name(first)]["all"]["speedup"], first, control_name(first)),
        speed_table(results, summary),
        "Cost of one forward pass over n new tokens (256-token context), relative to n = 1 of the same format:",
        cost_table(results, 1),
        "The same n tokens as a token tree (binary, below the first), relative to the chain, each tree pass "
        "right after its chain pass:",
        tree_cost_table(results, 1)])
    return SuiteReport("plain", text, formats_data(results, summary))
