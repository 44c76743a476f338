"""Benchmark outputs: the machine description, the terminal table and the JSON file."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

VERSIONED_PACKAGES = [
    "numpy",
    "torch",
    "triton",
    "numba",
    "sglang",
    "gpu-planner",
    "nvtx",
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
]
RECORDED_ENV = ["OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "TRITON_INTERPRET", "OMP_NUM_THREADS"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU, GPU and the versions every figure depends on."""
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {package: _version(package) for package in VERSIONED_PACKAGES},
        "env": {name: os.environ[name] for name in RECORDED_ENV if name in os.environ},
    }


def format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.2f}s"


def _format_timing(timing: dict[str, float] | None) -> str:
    if timing is None:
        return "-"
    spread = f"{format_seconds(timing['p10'])}-{format_seconds(timing['p90'])}"
    return f"{format_seconds(timing['median'])} [{spread}]"


def _format_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x"


TABLE_COLUMNS = [
    "planner",
    "plan med [p10-p90]",
    "hand-off med [p10-p90]",
    "plan/ref",
    "h-o/ref",
    "h-o/floor",
]


def table_rows(case_result: dict[str, Any]) -> list[list[str]]:
    """One row per planner and one for the floor, for one case."""
    rows = []
    for name, figures in case_result["planners"].items():
        rows.append(
            [
                name,
                _format_timing(figures["plan"]),
                _format_timing(figures["hand_off"]),
                _format_ratio(figures["plan_speedup"]),
                _format_ratio(figures["hand_off_speedup"]),
                _format_ratio(figures["hand_off_over_floor"]),
            ]
        )
    rows.append(["floor", "-", _format_timing(case_result["floor"]), "-", "-", "1.0x"])
    return rows


SEND_COLUMNS = [
    "send path",
    "interleaved med [p10-p90]",
    "GIL hold med / max",
    "GIL wait max",
    "alone med [p10-p90]",
    "GIL hold med / max",
    "speedup (alone)",
]


def _hold(figures: dict[str, Any]) -> str:
    hold = figures["gil_hold"]
    return f"{format_seconds(hold['median'])} / {format_seconds(hold['max'])}"


def send_path_rows(send: dict[str, Any]) -> list[list[str]]:
    """sglang's send and the hooked one: times, GIL holds and waits, interleaved and alone."""
    rows = []
    for variant in ("sglang", "hooked"):
        figures = send[variant]
        speedup = "-"
        if variant == "hooked":
            speedup = f"{send['speedup']:.1f}x ({send['speedup_alone']:.1f}x)"
        rows.append(
            [
                variant,
                _format_timing(figures),
                _hold(figures),
                format_seconds(figures["gil_wait"]["max"]),
                _format_timing(figures["alone"]),
                _hold(figures["alone"]),
                speedup,
            ]
        )
    return rows


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]


def format_table(results: list[dict[str, Any]]) -> str:
    """The whole sweep as a text table: a header line per case, then its planners."""
    rows = [row for result in results for row in table_rows(result)]
    widths = [
        max(len(str(cell)) for cell in column) for column in zip(TABLE_COLUMNS, *rows, strict=True)
    ]
    lines = []
    for result in results:
        extra = ""
        cuda_figures = [f for f in result["planners"].values() if "gpu_plan_transfer" in f]
        for figures in cuda_figures:
            gpu_time = format_seconds(figures["gpu_plan_transfer"]["median"])
            extra += f"  gpu={gpu_time} no_host_sync={figures['no_host_sync']}"
        lines.append(
            f"\n{result['label']}  pages={result['num_pages']} descriptors="
            f"{result['num_descriptors']} calls={result['num_calls']}"
            f"  identical={result['descriptors_identical']}{extra}"
        )
        lines.append(
            "  " + "  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths, strict=True))
        )
        for row in table_rows(result):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        send = result.get("send_path")
        if send is not None:
            lines.append(
                f"  whole send path into a real Mooncake engine (refused peer, status "
                f"{send['status']}), hooked hand-off: {send['handoff']}"
            )
            lines += _aligned(SEND_COLUMNS, send_path_rows(send))
            lines.append("  " + send_path_after(send))
    return "\n".join(lines)


def send_path_after(send: dict[str, Any]) -> str:
    """Each send's interleaved median by the send that ran right before its samples."""
    parts = [
        f"{variant} after {previous} {format_seconds(figures['median'])} ({figures['samples']})"
        for variant in ("sglang", "hooked")
        for previous, figures in sorted(send[variant]["after"].items())
    ]
    return "interleaved, by the send before (samples): " + ", ".join(parts)


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
