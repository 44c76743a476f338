"""Benchmark inputs: one case's parameters and the page lists a fragmented allocator hands out.

Every planner of a run plans the same `BenchInput`: the pages are generated once per
case from a seed, never per planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BYTES_PER_TOKEN = 1152  # one MLA layer at bf16: (512 + 64) * 2 bytes per token
BUFFER_STRIDE = 1 << 40  # address gap between two buffers' (unbacked) base addresses
SRC_BASE = 0x1000_0000_0000
DST_BASE = 0x4000_0000_0000
POOL_GAP_MEAN = 4.0  # mean free pages between two allocated runs in the pool


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One point of the sweep."""

    tokens: int
    page_size: int
    buffers: int
    mean_run: float
    device_share: float
    batch_pages: int

    @property
    def num_pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def label(self) -> str:
        return (
            f"tok={self.tokens // 1024}k page={self.page_size} bufs={self.buffers} "
            f"run={self.mean_run:g} dev={self.device_share:g} batch={self.batch_pages}"
        )


@dataclasses.dataclass(frozen=True)
class BenchInput:
    """Pages and buffer layout of one case, as NumPy arrays shared by every planner."""

    case: BenchCase
    src_pages: np.ndarray
    host_dst_pages: np.ndarray
    device_dst_pages: np.ndarray | None
    src_ptrs: list[int]
    dst_ptrs: list[int]
    item_lens: list[int]
    dst_is_device: list[bool]


def fragmented_pages(num_pages: int, mean_run: float, rng: np.random.Generator) -> np.ndarray:
    """Pages of one request from a fragmented pool, as an allocator would return them.

    The request gets runs of consecutive pages with geometric lengths of mean
    `mean_run`; the runs sit in the pool in random order separated by at least one
    free page, so no two runs of the request join into one.
    """
    if num_pages == 0:
        return np.zeros(0, dtype=np.int32)
    run_lens = rng.geometric(1.0 / mean_run, size=int(num_pages / mean_run * 1.5) + 16)
    while run_lens.sum() < num_pages:
        run_lens = np.concatenate([run_lens, rng.geometric(1.0 / mean_run, size=run_lens.size)])
    num_runs = int(np.searchsorted(np.cumsum(run_lens), num_pages)) + 1
    run_lens = run_lens[:num_runs]
    run_lens[-1] -= int(run_lens.sum()) - num_pages
    pool_order = rng.permutation(num_runs)
    gaps = rng.geometric(1.0 / POOL_GAP_MEAN, size=num_runs)
    pool_lens = run_lens[pool_order] + gaps
    pool_starts = np.empty(num_runs, dtype=np.int64)
    pool_starts[pool_order] = np.cumsum(pool_lens) - pool_lens
    run_offsets = np.cumsum(run_lens) - run_lens
    within_run = np.arange(num_pages) - np.repeat(run_offsets, run_lens)
    pages = np.repeat(pool_starts, run_lens) + within_run
    return pages.astype(np.int32)


def device_buffer_mask(buffers: int, device_share: float) -> list[bool]:
    """Spread round(share * buffers) device-backed buffers evenly over the layout."""
    return [int((b + 1) * device_share) > int(b * device_share) for b in range(buffers)]


def make_input(case: BenchCase, seed: int) -> BenchInput:
    """Generate the pages and layout of `case`; the same seed gives the same arrays."""
    rng = np.random.default_rng([seed, case.tokens, case.page_size, int(case.mean_run * 1000)])
    num_pages = case.num_pages
    src_pages = fragmented_pages(num_pages, case.mean_run, rng)
    host_dst_pages = fragmented_pages(num_pages, case.mean_run, rng)
    is_device = device_buffer_mask(case.buffers, case.device_share)
    device_dst_pages = fragmented_pages(num_pages, case.mean_run, rng) if any(is_device) else None
    item_len = case.page_size * BYTES_PER_TOKEN
    return BenchInput(
        case=case,
        src_pages=src_pages,
        host_dst_pages=host_dst_pages,
        device_dst_pages=device_dst_pages,
        src_ptrs=[SRC_BASE + b * BUFFER_STRIDE for b in range(case.buffers)],
        dst_ptrs=[DST_BASE + b * BUFFER_STRIDE for b in range(case.buffers)],
        item_lens=[item_len] * case.buffers,
        dst_is_device=is_device,
    )
