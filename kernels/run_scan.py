"""Contiguous-run grouping for the host and device destination spaces in one pass.

A page starts a run when it starts a batch or when src or dst is not the
previous page + 1. Runs are numbered with a multi-block prefix scan: count
flags per block, scan the block counts, then scatter each run's start, end
and first pages. Counts stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import PAGES, SCAN
from gpu_planner.status import NEGATIVE_PAGE_SLOTS, NO_ERROR, NUM_SLOTS

# The status slots of the first negative page of each page list (gpu_planner/status.py),
# relative to the source pages' slot, which the count kernel receives.
_SRC_SLOT = NEGATIVE_PAGE_SLOTS["src_pages"]
_DST_SLOT = tl.constexpr(NEGATIVE_PAGE_SLOTS["dst_pages"] - _SRC_SLOT)
_DST_DEVICE_SLOT = tl.constexpr(NEGATIVE_PAGE_SLOTS["dst_device_pages"] - _SRC_SLOT)
_NO_ERROR = tl.constexpr(NO_ERROR)

# Page pointers may be views at any address; sizes and counts are never specialised.
PAGE_POINTERS = ["src_pages_ptr", "dst_pages_ptr", "dst_device_pages_ptr"]
PAGE_STRIDES = ["src_pages_stride", "dst_pages_stride", "dst_device_pages_stride"]


@triton.jit
def _load_pages(pages_ptr, stride, page, mask):
    return tl.load(pages_ptr + page.to(tl.int64) * stride, mask=mask, other=0).to(tl.int64)


@triton.jit
def _block_source_pages(src_pages_ptr, src_pages_stride, num_pages, BLOCK: tl.constexpr):
    """This program's pages: (page, page in range, its source page, the previous source page)."""
    page = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    page_in_range = page < num_pages
    src = _load_pages(src_pages_ptr, src_pages_stride, page, page_in_range)
    prev_src = _load_pages(src_pages_ptr, src_pages_stride, page - 1, page_in_range & (page > 0))
    return page, page_in_range, src, prev_src


@triton.jit
def _run_start_flags(src, prev_src, dst_ptr, dst_stride, page, page_in_range, batch_pages):
    """(starts a run, dst page) for each page, given its source page and the previous one."""
    dst = _load_pages(dst_ptr, dst_stride, page, page_in_range)
    prev_dst = _load_pages(dst_ptr, dst_stride, page - 1, page_in_range & (page > 0))
    continues = (src == prev_src + 1) & (dst == prev_dst + 1) & (page % batch_pages != 0)
    return page_in_range & ~continues, dst


@triton.jit
def _record_first_negative(status_slot_ptr, pages, page, page_in_range):
    negative_at = tl.where(page_in_range & (pages < 0), page.to(tl.int64), _NO_ERROR)
    tl.atomic_min(status_slot_ptr, tl.min(negative_at, axis=0))


@triton.jit(
    do_not_specialize=PAGE_STRIDES + ["num_pages", "num_blocks", "batch_pages"],
    do_not_specialize_on_alignment=PAGE_POINTERS,
)
def _count_runs_kernel(
    src_pages_ptr,  # int32/int64 [num_pages]: source pages
    src_pages_stride: tl.int64,  # element stride of src
    dst_pages_ptr,  # int32/int64 [num_pages]: host-space destination pages
    dst_pages_stride: tl.int64,
    dst_device_pages_ptr,  # int32/int64 [num_pages]: device-space destination pages (or host's)
    dst_device_pages_stride: tl.int64,
    block_counts_ptr,  # out, int64 [spaces, num_blocks]: run starts per block
    first_negative_ptr,  # int64 status slots: first negative src, host dst, device dst page
    num_pages: tl.int64,
    num_blocks: tl.int64,  # programs in the grid
    batch_pages: tl.int64,  # pages per batch: a run never crosses a multiple of it
    HAS_DEVICE: tl.constexpr,  # a device space exists
    BLOCK: tl.constexpr,  # pages per program
):
    """Run starts per block and space; first negative src, host dst, device dst page."""
    block = tl.program_id(0)
    page, page_in_range, src, prev_src = _block_source_pages(
        src_pages_ptr, src_pages_stride, num_pages, BLOCK
    )
    _record_first_negative(first_negative_ptr, src, page, page_in_range)

    host_starts, dst = _run_start_flags(
        src, prev_src, dst_pages_ptr, dst_pages_stride, page, page_in_range, batch_pages
    )
    tl.store(block_counts_ptr + block, tl.sum(host_starts.to(tl.int64), axis=0))
    _record_first_negative(first_negative_ptr + _DST_SLOT, dst, page, page_in_range)
    if HAS_DEVICE:
        device_starts, dst_device = _run_start_flags(
            src,
            prev_src,
            dst_device_pages_ptr,
            dst_device_pages_stride,
            page,
            page_in_range,
            batch_pages,
        )
        tl.store(block_counts_ptr + num_blocks + block, tl.sum(device_starts.to(tl.int64), axis=0))
        _record_first_negative(
            first_negative_ptr + _DST_DEVICE_SLOT, dst_device, page, page_in_range
        )


