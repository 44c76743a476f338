"""The HiSparse bug class: device-backed buffers planned with host page ids.

Decode's host-backed and device-backed buffers take page ids from different
allocators. Planning a device buffer with host pages writes other pages (the
silent corruption); with registered lengths the bounds check refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_planner as gp
from gpu_planner.testing import fragmented_pages

NUM_PAGES = 256
ITEM_LEN = 64
DEVICE_POOL_PAGES = 2 * NUM_PAGES  # the pool every request's fragmented pages come from
HOST_POOL_PAGES = 8 * NUM_PAGES


def request_pages(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "src_pages": fragmented_pages(NUM_PAGES, 8.0, rng, DEVICE_POOL_PAGES),
        "dst_pages": HOST_POOL_PAGES
        - DEVICE_POOL_PAGES
        + fragmented_pages(NUM_PAGES, 8.0, rng, DEVICE_POOL_PAGES),
        "dst_device_pages": fragmented_pages(NUM_PAGES, 8.0, rng, DEVICE_POOL_PAGES),
    }


def hisparse_layout(with_lengths: bool) -> gp.BufferLayout:
    """Four buffers, the last two device-backed, each in its own 2**40-spaced region."""
    pools = [HOST_POOL_PAGES, HOST_POOL_PAGES, DEVICE_POOL_PAGES, DEVICE_POOL_PAGES]
    lengths = {}
    if with_lengths:
        lengths = {
            "src_lens": [2 * NUM_PAGES * ITEM_LEN] * 4,
            "dst_lens": [pages * ITEM_LEN for pages in pools],
        }
    return gp.BufferLayout(
        src_ptrs=[(1 + b) << 40 for b in range(4)],
        dst_ptrs=[(5 + b) << 40 for b in range(4)],
        item_lens=[ITEM_LEN] * 4,
        dst_is_device=[False, False, True, True],
        **lengths,
    )


def written_ranges(plan: gp.TransferPlan) -> set[tuple[int, int]]:
    return {
        (dst, dst + length)
        for dst, length in zip(plan.dst_addrs.tolist(), plan.lengths.tolist(), strict=True)
    }


def test_host_pages_for_device_buffers_write_elsewhere(backend_device):
    backend, device = backend_device
    pages = {k: torch.from_numpy(v).to(device) for k, v in request_pages(1).items()}
    layout = hisparse_layout(with_lengths=False)
    right = gp.plan_transfer(layout=layout, backend=backend, **pages)
    wrong = gp.plan_transfer(
        pages["src_pages"],
        pages["dst_pages"],
        layout,
        dst_device_pages=pages["dst_pages"],
        backend=backend,
    )
    device_region = 7 << 40
    right_device = {r for r in written_ranges(right) if r[0] >= device_region}
    wrong_device = {r for r in written_ranges(wrong) if r[0] >= device_region}
    assert right_device != wrong_device  # the wrong space silently targets other pages
    host_region = {r for r in written_ranges(right) if r[0] < device_region}
    assert host_region == {r for r in written_ranges(wrong) if r[0] < device_region}


def test_bounds_check_rejects_host_pages_for_device_buffers(backend_device):
    backend, device = backend_device
    pages = {k: torch.from_numpy(v).to(device) for k, v in request_pages(2).items()}
    layout = hisparse_layout(with_lengths=True)
    assert gp.plan_transfer(layout=layout, backend=backend, **pages).num_descriptors > 0
    with pytest.raises(gp.BoundsError, match=r"buffer 2: dst pages .* device-backed"):
        gp.plan_transfer(
            pages["src_pages"],
            pages["dst_pages"],
            layout,
            dst_device_pages=pages["dst_pages"],
            backend=backend,
        ).materialize()
