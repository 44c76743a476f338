"""Vectorised NumPy backend: the same pipeline as the Triton kernels, for CPU tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu_planner.layout import BufferLayout


@dataclass
class SpaceRuns:
    """Runs of one destination page space, in page order."""

    page_starts: np.ndarray  # int64: position of each run's first page in the page lists
    starts: np.ndarray  # int64 [2, runs]: first source page, first destination page of each run
    lengths: np.ndarray  # int64: pages per run
    batch_run_offsets: np.ndarray  # int64 [num_batches + 1]: first run of each batch, then total

    @property
    def src_starts(self) -> np.ndarray:
        return self.starts[0]

    @property
    def dst_starts(self) -> np.ndarray:
        return self.starts[1]


def batch_page_count(num_pages: int, max_batch_pages: int) -> int:
    """Pages per batch: the cut size, or all pages when batching is off."""
    return max_batch_pages if 0 < max_batch_pages < num_pages else max(num_pages, 1)


def group_runs(
    src_pages: np.ndarray, dst_pages_per_space: list[np.ndarray], max_batch_pages: int
) -> list[SpaceRuns]:
    """Split the page lists into runs for every destination space (they share `src_pages`)."""
    num_pages = len(src_pages)
    if num_pages == 0:
        empty = np.zeros(0, dtype=np.int64)
        no_runs = SpaceRuns(empty, np.zeros((2, 0), np.int64), empty, np.zeros(1, np.int64))
        return [no_runs for _ in dst_pages_per_space]
    src = src_pages.astype(np.int64, copy=False)
    src_breaks = _steps_not_one(src)
    batch_pages = batch_page_count(num_pages, max_batch_pages)
    batch_starts = np.arange(0, num_pages, batch_pages, dtype=np.int64)
    src_breaks[batch_starts[1:] - 1] = True  # a batch cut always starts a run
    spaces = []
    for dst_pages in dst_pages_per_space:
        dst = dst_pages.astype(np.int64, copy=False)
        breaks = np.flatnonzero(src_breaks | _steps_not_one(dst))
        page_starts = np.empty(len(breaks) + 1, dtype=np.int64)
        page_starts[0] = 0
        np.add(breaks, 1, out=page_starts[1:])
        page_ends = np.append(page_starts[1:], num_pages)
        batch_run_offsets = np.empty(len(batch_starts) + 1, dtype=np.int64)
        batch_run_offsets[:-1] = np.searchsorted(page_starts, batch_starts)
        batch_run_offsets[-1] = len(page_starts)
        spaces.append(
            SpaceRuns(
                page_starts=page_starts,
                starts=np.stack((src[page_starts], dst[page_starts])),
                lengths=page_ends - page_starts,
                batch_run_offsets=batch_run_offsets,
            )
        )
    return spaces


def _steps_not_one(pages: np.ndarray) -> np.ndarray:
    """Where page i + 1 does not follow page i (length n - 1)."""
    return pages[1:] != pages[:-1] + 1


def descriptor_batch_offsets(
    layout: BufferLayout, batch_run_offsets: list[np.ndarray]
) -> np.ndarray:
    """Descriptor offset of each batch (then the total): every buffer adds its space's runs."""
    offsets = layout.num_host_buffers * batch_run_offsets[0]
    if layout.num_device_buffers:
        offsets = offsets + layout.num_device_buffers * batch_run_offsets[1]
    return offsets


def expand_descriptors(
    layout: BufferLayout, spaces: list[SpaceRuns], batch_offsets: np.ndarray, max_batch_pages: int
) -> np.ndarray:
    """Descriptor columns [3, N] (src_addr, dst_addr, length), batch-major, buffer-major.

    Three strategies give the same columns; the cheapest is picked by shape:
    large blocks (one per batch and stretch of same-space buffers) are written
    in place; small pieces are computed per space and gathered with one
    concatenate; with a huge number of pieces (tiny batch limits) every
    descriptor is scattered to its slot, as the Triton kernel does. `batch_offsets`
    is `descriptor_batch_offsets` of these runs.
    """
    columns = np.empty((3, int(batch_offsets[-1])), dtype=np.int64)
    num_batches = len(batch_offsets) - 1
    if not columns.shape[1]:
        return columns
    num_blocks = num_batches * len(layout.segments)
    if columns.shape[1] >= num_blocks * _MIN_IN_PLACE_BLOCK:
        _write_blocks_in_place(columns, batch_offsets, layout, spaces)
    elif num_batches * layout.num_buffers <= _MAX_CONCATENATED_PIECES:
        _concatenate_pieces(columns, layout, spaces)
    else:
        _scatter_descriptors(columns, batch_offsets, layout, spaces, max_batch_pages)
    return columns


# A block written in place costs ~20 us of NumPy calls; gathering costs one more
# pass (~2.5 ns per descriptor). In place wins for blocks of ~8k descriptors.
_MIN_IN_PLACE_BLOCK = 8192
_MAX_CONCATENATED_PIECES = 1 << 17


def _write_blocks_in_place(
    columns: np.ndarray, batch_offsets: np.ndarray, layout: BufferLayout, spaces: list[SpaceRuns]
) -> None:
    """Per batch and stretch of same-space buffers, fill that contiguous block directly."""
    for batch, start in enumerate(batch_offsets[:-1].tolist()):
        for space_id, ranks in layout.segments:
            first, last = spaces[space_id].batch_run_offsets[batch : batch + 2].tolist()
            num_buffers = ranks.stop - ranks.start
            end = start + num_buffers * (last - first)
            block = columns[:, start:end].reshape(3, num_buffers, last - first)
            _fill(block, layout, space_id, ranks, slice(first, last), spaces[space_id])
            start = end


