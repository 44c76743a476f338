"""The CUDA path's host logic (staging, events, streams, lifetimes), run on CPU tensors.

Through the host stand-in (`host_cuda`, tests/cuda_standin.py) the real pinned
staging, plan materialisation and `page_indices_async` run as on a GPU: copies
land in pooled pinned blocks and complete only when their event is waited
for. Every result is checked again after later copies, which would reuse a
block handed back too early. The `cuda_path` tests run on a real device too
(`scripts/gpu_check.sh`), with CUDA tensors and the real runtime.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from cuda_standin import one_kernel_at_a_time
from suite_support import list_batches

import gpu_planner as gp
from gpu_planner import pinned_copies, reference
from gpu_planner.block_pool import MIN_BLOCK_BYTES
from gpu_planner.plan import LaunchedPlan
from gpu_planner.testing import fragmented_pages

ITEM_LENS = [4096, 512, 576]


def _layout(num_buffers: int = 3) -> gp.BufferLayout:
    return gp.BufferLayout(
        [(1 << 40) + (b << 32) for b in range(num_buffers)],
        [(1 << 41) + (b << 32) for b in range(num_buffers)],
        ITEM_LENS[:num_buffers],
        dst_is_device=[b % 2 == 1 for b in range(num_buffers)],
    )


def _request(seed: int, num_pages: int = 200) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: fragmented_pages(num_pages, 3.0, rng) for name in ("src", "dst", "device")}


def _launch(
    pages: dict[str, np.ndarray],
    layout: gp.BufferLayout,
    torch_device: torch.device,
    max_batch_pages: int = 0,
) -> gp.TransferPlan:
    def on_device(name: str) -> torch.Tensor:
        return torch.from_numpy(pages[name]).to(torch_device)

    return gp.plan_transfer(
        on_device("src"),
        on_device("dst"),
        layout,
        dst_device_pages=on_device("device"),
        max_batch_pages=max_batch_pages,
        backend="triton",
    )


def _expected(pages: dict[str, np.ndarray], layout: gp.BufferLayout, max_batch_pages: int = 0):
    return reference.plan_batches(
        pages["src"],
        pages["dst"],
        layout.src_ptrs.tolist(),
        layout.dst_ptrs.tolist(),
        layout.item_lens.tolist(),
        layout.dst_is_device.tolist(),
        pages["device"],
        max_batch_pages,
    )


def _batches(plan: gp.TransferPlan) -> list:
    return [tuple(list(column) for column in batch) for batch in list_batches(plan)]


def test_host_copies_keep_their_block_lent_through_every_view(cuda_path):
    """A block comes back only when the last tensor, slice or `.numpy()` made from it is freed."""
    pool = pinned_copies.pinned_pool(max_retained_bytes=MIN_BLOCK_BYTES)  # one free block
    source = torch.arange(64, dtype=torch.int64, device=cuda_path)
    (host,), copied = pinned_copies.copy_into_pool(pool, [source])
    copied.synchronize()
    lent_block_address = host.data_ptr()
    expected = source.cpu().numpy()
    survivors = [  # (what a caller kept, what it must still read)
        (host[10:20], expected[10:20]),
        (host.numpy()[5:], expected[5:]),
        (host[::2].numpy(), expected[::2]),
        (host.view(torch.int32), expected.view(np.int32)),
    ]
    del host
    while survivors:
        gc.collect()
        (other,), other_copied = pinned_copies.copy_into_pool(
            pool, [torch.full((64,), -1, device=cuda_path)]
        )
        other_copied.synchronize()
        assert other.data_ptr() != lent_block_address  # not the block still viewed
        del other
        assert all(np.array_equal(np.asarray(kept), values) for kept, values in survivors)
        survivors.pop(0)
    gc.collect()
    (again,), again_copied = pinned_copies.copy_into_pool(pool, [source])
    again_copied.synchronize()
    assert again.data_ptr() == lent_block_address  # the most recently returned: reused


def test_a_result_read_before_its_event_is_unwritten(host_cuda):
    """The stand-in defers copies to the wait: a reader that skips it would see no data."""
    (host,), copied = pinned_copies.copy_to_host_async([torch.arange(1, 9)])
    assert not copied.query() and host.tolist() != list(range(1, 9))
    copied.synchronize()
    assert copied.query() and host.tolist() == list(range(1, 9))


@pytest.mark.parametrize("max_batch_pages", [0, 64])
def test_two_plans_in_a_row_keep_their_own_descriptors(cuda_path, max_batch_pages):
    layout = _layout()
    first = _request(1)
    second = {name: pages + 1000 for name, pages in first.items()}  # same sizes, other values
    first_plan = _launch(first, layout, cuda_path, max_batch_pages)
    assert isinstance(first_plan._state, LaunchedPlan)  # nothing read back until first used
    first_columns = first_plan.columns
    second_plan = _launch(second, layout, cuda_path, max_batch_pages)
    assert second_plan.num_descriptors > 0
    assert _batches(first_plan) == _expected(first, layout, max_batch_pages)
    assert _batches(second_plan) == _expected(second, layout, max_batch_pages)
    assert first_plan.columns is first_columns
    assert not np.shares_memory(first_plan.columns_array(), second_plan.columns_array())


def test_a_plans_recorded_bounds_error_is_not_lost_to_the_next_plan(cuda_path):
    """The status word lives in the plan's own block: a later read cannot clear it."""
    pages = _request(3)
    narrow = gp.BufferLayout(
        [1 << 40], [1 << 41], [4096], dst_lens=[4096 * int(pages["dst"].max())]
    )
    too_far = gp.plan_transfer(
        torch.from_numpy(pages["src"]).to(cuda_path),
        torch.from_numpy(pages["dst"]).to(cuda_path),
        narrow,
        backend="triton",
    )
    fine = _launch(_request(4), _layout(), cuda_path)
    assert fine.num_descriptors > 0
    with pytest.raises(gp.BoundsError, match="dst"):
        too_far.materialize()


