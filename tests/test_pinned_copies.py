"""Pinned staging: mixed devices are refused; on CUDA, exact copies and unpinned evictions."""

from __future__ import annotations

import pytest
import torch
from suite_support import ON_CUDA

from gpu_planner.block_pool import Block, BlockPool
from gpu_planner.cuda_streams import torch_device_of
from gpu_planner.errors import PlanValidationError


def test_mixed_torch_devices_are_a_clear_error():
    with pytest.raises(PlanValidationError, match="must share a torch device"):
        torch_device_of([torch.zeros(1), torch.zeros(1, device="meta")])


@pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (the host-memory twins above run)")
def test_cuda_staging_copies_exactly_and_unpins_evicted_blocks():
    from gpu_planner.pinned_copies import (
        allocate_pinned_block,
        copy_into_pool,
        release_pinned_block,
    )

    released = []

    def release(block: Block) -> None:
        released.append(block.nbytes)
        release_pinned_block(block)

    pool = BlockPool(1 << 16, allocate_pinned_block, release)
    source = torch.arange(1 << 16, device="cuda")
    (host,), copied = copy_into_pool(pool, [source])
    copied.synchronize()
    assert torch.equal(host, source.cpu())
    del host
    pool.take(1)  # takes the returned block in, over the cap: unpinned
    assert released == [1 << 19]
    for _ in range(64):  # each dropped block unpinned before unmapped: its address pins again
        assert allocate_pinned_block(4096).tensor.is_pinned()
