"""Descriptor expansion over (buffer, run block), with each buffer's space chosen on the device.

Output: three columns packed at stride `total` (src_addrs, then dst_addrs, then
lengths), so the exact plan is the contiguous prefix [0, 3 * total) and the
host fetches it with one copy. Buffer `b` in batch `k` starts at
    num_host_buffers * host_runs_before_k + num_device_buffers * device_runs_before_k
    + host_before[b] * host_runs_in_k + device_before[b] * device_runs_in_k
so every program finds its output slots from device-side counts alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_planner.kernels.run_scan import DeviceRuns
from gpu_planner.kernels.status import OUT_OF_BOUNDS

BLOCK_RUNS = 1024


@triton.jit
def _expand_descriptors_kernel(
    space_ptr,
    host_before_ptr,
    device_before_ptr,
    src_ptrs_ptr,
    dst_ptrs_ptr,
    item_lens_ptr,
    src_lens_ptr,
    dst_lens_ptr,
    page_starts_ptr,
    page_ends_ptr,
    src_starts_ptr,
    dst_starts_ptr,
    batch_run_offsets_ptr,
    descriptors_ptr,
    first_out_of_bounds_ptr,
    capacity,
    num_batches,
    batch_pages,
    num_host_buffers,
    num_device_buffers,
    HAS_DEVICE: tl.constexpr,
    CHECK_BOUNDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    buffer = tl.program_id(0)
    run = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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

    if CHECK_BOUNDS:
        dst_over = run_in_range & (dst_offset + length > tl.load(dst_lens_ptr + buffer))
        src_over = run_in_range & (src_offset + length > tl.load(src_lens_ptr + buffer))
        key = (buffer.to(tl.int64) * capacity + run) * 2 + tl.where(dst_over, 0, 1)
        key = tl.where(dst_over | src_over, key, 9223372036854775807)
        tl.atomic_min(first_out_of_bounds_ptr, tl.min(key, axis=0))


def launch_expand_descriptors(
    tables: dict[str, torch.Tensor],
    num_host_buffers: int,
    num_device_buffers: int,
    runs: DeviceRuns,
    status: torch.Tensor,
    check_bounds: bool,
) -> torch.Tensor:
    """Write every buffer's descriptors into a worst-case flat int64 tensor (3 packed columns)."""
    num_buffers = num_host_buffers + num_device_buffers
    descriptors = torch.empty(
        3 * num_buffers * runs.capacity, dtype=torch.int64, device=runs.page_starts.device
    )
    if runs.num_pages == 0 or num_buffers == 0:
        return descriptors
    grid = (num_buffers, triton.cdiv(runs.capacity, BLOCK_RUNS))
    _expand_descriptors_kernel[grid](
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
        status[OUT_OF_BOUNDS:],
        runs.capacity,
        runs.num_batches,
        runs.batch_pages,
        num_host_buffers,
        num_device_buffers,
        HAS_DEVICE=runs.num_spaces > 1,
        CHECK_BOUNDS=check_bounds,
        BLOCK=BLOCK_RUNS,
    )
    return descriptors
