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
from gpu_planner.kernels.launcher import LaunchTarget, launch
from gpu_planner.status import NEGATIVE_PAGE_SLOTS, NO_ERROR, NUM_SLOTS, OUT_OF_BOUNDS

# The status slots of the first negative page of each page list (gpu_planner/status.py),
# relative to the source pages' slot, which the count kernel receives.
_SRC_SLOT = NEGATIVE_PAGE_SLOTS["src_pages"]
_DST_SLOT = tl.constexpr(NEGATIVE_PAGE_SLOTS["dst_pages"] - _SRC_SLOT)
_DST_DEVICE_SLOT = tl.constexpr(NEGATIVE_PAGE_SLOTS["dst_device_pages"] - _SRC_SLOT)
_NO_ERROR = tl.constexpr(NO_ERROR)
_NUM_PAGE_LISTS = tl.constexpr(len(NEGATIVE_PAGE_SLOTS))
_FIRST_NEGATIVE_SLOT = tl.constexpr(_SRC_SLOT)
_OUT_OF_BOUNDS = tl.constexpr(OUT_OF_BOUNDS)

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
def _record_first_negative(block_negatives_ptr, pages, page, page_in_range):
    """Store this block's first negative page position (NO_ERROR if none) in its slot."""
    negative_at = tl.where(page_in_range & (pages < 0), page.to(tl.int64), _NO_ERROR)
    tl.store(block_negatives_ptr, tl.min(negative_at, axis=0))


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
    block_negatives_ptr,  # out, int64 [3, num_blocks]: first negative src, dst, device dst page
    num_pages: tl.int64,
    num_blocks: tl.int64,  # programs in the grid
    batch_pages: tl.int64,  # pages per batch: a run never crosses a multiple of it
    HAS_DEVICE: tl.constexpr,  # a device space exists
    BLOCK: tl.constexpr,  # pages per program
):
    """Run starts per block and space; each block's first negative src, dst, device dst page."""
    block = tl.program_id(0)
    page, page_in_range, src, prev_src = _block_source_pages(
        src_pages_ptr, src_pages_stride, num_pages, BLOCK
    )
    _record_first_negative(block_negatives_ptr + block, src, page, page_in_range)

    host_starts, dst = _run_start_flags(
        src, prev_src, dst_pages_ptr, dst_pages_stride, page, page_in_range, batch_pages
    )
    tl.store(block_counts_ptr + block, tl.sum(host_starts.to(tl.int64), axis=0))
    _record_first_negative(
        block_negatives_ptr + _DST_SLOT * num_blocks + block, dst, page, page_in_range
    )
    device_negatives_ptr = block_negatives_ptr + _DST_DEVICE_SLOT * num_blocks + block
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
        _record_first_negative(device_negatives_ptr, dst_device, page, page_in_range)
    else:
        tl.store(device_negatives_ptr, _NO_ERROR)


