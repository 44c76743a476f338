"""The block pool: give-back without a lock, a byte cap, least-recently-used eviction.

The pool's bookkeeping is the same for any host memory, so these run on plain
host blocks; pinned staging is checked in test_staging.py and test_cuda_host_path.py.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import torch

from gpu_planner.block_pool import MIN_BLOCK_BYTES, Block, BlockPool


class HostMemory:
    """Plain host blocks, with a record of every block the pool releases."""

    def __init__(self) -> None:
        self.released: list[Block] = []

    def allocate(self, nbytes: int) -> Block:
        array = np.zeros(nbytes, dtype=np.uint8)
        return Block(array, torch.from_numpy(array))

    def release(self, block: Block) -> None:
        self.released.append(block)


class CopyEvent:
    """The part of a CUDA event the pool reads: whether its copy has completed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _lend(pool: BlockPool, nbytes: int, ready=None) -> tuple[Block, np.ndarray]:
    """Take a block as a copy does: the loan's death (its last view's) gives it back."""
    block = pool.take(nbytes)
    return block, pool.lend(block, ready)


def test_give_back_during_a_collection_under_the_pool_lock_does_not_deadlock():
    """A collection while `take` holds the lock runs the give-back: it must not wait on it."""
    pool = BlockPool(1 << 30, allocate=HostMemory().allocate)
    _, view = _lend(pool, 100)
    cycle = [view]
    cycle.append(cycle)  # only a garbage collection frees the view
    del view, cycle
    finished = threading.Event()

    def collect_under_the_lock() -> None:
        with pool._lock:  # where `take` is when a collection happens to run
            gc.collect()
        finished.set()

    worker = threading.Thread(target=collect_under_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert finished.is_set(), "the give-back waited on the pool's own lock"
    assert pool.retained_bytes == MIN_BLOCK_BYTES


def test_retained_bytes_are_capped_and_the_least_recently_used_go_first():
    memory = HostMemory()
    pool = BlockPool(48 << 10, allocate=memory.allocate, release=memory.release)
    huge, view = _lend(pool, 1 << 20)  # one huge plan
    del view
    assert pool.retained_bytes == 0 and memory.released == [huge]  # over the cap alone

    first, first_view = _lend(pool, 16 << 10)
    second, second_view = _lend(pool, 16 << 10)
    third, third_view = _lend(pool, 32 << 10)
    del first_view, second_view, third_view  # returned in this order: first is least recent
    assert pool.retained_bytes == 48 << 10
    assert memory.released == [huge, first]
    assert pool.take(10 << 10) is second  # the smallest free block that fits


def test_a_block_is_reused_only_after_its_copy_completed():
    pool = BlockPool(1 << 30, allocate=HostMemory().allocate)
    copying = CopyEvent()
    block, view = _lend(pool, 100, copying)
    del view  # dropped unread while its copy may still be writing
    assert pool.take(100) is not block
    copying.done = True
    assert pool.take(100) is block


def test_a_borrowed_block_comes_back_when_its_last_view_is_freed():
    pool = BlockPool(MIN_BLOCK_BYTES)  # keeps one free block: the last returned
    borrowed = pool.borrow(96)
    addresses = borrowed.view(np.int64)[2:5]  # what a running engine call would hold
    address = borrowed.ctypes.data
    del borrowed
    assert pool.borrow(96).ctypes.data != address  # still viewed: not lent again
    del addresses
    assert pool.borrow(96).ctypes.data == address


def test_a_loan_alive_at_exit_is_not_given_back_during_exit_hooks():
    """At exit daemon threads may still use a loan: its block must not be lent again then."""
    script = textwrap.dedent(
        """
        import atexit
        import weakref

        # Registered before any finalizer exists: it runs after weakref's own exit hook.
        assert not weakref.finalize._registered_with_atexit

        def lend_again_at_exit():
            print("re-lent" if pool.take(100) is block else "kept", flush=True)

        atexit.register(lend_again_at_exit)

        from gpu_planner.block_pool import BlockPool

        pool = BlockPool(1 << 20)
        block = pool.take(100)
        loan = pool.lend(block, None)  # a global: alive until after the exit hooks
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "kept"
