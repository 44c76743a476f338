"""Inputs for tests, the benchmark and the demo: page lists as a fragmented allocator gives them.

One generator serves all three, so what the tests check, the benchmark times
and the demo moves are the same kind of request.
"""

from __future__ import annotations

import numpy as np

POOL_GAP_MEAN = 4  # mean free pages between two allocated runs when the pool size is free


def fragmented_pages(
    num_pages: int,
    mean_run: float,
    rng: np.random.Generator,
    pool_pages: int | None = None,
    dtype: np.dtype | type = np.int64,
) -> np.ndarray:
    """`num_pages` distinct pages of a pool, in runs of consecutive pages, as an allocator gives.

    The request is cut into runs of geometric length (mean `mean_run`); the
    runs sit in the pool in random order, with the pool's free pages spread
    between them at random (at least one between two runs when the pool has
    room, so no two runs join). `pool_pages` bounds every page id; by default
    the pool has `POOL_GAP_MEAN` free pages per run on average.

    Example: `fragmented_pages(2048, 8.0, np.random.default_rng(0))` is a
    128k-token request at page size 64 with runs of about 8 pages.
    """
    if num_pages == 0:
        return np.zeros(0, dtype=dtype)
    run_lens = _run_lengths(num_pages, max(mean_run, 1.0), rng)
    num_runs = run_lens.size
    if pool_pages is None:
        pool_pages = num_pages + POOL_GAP_MEAN * num_runs
    free_pages = pool_pages - num_pages
    if free_pages < 0:
        raise ValueError(f"a request of {num_pages} pages does not fit a pool of {pool_pages}")
    # Free pages before each run in pool order, and after the last one.
    gaps = np.zeros(num_runs + 1, dtype=np.int64)
    if free_pages >= num_runs - 1:
        gaps[1:-1] = 1
    gaps += rng.multinomial(free_pages - int(gaps.sum()), np.full(num_runs + 1, 1 / (num_runs + 1)))
    pool_order = rng.permutation(num_runs)  # pool_order[k]: the request's run at pool position k
    pool_lens = run_lens[pool_order] + gaps[:-1]
    pool_starts = np.empty(num_runs, dtype=np.int64)
    pool_starts[pool_order] = np.cumsum(pool_lens) - run_lens[pool_order]
    run_offsets = np.cumsum(run_lens) - run_lens
    within_run = np.arange(num_pages) - np.repeat(run_offsets, run_lens)
    return (np.repeat(pool_starts, run_lens) + within_run).astype(dtype)


def _run_lengths(num_pages: int, mean_run: float, rng: np.random.Generator) -> np.ndarray:
    """Geometric run lengths of mean `mean_run`, the last one cut so they sum to `num_pages`."""
    run_lens = rng.geometric(1.0 / mean_run, size=int(num_pages / mean_run * 1.5) + 16)
    while run_lens.sum() < num_pages:
        run_lens = np.concatenate([run_lens, rng.geometric(1.0 / mean_run, size=run_lens.size)])
    num_runs = int(np.searchsorted(np.cumsum(run_lens), num_pages)) + 1
    run_lens = run_lens[:num_runs].astype(np.int64)
    run_lens[-1] -= int(run_lens.sum()) - num_pages
    return run_lens
