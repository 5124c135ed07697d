"""What a suite writes: Markdown tables, `<suite>.md` and `<suite>.json` in the output folder (its plots
beside them), and on request a section of BENCHMARKS.md headed by the command that produced it."""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from draftwise.benchmark.configs import CONTROL, PLAIN


@dataclass(slots=True)
class SuiteReport:
    suite: str
    markdown: str  # the tables, without the plots
    data: dict  # everything measured, for the JSON file
    plots: dict[str, Path] = field(default_factory=dict)  # caption -> PNG written by the suite


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def control_line(control_ratio: float, baseline: str = PLAIN, control: str = CONTROL, where: str = "") -> str:
    """The line above every table: the plain-vs-plain control's ratio (`where`: which of its ratios)."""
    return (f"Control: `{control}` is `{baseline}` again, built and run exactly like it, and measured "
            f"**{control_ratio:.2f}x** of it{where}: differences of that size are this run's noise.")


def speedup_tables(summary: dict, absent: dict[str, str] | None = None) -> str:
    """The per-prompt suites' tables: speedup and outputs = plain per category, tau per category, and
    the details over all prompts; `absent`: configs not run (a peer) -> why, shown as such."""
    configs = list(summary)
    categories = list(summary[configs[0]])
    rows = [[name, *(ratio(summary[name][c]["speedup"]) for c in categories), _equal(summary[name]["all"])]
            for name in configs]
    rows += [[name, f"not run ({why})", *["-"] * len(categories)] for name, why in (absent or {}).items()]
    lines = ["Speedup over plain decoding (tokens/s, prefill included; `summary.speedup`); outputs = plain: "
             "equal to plain decoding's (a peer's: to its own plain decoding):", "",
             table(["config", *categories, "outputs = plain"], rows), "",
             "The speedup's 90% interval over the category's prompts (a paired bootstrap: each prompt's times "
             "under the config and under plain decoding drawn together; `stats.paired_ratio_interval`). The "
             "control's interval is this run's noise:", "",
             table(["config", *categories], [[name, *(_interval(summary[name][c].get("speedup_interval"))
                                                      for c in categories)] for name in configs]), "",
             "Tau (tokens after the first per target decoding step; plain = 1.00):", "",
             table(["config", *categories], [[name, *(number(summary[name][c]["tau"]) for c in categories)]
                                             for name in configs]), ""]
    details = []
    for name in configs:
        a = summary[name]["all"]
        positions = " ".join(f"{p:.2f}" for p in a["acceptance_by_position"]) or "-"
        details.append([name, number(a["tokens_per_s"]), percent(a["acceptance_rate"]), positions,
                        percent(a["draft_share"]), number(a["ttft_p50"]),
                        f"{a['latency_p50']:.1f} / {a['latency_p95']:.1f}"])
    lines.append(table(["config", "tokens/s", "acceptance", "acceptance by position", "time drafting",
                        "TTFT p50 s", "latency p50 / p95 s"], details))
    return "\n".join(lines)


def _interval(bounds: tuple[float, float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def _equal(figures: dict) -> str:
    return "-" if figures["equal_to_plain"] is None else f"{figures['equal_to_plain']}/{figures['requests']}"


def write_outputs(report: SuiteReport, folder: Path) -> dict[str, Path]:
    """`<suite>.md` (the tables and the plots) and `<suite>.json` in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / f"{report.suite}.md", "json": folder / f"{report.suite}.json"}
    paths["markdown"].write_text(report.markdown + _images(report.plots, folder) + "\n")
    paths["json"].write_text(json.dumps(report.data, indent=1, default=str))
    return paths | {caption: path for caption, path in report.plots.items()}


def write_benchmarks_section(report: SuiteReport, path: Path, section: str, command: str) -> None:
    """Append to BENCHMARKS.md (or replace there) the section `section`: the exact command, when and
    where it ran, the tables and the plots."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    body = (f"<!-- {section}:start -->\nCommand: `{command}`  \nMeasured {stamp} on {machine()}.\n\n"
            f"{report.markdown.strip()}{_images(report.plots, path.parent)}\n<!-- {section}:end -->")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"<!-- {re.escape(section)}:start -->.*?<!-- {re.escape(section)}:end -->", re.S)
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else text.rstrip() + "\n\n" + body + "\n"
    path.write_text(text)


def _images(plots: dict[str, Path], folder: Path) -> str:
    return "".join(f"\n\n![{caption}]({os.path.relpath(plot, folder)})" for caption, plot in plots.items())


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