@triton.jit(do_not_specialize=["num_blocks", "num_batches"])
def _scan_block_counts_kernel(
    block_counts_ptr,  # int64 [spaces, num_blocks]: run starts per block
    block_offsets_ptr,  # out, int64 [spaces, num_blocks]: runs before each block
    batch_run_offsets_ptr,  # out, int64 [spaces, num_batches + 1]: the run count at the end
    num_blocks: tl.int64,
    num_batches: tl.int64,
    BLOCK: tl.constexpr,  # block counts per loop step
):
    """One program per space: exclusive scan of block counts; the total ends the batch table."""
    space = tl.program_id(0)
    counts_ptr = block_counts_ptr + space * num_blocks
    offsets_ptr = block_offsets_ptr + space * num_blocks
    runs_before = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for chunk_start in range(0, num_blocks, BLOCK):
        block = chunk_start + tl.arange(0, BLOCK)
        block_in_range = block < num_blocks
        counts = tl.load(counts_ptr + block, mask=block_in_range, other=0)
        inclusive = tl.cumsum(counts, axis=0)
        tl.store(offsets_ptr + block, runs_before + inclusive - counts, mask=block_in_range)
        runs_before += tl.sum(counts, axis=0)
    tl.store(batch_run_offsets_ptr + space * (num_batches + 1) + num_batches, runs_before)


