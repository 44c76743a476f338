"""The issue's target checks, read from the sweep's results at the target point (informational)."""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.cases import TARGET, TARGET_PAGE_1

CPU = "gpu_planner-cpu"
TRITON = "gpu_planner-triton"
CPU_PLAN_SPEEDUP = {64: 100.0, 1: 150.0}
HAND_OFF_SPEEDUP = 12.0
HAND_OFF_OVER_FLOOR = 1.2
GPU_PLAN_S = 30e-6
GPU_WALL_S = 150e-6
TRITON_OVER_CPU_PAGE_1 = 3.0
SEND_PATH_SPEEDUP = {64: 25.0, 1: 50.0}
SEND_PATH_GIL_HOLD_S = 1.5e-3


@dataclasses.dataclass(frozen=True)
class TargetCheck:
    name: str
    passed: bool
    measured: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.measured}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _at(results: list[dict[str, Any]], case: Any) -> dict[str, Any] | None:
    wanted = dataclasses.asdict(case)
    return next((result for result in results if result["case"] == wanted), None)


def _cpu_checks(result: dict[str, Any], page_size: int) -> list[TargetCheck]:
    cpu = result["planners"][CPU]
    plan_target = CPU_PLAN_SPEEDUP[page_size]
    return [
        TargetCheck(
            f"page {page_size}: CPU plan >= {plan_target:g}x reference",
            cpu["plan_speedup"] >= plan_target,
            f"{cpu['plan_speedup']:.1f}x",
        ),
        TargetCheck(
            f"page {page_size}: CPU hand-off >= {HAND_OFF_SPEEDUP:g}x reference",
            cpu["hand_off_speedup"] >= HAND_OFF_SPEEDUP,
            f"{cpu['hand_off_speedup']:.1f}x",
        ),
        TargetCheck(
            f"page {page_size}: CPU hand-off <= {HAND_OFF_OVER_FLOOR:g}x floor",
            cpu["hand_off_over_floor"] <= HAND_OFF_OVER_FLOOR,
            f"{cpu['hand_off_over_floor']:.2f}x",
        ),
    ]


def _send_path_checks(result: dict[str, Any], page_size: int) -> list[TargetCheck]:
    """The hooked send >= the target speed-up over sglang's (interleaved, as every figure
    here); at page 64 its typical longest GIL hold (median over calls) <= SEND_PATH_GIL_HOLD_S."""
    send = result.get("send_path")
    if send is None:
        return []
    target = SEND_PATH_SPEEDUP[page_size]
    checks = [
        TargetCheck(
            f"page {page_size}: whole send path >= {target:g}x sglang's",
            send["speedup"] >= target,
            f"{send['speedup']:.1f}x interleaved ({send['speedup_alone']:.1f}x each alone)",
        )
    ]
    if page_size == 64:
        hold = send["hooked"]["gil_hold"]
        checks.append(
            TargetCheck(
                f"page 64: hooked send's longest GIL hold <= {SEND_PATH_GIL_HOLD_S * 1e3:g} ms",
                hold["median"] <= SEND_PATH_GIL_HOLD_S,
                f"median {hold['median'] * 1e3:.2f} ms, max {hold['max'] * 1e3:.2f} ms",
            )
        )
    return checks


def _triton_checks(
    result: dict[str, Any], result_page_1: dict[str, Any] | None
) -> list[TargetCheck]:
    triton = result["planners"][TRITON]
    gpu_s = triton["gpu_plan_transfer"]["median"]
    wall_s = triton["plan"]["median"]
    cpu_wall_s = result["planners"][CPU]["plan"]["median"]
    checks = [
        TargetCheck(
            f"page 64: Triton GPU time < {GPU_PLAN_S * 1e6:g}us",
            gpu_s < GPU_PLAN_S,
            f"{gpu_s * 1e6:.1f}us",
        ),
        TargetCheck(
            f"page 64: Triton wall time incl. final copy < {GPU_WALL_S * 1e6:g}us",
            wall_s < GPU_WALL_S,
            f"{wall_s * 1e6:.1f}us",
        ),
        TargetCheck(
            "page 64: Triton wall time incl. final copy <= CPU backend's",
            wall_s <= cpu_wall_s,
            f"{wall_s * 1e6:.1f}us against {cpu_wall_s * 1e6:.1f}us",
        ),
        TargetCheck(
            "page 64: no host sync before the final copy",
            triton["no_host_sync"],
            str(triton["sync_error"]),
        ),
    ]
    if result_page_1 is not None:
        triton_1 = result_page_1["planners"][TRITON]
        speedup = result_page_1["planners"][CPU]["plan"]["median"] / triton_1["plan"]["median"]
        checks += [
            TargetCheck(
                "page 1: no host sync before the final copy",
                triton_1["no_host_sync"],
                str(triton_1["sync_error"]),
            ),
            TargetCheck(
                f"page 1: Triton plan >= {TRITON_OVER_CPU_PAGE_1:g}x CPU backend",
                speedup >= TRITON_OVER_CPU_PAGE_1,
                f"{speedup:.1f}x",
            ),
        ]
    return checks


def evaluate_targets(results: list[dict[str, Any]]) -> list[TargetCheck]:
    """Every target check whose case is in `results`."""
    at_target = _at(results, TARGET)
    at_page_1 = _at(results, TARGET_PAGE_1)
    checks = []
    for result, page_size in ((at_target, 64), (at_page_1, 1)):
        if result is not None:
            checks += _cpu_checks(result, page_size) + _send_path_checks(result, page_size)
    if at_target is not None and TRITON in at_target["planners"]:
        checks += _triton_checks(at_target, at_page_1)
    return checks
