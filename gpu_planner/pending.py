"""Decode-side page indices on their way to host memory, without a device-wide sync.

The decode worker converts a request's token slots to pages in both index
spaces and serialises them into its ZMQ metadata frames. On CUDA,
`page_indices_async` launches the conversion, starts one copy of both page
arrays into reusable pinned memory and records an event; serialising waits on
that event alone, so the scheduler never synchronises the device or a stream.
The same API runs on CPU tensors, where the pages are ready at once.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_planner.inputs import Backend, IndexLike
from gpu_planner.pages import PageIndices, page_indices
from gpu_planner.pinned_copies import copy_to_host_async


def _as_numpy(pages: torch.Tensor | np.ndarray) -> np.ndarray:
    return pages.numpy() if isinstance(pages, torch.Tensor) else pages


class PendingPageIndices:
    """A request's host- and device-space pages, computed, and copied to host memory.

    `computed` holds the pages on the torch device that computed them (plan
    with them there); `wait()` and `numpy()` return their copies in host
    memory once the copy event has completed.
    """

    def __init__(
        self, computed: PageIndices, copies: PageIndices, copied: torch.cuda.Event | None
    ) -> None:
        self.computed = computed
        self._copies = copies  # in host memory, complete once `copied` has
        self._copied = copied

    def ready(self) -> bool:
        """Whether the host copies are complete (never blocks)."""
        return self._copied is None or self._copied.query()

    def wait(self) -> PageIndices:
        """Both spaces' pages in host memory (CPU tensors; NumPy for NumPy input), once copied."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._copies

    def numpy(self) -> PageIndices:
        """Both spaces' pages as NumPy arrays (views of the host-memory copies), once copied."""
        copies = self.wait()
        return PageIndices(host=_as_numpy(copies.host), device=_as_numpy(copies.device))


def _one_allocation(pages: PageIndices) -> torch.Tensor | None:
    """The bytes of the one allocation both spaces' pages are views of (one launch wrote them
    there, `launch_page_indices`), or None."""
    if not all(isinstance(space, torch.Tensor) for space in pages):
        return None
    storage = pages.host.untyped_storage()
    if storage.data_ptr() != pages.device.untyped_storage().data_ptr():
        return None
    return torch.empty(0, dtype=torch.uint8, device=pages.host.device).set_(storage)


def _copies_of(pages: PageIndices) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Host copies of both spaces: one copy of their shared allocation where they have one."""
    allocation = _one_allocation(pages)
    if allocation is None:
        return copy_to_host_async([torch.as_tensor(space) for space in pages])
    (host_bytes,), copied = copy_to_host_async([allocation])
    copies = []
    for space in pages:
        offset = space.data_ptr() - allocation.data_ptr()
        nbytes = space.numel() * space.element_size()
        copies.append(host_bytes[offset : offset + nbytes].view(space.dtype))
    return copies, copied


def page_indices_async(
    req_to_token_row: IndexLike,
    host_slots: IndexLike,
    start: int,
    end: int,
    page_size: int,
    backend: Backend | None = None,
    *,
    host_range: tuple[int, int] | None = None,
    host_page_size: int | None = None,
) -> PendingPageIndices:
    """`page_indices` whose copies in host memory arrive in the background.

    Same arguments, checks and results as `gp.page_indices`; read the copies
    with `.wait()` / `.numpy()`, plan on the torch device with `.computed`. On CUDA it is one
    kernel launch, then one pinned copy of both spaces and an event, all on the
    current stream of the slots' device (whatever device is current in the
    calling thread): the copy follows the kernel, which follows the work that
    wrote the slots. On CPU the result is complete when this returns.
    """
    pages = page_indices(
        req_to_token_row,
        host_slots,
        start,
        end,
        page_size,
        backend,
        host_range=host_range,
        host_page_size=host_page_size,
    )
    copies, copied = _copies_of(pages)
    if copied is None:
        return PendingPageIndices(pages, pages, None)
    return PendingPageIndices(pages, PageIndices(*copies), copied)
