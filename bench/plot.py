"""PNG plot of plan and hand-off time against descriptor count, one series per planner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

STAGES = [("plan", "plan time (to descriptor arrays)"), ("hand_off", "hand-off time (to lists)")]
SEND_PATH = ("send_path", "whole send path (into a real Mooncake engine)")


def _series(results: list[dict[str, Any]], stage: str) -> dict[str, list[tuple[int, dict]]]:
    """planner name -> [(descriptors, timing)] sorted by descriptors; the floor joins hand-off.

    The send-path panel has sglang's send and the hooked one instead of planners.
    """
    series: dict[str, list[tuple[int, dict]]] = {}
    for result in results:
        if stage == SEND_PATH[0]:
            for variant in ("sglang", "hooked"):
                timing = result[stage][variant]
                series.setdefault(f"{variant} send", []).append((result["num_descriptors"], timing))
            continue
        for name, figures in result["planners"].items():
            series.setdefault(name, []).append((result["num_descriptors"], figures[stage]))
        if stage == "hand_off":
            series.setdefault("floor", []).append((result["num_descriptors"], result["floor"]))
    return {name: sorted(points, key=lambda point: point[0]) for name, points in series.items()}


Series = dict[str, list[tuple[float, dict]]]  # label -> [(x, timing with median/p10/p90)]


def write_plot(path: Path, results: list[dict[str, Any]], title: str) -> None:
    """Log-log scatter with p10-p90 error bars: plan time, hand-off time, and the whole
    send path when the sweep timed it."""
    panels = list(STAGES)
    if results and all(result.get(SEND_PATH[0]) for result in results):
        panels.append(SEND_PATH)
    write_panels(
        path,
        {stage_title: _series(results, stage) for stage, stage_title in panels},
        title,
        xlabel="descriptors per request",
    )


def write_panels(path: Path, panels: dict[str, Series], title: str, xlabel: str) -> None:
    """One log-log panel per title, one series of medians with p10-p90 error bars per label."""
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), sharey=True)
    axes = list(axes) if len(panels) > 1 else [axes]
    for axis, (panel_title, series) in zip(axes, panels.items(), strict=True):
        for name, points in series.items():
            xs = [max(x, 1) for x, _ in points]
            medians = [timing["median"] for _, timing in points]
            errors = [
                [timing["median"] - timing["p10"] for _, timing in points],
                [timing["p90"] - timing["median"] for _, timing in points],
            ]
            axis.errorbar(xs, medians, yerr=errors, fmt="o", ms=4, capsize=2, label=name)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(xlabel)
        axis.set_title(panel_title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    axes[0].set_ylabel("seconds (median, p10-p90)")
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
