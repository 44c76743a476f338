"""Reusable pinned host buffers for the planner's device-to-host copies.

Each copy lands in a page-locked block taken from a small pool. The returned
tensor aliases the block through a NumPy array; the block goes back to the
pool only when that array, and so every tensor viewing it, has been freed.
A block is therefore never overwritten while anything still reads it.
"""

from __future__ import annotations

import threading
import weakref

import torch

_MAX_FREE_BLOCKS = 8


class PinnedStaging:
    """A pool of pinned byte blocks, grown to powers of two and recycled."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def copy_to_host(self, source: torch.Tensor) -> torch.Tensor:
        """Exact copy of a contiguous CUDA tensor into pinned memory; waits on this copy only."""
        nbytes = source.numel() * source.element_size()
        block = self._take(nbytes)
        target = block[:nbytes].view(source.dtype).view(source.shape)
        target.copy_(source, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        copied.synchronize()
        block_array = block.numpy()
        weakref.finalize(block_array, self._give_back, block)
        host_dtype = target.numpy().dtype
        return torch.from_numpy(block_array[:nbytes].view(host_dtype).reshape(source.shape))

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fitting = [block for block in self._free if block.numel() >= nbytes]
            if fitting:
                block = min(fitting, key=torch.Tensor.numel)
                self._free.remove(block)
                return block
        size = 1 << max(nbytes - 1, 0).bit_length()
        return torch.empty(max(size, 4096), dtype=torch.uint8, pin_memory=True)

    def _give_back(self, block: torch.Tensor) -> None:
        with self._lock:
            self._free.append(block)
            if len(self._free) > _MAX_FREE_BLOCKS:
                self._free.remove(min(self._free, key=torch.Tensor.numel))


_staging = PinnedStaging()


def copy_to_host(source: torch.Tensor) -> torch.Tensor:
    """Exact host copy of `source`: through pinned staging on CUDA, a plain view on CPU."""
    if source.device.type != "cuda":
        return source
    return _staging.copy_to_host(source.contiguous())