@triton.jit(do_not_specialize=["num_blocks", "num_batches"])
def _scan_block_counts_kernel(
    block_counts_ptr,  # int64 [spaces, num_blocks]: run starts per block
    block_negatives_ptr,  # int64 [3, num_blocks]: each block's first negative page per list
    block_offsets_ptr,  # out, int64 [spaces, num_blocks]: runs before each block
    status_ptr,  # out, int64 [NUM_SLOTS]: the status word, written whole here
    batch_run_offsets_ptr,  # out, int64 [spaces, num_batches + 1]: the run count at the end
    num_blocks: tl.int64,
    num_batches: tl.int64,
    BLOCK: tl.constexpr,  # block counts per loop step
):
    """One program per space: exclusive scan of block counts; the total ends the batch table.

    The programs also write the status word (no fill before the plan): each
    page list's first negative page, reduced over the blocks (program p takes
    lists p, p + spaces, ...), and an empty out-of-bounds slot for the expansion.
    """
    space = tl.program_id(0)
    num_spaces = tl.num_programs(0)
    for negative_slot in range(space, _NUM_PAGE_LISTS, num_spaces):
        first_negative = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0) + _NO_ERROR
        for chunk_start in range(0, num_blocks, BLOCK):
            block = chunk_start + tl.arange(0, BLOCK)
            negatives = tl.load(
                block_negatives_ptr + negative_slot * num_blocks + block,
                mask=block < num_blocks,
                other=_NO_ERROR,
            )
            first_negative = tl.minimum(first_negative, tl.min(negatives, axis=0))
        tl.store(status_ptr + _FIRST_NEGATIVE_SLOT + negative_slot, first_negative)
    if space == 0:
        tl.store(status_ptr + _OUT_OF_BOUNDS, _NO_ERROR)
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
    status word, then each space's batch run offsets. A plan's tables are
    pieces of one workspace (`workspace_pieces`), with room for its
    worst-case descriptors (`descriptors`, empty outside a plan).
    """

    page_starts: torch.Tensor  # int64 [spaces, capacity]
    page_ends: torch.Tensor  # int64 [spaces, capacity]
    src_starts: torch.Tensor  # int64 [spaces, capacity]
    dst_starts: torch.Tensor  # int64 [spaces, capacity]
    metadata: torch.Tensor  # int64 [NUM_SLOTS + spaces * (num_batches + 1)]
    num_pages: int
    num_batches: int
    batch_pages: int
    block_counts: torch.Tensor  # int64 [spaces, num_blocks]: scratch of the scan
    block_offsets: torch.Tensor  # int64 [spaces, num_blocks]
    block_negatives: torch.Tensor  # int64 [3, num_blocks]
    descriptors: torch.Tensor  # int64 [3 * buffers * capacity]: the expansion's output room

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


_ALIGN = 32  # int64s: every piece starts 256-byte aligned, so its alignment never varies


def _piece_sizes(num_pages: int, num_spaces: int, num_batches: int, num_buffers: int) -> list[int]:
    capacity = max(num_pages, 1)
    num_blocks = PAGES.num_programs(num_pages)
    return [
        NUM_SLOTS + num_spaces * (num_batches + 1),  # metadata
        num_spaces * num_blocks,  # block counts
        num_spaces * num_blocks,  # block offsets
        3 * num_blocks,  # block negatives
        *[num_spaces * capacity] * 4,  # page starts, page ends, src starts, dst starts
        3 * num_buffers * capacity,  # descriptors: at most one per buffer and page
    ]


def workspace_bytes(num_pages: int, num_spaces: int, num_batches: int, num_buffers: int) -> int:
    """Bytes of one plan's workspace: run tables, scan scratch and descriptor room."""
    sizes = _piece_sizes(num_pages, num_spaces, num_batches, num_buffers)
    return 8 * sum(-(-size // _ALIGN) * _ALIGN for size in sizes)


def workspace_pieces(
    workspace: torch.Tensor,
    num_pages: int,
    num_spaces: int,
    num_batches: int,
    batch_pages: int,
    num_buffers: int,
) -> RunTables:
    """The run tables as pieces of `workspace` (uint8, `workspace_bytes` long or more)."""
    words = workspace.view(torch.int64)
    pieces = []
    offset = 0
    for size in _piece_sizes(num_pages, num_spaces, num_batches, num_buffers):
        pieces.append(words[offset : offset + size])
        offset += -(-size // _ALIGN) * _ALIGN
    metadata, counts, offsets, negatives, *tables, descriptors = pieces
    rows = [table.view(num_spaces, -1) for table in tables]
    return RunTables(
        *rows,
        metadata=metadata,
        num_pages=num_pages,
        num_batches=num_batches,
        batch_pages=batch_pages,
        block_counts=counts.view(num_spaces, -1),
        block_offsets=offsets.view(num_spaces, -1),
        block_negatives=negatives,
        descriptors=descriptors,
    )


def launch_group_runs(
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_device_pages: torch.Tensor | None,
    batch_pages: int,
    workspace: torch.Tensor | None = None,
    num_buffers: int = 0,
    target: LaunchTarget | None = None,
) -> RunTables:
    """Group runs for one or two destination spaces: three kernels, no fill, no host read.

    The tables are pieces of `workspace` (room for `num_buffers` buffers'
    descriptors), or of a new one when None. Launches on the current CUDA
    device and stream, through the cached compiled kernels of `target` when
    given: the caller guards the device.
    """
    num_pages = src_pages.numel()
    num_spaces = 1 if dst_device_pages is None else 2
    num_batches = triton.cdiv(num_pages, batch_pages)
    sizes = (num_pages, num_spaces, num_batches)
    if workspace is None:
        workspace = torch.empty(
            workspace_bytes(*sizes, num_buffers), dtype=torch.uint8, device=src_pages.device
        )
    runs = workspace_pieces(workspace, *sizes, batch_pages, num_buffers)
    if num_pages == 0:
        runs.status.fill_(NO_ERROR)
        runs.batch_run_offsets.zero_()
        return runs
    num_blocks = runs.block_counts.shape[1]
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
    variant = (src_pages.dtype, dst_pages.dtype, dst_device.dtype, has_device)
    pages_options = {"HAS_DEVICE": has_device, "BLOCK": PAGES.block}
    launch(
        _count_runs_kernel,
        (num_blocks,),
        variant,
        target,
        (*page_args, runs.block_counts, runs.block_negatives, num_pages, num_blocks, batch_pages),
        pages_options,
        PAGES.num_warps,
    )
    launch(
        _scan_block_counts_kernel,
        (num_spaces,),
        None,
        target,
        (
            runs.block_counts,
            runs.block_negatives,
            runs.block_offsets,
            runs.status,
            runs.batch_run_offsets,
            num_blocks,
            num_batches,
        ),
        {"BLOCK": SCAN.block},
        SCAN.num_warps,
    )
    launch(
        _scatter_runs_kernel,
        (num_blocks,),
        variant,
        target,
        (
            *page_args,
            runs.block_offsets,
            runs.page_starts,
            runs.page_ends,
            runs.src_starts,
            runs.dst_starts,
            runs.batch_run_offsets,
            num_pages,
            num_blocks,
            runs.capacity,
            num_batches,
            batch_pages,
        ),
        pages_options,
        PAGES.num_warps,
    )
    return runs
