"""Reusable pinned host buffers for the planner's device-to-host copies.

Each copy lands in a page-locked block taken from a pool and is handed out as
a loan: the returned tensors view a NumPy array whose base is a fresh `_Loan`
object, so every tensor, `.numpy()` array, slice and view made from them keeps
that loan alive (NumPy and torch both hold their base). The block goes back to
the pool only when the last of them is freed, and is reused only once its
copy's event has completed. A block is therefore never overwritten while
anything handed out from it is alive, whoever holds it and in whatever form.

The give-back runs in a `weakref.finalize` callback, so at any point of any
thread, including inside a garbage collection while the pool's lock is held:
it only appends to a deque (atomic, no lock, no wait). The lock-holding
`take` drains that deque. Free blocks are kept up to `max_retained_bytes`;
beyond it the least recently used are unpinned and released first (by the
next `take`, outside the lock, under the device they were pinned on), so a
few huge plans do not keep their blocks pinned for ever.

Every CUDA call goes through `cuda_runtime()`, so the CPU suite runs this
module's logic through a host stand-in.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device, torch_device_of

ALIGN_BYTES = 16  # each tensor of a multi-tensor copy starts at this alignment
MIN_BLOCK_BYTES = 4096
DEFAULT_MAX_RETAINED_BYTES = 64 << 20


@dataclass(eq=False)
class Block:
    """A host byte block: `array` owns the memory, `tensor` views it."""

    array: np.ndarray  # uint8 [nbytes]
    tensor: torch.Tensor  # uint8 [nbytes], same memory
    cuda_device: int | None = None  # the device it was pinned under (None: not pinned)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def allocate_pinned_block(nbytes: int) -> Block:
    """Page-aligned anonymous memory, page-locked with `cudaHostRegister` (portable).

    Not torch's caching host allocator: a block this pool releases is really
    unpinned, instead of staying pinned in torch's cache. Call it with the
    copy's device current, so no other device gets a CUDA context.
    """
    runtime = cuda_runtime()
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    error = runtime.host_register(array.ctypes.data, nbytes)
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {error})")
    return Block(array, torch.from_numpy(array), runtime.current_device())


def release_pinned_block(block: Block) -> None:
    """Unpin a block of `allocate_pinned_block`; its memory goes with its last reference."""
    runtime = cuda_runtime()
    with runtime.device_guard(torch.device("cuda", block.cuda_device)):
        runtime.host_unregister(block.array.ctypes.data)


class _Loan:
    """One loan of a block: NumPy arrays made from it have it as their base.

    Its death (that of the last array, view, tensor or `.numpy()` made from
    it) gives the block back. It holds the block, so the memory outlives it.
    """

    def __init__(self, block: Block) -> None:
        self.block = block
        self.__array_interface__ = {
            "data": (block.array.ctypes.data, False),
            "shape": (block.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _block_bytes(nbytes: int) -> int:
    """`nbytes` rounded up to one of 8 size classes per power of two (at most 25% more)."""
    granule = max(1 << max(nbytes.bit_length() - 3, 0), MIN_BLOCK_BYTES)
    return -(-max(nbytes, 1) // granule) * granule


class PinnedStaging:
    """A pool of pinned byte blocks, in size classes, recycled.

    `allocate`/`release` make and free a block (pinned memory by default;
    any host memory works, which is how the pool is tested without a GPU).
    """

    def __init__(
        self,
        max_retained_bytes: int = DEFAULT_MAX_RETAINED_BYTES,
        allocate: Callable[[int], Block] = allocate_pinned_block,
        release: Callable[[Block], None] = release_pinned_block,
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

    def copy_to_host_async(
        self, sources: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None
    ) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Start exact copies of CUDA tensors into one pinned block and return without waiting.

        The copies and their event run on `stream` (default: the current stream
        of the sources' device). Read the host tensors once the event has
        completed; they keep the block lent for as long as anything views them.
        """
        runtime = cuda_runtime()
        sizes = [source.numel() * source.element_size() for source in sources]
        offsets = [0]
        for nbytes in sizes:
            offsets.append(offsets[-1] + -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        pieces = []  # (offset, nbytes, NumPy dtype, shape) of each host copy
        with on_torch_device(torch_device_of(sources)):
            block = self.take(offsets[-1])
            stream = runtime.current_stream() if stream is None else stream
            try:
                with runtime.stream_guard(stream):
                    for source, offset, nbytes in zip(sources, offsets[:-1], sizes, strict=True):
                        target = block.tensor[offset : offset + nbytes].view(source.dtype)
                        runtime.copy_async(target.view(source.shape), source.contiguous())
                        pieces.append((offset, nbytes, target.numpy().dtype, source.shape))
                    copied = runtime.new_event()
                    copied.record(stream)
            except BaseException:
                stream.synchronize()  # nothing may still write into the block
                self._returned.append((block, None))
                raise
        loan = self.lend(block, copied)
        hosts = [
            torch.from_numpy(loan[offset : offset + nbytes].view(dtype).reshape(shape))
            for offset, nbytes, dtype, shape in pieces
        ]
        return hosts, copied

    def lend(self, block: Block, ready: torch.cuda.Event | None) -> np.ndarray:
        """`block` as a uint8 array that keeps it lent; reusable once all views of it are freed
        and `ready` (the event of the last write into it; None: none pending) has completed."""
        loan = _Loan(block)
        weakref.finalize(loan, self._returned.append, (block, ready))
        return np.asarray(loan)

    def take(self, nbytes: int) -> Block:
        """The smallest free block of at least `nbytes` whose last copy is done, or a new one."""
        with self._lock:
            evicted = self._collect_returned()
            fitting = [block for block in self._free if block.nbytes >= nbytes]
            block = min(fitting, key=lambda block: block.nbytes) if fitting else None
            if block is not None:
                self._free.remove(block)
        for old in evicted:  # unpinned outside the lock
            self._release(old)
        return self._allocate(_block_bytes(nbytes)) if block is None else block

    def _collect_returned(self) -> list[Block]:
        """Move returned blocks whose copy is done to the free list; return those over the cap.

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


_staging = PinnedStaging()


def copy_to_host(source: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Exact host copy of `source`: through pinned staging on CUDA, a plain view on CPU.

    On CUDA the host waits on this copy's event alone.
    """
    (host,), copied = copy_to_host_async([source], stream)
    if copied is not None:
        copied.synchronize()
    return host


def copy_to_host_async(
    sources: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of `sources` and the event that marks them complete (None: already are).

    On CUDA the copies go into one pinned block without any wait, on `stream`
    (default: the current stream of the sources' device); on CPU the sources
    are returned as they are.
    """
    if not cuda_runtime().runs_on_device(torch_device_of(sources)):
        return list(sources), None
    return _staging.copy_to_host_async(sources, stream)