def _concatenate_pieces(columns: np.ndarray, layout: BufferLayout, spaces: list[SpaceRuns]) -> None:
    """Gather each (batch, buffer)'s runs in one concatenate, then scale and offset them all.

    The runs are stacked as (src_start, dst_start, length) rows per space, so a
    piece is a slice and the whole gather is one call; item lengths and
    pointers are repeated per descriptor. A handful of NumPy calls in all,
    whatever the layout: what matters when caches are cold.
    """
    runs = [np.concatenate((space.starts, space.lengths[None])) for space in spaces]
    offsets = [space.batch_run_offsets.tolist() for space in spaces]
    buffer_spaces = layout.space.tolist()
    pieces = [
        runs[space_id][:, offsets[space_id][batch] : offsets[space_id][batch + 1]]
        for batch in range(len(offsets[0]) - 1)
        for space_id in buffer_spaces
    ]
    np.concatenate(pieces, axis=1, out=columns)
    runs_per_batch = np.stack([np.diff(space.batch_run_offsets) for space in spaces])
    counts = runs_per_batch[layout.space].T.ravel()  # descriptors per (batch, buffer) piece
    num_batches = runs_per_batch.shape[1]
    columns *= np.repeat(np.tile(layout.item_lens, num_batches), counts)
    ptrs = np.stack((layout.src_ptrs, layout.dst_ptrs))
    columns[:2] += np.repeat(np.tile(ptrs, num_batches), counts, axis=1)


def _fill(
    block: np.ndarray,
    layout: BufferLayout,
    space_id: int,
    ranks: slice,
    runs: slice,
    space: SpaceRuns,
) -> None:
    """block[:, b, r] = (src_addr, dst_addr, length) of space buffer `ranks[b]`, run `runs[r]`."""
    item_lens = layout.space_item_lens[space_id][ranks]
    ptrs = layout.space_ptrs[space_id][:, ranks]
    np.multiply(space.starts[:, None, runs], item_lens[None, :, None], out=block[:2])
    block[:2] += ptrs[:, :, None]
    np.multiply(space.lengths[runs], item_lens[:, None], out=block[2])


def _scatter_descriptors(
    columns: np.ndarray,
    batch_offsets: np.ndarray,
    layout: BufferLayout,
    spaces: list[SpaceRuns],
    max_batch_pages: int,
) -> None:
    """Write every (buffer, run) descriptor at its slot, computed as the Triton kernel does."""
    num_pages = int(spaces[0].page_starts[-1] + spaces[0].lengths[-1])
    batch_pages = batch_page_count(num_pages, max_batch_pages)
    runs_per_batch = [np.diff(space.batch_run_offsets) for space in spaces]
    for space_id, space in enumerate(spaces):
        buffers = layout.space_buffers[space_id]
        if not buffers.size:
            continue
        run_batch = space.page_starts // batch_pages
        run_in_batch = np.arange(len(space.page_starts)) - space.batch_run_offsets[run_batch]
        slots = batch_offsets[run_batch] + run_in_batch
        slots = slots + np.outer(layout.host_before[buffers], runs_per_batch[0][run_batch])
        if len(spaces) > 1:
            slots += np.outer(layout.device_before[buffers], runs_per_batch[1][run_batch])
        values = np.empty((3, *slots.shape), dtype=np.int64)
        _fill(values, layout, space_id, slice(None), slice(None), space)
        columns[:, slots.ravel()] = values.reshape(3, -1)


def first_bounds_violation(
    layout: BufferLayout, spaces: list[SpaceRuns]
) -> tuple[int, str, int, int] | None:
    """First (buffer, side, page_start, num_pages) reaching past a registered length.

    Order: buffer in layout order, then run in page order, destination side
    first: the order the Triton kernel's atomic-min key encodes.
    """
    if not layout.has_bounds:
        return None
    limits = {"dst": layout.bound_limits("dst"), "src": layout.bound_limits("src")}
    first_buffer = None
    for space_id, space in enumerate(spaces):
        buffers = layout.space_buffers[space_id]
        if not buffers.size or not space.lengths.size:
            continue
        items = layout.item_lens[buffers]
        bad = np.zeros(buffers.size, dtype=bool)
        for side, starts in (("dst", space.dst_starts), ("src", space.src_starts)):
            bad |= int((starts + space.lengths).max()) * items > limits[side][buffers]
        if bad.any():
            candidate = int(buffers[bad][0])
            first_buffer = candidate if first_buffer is None else min(first_buffer, candidate)
    if first_buffer is None:
        return None
    space = spaces[int(layout.space[first_buffer])]
    item_len = int(layout.item_lens[first_buffer])
    over = {
        side: (starts + space.lengths) * item_len > limits[side][first_buffer]
        for side, starts in (("dst", space.dst_starts), ("src", space.src_starts))
    }
    run = int(np.flatnonzero(over["dst"] | over["src"])[0])
    side = "dst" if over["dst"][run] else "src"
    starts = space.dst_starts if side == "dst" else space.src_starts
    return first_buffer, side, int(starts[run]), int(space.lengths[run])
