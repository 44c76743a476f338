"""Reusable host byte blocks, lent so that no block is handed out twice.

A block is taken from the pool and lent as a NumPy array whose base is a
fresh `_Loan` object, so every view, slice, `torch.from_numpy` tensor and
`.numpy()` array made from it keeps that loan alive (NumPy and torch both
hold their base). The block goes back to the pool only when the last of them
is freed, and is reused only once the event of its last write (a device
copy, for pinned staging) has completed. A block is therefore never
overwritten while anything handed out from it is alive, whoever holds it and
in whatever form: a plan's columns, a page list sglang serialises, the
addresses a running Mooncake call reads.

The give-back runs in a `weakref.finalize` callback, so at any point of any
thread, including inside a garbage collection while the pool's lock is held:
it only appends to a deque (atomic, no lock, no wait); not at interpreter
exit, where daemon threads may still use a live loan. The lock-holding
`take` drains that deque. Free blocks are kept up to `max_retained_bytes`;
beyond it the least recently used are released first (by the next `take`,
outside the lock).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MIN_BLOCK_BYTES = 4096


@dataclass(eq=False)
class Block:
    """A host byte block: `array` owns the memory, `tensor` views it."""

    array: np.ndarray  # uint8 [nbytes]
    tensor: torch.Tensor  # uint8 [nbytes], same memory

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def host_block(nbytes: int) -> Block:
    """A block of plain (pageable) host memory."""
    array = np.empty(nbytes, dtype=np.uint8)
    return Block(array, torch.from_numpy(array))


def byte_array_interface(address: int, nbytes: int) -> dict:
    """The `__array_interface__` of `nbytes` writable bytes at `address`: an object carrying it
    becomes the base of the uint8 arrays `np.asarray` makes of it (it keeps them alive)."""
    return {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


class _Loan:
    """One loan of a block: NumPy arrays made from it have it as their base.

    Its death (that of the last array, view, tensor or `.numpy()` made from
    it) gives the block back. It holds the block, so the memory outlives it.
    """

    def __init__(self, block: Block) -> None:
        self.block = block
        self.__array_interface__ = byte_array_interface(block.array.ctypes.data, block.nbytes)


def _block_bytes(nbytes: int) -> int:
    """`nbytes` rounded up to one of 8 size classes per power of two (at most 25% more)."""
    granule = max(1 << max(nbytes.bit_length() - 3, 0), MIN_BLOCK_BYTES)
    return -(-max(nbytes, 1) // granule) * granule


class BlockPool:
    """Host byte blocks in size classes, lent out and recycled.

    `allocate`/`release` make and free a block: pinned memory for the
    planner's staging, plain memory for head-sliced descriptor addresses (and
    for the tests). At most `max_retained_bytes` of free blocks are kept.
    """

    def __init__(
        self,
        max_retained_bytes: int,
        allocate: Callable[[int], Block] = host_block,
        release: Callable[[Block], None] = lambda block: None,
    ) -> None:
        self.max_retained_bytes = max_retained_bytes
        self._allocate = allocate
        self._release = release
        self._free: list[Block] = []  # least recently used first
        self._in_flight: list[tuple[Block, torch.cuda.Event | None]] = []
        self._returned: deque[tuple[Block, torch.cuda.Event | None]] = deque()
        self._lock = threading.Lock()

    @property
    def retained_bytes(self) -> int:
        """Bytes held in free blocks (after the blocks returned so far are taken in)."""
        with self._lock:
            evicted = self._collect_returned()
            retained = sum(block.nbytes for block in self._free)
        for old in evicted:
            self._release(old)
        return retained

    def lend(self, block: Block, ready: torch.cuda.Event | None) -> np.ndarray:
        """`block` as a uint8 array that keeps it lent; reusable once all views of it are freed
        and `ready` (the event of the last write into it; None: none pending) has completed."""
        loan = _Loan(block)
        give_back = weakref.finalize(loan, self._returned.append, (block, ready))
        give_back.atexit = False  # at exit daemon threads may still use it: never lend it again
        return np.asarray(loan)

    def borrow(self, nbytes: int) -> np.ndarray:
        """`nbytes` of a block, nothing pending on it, lent until every view of it is freed."""
        return self.lend(self.take(nbytes), None)[:nbytes]

    def take(self, nbytes: int) -> Block:
        """The smallest free block of at least `nbytes` whose last write is done, or a new one."""
        with self._lock:
            evicted = self._collect_returned()
            fitting = [block for block in self._free if block.nbytes >= nbytes]
            block = min(fitting, key=lambda block: block.nbytes) if fitting else None
            if block is not None:
                self._free.remove(block)
        for old in evicted:  # released (unpinned) outside the lock
            self._release(old)
        return self._allocate(_block_bytes(nbytes)) if block is None else block

    def _collect_returned(self) -> list[Block]:
        """Free the returned blocks whose last write is done; return those over the cap.

        The least recently used free blocks go first, until the rest fit the cap.
        """
        while self._returned:
            self._in_flight.append(self._returned.popleft())
        still_in_flight = []
        for block, ready in self._in_flight:
            if ready is None or ready.query():
                self._free.append(block)  # most recently used last
            else:
                still_in_flight.append((block, ready))
        self._in_flight = still_in_flight
        retained = sum(block.nbytes for block in self._free)
        evicted = []
        while retained > self.max_retained_bytes:
            evicted.append(self._free.pop(0))
            retained -= evicted[-1].nbytes
        return evicted
