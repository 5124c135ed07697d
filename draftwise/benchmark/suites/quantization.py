"""`--suite quantization`: weight formats side by side (`formats.py`; default fp32 = `none`, int8 and int4
on draftwise's native kernels, then int8 and int4 on PyTorch's packed kernels), for one model.

Speed: load time, plain greedy decoding on HumanEval prompts (batch 1, EOS ignored; tokens/s and the
ratio to fp32, decode tokens/s), the layers each format quantized how, and the cost of a forward over
n = 1..6, 8, 16 new tokens relative to n = 1. Quality against the first format (fp32): perplexity
on a text sample shipped with draftwise (three of its own modules), teacher-forced in 512-token
windows, and how often the top-1 token equals the first format's. Run it once per model.
"""

from __future__ import annotations

from pathlib import Path

from draftwise.benchmark.configs import control_name
from draftwise.benchmark.probes import ForwardCost, TeacherForced
from draftwise.benchmark.report import SuiteReport, control_line, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.formats import cost_table, formats_data, header, measure_formats, speed_table

FORMATS = ("none", "int8", "int4", "int4:bf16", "int8:pytorch", "int4:pytorch")
SAMPLE_FILES = ("speculative/verify.py", "engine/engine.py", "model/attention.py")  # in the draftwise package
PACKAGE = Path(__file__).resolve().parents[2]


def run(settings: BenchSettings) -> SuiteReport:
    formats = list(settings.formats or FORMATS)
    sample = "\n\n".join((PACKAGE / name).read_text() for name in SAMPLE_FILES)
    probes = [ForwardCost(sizes=(1, 2, 3, 4, 5, 6, 8, 16)), TeacherForced(sample, settings.eval_tokens)]
    prompts, results, summary = measure_formats(settings, formats, probes, per_category=4)
    first = results[0].name
    reference_top1 = results[0].measures[2]["top1"]
    quality = []
    for result in results:
        measured = result.measures[2]
        agreement = sum(a == b for a, b in zip(measured["top1"], reference_top1)) / max(1, len(reference_top1))
        result.measures[2] = {"perplexity": measured["perplexity"], "tokens": measured["tokens"],
                              "top1_agreement": agreement}
        quality.append([result.name, f"{measured['perplexity']:.3f}", f"{agreement:.1%}", measured["tokens"]])
    text = "\n\n".join([
        header(settings, len(prompts), "; int8/int4 on draftwise's native kernels, `:pytorch` on PyTorch's"),
        control_line(summary[control_name(first)]["all"]["speedup"], first, control_name(first)),
        speed_table(results, summary),
        "Forward over n new tokens (256-token context), relative to n = 1 of the same format:",
        cost_table(results, 1),
        f"Quality on a text sample shipped with draftwise ({', '.join(SAMPLE_FILES)}; teacher-forced, 512-token "
        f"windows): perplexity, and how often the top-1 token equals `{first}`'s.",
        table(["format", "perplexity", f"top-1 = {first}", "tokens"], quality)])
    return SuiteReport("quantization", text, formats_data(results, summary))
