"""Plot helpers shared by the benchmark and the planner (matplotlib, without a screen)."""

from __future__ import annotations

from pathlib import Path


def plot_against_concurrency(series: dict[str, tuple[list[float], list[float]]], levels: list[int], path: Path,
                             labels: tuple[str, str] = ("tokens / s", "p95 latency, s"), title: str = "") -> None:
    """Two panels over a log2 concurrency axis: throughput and p95 latency, one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
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
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