@triton.jit
def _scatter_space_runs(
    src,  # int64 [BLOCK]: this block's source pages
    prev_src,  # int64 [BLOCK]: the source page before each
    next_src,  # int64 [BLOCK]: the source page after each
    dst_ptr,  # int32/int64 [num_pages]: this space's destination pages
    dst_stride,  # their element stride
    page,  # int64 [BLOCK]: page positions of this block
    page_in_range,  # [BLOCK]: page < num_pages
    num_pages,
    batch_pages,  # pages per batch
    first_run,  # runs of this space before this block
    page_starts_ptr,  # out, int64 [capacity]: this space's row of each run table
    page_ends_ptr,
    src_starts_ptr,
    dst_starts_ptr,
    batch_run_offsets_ptr,  # out, int64 [num_batches + 1]: this space's first run per batch
):
    """Write the runs of one destination space that start or end in this block."""
    starts, dst = _run_start_flags(
        src, prev_src, dst_ptr, dst_stride, page, page_in_range, batch_pages
    )
    next_page = page + 1
    next_starts, _ = _run_start_flags(
        next_src, src, dst_ptr, dst_stride, next_page, next_page < num_pages, batch_pages
    )
    ends = page_in_range & ((next_page == num_pages) | next_starts)
    run = first_run + tl.cumsum(starts.to(tl.int64), axis=0) - 1
    tl.store(page_starts_ptr + run, page.to(tl.int64), mask=starts)
    tl.store(src_starts_ptr + run, src, mask=starts)
    tl.store(dst_starts_ptr + run, dst, mask=starts)
    tl.store(page_ends_ptr + run, next_page.to(tl.int64), mask=ends)
    starts_batch = page_in_range & (page % batch_pages == 0)
    tl.store(batch_run_offsets_ptr + page // batch_pages, run, mask=starts_batch)


@triton.jit(
    do_not_specialize=PAGE_STRIDES
    + ["num_pages", "num_blocks", "capacity", "num_batches", "batch_pages"],
    do_not_specialize_on_alignment=PAGE_POINTERS,
)
def _scatter_runs_kernel(
    src_pages_ptr,  # int32/int64 [num_pages]: source pages
    src_pages_stride: tl.int64,
    dst_pages_ptr,  # int32/int64 [num_pages]: host-space destination pages
    dst_pages_stride: tl.int64,
    dst_device_pages_ptr,  # int32/int64 [num_pages]: device-space destination pages (or host's)
    dst_device_pages_stride: tl.int64,
    block_offsets_ptr,  # int64 [spaces, num_blocks]: runs before each block
    page_starts_ptr,  # out, int64 [spaces, capacity]: first page of each run
    page_ends_ptr,  # out, int64 [spaces, capacity]: one past its last page
    src_starts_ptr,  # out, int64 [spaces, capacity]: its first source page
    dst_starts_ptr,  # out, int64 [spaces, capacity]: its first destination page
    batch_run_offsets_ptr,  # out, int64 [spaces, num_batches + 1]: first run of each batch
    num_pages: tl.int64,
    num_blocks: tl.int64,
    capacity: tl.int64,  # row length of the run tables
    num_batches: tl.int64,
    batch_pages: tl.int64,
    HAS_DEVICE: tl.constexpr,  # a device space exists
    BLOCK: tl.constexpr,  # pages per program
):
    block = tl.program_id(0)
    page, page_in_range, src, prev_src = _block_source_pages(
        src_pages_ptr, src_pages_stride, num_pages, BLOCK
    )
    next_src = _load_pages(src_pages_ptr, src_pages_stride, page + 1, page + 1 < num_pages)
    _scatter_space_runs(
        src,
        prev_src,
        next_src,
        dst_pages_ptr,
        dst_pages_stride,
        page,
        page_in_range,
        num_pages,
        batch_pages,
        tl.load(block_offsets_ptr + block),
        page_starts_ptr,
        page_ends_ptr,
        src_starts_ptr,
        dst_starts_ptr,
        batch_run_offsets_ptr,
    )
    if HAS_DEVICE:
        _scatter_space_runs(
            src,
            prev_src,
            next_src,
            dst_device_pages_ptr,
            dst_device_pages_stride,
            page,
            page_in_range,
            num_pages,
            batch_pages,
            tl.load(block_offsets_ptr + num_blocks + block),
            page_starts_ptr + capacity,
            page_ends_ptr + capacity,
            src_starts_ptr + capacity,
            dst_starts_ptr + capacity,
            batch_run_offsets_ptr + num_batches + 1,
        )


@dataclass
class RunTables:
    """Runs of both destination spaces, padded to `capacity`; row 0 host, row 1 device.

    `metadata` is the one small tensor the host reads before expansion: the
    status word, then each space's batch run offsets.
    """

    page_starts: torch.Tensor  # int64 [spaces, capacity]
    page_ends: torch.Tensor  # int64 [spaces, capacity]
    src_starts: torch.Tensor  # int64 [spaces, capacity]
    dst_starts: torch.Tensor  # int64 [spaces, capacity]
    metadata: torch.Tensor  # int64 [NUM_SLOTS + spaces * (num_batches + 1)]
    num_pages: int
    num_batches: int
    batch_pages: int

    @property
    def capacity(self) -> int:
        return self.page_starts.shape[1]

    @property
    def num_spaces(self) -> int:
        return self.page_starts.shape[0]

    @property
    def status(self) -> torch.Tensor:
        """int64 [NUM_SLOTS]: the status word the kernels record errors in."""
        return self.metadata[:NUM_SLOTS]

    @property
    def batch_run_offsets(self) -> torch.Tensor:
        """int64 [spaces, num_batches + 1]: first run of each batch, then the run count."""
        return self.metadata[NUM_SLOTS:].view(self.num_spaces, self.num_batches + 1)


def _int64_rows(rows: int, columns: int, torch_device: torch.device) -> torch.Tensor:
    return torch.empty((rows, columns), dtype=torch.int64, device=torch_device)


def launch_group_runs(
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_device_pages: torch.Tensor | None,
    batch_pages: int,
) -> RunTables:
    """Group runs for one or two destination spaces: one fill, three kernels, no host read.

    Launches on the current CUDA device and stream: the caller guards the device.
    """
    num_pages = src_pages.numel()
    num_spaces = 1 if dst_device_pages is None else 2
    num_batches = triton.cdiv(num_pages, batch_pages)
    torch_device = src_pages.device
    capacity = max(num_pages, 1)

    # One fill: the status slots start empty; the kernels write every batch offset.
    metadata = torch.full(
        (NUM_SLOTS + num_spaces * (num_batches + 1),),
        NO_ERROR,
        dtype=torch.int64,
        device=torch_device,
    )
    runs = RunTables(
        page_starts=_int64_rows(num_spaces, capacity, torch_device),
        page_ends=_int64_rows(num_spaces, capacity, torch_device),
        src_starts=_int64_rows(num_spaces, capacity, torch_device),
        dst_starts=_int64_rows(num_spaces, capacity, torch_device),
        metadata=metadata,
        num_pages=num_pages,
        num_batches=num_batches,
        batch_pages=batch_pages,
    )
    if num_pages == 0:
        runs.batch_run_offsets.zero_()
        return runs
    num_blocks = PAGES.num_programs(num_pages)
    block_counts = _int64_rows(num_spaces, num_blocks, torch_device)
    block_offsets = _int64_rows(num_spaces, num_blocks, torch_device)
    dst_device = dst_pages if dst_device_pages is None else dst_device_pages
    page_args = (
        src_pages,
        src_pages.stride(0),
        dst_pages,
        dst_pages.stride(0),
        dst_device,
        dst_device.stride(0),
    )
    has_device = dst_device_pages is not None
    status = runs.status
    _count_runs_kernel[(num_blocks,)](
        *page_args,
        block_counts,
        status[_SRC_SLOT:],
        num_pages,
        num_blocks,
        batch_pages,
        HAS_DEVICE=has_device,
        **PAGES.launch_options(),
    )
    _scan_block_counts_kernel[(num_spaces,)](
        block_counts,
        block_offsets,
        runs.batch_run_offsets,
        num_blocks,
        num_batches,
        **SCAN.launch_options(),
    )
    _scatter_runs_kernel[(num_blocks,)](
        *page_args,
        block_offsets,
        runs.page_starts,
        runs.page_ends,
        runs.src_starts,
        runs.dst_starts,
        runs.batch_run_offsets,
        num_pages,
        num_blocks,
        capacity,
        num_batches,
        batch_pages,
        HAS_DEVICE=has_device,
        **PAGES.launch_options(),
    )
    return runs
