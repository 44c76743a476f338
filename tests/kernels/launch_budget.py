"""Cached launches against Triton's real CUDA pipeline (sm_90 stand-in driver, no GPU).

After one launch of each variant, a plan's four kernels and a page conversion
launch through their cached `CompiledKernel`s: none goes through
`JITFunction.run`. Every cached launch is then checked against the JIT's own
choice for the same arguments (`run(..., warmup=True)`): the very same
compiled kernel, so the cache never launches another specialisation. Run with
TRITON_INTERPRET unset; prints one JSON line.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
from aot_compile import CPU, Sm90Driver
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from gpu_planner.inputs import collect_pages
from gpu_planner.kernels import launcher
from gpu_planner.kernels.expand_descriptors import launch_expand_descriptors
from gpu_planner.kernels.launcher import CachedKernel, LaunchTarget
from gpu_planner.kernels.page_indices import launch_page_indices
from gpu_planner.kernels.run_scan import workspace_bytes
from gpu_planner.layout import BufferLayout
from gpu_planner.runs import launch_runs

TARGET = LaunchTarget(device=0, stream=0)
DTYPES = (torch.int32, torch.int64)


def plan(num_pages: int, num_buffers: int, dtypes, max_batch_pages: int, view: int) -> None:
    """One plan's launches as `plan._launch` makes them, into a workspace of its size."""
    is_device = [buffer % 2 == 1 for buffer in range(num_buffers)]
    layout = BufferLayout(
        [1 << 20] * num_buffers, [1 << 30] * num_buffers, [4096] * num_buffers, is_device
    )
    pages = [torch.arange(view, num_pages + view, dtype=dtype)[view:] for dtype in dtypes]
    request = collect_pages(
        pages[0], pages[1], pages[2] if any(is_device) else None, max_batch_pages
    )
    spaces = 1 + ("dst_device_pages" in request.pages)
    nbytes = workspace_bytes(num_pages, spaces, request.num_batches, num_buffers)
    workspace = torch.empty(nbytes, dtype=torch.uint8)
    runs = launch_runs(request.pages, request.batch_pages, workspace, num_buffers, TARGET)
    launch_expand_descriptors(
        layout.tables(CPU), layout.num_host_buffers, layout.num_device_buffers, runs, target=TARGET
    )


def main() -> int:
    driver.set_active(Sm90Driver())
    jit_runs = [0]
    run = JITFunction.run

    def counted_run(self, *args, **kwargs):
        jit_runs[0] += 1
        return run(self, *args, **kwargs)

    JITFunction.run = counted_run
    cases = list(
        itertools.product(
            (1, 17, 2048), (1, 61), itertools.product(DTYPES, repeat=3), (0, 16), range(2)
        )
    )
    for case in cases:  # warm: each variant's first launch goes through the JIT
        plan(*case)
    for dtypes in itertools.product(DTYPES, repeat=2):
        launch_page_indices(
            torch.arange(9, dtype=dtypes[0]), torch.arange(9, dtype=dtypes[1]), 0, 9, 2, TARGET
        )
    warm_jit_runs = jit_runs[0]
    jit_runs[0] = 0
    before = {name: counts[1] for name, counts in launcher.launch_counts.items()}
    plan(2048, 61, (torch.int64, torch.int32, torch.int64), 0, 1)
    plan_jit_runs = jit_runs[0]
    plan_cached = sum(
        counts[1] - before.get(name, 0) for name, counts in launcher.launch_counts.items()
    )
    launch_page_indices(torch.arange(9, dtype=torch.int32), torch.arange(9), 0, 9, 2, TARGET)
    pages_jit_runs = jit_runs[0] - plan_jit_runs

    mismatches = []
    cached_launch = CachedKernel.launch

    def checked_launch(self, grid, variant, stream, device, args, constexprs, num_warps):
        compiled = self.compiled(device, variant)
        chosen = run(self.kernel, *args, grid=grid, warmup=True, **constexprs, num_warps=num_warps)
        if compiled is not None and chosen is not compiled:
            mismatches.append(self.name)
        return cached_launch(self, grid, variant, stream, device, args, constexprs, num_warps)

    CachedKernel.launch = checked_launch
    for case in cases:
        plan(*case)
    print(
        json.dumps(
            {
                "warm_jit_runs": warm_jit_runs,
                "plan_jit_runs": plan_jit_runs,
                "plan_cached_launches": plan_cached,
                "page_indices_jit_runs": pages_jit_runs,
                "checked_plans": len(cases),
                "mismatches": mismatches,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
