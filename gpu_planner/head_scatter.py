"""Scatter staged head slices into destination pages: the receive side of staging.

The mirror of `gpu_planner.head_gather`: there each staged page is read from
source page `src_pages[i]`; here staged page `i` (consecutive in the staging
region, as RDMA landed it) is written into destination page `dst_pages[i]`,
each token's slice at its destination head offset and nothing else. With a
higher prefill TP, `writers` prefill ranks send one chunk each and each chunk
fills its own head range of the same token slots (`scatter_layout`).

Layout (a `HeadSliceLayout`): side 0 is the staged pages, whose `ptrs` are
byte offsets from the start of `staging`; side 1 is the destination KV
buffers (absolute addresses). Entry `j`, page position `i`, token slot `t`
copies `slice_lens[j]` bytes from
`staging + ptr0[j] + i * page_len0[j] + t * token_len0[j] + head_offset0[j]` to
`ptr1[j] + P * page_len1[j] + t * token_len1[j] + head_offset1[j]`, where `P`
is `dst_device_pages[i]` when `dst_is_device[j]`, else `dst_pages[i]`: HiSparse
decode buffers are host- or device-backed and their page ids differ, and a
buffer given the other space's pages is silently corrupted. Both spaces take
one kernel launch.

Safety: every argument is checked before a byte is written, else a
`PlanValidationError` names the argument, entry and page at fault. Reads
stay in the staging region, writes in the registered destination buffers
(`dst_lens`: the largest page's last slice, per page list, ends inside each)
and in their pages; the bytes read are apart from every destination.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import HeadSliceLayout, PerLayer, per_layer
from gpu_planner.host_copy import scatter_loop
from gpu_planner.inputs import (
    INT64_MAX,
    Backend,
    IndexLike,
    PageList,
    as_host_array,
    as_page_list,
    as_tensor,
    check_page_size,
    check_same_length,
    is_integer,
)
from gpu_planner.slice_copies import (
    HostRegion,
    Staging,
    check_copies,
    check_layout,
    largest_page,
    staging_and_backend,
)

__all__ = ["HostRegion", "compile_kernels", "scatter_head_slices", "scatter_layout"]


def scatter_layout(
    dst_ptrs: Sequence[int],
    dst_page_lens: PerLayer,
    page_size: int,
    writers: int = 1,
    writer: int = 0,
    staged_base: int = 0,
    *,
    num_pages: int,
) -> HeadSliceLayout:
    """The layout that scatters writer `writer`'s staged chunk of `num_pages` pages.

    Each of `writers` prefill ranks fills `1 / writers` of every destination
    token slot (writers = 1: whole pages). Its staged page of entry `j` is
    `dst_page_lens[j] // writers` bytes of whole slices; entries are
    buffer-major from `staged_base`, entry `j`'s pages starting after
    `num_pages` staged pages of each entry before it (as the gather stages).

    Example:
        >>> layout = scatter_layout([4096, 8192], 64, page_size=2, writers=2, writer=1,
        ...                         num_pages=3)
        >>> layout.geometry[0, :, 1].tolist()  # staged: offset, page, token, head offset
        [96, 32, 16, 0]
        >>> layout.geometry[1, :, 1].tolist(), layout.slice_lens.tolist()
        ([8192, 64, 32, 16], [16, 16])
    """
    page_size = check_page_size(page_size)
    for name, value, minimum in (("writers", writers, 1), ("staged_base", staged_base, 0)):
        if not (is_integer(value) and minimum <= value <= INT64_MAX):
            raise PlanValidationError(
                f"{name}: must be an integer in [{minimum}, 2**63), got {value!r}"
            )
    if not (is_integer(writer) and 0 <= writer < writers):
        raise PlanValidationError(
            f"writer: must be an integer in [0, {writers}) (writers = {writers}), got {writer!r}"
        )
    if not (is_integer(num_pages) and 0 <= num_pages <= INT64_MAX):
        raise PlanValidationError(f"num_pages: must be an integer >= 0, got {num_pages!r}")
    try:
        num_entries = len(dst_ptrs)
    except TypeError:
        raise PlanValidationError(
            f"dst_ptrs: expected one address per entry, got {dst_ptrs!r}"
        ) from None
    page_lens = per_layer(dst_page_lens, "dst_page_lens", num_entries)
    unit = page_size * int(writers)
    not_whole = np.flatnonzero(page_lens % unit)
    if not_whole.size:
        entry = int(not_whole[0])
        raise PlanValidationError(
            f"entry {entry}: dst_page_lens[{entry}] = {page_lens[entry]} is not a multiple of "
            f"page_size * writers = {page_size} * {writers}"
        )
    staged_page_lens = page_lens // int(writers)
    # Python ints (object arrays) for the starts: no sum can overflow.
    sizes = staged_page_lens[:-1].astype(object) * int(num_pages)
    starts = np.cumsum(np.concatenate([np.array([int(staged_base)], dtype=object), sizes]))
    past_int64 = np.flatnonzero(starts > INT64_MAX)
    if past_int64.size:
        entry = int(past_int64[0])
        raise PlanValidationError(
            f"entry {entry}: its staged pages would start at byte {starts[entry]} (staged_base "
            f"{staged_base} + {num_pages} pages of the entries before it), past 2**63 - 1"
        )
    slice_lens = page_lens // unit
    return HeadSliceLayout.build(
        src_ptrs=starts[:num_entries].astype(np.int64),
        dst_ptrs=dst_ptrs,
        page_size=page_size,
        src_page_lens=staged_page_lens,
        dst_page_lens=page_lens,
        src_token_lens=slice_lens,
        dst_token_lens=page_lens // page_size,
        src_head_offsets=0,
        dst_head_offsets=int(writer) * slice_lens,
        slice_lens=slice_lens,
    )


def scatter_head_slices(
    layout: HeadSliceLayout,
    dst_pages: IndexLike,
    staging: Staging,
    dst_lens: PerLayer,
    dst_device_pages: IndexLike | None = None,
    dst_is_device: Sequence[bool] | np.ndarray | None = None,
    backend: Backend | None = None,
) -> None:
    """Write every entry's staged slices into its destination pages, in place.

    Args:
        layout: side 0 the staged pages (offsets from the start of `staging`),
            side 1 the destination buffers (`scatter_layout` builds it).
        dst_pages: int32/int64 [num_pages] host-space destination pages
            (NumPy or tensor, any stride).
        staging: the staged bytes: a 1-D contiguous uint8 tensor on the KV's
            torch device, or, for KV in this process's host memory, a
            writable 1-D uint8 NumPy array or a `HostRegion`.
        dst_lens: the registered bytes of each entry's destination buffer
            from its address (one int for all, or one per entry).
        dst_device_pages: int32/int64 [num_pages] device-space pages; needed
            when an entry is device-backed.
        dst_is_device: per entry, True when its pages are `dst_device_pages`
            (None: every entry uses `dst_pages`).
        backend: None picks the Triton kernel for CUDA staging and the
            compiled CPU loop for host staging; "triton" on the host needs
            TRITON_INTERPRET=1. As the gather's: the current stream of the
            staging's device, host page lists up through pinned memory, a
            device page tensor checked with one read-back.

    Raises:
        PlanValidationError: naming the argument, entry or page at fault,
            before anything is written.

    Example:
        >>> kv = np.zeros(32, dtype=np.uint8)  # 2 pages of 2 token slots of 8 bytes
        >>> layout = scatter_layout([kv.ctypes.data], 16, page_size=2, writers=2, writer=1,
        ...                         num_pages=1)
        >>> staged = np.arange(1, 9, dtype=np.uint8)  # one staged page: 2 slices of 4 bytes
        >>> scatter_head_slices(layout, np.array([1]), staged, dst_lens=32)
        >>> kv.reshape(2, 2, 8)[1].tolist()  # page 1: the second half of each slot
        [[0, 0, 0, 0, 1, 2, 3, 4], [0, 0, 0, 0, 5, 6, 7, 8]]
    """
    check_layout(layout)
    pages = as_page_list(dst_pages, "dst_pages")
    on_device = _dst_is_device(dst_is_device, layout.num_layers)
    device_pages = _device_pages(dst_device_pages, pages, on_device)
    largest = [largest_page(pages, "dst_pages"), -1]
    if device_pages is not None:
        largest[1] = largest_page(device_pages, "dst_device_pages")
    staging, backend, staging_address, staging_len = staging_and_backend(
        staging, backend, layout.num_layers
    )
    check_copies(
        layout,
        paged_side=1,
        num_pages=len(pages),
        registered=dst_lens,
        largest_pages=tuple(largest),
        staging=(staging_address, staging_len),
        staged=_staged_reads(layout, len(pages)),
        spaces=on_device,
    )
    if not len(pages):
        return
    entries = _copy_table(layout, on_device)
    if backend == "cpu":
        page_rows = np.empty((2, len(pages)), dtype=np.int64)
        page_rows[0] = as_host_array(pages)
        page_rows[1] = page_rows[0] if device_pages is None else as_host_array(device_pages)
        entries[:, 0] += staging_address
        scatter_loop(entries, page_rows, layout.page_size)
        return
    from gpu_planner.kernels.head_scatter import launch_scatter_head_slices

    if not isinstance(staging, torch.Tensor):
        staging = torch.from_numpy(staging)
    device_tensor = None if device_pages is None else as_tensor(device_pages)
    with on_torch_device(staging.device):
        launch_scatter_head_slices(
            staging, as_tensor(pages), device_tensor, entries, layout.page_size
        )


def _dst_is_device(flags: Sequence[bool] | np.ndarray | None, num_entries: int) -> np.ndarray:
    """bool [entries]: which entries use the device page space (checked: bools or 0/1)."""
    if flags is None:
        return np.zeros(num_entries, dtype=bool)
    if isinstance(flags, torch.Tensor):
        flags = flags.cpu().numpy()
    array = np.asarray(flags)
    if array.ndim != 1 or not (array.dtype == bool or array.dtype.kind in "iu"):
        raise PlanValidationError(
            f"dst_is_device: expected one bool per entry, got {array.dtype} of shape {array.shape}"
        )
    if len(array) != num_entries:
        raise PlanValidationError(
            f"dst_is_device: has {len(array)} values for {num_entries} entries"
        )
    not_flags = np.flatnonzero((array != 0) & (array != 1))
    if not_flags.size:
        entry = int(not_flags[0])
        raise PlanValidationError(
            f"dst_is_device[{entry}] = {array[entry].item()!r}: must be True/False (or 1/0)"
        )
    return array.astype(bool)


def _device_pages(
    dst_device_pages: IndexLike | None, pages: PageList, on_device: np.ndarray
) -> PageList | None:
    """The validated device-space page list: given whenever an entry uses it, as long as pages."""
    if dst_device_pages is None:
        if on_device.any():
            entry = int(np.flatnonzero(on_device)[0])
            raise PlanValidationError(
                f"dst_device_pages: missing, but entry {entry} is device-backed "
                f"(dst_is_device[{entry}] = True)"
            )
        return None
    device_pages = as_page_list(dst_device_pages, "dst_device_pages")
    check_same_length(pages, "dst_pages", device_pages, "dst_device_pages")
    return device_pages


def _staged_reads(layout: HeadSliceLayout, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Python ints [entries]: the first and the end byte of the staging each entry reads."""
    ptrs, page_lens, token_lens, offsets = layout.geometry[0].astype(object)
    starts = ptrs + offsets
    ends = starts + (num_pages - 1) * page_lens + (layout.page_size - 1) * token_lens
    return starts, ends + layout.slice_lens.astype(object)


def _copy_table(layout: HeadSliceLayout, on_device: np.ndarray) -> np.ndarray:
    """int64 [entries, 8], the kernel's `entries` in bytes (checked: no sum overflows).

    Columns: offset in the staging of staged page 0's first slice, staged
    page and token lengths, destination address of page 0's first slice,
    destination page and token lengths, slice length, page space.
    """
    staged_ptrs, staged_page_lens, staged_token_lens, staged_offsets = layout.geometry[0]
    dst_ptrs, dst_page_lens, dst_token_lens, dst_offsets = layout.geometry[1]
    return np.stack(
        [
            staged_ptrs + staged_offsets,
            staged_page_lens,
            staged_token_lens,
            dst_ptrs + dst_offsets,
            dst_page_lens,
            dst_token_lens,
            layout.slice_lens,
            on_device.astype(np.int64),
        ],
        axis=1,
    )


def compile_kernels() -> None:
    """Compile the CPU loop now (or load it from Numba's cache), so no receive waits for it."""
    scatter_loop(np.zeros((1, 8), dtype=np.int64), np.zeros((2, 0), dtype=np.int64), 1)
