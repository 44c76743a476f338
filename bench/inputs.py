"""Benchmark inputs: one case's parameters and the page lists a fragmented allocator hands out.

Every planner of a run plans the same `BenchInput`: the pages are generated once per
case from a seed, never per planner.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gpu_planner.testing import fragmented_pages

BYTES_PER_TOKEN = 1152  # one MLA layer at bf16: (512 + 64) * 2 bytes per token
BUFFER_STRIDE = 1 << 40  # address gap between two buffers' (unbacked) base addresses
SRC_BASE = 0x1000_0000_0000
DST_BASE = 0x4000_0000_0000


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
    dst_pages: np.ndarray
    dst_device_pages: np.ndarray | None
    src_ptrs: list[int]
    dst_ptrs: list[int]
    item_lens: list[int]
    dst_is_device: list[bool]


def device_buffer_mask(buffers: int, device_share: float) -> list[bool]:
    """Spread round(share * buffers) device-backed buffers evenly over the layout."""
    return [int((b + 1) * device_share) > int(b * device_share) for b in range(buffers)]


def make_input(case: BenchCase, seed: int) -> BenchInput:
    """Generate the pages and layout of `case`; the same seed gives the same arrays."""
    rng = np.random.default_rng([seed, case.tokens, case.page_size, int(case.mean_run * 1000)])
    num_pages = case.num_pages
    src_pages = fragmented_pages(num_pages, case.mean_run, rng, dtype=np.int32)
    dst_pages = fragmented_pages(num_pages, case.mean_run, rng, dtype=np.int32)
    is_device = device_buffer_mask(case.buffers, case.device_share)
    dst_device_pages = (
        fragmented_pages(num_pages, case.mean_run, rng, dtype=np.int32) if any(is_device) else None
    )
    item_len = case.page_size * BYTES_PER_TOKEN
    return BenchInput(
        case=case,
        src_pages=src_pages,
        dst_pages=dst_pages,
        dst_device_pages=dst_device_pages,
        src_ptrs=[SRC_BASE + b * BUFFER_STRIDE for b in range(case.buffers)],
        dst_ptrs=[DST_BASE + b * BUFFER_STRIDE for b in range(case.buffers)],
        item_lens=[item_len] * case.buffers,
        dst_is_device=is_device,
    )
