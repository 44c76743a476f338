"""Reusable pinned host buffers for the planner's device-to-host copies.

Each copy lands in a page-locked block taken from a small pool. The returned
tensor aliases the block through a NumPy array; the block goes back to the
pool only when that array, and so every tensor viewing it, has been freed.
A block is therefore never overwritten while anything still reads it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

_MAX_FREE_BLOCKS = 8
_ALIGN_BYTES = 16  # each tensor of a multi-tensor copy starts at this alignment


class PinnedStaging:
    """A pool of pinned byte blocks, grown to powers of two and recycled."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def copy_to_host(self, source: torch.Tensor) -> torch.Tensor:
        """Exact copy of a CUDA tensor into pinned memory; waits on this copy only."""
        (host,), copied = self.copy_to_host_async([source])
        copied.synchronize()
        return host

    def copy_to_host_async(
        self, sources: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Start exact copies of CUDA tensors into one pinned block and return without waiting.

        Returns the host tensors and an event recorded after the copies on the
        current stream: read the tensors only once the event has completed.
        The block goes back to the pool when the tensors are freed and the
        copies are done.
        """
        sizes = [source.numel() * source.element_size() for source in sources]
        offsets = [0]
        for nbytes in sizes:
            offsets.append(offsets[-1] + -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES)
        block = self._take(offsets[-1])
        block_array = block.numpy()
        hosts = []
        for source, offset, nbytes in zip(sources, offsets[:-1], sizes, strict=True):
            target = block[offset : offset + nbytes].view(source.dtype).view(source.shape)
            target.copy_(source, non_blocking=True)
            host_dtype = target.numpy().dtype
            host = block_array[offset : offset + nbytes].view(host_dtype).reshape(source.shape)
            hosts.append(torch.from_numpy(host))
        copied = torch.cuda.Event()
        copied.record()
        weakref.finalize(block_array, self._give_back_after, copied, block)
        return hosts, copied

    def _give_back_after(self, copied: torch.cuda.Event, block: torch.Tensor) -> None:
        copied.synchronize()  # a block dropped unread may still be a copy's target
        self._give_back(block)

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


def copy_to_host_async(
    sources: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of `sources` and the event that marks them complete (None: already are).

    On CUDA the copies go into one pinned block without any wait; on CPU the
    sources are returned as they are.
    """
    if not any(source.device.type == "cuda" for source in sources):
        return list(sources), None
    return _staging.copy_to_host_async(sources)
