"""The report's PNGs, drawn off-screen (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path, legend_from=None) -> str:
    """`legend_from`: an axis whose legend goes below the plots, clear of the bars."""
    bottom = 0.0
    if legend_from is not None:
        handles, labels = legend_from.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
        bottom = 0.06 * (1 + (len(labels) - 1) // 4)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def grouped_bars(ax, groups: list[str], series: dict[str, list[float | None]]) -> None:
    """One cluster of bars per group, one bar per series (None: no bar)."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar([x for x, v in zip(xs, values) if v is not None],
               [v for v in values if v is not None], width, label=label)
    ax.set_xticks(range(len(groups)), groups)


def post_recovery(path: Path, panels: dict[str, tuple[list[str], dict[str, list], float]]
                  ) -> str:
    """panels: title -> (models, strategy -> ratio per model, the physical limit)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), sharey=True,
                             squeeze=False)
    for ax, (title, (models, series, limit)) in zip(axes[0], panels.items()):
        grouped_bars(ax, models, series)
        ax.axhline(limit, color="black", linestyle="--", linewidth=1,
                   label="physical limit (N - f) / N")
        ax.set_title(f"{title} (limit {limit:.3f})", fontsize=10)
        ax.set_ylim(0, 1.1)
    axes[0][0].set_ylabel("post-recovery / failure-free throughput")
    fig.suptitle("Post-recovery throughput, 32 H200 GPUs (analytical profile)", fontsize=10)
    return _save(fig, path, axes[0][-1])


def trace_throughput(path: Path, traces: list[str], series: dict[str, list[float]]) -> str:
    fig, ax = plt.subplots(figsize=(max(11, 1.5 * len(traces)), 4))
    grouped_bars(ax, traces, series)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("average / failure-free throughput")
    ax.set_ylim(0, 1.1)
    ax.set_title("Average throughput under failure traces, 32 H200 GPUs (analytical profile)",
                 fontsize=10)
    return _save(fig, path, ax)


def loss_curves(path: Path, curves: dict[str, list[float]], reference: str,
                kill_at: int) -> str:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    ref = curves[reference]
    for label, losses in curves.items():
        its = range(1, len(losses) + 1)
        line, = top.plot(its, losses, marker="o" if label == reference else None,
                         markersize=3, label=label)
        if label != reference:
            bottom.plot(its, [abs(a - b) / abs(b) for a, b in zip(losses, ref)], label=label,
                        color=line.get_color())
    for ax in (top, bottom):
        ax.axvline(kill_at, color="grey", linestyle=":", linewidth=1)
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    top.set_title(f"CPU runs, pipeline 2 x data 2: a worker killed in iteration {kill_at}",
                  fontsize=10)
    bottom.set_ylabel("|loss - failure-free| / failure-free")
    bottom.set_xlabel("iteration")
    return _save(fig, path)


def memory(path: Path, models: list[str], series: dict[str, list[float | None]],
           device_gib: float) -> str:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    grouped_bars(ax, models, series)
    ax.axhline(device_gib, color="black", linestyle="--", linewidth=1,
               label=f"device memory {device_gib:.0f} GiB")
    ax.set_ylabel("peak memory per GPU (GiB, estimated)")
    ax.set_title("Estimated peak memory per GPU after one lost GPU (analytical H200 profile)",
                 fontsize=10)
    return _save(fig, path, ax)


def search_time(path: Path, by_failures: dict[int, tuple[list[int], list[float]]],
                targets: dict[int, float]) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    for failed, (sizes, ms) in by_failures.items():
        ax.plot(sizes, ms, marker="o", label=f"{failed} failed GPU(s)")
    sizes = sorted(targets)
    ax.plot(sizes, [targets[s] for s in sizes], color="black", linestyle="--", marker="x",
            label="target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("plan search (ms)")
    ax.legend(fontsize=7)
    ax.set_title("Planner search time vs cluster size (analytical H200 profile)", fontsize=10)
    return _save(fig, path)


def accuracy(path: Path, labels: list[str], predicted: list[float],
             measured: list[float]) -> str:
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.scatter(measured, predicted)
    for label, x, y in zip(labels, measured, predicted):
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    top = max(measured + predicted) * 1.15
    ax.plot([0, top], [0, top], color="black", linestyle="--", linewidth=1, label="exact")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured ms / iteration after the recovery")
    ax.set_ylabel("predicted ms / iteration")
    ax.legend(fontsize=7)
    ax.set_title("Performance model on the CPU runs (measured profile)", fontsize=10)
    return _save(fig, path)
