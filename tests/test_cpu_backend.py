"""The compiled CPU backend: plans from concurrent threads, and inputs beyond hypothesis sizes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from suite_support import list_batches
from test_plan import expected_batches, plan

from gpu_planner.testing import fragmented_pages


def _case(seed: int, num_pages: int, num_buffers: int) -> tuple[dict, dict, int]:
    rng = np.random.default_rng(seed)
    pages = {name: fragmented_pages(num_pages, 4.0, rng) for name in ("src", "dst", "device")}
    layout = {
        "src_ptrs": (rng.integers(1, 2**40, num_buffers) + 2**46).tolist(),
        "dst_ptrs": (rng.integers(1, 2**40, num_buffers) + 2**46).tolist(),
        "item_lens": rng.integers(1, 4096, num_buffers).tolist(),
        "dst_is_device": (rng.random(num_buffers) < 0.5).tolist(),
    }
    return pages, layout, int(rng.choice([0, 5, 64, 1000]))


def test_concurrent_plans_from_threads_match_reference():
    # The kernels release the GIL (nogil): sender threads plan at the same time.
    cases = [_case(seed, num_pages=3000, num_buffers=8) for seed in range(8)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        plans = list(pool.map(lambda case: plan(*case, "cpu", "cpu"), cases))
    for result, (pages, layout, max_batch_pages) in zip(plans, cases, strict=True):
        assert list_batches(result) == expected_batches(pages, layout, max_batch_pages)


def test_large_plan_matches_reference():
    # 2^17 pages: far more runs per space than hypothesis draws, with batch cuts.
    pages, layout, _ = _case(seed=11, num_pages=1 << 17, num_buffers=3)
    result = plan(pages, layout, 4096, "cpu", "cpu")
    assert list_batches(result) == expected_batches(pages, layout, 4096)


def test_one_compiled_signature_serves_every_input_kind():
    # A compile per dtype or layout would stall a request for seconds: every call
    # site must hand the kernels contiguous int64 arrays. Fresh process, no cache.
    script = """
import numpy as np, torch
import gpu_planner as gp
from gpu_planner import cpu_backend
cpu_backend.compile_kernels()
layout = gp.BufferLayout([1 << 40, 1 << 41], [1 << 42, 1 << 43], [64, 128], dst_is_device=[0, 1],
                         src_lens=[1 << 20, 1 << 20], dst_lens=[1 << 20, 1 << 20])
pages32 = torch.arange(20, dtype=torch.int32)[::2]
pages64 = np.arange(100, 110, dtype=np.uint16)
gp.plan_transfer(pages32, pages64, layout, dst_device_pages=pages32.numpy(), max_batch_pages=3)
gp.group_runs(pages64, pages32)
print(len(cpu_backend._scan_pages.signatures), len(cpu_backend._expand.signatures))
"""
    environment = {**os.environ, "NUMBA_CACHE_DIR": tempfile.mkdtemp()}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, check=True
    )
    assert result.stdout.split() == ["1", "1"]
