"""`gpu-planner demo`: the two-process Mooncake transfer, every `DemoConfig` knob a flag."""

from __future__ import annotations

import argparse
import dataclasses
import sys

_DEMO_HELP = {
    "buffers": "KV buffers (layers x K/V) per side",
    "device_fraction": "fraction of decode buffers that are device-backed (device page space)",
    "tokens": "tokens in the request",
    "page_size": "tokens per page",
    "item_len": "bytes per page per buffer (multiple of 8)",
    "mean_run": "mean free-run length of the fragmented allocators, in pages",
    "max_batch_pages": "pages per Mooncake call (0 = one call)",
    "host_pool_factor": "host-space (and prefill) pool size, in request sizes",
    "device_pool_factor": "device-space pool size, in request sizes",
    "planner": "gpu = gpu_planner (auto backend); reference = sglang-style Python loop",
    "mode": "push = prefill plans and writes (sglang's model); pull = decode plans and reads",
    "buffer_workers": "submit one call per buffer on this many threads (0 = one call per batch)",
    "seed": "allocator seed",
    "timeout_s": "bound on each wait: metadata, each Mooncake batch, verification",
}


def add_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `demo` to the `gpu-planner` parser (the `gpu_planner.commands` entry point)."""
    from gpu_planner.integration.demo.config import MODE_NAMES, PLANNERS, DemoConfig

    parser = subparsers.add_parser(
        "demo",
        help="move one request's KV between two processes through Mooncake and verify it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    choices = {"planner": PLANNERS, "mode": MODE_NAMES}
    for config_field in dataclasses.fields(DemoConfig):
        name = config_field.name
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(config_field.default),
            default=config_field.default,
            choices=choices.get(name),
            help=_DEMO_HELP[name],
        )
    parser.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from gpu_planner.integration.mooncake.engine import QUIET_ENV, set_mooncake_defaults

    set_mooncake_defaults(QUIET_ENV)  # before Mooncake loads; the demo's processes inherit it
    from gpu_planner.integration.demo.config import DemoConfig
    from gpu_planner.integration.demo.run import format_report, run_demo

    names = [config_field.name for config_field in dataclasses.fields(DemoConfig)]
    try:
        config = DemoConfig(**{name: getattr(args, name) for name in names})
    except ValueError as error:
        print(f"gpu-planner demo: {error}", file=sys.stderr)
        return 2
    report = run_demo(config)
    print(format_report(report))
    return 0 if report.ok else 1
