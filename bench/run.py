"""Benchmark entry point: `python -m bench.run [--quick | --target] [sweep options]`.

For every case it generates one set of pages, runs every planner on them, checks
that all planners hand Mooncake identical descriptor lists, and times plan and
hand-off. Where sglang and Mooncake import, it also times the whole send path
(`bench.send_path`: sglang's send and the hooked one into a real engine, with
the longest GIL hold). It prints a table, writes JSON and a PNG, and prints the
target checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script (`python bench/run.py`): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.cases import default_cases, grid_cases, quick_cases, target_cases  # noqa: E402
from bench.harness import RepeatPolicy, measure_interleaved  # noqa: E402
from bench.inputs import BenchCase, make_input  # noqa: E402
from bench.planners import (  # noqa: E402
    GpuPlannerBackend,
    ListFloor,
    Planner,
    make_planners,
    nvtx_range,
)
from bench.plot import write_plot  # noqa: E402
from bench.progress import ProgressBar  # noqa: E402
from bench.report import format_table, machine_info, write_json  # noqa: E402
from bench.send_path import SendPathBench, send_path_available  # noqa: E402
from bench.targets import evaluate_targets  # noqa: E402

GRID_OPTIONS = {
    "tokens": int,
    "page_size": int,
    "buffers": int,
    "mean_run": float,
    "device_share": float,
    "batch_pages": int,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    preset.add_argument("--target", action="store_true", help="only the issue's target point")
    for name, kind in GRID_OPTIONS.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            nargs="+",
            help=f"sweep {name} over these values (a grid with the other given lists)",
        )
    parser.add_argument("--reference", choices=["auto", "sglang", "loop"], default="auto")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--send-path",
        choices=["auto", "on", "off"],
        default="auto",
        help="time the whole send path into a real Mooncake engine (auto: when it imports)",
    )
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of samples per figure")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    parser.add_argument("--name", default="gpu_planner_bench", help="stem of the JSON/PNG files")
    return parser.parse_args(argv)


def select_cases(args: argparse.Namespace) -> list[BenchCase]:
    grid = {name: getattr(args, name) for name in GRID_OPTIONS}
    if any(grid.values()):
        return grid_cases(**grid)
    if args.quick:
        return quick_cases()
    if args.target:
        return target_cases()
    return default_cases()


def _normalised(batches: list) -> list[tuple[list[int], list[int], list[int]]]:
    return [(list(srcs), list(dsts), list(lens)) for srcs, dsts, lens in batches]


def _stage_key(owner: str, stage: str) -> str:
    return f"{owner}/{stage}"


def _ratios(figures: dict[str, dict[str, Any]], reference: str, floor: dict[str, float]) -> None:
    """Add each planner's speed-up over the reference and its hand-off over the floor."""
    for planner_figures in figures.values():
        for stage in ("plan", "hand_off"):
            planner_figures[f"{stage}_speedup"] = (
                figures[reference][stage]["median"] / planner_figures[stage]["median"]
            )
        planner_figures["hand_off_over_floor"] = (
            planner_figures["hand_off"]["median"] / floor["median"]
        )


def run_case(
    case: BenchCase,
    planners: list[Planner],
    policy: RepeatPolicy,
    seed: int,
    progress: ProgressBar,
    send_path: SendPathBench | None = None,
) -> dict[str, Any]:
    """Time every planner on one generated input, interleaved, and compare their lists."""
    progress.show(f"{case.label} preparing")
    with nvtx_range(f"inputs {case.label}"):
        bench_input = make_input(case, seed)
    for planner in planners:
        planner.prepare(bench_input)
    cpu_planner = next(p for p in planners if isinstance(p, GpuPlannerBackend))
    floor = ListFloor(cpu_planner.plan())
    stages = {
        _stage_key(owner.name, stage_name): stage
        for owner in [*planners, floor]
        for stage_name, stage in owner.stages().items()
    }
    progress.show(f"{case.label} timing {len(stages)} stages")
    timings = measure_interleaved(stages, policy)
    progress.show(f"{case.label} checking descriptors")
    reference_batches = _normalised(planners[0].hand_off())
    identical = all(
        _normalised(owner.hand_off()) == reference_batches for owner in [*planners[1:], floor]
    )
    figures: dict[str, dict[str, Any]] = {}
    for planner in planners:
        own = {
            stage_name: timings[_stage_key(planner.name, stage_name)].as_dict()
            for stage_name in planner.stages()
        }
        own.setdefault("plan", own["hand_off"])
        figures[planner.name] = {**own, **planner.extra_figures()}
    floor_timing = timings[_stage_key(floor.name, "hand_off")].as_dict()
    _ratios(figures, planners[0].name, floor_timing)
    send_figures = None
    if send_path is not None:
        progress.show(f"{case.label} timing the send path")
        send_path.prepare(bench_input)
        send_figures = send_path.measure(policy)
    progress.advance()
    return {
        "case": dataclasses.asdict(case),
        "label": case.label,
        "num_pages": case.num_pages,
        "num_descriptors": sum(len(srcs) for srcs, _, _ in reference_batches),
        "num_calls": len(reference_batches),
        "descriptors_identical": identical,
        "reference": planners[0].name,
        "planners": figures,
        "floor": floor_timing,
        "send_path": send_figures,
    }


def make_send_path(choice: str) -> SendPathBench | None:
    """The send-path bench when asked for (`on`) or possible (`auto`), else None."""
    if choice == "off":
        return None
    missing = send_path_available()
    if missing is None:
        return SendPathBench()
    if choice == "on":
        raise SystemExit(f"--send-path on: sglang or Mooncake does not import ({missing})")
    print(f"send path not timed: {missing}", file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    cases = select_cases(args)
    policy = RepeatPolicy(args.budget, max(args.min_repeats, 1), args.max_repeats)
    started = time.perf_counter()
    planners = make_planners(args.reference, with_cuda=with_cuda)
    send_path = make_send_path(args.send_path)
    setup_s = time.perf_counter() - started
    progress = ProgressBar(len(cases))
    results = [run_case(case, planners, policy, args.seed, progress, send_path) for case in cases]
    progress.close()
    duration_s = time.perf_counter() - started
    checks = evaluate_targets(results)
    print(format_table(results))
    document = {
        "machine": machine_info(),
        "settings": {
            **{key: str(value) for key, value in vars(args).items()},
            "with_cuda": with_cuda,
            "planners": [planner.name for planner in planners],
            "send_path": send_path is not None,
        },
        "setup_s": setup_s,
        "duration_s": duration_s,
        "cases": results,
        "targets": [check.as_dict() for check in checks],
    }
    json_path = args.out / f"{args.name}.json"
    png_path = args.out / f"{args.name}.png"
    write_json(json_path, document)
    title = f"gpu_planner vs {planners[0].name} on {document['machine']['cpu']}"
    write_plot(png_path, results, title)
    print(f"\nsweep: {len(cases)} cases in {duration_s:.1f}s (setup {setup_s:.1f}s)")
    print(f"wrote {json_path} and {png_path}")
    if checks:
        print("\ntarget checks (informational):")
        for check in checks:
            print("  " + check.line())
    mismatched = [result["label"] for result in results if not result["descriptors_identical"]]
    for label in mismatched:
        print(f"ERROR: planners disagree on the descriptors of {label}", file=sys.stderr)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
