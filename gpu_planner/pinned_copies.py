"""Pinned host copies: where the planner's device-to-host copies land.

Each copy lands in a page-locked block of a `BlockPool` (block_pool.py): the
returned tensors keep their block lent for as long as anything views them,
and a block is reused only once its copy's event has completed. Blocks are
pinned with `cudaHostRegister`, not torch's caching host allocator, so a
block the pool releases past its cap (`GPU_PLANNER_STAGING_RETAINED_BYTES`)
is really unpinned, under the device it was pinned on.

Every CUDA call goes through `cuda_runtime()`, so the CPU suite runs this
module's logic through a host stand-in.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner import settings
from gpu_planner.block_pool import Block, BlockPool, byte_array_interface
from gpu_planner.cuda_runtime import CudaRuntime, cuda_runtime
from gpu_planner.cuda_streams import on_torch_device, torch_device_of

ALIGN_BYTES = 16  # each tensor of a multi-tensor copy starts at this alignment


class _PinnedMemory:
    """Anonymous memory, page-locked for its whole life: unpinned before it is unmapped.

    NumPy arrays made from it (`np.asarray`) have it as their base, so every
    view keeps it mapped; the unpin runs at its death at the latest, with
    the mapping still held, so no later mapping of the same addresses is
    ever found pinned (CUDA error 712).
    """

    def __init__(self, nbytes: int) -> None:
        runtime = cuda_runtime()
        memory = mmap.mmap(-1, nbytes)
        address = np.frombuffer(memory, dtype=np.uint8).ctypes.data
        error = runtime.host_register(address, nbytes)
        if error != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (error {error})")
        self.__array_interface__ = byte_array_interface(address, nbytes)
        cuda_device = runtime.current_device()
        self.unpin = weakref.finalize(self, _unpin, runtime, memory, address, cuda_device)
        self.unpin.atexit = False  # the process's exit frees it: no CUDA call then


def _unpin(runtime: CudaRuntime, memory: mmap.mmap, address: int, cuda_device: int) -> None:
    """Unregister `address` under the device it was pinned on; `memory` stays mapped till then."""
    with runtime.device_guard(torch.device("cuda", cuda_device)):
        runtime.host_unregister(address)


def allocate_pinned_block(nbytes: int) -> Block:
    """Page-aligned anonymous memory, page-locked with `cudaHostRegister` (portable).

    Not torch's caching host allocator: a block this pool releases is really
    unpinned, instead of staying pinned in torch's cache. Call it with the
    copy's device current, so no other device gets a CUDA context.
    """
    array = np.asarray(_PinnedMemory(nbytes))
    return Block(array, torch.from_numpy(array))


def release_pinned_block(block: Block) -> None:
    """Unpin a block of `allocate_pinned_block` now; its memory goes with its last view."""
    block.array.base.unpin()


def copy_into_pool(
    pool: BlockPool, sources: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None
) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Start exact copies of CUDA tensors into one block of `pool`; return without waiting.

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
        block = pool.take(offsets[-1])
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
            pool.lend(block, None)  # back once nothing views it: at once
            raise
    loan = pool.lend(block, copied)
    hosts = [
        torch.from_numpy(loan[offset : offset + nbytes].view(dtype).reshape(shape))
        for offset, nbytes, dtype, shape in pieces
    ]
    return hosts, copied


def pinned_pool(max_retained_bytes: int | None = None) -> BlockPool:
    """A pool of pinned blocks (default cap: `GPU_PLANNER_STAGING_RETAINED_BYTES`)."""
    if max_retained_bytes is None:
        max_retained_bytes = settings.loaded(settings.STAGING_RETAINED_BYTES)
    return BlockPool(max_retained_bytes, allocate_pinned_block, release_pinned_block)


_pinned_pool: BlockPool | None = None  # the process's pool, made at its first copy


def _shared_pool() -> BlockPool:
    """The process's pinned pool (sized by the loaded setting when first used)."""
    global _pinned_pool
    if _pinned_pool is None:
        _pinned_pool = pinned_pool()
    return _pinned_pool


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
    return copy_into_pool(_shared_pool(), sources, stream)
