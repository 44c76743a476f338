"""Descriptor expansion over (buffer, run block), with each buffer's space chosen on the device.

Output: three columns packed at stride `total` (src_addrs, then dst_addrs, then
lengths), so the exact plan is the contiguous prefix [0, 3 * total) and the
host fetches it with one copy. Buffer `b` in batch `k` starts at
    num_host_buffers * host_runs_before_k + num_device_buffers * device_runs_before_k
    + host_before[b] * host_runs_in_k + device_before[b] * device_runs_in_k
so every program finds its output slots from device-side counts alone.
The grid is (run blocks, buffers): runs on the x axis, which has no practical
limit, and buffers on the y axis (at most 65535, checked by the plan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import RUNS
from gpu_planner.kernels.launcher import LaunchTarget, launch
from gpu_planner.kernels.run_scan import RunTables
from gpu_planner.status import DST_SIDE, NO_ERROR, OUT_OF_BOUNDS, SRC_SIDE

_NO_ERROR = tl.constexpr(NO_ERROR)
_DST_SIDE = tl.constexpr(DST_SIDE)
_SRC_SIDE = tl.constexpr(SRC_SIDE)


@triton.jit(
    do_not_specialize=[
        "capacity",
        "num_batches",
        "batch_pages",
        "num_host_buffers",
        "num_device_buffers",
    ]
)
def _expand_descriptors_kernel(
    space_ptr,  # int64 [buffers]: destination space of each buffer (0 host, 1 device)
    host_before_ptr,  # int64 [buffers]: host-space buffers before each buffer
    device_before_ptr,  # int64 [buffers]: device-space buffers before each buffer
    src_ptrs_ptr,  # int64 [buffers]: source base address
    dst_ptrs_ptr,  # int64 [buffers]: destination base address
    item_lens_ptr,  # int64 [buffers]: bytes per page
    src_lens_ptr,  # int64 [buffers]: source bytes a descriptor may reach past src_ptrs
    dst_lens_ptr,  # int64 [buffers]: destination bytes a descriptor may reach past dst_ptrs
    page_starts_ptr,  # int64 [spaces, capacity]: first page of each run
    page_ends_ptr,  # int64 [spaces, capacity]: one past its last page
    src_starts_ptr,  # int64 [spaces, capacity]: its first source page
    dst_starts_ptr,  # int64 [spaces, capacity]: its first destination page
    batch_run_offsets_ptr,  # int64 [spaces, num_batches + 1]: first run of each batch, count
    descriptors_ptr,  # out, int64 [3, total]: src addrs, dst addrs, lengths
    first_out_of_bounds_ptr,  # int64 status slot: first out-of-bounds key (atomic min)
    capacity: tl.int64,  # row length of the run tables
    num_batches: tl.int64,
    batch_pages: tl.int64,  # pages per batch
    num_host_buffers: tl.int64,
    num_device_buffers: tl.int64,
    HAS_DEVICE: tl.constexpr,  # a device space exists
    BLOCK: tl.constexpr,  # runs per program
):
    buffer = tl.program_id(1)
    run = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    space = tl.load(space_ptr + buffer)
    total = num_host_buffers * tl.load(batch_run_offsets_ptr + num_batches)
    if HAS_DEVICE:
        total += num_device_buffers * tl.load(batch_run_offsets_ptr + 2 * num_batches + 1)
    space_batch_runs_ptr = batch_run_offsets_ptr + space * (num_batches + 1)
    run_in_range = run < tl.load(space_batch_runs_ptr + num_batches)
    space_run = space * capacity + run
    page_start = tl.load(page_starts_ptr + space_run, mask=run_in_range, other=0)
    run_pages = tl.load(page_ends_ptr + space_run, mask=run_in_range, other=0) - page_start
    src_start = tl.load(src_starts_ptr + space_run, mask=run_in_range, other=0)
    dst_start = tl.load(dst_starts_ptr + space_run, mask=run_in_range, other=0)

    batch = page_start // batch_pages
    host_runs_before = tl.load(batch_run_offsets_ptr + batch, mask=run_in_range, other=0)
    host_runs_in_batch = (
        tl.load(batch_run_offsets_ptr + batch + 1, mask=run_in_range, other=0) - host_runs_before
    )
    slot = (
        num_host_buffers * host_runs_before + tl.load(host_before_ptr + buffer) * host_runs_in_batch
    )
    if HAS_DEVICE:
        device_offsets_ptr = batch_run_offsets_ptr + num_batches + 1
        device_runs_before = tl.load(device_offsets_ptr + batch, mask=run_in_range, other=0)
        device_runs_in_batch = (
            tl.load(device_offsets_ptr + batch + 1, mask=run_in_range, other=0) - device_runs_before
        )
        slot += num_device_buffers * device_runs_before
        slot += tl.load(device_before_ptr + buffer) * device_runs_in_batch
    slot += run - tl.load(space_batch_runs_ptr + batch, mask=run_in_range, other=0)

    item_len = tl.load(item_lens_ptr + buffer)
    length = run_pages * item_len
    src_offset = src_start * item_len
    dst_offset = dst_start * item_len
    descriptor_ptr = descriptors_ptr + slot
    tl.store(descriptor_ptr, tl.load(src_ptrs_ptr + buffer) + src_offset, mask=run_in_range)
    descriptor_ptr += total
    tl.store(descriptor_ptr, tl.load(dst_ptrs_ptr + buffer) + dst_offset, mask=run_in_range)
    tl.store(descriptor_ptr + total, length, mask=run_in_range)

    # Every descriptor must end within its buffer's byte limit on each side (the
    # registered length, else the rest of the int64 address space). The products
    # above may wrap; this compares the run's last page with the pages that fit,
    # which cannot. Key: status.out_of_bounds_key, so the first error wins.
    last_offset = run_pages - 1
    dst_fit = tl.load(dst_lens_ptr + buffer) // item_len
    src_fit = tl.load(src_lens_ptr + buffer) // item_len
    dst_over = run_in_range & (dst_start + last_offset >= dst_fit)
    src_over = run_in_range & (src_start + last_offset >= src_fit)
    side = tl.where(dst_over, _DST_SIDE, _SRC_SIDE)
    key = (buffer.to(tl.int64) * capacity + run) * 2 + side
    key = tl.where(dst_over | src_over, key, _NO_ERROR)
    tl.atomic_min(first_out_of_bounds_ptr, tl.min(key, axis=0))


def launch_expand_descriptors(
    tables: dict[str, torch.Tensor],
    num_host_buffers: int,
    num_device_buffers: int,
    runs: RunTables,
    run_counts: list[int] | None = None,
    target: LaunchTarget | None = None,
) -> torch.Tensor:
    """Write every buffer's descriptors as 3 packed columns; return the tensor they are in.

    With `run_counts` (each space's run count, read from `runs.batch_run_offsets`)
    the output is a new exact flat int64 tensor and the grid fits the counts.
    Without, the kernel writes into `runs.descriptors` (room for the worst case)
    over a grid sized by the page count, every program masked by the counts on
    the device: nothing is read back first, and the exact plan is the prefix
    [0, 3 * total). Launches on the current CUDA device and stream (cached when
    `target` has one); a layout of more than 65535 buffers is refused by the caller.
    """
    num_buffers = num_host_buffers + num_device_buffers
    if run_counts is None:
        descriptors = runs.descriptors
        max_runs = runs.num_pages
    else:
        space_buffers = (num_host_buffers, num_device_buffers)[: runs.num_spaces]
        total = sum(buffers * n for buffers, n in zip(space_buffers, run_counts, strict=True))
        descriptors = torch.empty(3 * total, dtype=torch.int64, device=runs.page_starts.device)
        max_runs = max(run_counts) if total else 0
    if max_runs == 0 or num_buffers == 0:
        return descriptors
    launch(
        _expand_descriptors_kernel,
        (RUNS.num_programs(max_runs), num_buffers),
        runs.num_spaces,
        target,
        (
            tables["space"],
            tables["host_before"],
            tables["device_before"],
            tables["src_ptrs"],
            tables["dst_ptrs"],
            tables["item_lens"],
            tables["src_lens"],
            tables["dst_lens"],
            runs.page_starts,
            runs.page_ends,
            runs.src_starts,
            runs.dst_starts,
            runs.batch_run_offsets,
            descriptors,
            runs.status[OUT_OF_BOUNDS:],
            runs.capacity,
            runs.num_batches,
            runs.batch_pages,
            num_host_buffers,
            num_device_buffers,
        ),
        {"HAS_DEVICE": runs.num_spaces > 1, "BLOCK": RUNS.block},
        RUNS.num_warps,
    )
    return descriptors
