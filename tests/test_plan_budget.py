"""Call budgets of the Triton plan's host side, counted on CPU through the CUDA stand-in.

On a GPU the plan is host-bound: what it costs is the number of things its
host code does per plan, not the kernels' time. These tests count them with
the stand-in runtime (tests/cuda_standin.py) and the Triton interpreter, on a
warm process (the same plan shape made before), per plan:

- kernel launches: four (run counts, block scan, run scatter, expansion) and
  no torch fills or allocations (the workspace is reused);
- host waits: one (the status, the counts and the descriptors arrive in one
  copy);
- device-index lookups: none (the thread's device context is cached).

`tests/kernels/test_launch_budget_sm90.py` counts the launches that go through
`JITFunction.run` (none once warm) against Triton's real CUDA pipeline.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from suite_support import list_batches
from torch.utils._python_dispatch import TorchDispatchMode

import gpu_planner as gp
from gpu_planner import reference
from gpu_planner.testing import fragmented_pages

pytestmark = pytest.mark.skipif(
    not __import__("gpu_planner.kernels").kernels.interpreter_enabled(),
    reason="the stand-in runs its kernels on the Triton interpreter",
)

ALLOCATING_OPS = ("empty", "full", "zeros", "ones", "arange", "clone")
FILLING_OPS = ("fill_", "zero_")


class _TorchOps(TorchDispatchMode):
    """Counts torch's allocations and fills outside Triton launches (the interpreter's own
    argument copies are not the plan's)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    def count(self, names: tuple[str, ...]) -> int:
        return sum(n for op, n in self.ops.items() if op in names)


@contextlib.contextmanager
def _counting(host_cuda) -> Iterator[dict]:
    """Counts of one block: Triton launches, torch allocations and fills, host waits, lookups."""
    from triton.runtime.interpreter import GridExecutor

    launch = GridExecutor.__call__
    counts: dict = {"launches": 0}
    ops = _TorchOps()

    def counted_launch(self, *args, **kwargs):
        counts["launches"] += 1
        ops.paused += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            ops.paused -= 1

    waits, lookups = host_cuda.host_waits, host_cuda.device_lookups
    GridExecutor.__call__ = counted_launch
    try:
        with ops:
            yield counts
    finally:
        GridExecutor.__call__ = launch
    counts["allocations"] = ops.count(ALLOCATING_OPS)
    counts["fills"] = ops.count(FILLING_OPS)
    counts["host_waits"] = host_cuda.host_waits - waits
    counts["device_lookups"] = host_cuda.device_lookups - lookups


def _layout(num_buffers: int) -> gp.BufferLayout:
    return gp.BufferLayout(
        [(1 << 40) + (b << 32) for b in range(num_buffers)],
        [(1 << 41) + (b << 32) for b in range(num_buffers)],
        [4096 + 64 * b for b in range(num_buffers)],
        dst_is_device=[b % 3 == 2 for b in range(num_buffers)],
    )


def _pages(seed: int, num_pages: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        name: torch.from_numpy(fragmented_pages(num_pages, 3.0, rng))
        for name in ("src", "dst", "device")
    }


def _plan(pages: dict[str, torch.Tensor], layout: gp.BufferLayout, max_batch_pages: int):
    return gp.plan_transfer(
        pages["src"],
        pages["dst"],
        layout,
        dst_device_pages=pages["device"],
        max_batch_pages=max_batch_pages,
        backend="triton",
    ).materialize()


@pytest.mark.parametrize("max_batch_pages", [0, 64])
def test_a_warm_plan_launches_four_kernels_waits_once_and_allocates_nothing(
    host_cuda, max_batch_pages
):
    layout = _layout(7)
    for seed in range(3):  # warm: the same shape planned before
        _plan(_pages(seed, 300), layout, max_batch_pages)
    pages = _pages(10, 300)
    with _counting(host_cuda) as counts:
        plan = _plan(pages, layout, max_batch_pages)
    assert counts == {
        "launches": 4,
        "allocations": 0,
        "fills": 0,
        "host_waits": 1,
        "device_lookups": 0,
    }
    expected = reference.plan_batches(
        pages["src"].numpy(),
        pages["dst"].numpy(),
        layout.src_ptrs.tolist(),
        layout.dst_ptrs.tolist(),
        layout.item_lens.tolist(),
        layout.dst_is_device.tolist(),
        pages["device"].numpy(),
        max_batch_pages,
    )
    assert [tuple(list(column) for column in batch) for batch in list_batches(plan)] == expected


def test_page_indices_async_looks_no_device_up_and_waits_once(host_cuda):
    rows = [torch.randperm(4096)[:500] for _ in range(4)]
    for row in rows[:2]:
        gp.page_indices_async(row, row + 7, 0, 500, 16, "triton").numpy()
    with _counting(host_cuda) as counts:
        pages = gp.page_indices_async(rows[3], rows[3] + 7, 0, 500, 16, "triton").numpy()
    assert pages.device.tolist() == (rows[3][::16] // 16).tolist()
    assert counts["launches"] == 1
    assert counts["host_waits"] == 1
    assert counts["device_lookups"] == 0
