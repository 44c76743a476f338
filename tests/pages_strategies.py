"""Hypothesis strategies for fragmented page lists and buffer layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from gpu_planner.testing import fragmented_pages

PAGE_SHAPES = ("random", "contiguous", "fragmented", "single", "empty")


@st.composite
def page_lists(draw, max_pages: int = 300) -> dict[str, np.ndarray]:
    """src, host dst and device dst page lists of one request (equal lengths)."""
    shape = draw(st.sampled_from(PAGE_SHAPES))
    num_pages = {"empty": 0, "single": 1}.get(shape, draw(st.integers(2, max_pages)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    # The highest base keeps every page an int32: a fragmented pool spans at most
    # 5 pages per requested page (gpu_planner.testing.POOL_GAP_MEAN free pages per run).
    base = draw(st.sampled_from([0, 7, 2**20, 2**31 - 5 * max_pages - 1]))
    mean_run = draw(st.sampled_from([1.5, 4.0, 16.0]))
    return {
        name: base + _pages_of_shape(shape, rng, num_pages, mean_run)
        for name in ("src", "dst", "device")
    }


def _pages_of_shape(
    shape: str, rng: np.random.Generator, num_pages: int, mean_run: float
) -> np.ndarray:
    if shape == "contiguous":
        return np.arange(num_pages, dtype=np.int64)
    if shape == "fragmented":  # every page its own run: even pages, shuffled
        return 2 * rng.permutation(num_pages).astype(np.int64)
    return fragmented_pages(num_pages, mean_run, rng)


@st.composite
def layouts(draw, max_buffers: int = 6) -> dict[str, list]:
    """Buffer pointers near 2**47, item lengths, and each buffer's destination space."""
    num_buffers = draw(st.integers(0, max_buffers))
    top = 2**47
    item_lens = draw(st.lists(st.integers(1, 2**16), min_size=num_buffers, max_size=num_buffers))
    src_ptrs = [top - draw(st.integers(0, 2**20)) * 4096 for _ in range(num_buffers)]
    dst_ptrs = [top + draw(st.integers(0, 2**20)) * 4096 for _ in range(num_buffers)]
    dst_is_device = draw(st.lists(st.booleans(), min_size=num_buffers, max_size=num_buffers))
    return {
        "src_ptrs": src_ptrs,
        "dst_ptrs": dst_ptrs,
        "item_lens": item_lens,
        "dst_is_device": dst_is_device,
    }
