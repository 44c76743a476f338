"""Compiled CPU backend: the planner's two passes as Numba loops, for CPU tensors.

`_scan_pages` checks the pages, walks each space's page lists once to find its
runs and batch cuts, checks that every descriptor ends inside its buffer and
counts the descriptors; `_expand` then writes every (src_addr, dst_addr,
length) once. Errors go into the planner's status word (`gpu_planner/status.py`),
so both backends decode and raise them alike. Two compiled passes replace a
NumPy version's dozens of calls and passes over the descriptor columns, which
is what matters with caches left cold by a scheduler loop (docs/design.md).
Numba is already a dependency of sglang. Arrays are allocated by NumPy, which
backs large ones with huge pages (faster to first touch than Numba's allocator).
"""

from __future__ import annotations

import numpy as np

from gpu_planner.descriptors import HostDescriptors
from gpu_planner.inputs import (
    PageList,
    as_host_array,
    raise_recorded_negative_page,
)
from gpu_planner.jit import compiled
from gpu_planner.layout import DEVICE_SPACE, HOST_SPACE, BufferLayout
from gpu_planner.status import (
    DST_SIDE,
    NO_ERROR,
    OUT_OF_BOUNDS,
    SRC_SIDE,
    new_status_array,
    out_of_bounds_key,
    recorded_out_of_bounds,
)

_DESCRIPTORS = 2  # the row of `counts` that holds descriptor offsets
_out_of_bounds_key = compiled(out_of_bounds_key)


@compiled
def _first_negative(pages):
    """Position of the first negative page, or NO_ERROR."""
    for position in range(pages.shape[0]):
        if pages[position] < 0:
            return position
    return NO_ERROR