def test_pending_pages_stay_intact_after_later_requests(cuda_path):
    rng = np.random.default_rng(5)
    requests = []
    for _ in range(4):  # as decode serialises them: each read before the next request
        device_slots = torch.from_numpy(rng.permutation(4096)[:300])
        host_slots = torch.from_numpy(rng.permutation(8192)[:300] + 3)
        pending = gp.page_indices_async(
            device_slots.to(cuda_path), host_slots.to(cuda_path), 0, 300, 16
        )
        requests.append((pending.numpy(), device_slots, host_slots))
    for pages, device_slots, host_slots in requests:  # after every later request's copies
        assert pages.device.tolist() == (device_slots[::16] // 16).tolist()
        assert pages.host.tolist() == (host_slots[::16] // 16).tolist()


def test_concurrent_plans_from_eight_threads(cuda_path):
    layout = _layout()
    results: dict[int, tuple] = {}
    failures: list[BaseException] = []
    start = threading.Barrier(8)

    def plan_and_keep(seed: int) -> None:
        try:
            pages = _request(seed, num_pages=120)
            start.wait()
            plan = _launch(pages, layout, cuda_path, max_batch_pages=32)
            plan.materialize()
            results[seed] = (plan, pages)
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            start.abort()  # the others stop waiting for this thread

    threads = [threading.Thread(target=plan_and_keep, args=(seed,)) for seed in range(8)]
    with one_kernel_at_a_time():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert not failures and len(results) == 8
    for plan, pages in results.values():  # every plan checked after all the others' copies
        assert _batches(plan) == _expected(pages, layout, 32)


def test_evicted_blocks_are_unpinned_once(host_cuda):
    pool = pinned_copies.pinned_pool(max_retained_bytes=0)
    (host,), copied = pinned_copies.copy_into_pool(pool, [torch.arange(10)])
    copied.synchronize()
    assert len(host_cuda.pinned) == 1
    del host
    assert pool.retained_bytes == 0 and host_cuda.pinned == {}


def test_pinned_memory_is_unpinned_before_it_is_unmapped_whoever_drops_it(host_cuda):
    """A pool dropped with free blocks, a block outlived by a view: each is unpinned, once,
    while still mapped (a mapping freed pinned makes the next one at its address fail)."""
    pool = pinned_copies.pinned_pool()
    (host,), copied = pinned_copies.copy_into_pool(pool, [torch.arange(10)])
    copied.synchronize()
    del host
    assert pool.retained_bytes > 0 and len(host_cuda.pinned) == 1  # a free block, pinned
    del pool
    gc.collect()
    assert host_cuda.pinned == {}
    block = pinned_copies.allocate_pinned_block(4096)
    view = block.tensor[:8]
    del block
    gc.collect()
    assert list(host_cuda.pinned) == [view.data_ptr()]  # still viewed: mapped and pinned
    view.fill_(7)
    del view
    gc.collect()
    assert host_cuda.pinned == {}
    released = pinned_copies.allocate_pinned_block(4096)
    pinned_copies.release_pinned_block(released)
    assert host_cuda.pinned == {} and released.array.base.unpin.alive is False
