"""Plot helpers shared by the benchmark and the planner (matplotlib, without a screen)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path, dpi: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=dpi, bbox_inches="tight")  # a legend above the axes included
    _pyplot().close(figure)


def plot_against_concurrency(series: dict[str, tuple[list[float], list[float]]], levels: list[int], path: Path,
                             labels: tuple[str, str] = ("tokens / s", "p95 latency, s"), title: str = "") -> None:
    """Two panels over a log2 concurrency axis: throughput and p95 latency, one line per series."""
    figure, (throughput, latency) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for name, (tokens_per_second, p95) in series.items():
        throughput.plot(levels, tokens_per_second, marker="o", label=name)
        latency.plot(levels, p95, marker="o", label=name)
    for axis, label in ((throughput, labels[0]), (latency, labels[1])):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent requests")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    throughput.legend()
    if title:
        figure.suptitle(title)
    _save(figure, path, dpi=110)


def bar_chart(groups: list[str], bars: dict[str, list[float]], path: Path, ylabel: str,
              baseline: float | None = 1.0) -> None:
    """One group of bars per entry of `groups`, one bar per series of `bars`; the legend above."""
    figure, axis = _pyplot().subplots(figsize=(max(6, 1.2 * len(groups)), 4))
    width = 0.8 / max(1, len(bars))
    for i, (name, values) in enumerate(bars.items()):
        axis.bar([j + i * width for j in range(len(groups))], values, width, label=name)
    if baseline is not None:
        axis.axhline(baseline, color="black", linewidth=0.8)
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, rotation=30, ha="right")
    axis.set_ylabel(ylabel)
    if bars:
        axis.legend(fontsize=7, ncol=min(len(bars), 6), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _save(figure, path)


def line_chart(lines: dict[str, tuple[list[float], list[float]]], path: Path, xlabel: str, ylabel: str,
               ylim: tuple[float, float] | None = None, baseline: float | None = None) -> None:
    """One line with markers per series: name -> (x values, y values)."""
    figure, axis = _pyplot().subplots(figsize=(6, 4))
    for name, (xs, ys) in lines.items():
        axis.plot(xs, ys, marker="o", label=name)
    if baseline is not None:
        axis.axhline(baseline, color="black", linewidth=0.8)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if ylim is not None:
        axis.set_ylim(*ylim)
    if lines:
        axis.legend(fontsize=7)
    _save(figure, path)
