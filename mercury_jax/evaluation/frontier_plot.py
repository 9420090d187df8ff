"""The accuracy / over-search frontier of a sweep as a PNG: one point per checkpoint (x = over-search rate, y =
accuracy, both with their interval as error bars), joined in step order and labelled by step; the starting
policy and the selected checkpoint are marked."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_frontier(records: Sequence[Mapping], selected_step: int, path: str | Path, *,
                  start_step: int = 0, confidence: float = 0.95, title: str = "") -> Path:
    """Write the frontier plot of `records` (as `table.checkpoint_record` makes them) to `path`; returns it."""
    import matplotlib  # noqa: PLC0415  (~0.5 s to import; only plotting needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  (after the backend is chosen)

    records = sorted(records, key=lambda r: r["step"])
    over = [r["over_search_rate"] for r in records]
    accuracy = [r["accuracy"] for r in records]
    over_err = _error_bars(records, "over_search_rate", "over_search_ci")
    accuracy_err = _error_bars(records, "accuracy", "accuracy_ci")

    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.plot(over, accuracy, "-", color="0.75", zorder=1, label="checkpoints in step order")
    ax.errorbar(over, accuracy, xerr=over_err, yerr=accuracy_err, fmt="o", color="tab:blue", ecolor="0.6",
                elinewidth=0.8, capsize=2, markersize=4, zorder=2)
    for record in records:
        ax.annotate(str(record["step"]), (record["over_search_rate"], record["accuracy"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    marks = {r["step"]: r for r in records}
    if start_step in marks:
        ax.scatter([marks[start_step]["over_search_rate"]], [marks[start_step]["accuracy"]], s=110, marker="s",
                   facecolors="none", edgecolors="tab:red", linewidths=1.5, zorder=3,
                   label=f"starting policy (step {start_step})")
    if selected_step in marks:
        ax.scatter([marks[selected_step]["over_search_rate"]], [marks[selected_step]["accuracy"]], s=200,
                   marker="*", color="tab:green", zorder=4, label=f"selected (step {selected_step})")
    ax.set_xlabel("post-answer over-search rate (episodes searching on after sufficient evidence)")
    ax.set_ylabel("end-task accuracy")
    ax.set_xlim(-0.04, 1.08)  # room for the step labels of points at rate 0 or 1
    ax.set_ylim(-0.04, 1.08)
    ax.grid(alpha=0.3)
    ax.set_title(title or f"accuracy vs over-search per checkpoint\n({confidence:.0%} Wilson intervals)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _error_bars(records: Sequence[Mapping], value: str, interval: str) -> list[list[float]]:
    """[[value - lower], [upper - value]] per record, as matplotlib's errorbar takes them (never negative)."""
    return [[max(0.0, r[value] - r[interval][0]) for r in records],
            [max(0.0, r[interval][1] - r[value]) for r in records]]
