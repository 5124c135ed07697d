"""The benchmark's outputs: a Markdown report, a JSON file and three PNG plots."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from draftwise.benchmark.runner import ConfigResult


def markdown(summary: dict, header: str = "") -> str:
    configs = list(summary)
    categories = list(summary[configs[0]])
    lines = [header, ""] if header else []
    lines += ["Speedup over draftwise's plain decoding (tokens/s incl. prefill); outputs = plain: equal to plain "
              "decoding's over all requests (a peer's: to its own plain decoding):", "",
              "| config | " + " | ".join(categories) + " | outputs = plain |",
              "|---" * (len(categories) + 2) + "|"]
    for name in configs:
        row = summary[name]
        lines.append(f"| {name} | " + " | ".join(f"{row[c]['speedup']:.2f}x" for c in categories)
                     + f" | {row['all']['equal_to_plain']}/{row['all']['requests']} |")
    lines += ["", "Tau (tokens after the first per target decoding step; plain = 1.00):", "",
              "| config | " + " | ".join(categories) + " |", "|---" * (len(categories) + 1) + "|"]
    for name in configs:
        lines.append(f"| {name} | " + " | ".join(_number(summary[name][c]["tau"]) for c in categories) + " |")
    lines += ["", "| config | tokens/s | acceptance | acceptance by position | TTFT p50 s | latency p50 / p95 s |",
              "|---|---|---|---|---|---|"]
    for name in configs:
        a = summary[name]["all"]
        positions = " ".join(f"{p:.2f}" for p in a["acceptance_by_position"]) or "-"
        lines.append(f"| {name} | {a['tokens_per_s']:.2f} | {_percent(a['acceptance_rate'])} | {positions} | "
                     f"{_number(a['ttft_p50'])} | {a['latency_p50']:.1f} / {a['latency_p95']:.1f} |")
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def write_outputs(results: list[ConfigResult], summary: dict, folder: Path, header: str = "") -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": folder / "bench.md", "json": folder / "bench.json",
             "speedup_by_category": folder / "speedup_by_category.png",
             "acceptance_by_position": folder / "acceptance_by_position.png",
             "speedup_vs_k": folder / "speedup_vs_k.png"}
    paths["markdown"].write_text(markdown(summary, header) + "\n")
    paths["json"].write_text(json.dumps({"summary": summary, "requests": {r.name: [asdict(q) for q in r.requests]
                                                                          for r in results}}))
    _plots(summary, paths)
    return paths


def _plots(summary: dict, paths: dict[str, Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in summary if c != "plain"]
    categories = [c for c in summary["plain"] if c != "all"] + ["all"]

    figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(categories)), 4))
    width = 0.8 / max(1, len(configs))
    for i, name in enumerate(configs):
        axis.bar([j + i * width for j in range(len(categories))], [summary[name][c]["speedup"] for c in categories],
                 width, label=name)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    axis.set_ylabel("speedup over plain")
    axis.legend(fontsize=7, ncol=min(len(configs), 6), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _save(figure, paths["speedup_by_category"])

    figure, axis = plt.subplots(figsize=(6, 4))
    for name in configs:
        rates = summary[name]["all"]["acceptance_by_position"]
        if rates:
            axis.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    axis.set_xlabel("draft position")
    axis.set_ylabel("acceptance rate")
    axis.set_ylim(0, 1.05)
    axis.legend(fontsize=7)
    _save(figure, paths["acceptance_by_position"])

    figure, axis = plt.subplots(figsize=(6, 4))
    by_method: dict[str, list[tuple[int, float]]] = {}
    for name in configs:
        match = re.match(r"^(\w+):k=(\d+)$", name)
        if match:
            by_method.setdefault(match.group(1), []).append((int(match.group(2)), summary[name]["all"]["speedup"]))
    for method, points in by_method.items():
        points.sort()
        axis.plot([k for k, _ in points], [s for _, s in points], marker="o", label=method)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("k (fixed)")
    axis.set_ylabel("speedup over plain")
    if by_method:
        axis.legend()
    _save(figure, paths["speedup_vs_k"])


def _save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100, bbox_inches="tight")  # a legend above the axes included
    plt.close(figure)