@compiled
def _scan_runs(src_pages, dst_pages, batch_pages, table, batch_run_offsets):
    """Fill `table` (room for one run per page) and `batch_run_offsets`; return the run count.

    A run starts at page 0, at every batch cut, and wherever the source or the
    destination page does not follow the previous one. Divides only at cuts.
    """
    num_runs = 0
    next_cut = 0
    next_src = next_dst = 0  # the pages that would extend the current run
    for page in range(src_pages.shape[0]):
        src = src_pages[page]
        dst = dst_pages[page]
        if page != next_cut and src == next_src and dst == next_dst:
            table[2, num_runs - 1] += 1
        else:
            if page == next_cut:
                batch_run_offsets[page // batch_pages] = num_runs
                next_cut += batch_pages
            table[0, num_runs] = src
            table[1, num_runs] = dst
            table[2, num_runs] = 1
            num_runs += 1
        next_src = src + 1
        next_dst = dst + 1
    batch_run_offsets[-1] = num_runs
    return num_runs


@compiled
def _first_out_of_bounds(table, num_runs, capacity, in_space, item_lens, src_limits, dst_limits):
    """Status key of the first run of `table` past a buffer `in_space`, or NO_ERROR.

    A run over pages [start, last] fits a buffer's side when `last < limit //
    item_len` (`BufferLayout.byte_limits`): no product or sum here can overflow.
    One pass finds each side's last page; only a buffer that fails walks its runs.
    """
    src_last = dst_last = -1
    for run in range(num_runs):
        src_last = max(src_last, table[0, run] + table[2, run] - 1)
        dst_last = max(dst_last, table[1, run] + table[2, run] - 1)
    for buffer in range(item_lens.shape[0]):
        src_fit = src_limits[buffer] // item_lens[buffer]
        dst_fit = dst_limits[buffer] // item_lens[buffer]
        if in_space[buffer] and (src_last >= src_fit or dst_last >= dst_fit):
            for run in range(num_runs):
                last_offset = table[2, run] - 1
                dst_over = table[1, run] + last_offset >= dst_fit
                if dst_over or table[0, run] + last_offset >= src_fit:
                    side = DST_SIDE if dst_over else SRC_SIDE
                    return _out_of_bounds_key(buffer, run, capacity, side)
    return NO_ERROR


@compiled
def _scan_pages(
    pages, batch_pages, dst_is_device, item_lens, src_limits, dst_limits, tables, counts, status
):
    """Runs of every space into `tables` [2, 3, pages], offsets into `counts`, errors into `status`.

    `pages` [1 + spaces, n] holds the source pages, then each space's destination
    pages. `counts[space]` gets each batch's first run of that space, then its total
    (a single space fills both rows); `counts[_DESCRIPTORS]` gets each batch's
    first descriptor, then N. `status` is the kernels' status word: the first
    negative page of each argument (then nothing else is done), and the first
    descriptor past its buffer. Returns whether it recorded an error.
    """
    negative = False
    for argument in range(pages.shape[0]):
        status[argument] = _first_negative(pages[argument])
        negative |= status[argument] != NO_ERROR
    if negative:
        return True
    num_spaces = pages.shape[0] - 1
    capacity = tables.shape[2]
    for space in range(num_spaces):
        num_runs = _scan_runs(pages[0], pages[1 + space], batch_pages, tables[space], counts[space])
        in_space = dst_is_device == (space == DEVICE_SPACE)
        key = _first_out_of_bounds(
            tables[space], num_runs, capacity, in_space, item_lens, src_limits, dst_limits
        )
        status[OUT_OF_BOUNDS] = min(status[OUT_OF_BOUNDS], key)
    if num_spaces == 1:
        counts[DEVICE_SPACE] = counts[HOST_SPACE]
    num_device_buffers = dst_is_device.sum()
    num_host_buffers = dst_is_device.shape[0] - num_device_buffers
    for batch in range(counts.shape[1]):
        counts[_DESCRIPTORS, batch] = (
            num_host_buffers * counts[HOST_SPACE, batch]
            + num_device_buffers * counts[DEVICE_SPACE, batch]
        )
    return status[OUT_OF_BOUNDS] != NO_ERROR


@compiled
def _expand(tables, counts, dst_is_device, src_ptrs, dst_ptrs, item_lens, columns):
    """columns[:, slot] for every (batch, buffer, run), in that order; one write per value.

    Each buffer's piece is three loops over contiguous rows, which LLVM vectorises.
    """
    out_srcs, out_dsts, out_lens = columns[0], columns[1], columns[2]
    slot = 0
    for batch in range(counts.shape[1] - 1):
        for buffer in range(dst_is_device.shape[0]):
            space = DEVICE_SPACE if dst_is_device[buffer] else HOST_SPACE
            first, end = counts[space, batch], counts[space, batch + 1]
            count = end - first
            src_starts = tables[space, 0, first:end]
            dst_starts = tables[space, 1, first:end]
            lengths = tables[space, 2, first:end]
            srcs = out_srcs[slot : slot + count]
            dsts = out_dsts[slot : slot + count]
            lens = out_lens[slot : slot + count]
            item_len, src_ptr, dst_ptr = item_lens[buffer], src_ptrs[buffer], dst_ptrs[buffer]
            for run in range(count):
                srcs[run] = src_ptr + src_starts[run] * item_len
            for run in range(count):
                dsts[run] = dst_ptr + dst_starts[run] * item_len
            for run in range(count):
                lens[run] = lengths[run] * item_len
            slot += count


_NO_BUFFERS = BufferLayout([], [], [])


def _scan(
    pages: dict[str, PageList], batch_pages: int, layout: BufferLayout
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_scan_pages` on the page lists, stacked in host memory; raise for a negative page.

    Returns (tables, counts, the status word where it recorded an out-of-bounds
    descriptor, else None).
    """
    page_lists = list(pages.values())
    num_pages = len(page_lists[0])
    # One int64 row per page list, copied row by row in C (np.stack is Python code).
    stacked = np.empty((len(page_lists), num_pages), dtype=np.int64)
    for row, values in enumerate(page_lists):
        stacked[row] = as_host_array(values)
    tables = np.empty((2, 3, max(num_pages, 1)), dtype=np.int64)
    counts = np.empty((3, -(-num_pages // batch_pages) + 1), dtype=np.int64)
    status = new_status_array()
    src_limits, dst_limits = layout.byte_limits("src"), layout.byte_limits("dst")
    failed = _scan_pages(
        stacked, batch_pages, layout.dst_is_device, layout.item_lens, src_limits, dst_limits,
        tables, counts, status,
    )  # fmt: skip
    if not failed:
        return tables, counts, None
    raise_recorded_negative_page(status, stacked)
    return tables, counts, status


def group_runs(pages: dict[str, PageList], batch_pages: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each destination space's (run table, batch run offsets), in page order.

    `pages` maps argument names to validated page lists: the source pages,
    then one destination array per space. A run table is int64 [3, runs]:
    first source page, first destination page, pages; the offsets are the
    first run of each batch, then the total.
    """
    tables, counts, _ = _scan(pages, batch_pages, _NO_BUFFERS)
    return [
        (tables[space, :, : counts[space, -1]], counts[space]) for space in range(len(pages) - 1)
    ]


def plan_descriptors(
    layout: BufferLayout, pages: dict[str, PageList], batch_pages: int
) -> HostDescriptors:
    """Plan one request; raise for a negative page or a descriptor past its buffer.

    `pages` maps argument names (src_pages, dst_pages and, for layouts with
    device-backed buffers, dst_device_pages) to validated page lists.
    """
    tables, counts, status = _scan(pages, batch_pages, layout)
    num_spaces = len(pages) - 1
    if status is not None:  # a descriptor past its buffer
        buffer, run, side = recorded_out_of_bounds(status, tables.shape[2])
        space_runs = tables[layout.space[buffer]]
        page_start = int(space_runs[0 if side == "src" else 1, run])
        raise layout.bounds_error(buffer, side, page_start, int(space_runs[2, run]))
    columns = np.empty((3, counts[_DESCRIPTORS, -1]), dtype=np.int64)
    _expand(
        tables, counts, layout.dst_is_device, layout.src_ptrs, layout.dst_ptrs, layout.item_lens,
        columns,
    )  # fmt: skip
    return HostDescriptors(columns, counts[_DESCRIPTORS], list(counts[:num_spaces]))


def compile_kernels() -> None:
    """Compile the kernels now (or load them from Numba's cache), so no request waits for it.

    Every call site passes contiguous int64/bool arrays, so one signature per
    kernel serves all inputs.
    """
    pages = np.arange(2, dtype=np.int64)
    plan_descriptors(_NO_BUFFERS, {"src_pages": pages, "dst_pages": pages}, batch_pages=2)
