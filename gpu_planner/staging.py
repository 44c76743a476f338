"""Reusable pinned host buffers for the planner's device-to-host copies.

Each copy lands in a page-locked block taken from a pool. The returned tensors
alias the block through a NumPy array; the block goes back to the pool only
when that array, and so every tensor viewing it, has been freed, and is reused
only once its copy's event has completed. A block is therefore never
overwritten while anything still reads it.

The give-back runs in a `weakref.finalize` callback, so at any point of any
thread, including inside a garbage collection while the pool's lock is held:
it only appends to a deque (atomic, no lock, no wait). The lock-holding
`take` drains that deque. Free blocks are kept up to `max_retained_bytes`;
beyond it the least recently used are unpinned and released first (by the
next `take`, outside the lock, under the device they were pinned on), so a
few huge plans do not keep their blocks pinned for ever.
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

from gpu_planner.cuda_streams import torch_device_of

ALIGN_BYTES = 16  # each tensor of a multi-tensor copy starts at this alignment
MIN_BLOCK_BYTES = 4096
DEFAULT_MAX_RETAINED_BYTES = 64 << 20
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device, as the pool serves them all


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
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    error = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, nbytes, _PORTABLE))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {error})")
    return Block(array, torch.from_numpy(array), torch.cuda.current_device())


def release_pinned_block(block: Block) -> None:
    """Unpin a block of `allocate_pinned_block`; its memory goes with its last reference."""
    with torch.cuda.device(block.cuda_device):
        torch.cuda.cudart().cudaHostUnregister(block.array.ctypes.data)


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
        of the sources' device). Read the host tensors once the event has completed.
        """
        torch_device = torch_device_of(sources)
        sizes = [source.numel() * source.element_size() for source in sources]
        offsets = [0]
        for nbytes in sizes:
            offsets.append(offsets[-1] + -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        hosts = []
        with torch.cuda.device(torch_device):
            block = self.take(offsets[-1])
            block_array = block.array[:]  # this copy's view: its death returns the block
            stream = torch.cuda.current_stream() if stream is None else stream
            with torch.cuda.stream(stream):
                for source, offset, nbytes in zip(sources, offsets[:-1], sizes, strict=True):
                    target = block.tensor[offset : offset + nbytes].view(source.dtype)
                    target.view(source.shape).copy_(source.contiguous(), non_blocking=True)
                    host_dtype = target.numpy().dtype
                    host = block_array[offset : offset + nbytes].view(host_dtype)
                    hosts.append(torch.from_numpy(host.reshape(source.shape)))
                copied = torch.cuda.Event()
                copied.record(stream)
        self.give_back_when_freed(block_array, block, copied)
        return hosts, copied

    def give_back_when_freed(
        self, view: np.ndarray, block: Block, ready: torch.cuda.Event | None
    ) -> None:
        """Return `block` to the pool once `view` is freed, for reuse after `ready` completes."""
        weakref.finalize(view, self._returned.append, (block, ready))

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
    if torch_device_of(sources).type != "cuda":
        return list(sources), None
    return _staging.copy_to_host_async(sources, stream)
