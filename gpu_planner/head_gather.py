"""Gather head-sliced KV into staging laid out as the destination pages, and its descriptors.

When the prefill's attention TP is below the decode's, each decode rank takes
one contiguous head range of every prefill token, and the decode side holds it
as whole token slots of its own pages. sglang sends one descriptor per token
(`gpu_planner.head_slices`); gathered first into a staging region laid out as
the decode pages, the same bytes move as one descriptor per run of consecutive
destination pages, the equal-TP count or fewer.

Staging layout of a chunk (a `HeadSliceLayout` of some entries, each a K or V
buffer of one layer, in sglang's order; `chunk_layout` picks them): entry `j`
takes `num_pages * dst_page_lens[j]` bytes after the entries before it, and
staged page `i` of entry `j` is what destination page `dst_pages[i]` of that
buffer must hold. The gather writes token `t`'s slice at
`t * dst_token_len + dst_head_offset` of each staged page, the bytes sglang's
send writes, and nothing else.

Safety: every argument is checked before a byte is written, else a
`PlanValidationError` names the argument, entry and page at fault. Reads stay
in the registered source buffers (`src_lens`: the largest page's last slice
ends inside each), writes in the staging region (each slice inside its staged
page; the region large enough and apart from the sources).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import HeadSliceLayout, PerLayer
from gpu_planner.host_copy import gather_loop
from gpu_planner.inputs import (
    INT64_MAX,
    Backend,
    IndexLike,
    PageList,
    as_host_array,
    as_page_list,
    as_tensor,
    is_integer,
)
from gpu_planner.layout import BufferLayout
from gpu_planner.plan import plan_transfer
from gpu_planner.slice_copies import (
    HostRegion,
    Staging,
    check_copies,
    check_layout,
    largest_page,
    staging_and_backend,
)

__all__ = [
    "HostRegion",
    "chunk_layout",
    "compile_kernels",
    "gather_head_slices",
    "gather_in_parts",
    "gathered_descriptors",
    "staging_nbytes",
]


def chunk_layout(layout: HeadSliceLayout, entries: Sequence[int] | slice) -> HeadSliceLayout:
    """The entries `entries` of `layout` (K and V buffers of some layers), in the order given.

    Example:
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[0, 64, 128, 192], dst_ptrs=[0, 32, 64, 96], page_size=1,
        ...     src_page_lens=16, dst_page_lens=8, src_token_lens=16, dst_token_lens=8,
        ...     src_head_offsets=8, dst_head_offsets=0, slice_lens=8)
        >>> chunk_layout(layout, [1, 3]).geometry[0, 0].tolist()  # K and V of layer 1 of 2
        [64, 192]
    """
    if not isinstance(entries, slice):
        entries = list(entries)
        for position, entry in enumerate(entries):
            if not (is_integer(entry) and 0 <= entry < layout.num_layers):
                raise PlanValidationError(
                    f"entries[{position}] = {entry!r}: must be an integer in "
                    f"[0, {layout.num_layers})"
                )
    return HeadSliceLayout(
        layout.geometry[:, :, entries], layout.slice_lens[entries], layout.page_size
    )


def staging_nbytes(layout: HeadSliceLayout, num_pages: int) -> int:
    """Bytes of staging a chunk of `num_pages` pages takes: pages x the sum of dst page lengths."""
    return int(num_pages) * sum(layout.geometry[1, 1].tolist())  # Python ints: no overflow


def gather_head_slices(
    layout: HeadSliceLayout,
    src_pages: IndexLike,
    staging: Staging,
    src_lens: PerLayer,
    backend: Backend | None = None,
) -> None:
    """Write every entry's staged pages: each token's head slice of `src_pages`, in place.

    Args:
        layout: the chunk's geometry (`HeadSliceLayout`, `chunk_layout`).
        src_pages: int32/int64 [num_pages] prefill pages (NumPy or tensor, any stride).
        staging: at least `staging_nbytes(layout, num_pages)` bytes: a 1-D
            contiguous uint8 tensor on the KV's torch device, or, for KV in
            this process's host memory, a writable 1-D uint8 NumPy array or a
            `HostRegion`. Its first bytes get the staged pages.
        src_lens: the registered bytes of each entry's source buffer from
            its address (one int for all, or one per entry).
        backend: None picks the Triton kernel for CUDA staging and the
            compiled CPU loop for host staging; "triton" on the host needs
            TRITON_INTERPRET=1. The kernel runs on the current stream of
            the staging's device; host page lists (sglang's) and the copy
            table go up through pinned memory without a host wait, a device
            page tensor is checked with one read-back (its smallest and
            largest page).

    Raises:
        PlanValidationError: naming the argument, entry or page at fault,
            before anything is written.

    Example:
        >>> kv = np.arange(32, dtype=np.uint8)  # 2 pages of 2 tokens of 8 bytes
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[kv.ctypes.data], dst_ptrs=[0], page_size=2, src_page_lens=16,
        ...     dst_page_lens=8, src_token_lens=8, dst_token_lens=4, src_head_offsets=4,
        ...     dst_head_offsets=0, slice_lens=4)
        >>> staging = np.zeros(staging_nbytes(layout, 1), dtype=np.uint8)
        >>> gather_head_slices(layout, np.array([1]), staging, src_lens=32)
        >>> staging.tolist()  # bytes 4..8 and 12..16 of page 1
        [20, 21, 22, 23, 28, 29, 30, 31]
    """
    pages, staging, backend, entries = _checked_gather(
        layout, src_pages, staging, src_lens, backend
    )
    if not len(pages):
        return
    if backend == "cpu":
        gather_loop(entries, _host_pages(pages), layout.page_size)
        return
    from gpu_planner.kernels.head_gather import launch_gather_head_slices

    if not isinstance(staging, torch.Tensor):
        staging = torch.from_numpy(staging)
    with on_torch_device(staging.device):
        launch_gather_head_slices(staging, as_tensor(pages), entries, layout.page_size)


def gather_in_parts(
    layout: HeadSliceLayout,
    src_pages: IndexLike,
    staging: np.ndarray | HostRegion,
    src_lens: PerLayer,
    parts: int,
) -> Iterator[int]:
    """`gather_head_slices` on the host in up to `parts` parts of whole entries, in order.

    After each part the iterator yields how many bytes of the staging are
    written: a prefix, since entries are staged one after another, so that
    prefix's tail can be on the wire while the next part is gathered. Every
    argument is checked here, before the first part (`PlanValidationError`,
    as `gather_head_slices`); parts are cut near equal bytes, at most one per
    entry, and an empty chunk yields nothing.

    Example:
        >>> kv = np.arange(32, dtype=np.uint8)  # 4 pages of 8 bytes
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[kv.ctypes.data, kv.ctypes.data + 16], dst_ptrs=[0, 0], page_size=1,
        ...     src_page_lens=8, dst_page_lens=8, src_token_lens=8, dst_token_lens=8,
        ...     src_head_offsets=0, dst_head_offsets=0, slice_lens=8)
        >>> staging = np.zeros(staging_nbytes(layout, 1), dtype=np.uint8)
        >>> list(gather_in_parts(layout, np.array([1]), staging, src_lens=16, parts=2))
        [8, 16]
    """
    if not (is_integer(parts) and parts >= 1):
        raise PlanValidationError(f"parts: must be an integer >= 1, got {parts!r}")
    pages, _, _, entries = _checked_gather(layout, src_pages, staging, src_lens, "cpu")
    if not len(pages):
        return iter(())
    # Where each entry's staged pages end: the bytes written once it is gathered.
    written = np.cumsum(entries[:, 4] * len(pages))
    cuts = np.searchsorted(written, written[-1] * np.arange(1, parts) / parts) + 1
    bounds = np.unique(np.concatenate([[0], cuts, [len(written)]]))
    return _gathered_parts(entries, _host_pages(pages), layout.page_size, bounds, written)


def _gathered_parts(
    entries: np.ndarray, pages: np.ndarray, page_size: int, bounds: np.ndarray, written: np.ndarray
) -> Iterator[int]:
    for first, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        gather_loop(entries[first:end], pages, page_size)
        yield int(written[end - 1])


def _checked_gather(
    layout: HeadSliceLayout,
    src_pages: IndexLike,
    staging: Staging,
    src_lens: PerLayer,
    backend: Backend | None,
) -> tuple[PageList, torch.Tensor | np.ndarray, Backend, np.ndarray]:
    """The gather's pages, staging, backend and copy table, once every argument is checked
    (host staging: the table's staged bases absolute)."""
    check_layout(layout)
    pages = as_page_list(src_pages, "src_pages")
    largest = largest_page(pages, "src_pages")
    staging, backend, staging_address, staging_len = staging_and_backend(
        staging, backend, layout.num_layers
    )
    check_copies(
        layout,
        paged_side=0,
        num_pages=len(pages),
        registered=src_lens,
        largest_pages=(largest,),
        staging=(staging_address, staging_len),
        staged=_staged_pages(layout, len(pages)),  # whole: what `gathered_descriptors` sends
    )
    entries = _copy_table(layout, len(pages))
    if backend == "cpu":
        entries[:, 3] += staging_address
    return pages, staging, backend, entries


def _host_pages(pages: PageList) -> np.ndarray:
    return np.ascontiguousarray(as_host_array(pages), dtype=np.int64)


def gathered_descriptors(
    layout: HeadSliceLayout,
    dst_pages: IndexLike,
    staging_address: int,
    backend: Backend | None = None,
) -> np.ndarray:
    """The chunk's (src=staging, dst=decode) descriptors: one per entry per run of dst pages.

    Staged pages are consecutive, so a run is a maximal stretch of `dst_pages`
    stepping by +1, at most the equal-TP count for the same page lists. The
    planner builds them (`plan_transfer`, its checks included) with the
    staging as the source buffers.

    Args:
        layout: the chunk's geometry; every staged page must be a whole
            destination page (head offset 0, slices filling the token slots
            and the slots the page), as when prefill TP <= decode TP.
        dst_pages: int32/int64 [num_pages] decode pages, the order of `src_pages`.
        staging_address: where the staging region starts (its `data_ptr`).
        backend: as `plan_transfer`'s.

    Returns:
        int64 [3, N] in host memory (src addresses, dst addresses, lengths),
        entry-major in the layout's order, runs in page order.

    Example:
        >>> layout = HeadSliceLayout.build(
        ...     src_ptrs=[0], dst_ptrs=[1 << 20], page_size=2, src_page_lens=16,
        ...     dst_page_lens=8, src_token_lens=8, dst_token_lens=4, src_head_offsets=4,
        ...     dst_head_offsets=0, slice_lens=4)
        >>> gathered_descriptors(layout, np.array([5, 6, 9]), 4096).tolist()
        [[4096, 4112], [1048616, 1048648], [16, 8]]
    """
    if not (is_integer(staging_address) and 0 <= staging_address <= INT64_MAX):
        raise PlanValidationError(
            f"staging_address: must be an integer in [0, 2**63), got {staging_address!r}"
        )
    check_layout(layout)
    _check_whole_pages(layout)
    pages = as_page_list(dst_pages, "dst_pages")
    num_pages = len(pages)
    if int(staging_address) + staging_nbytes(layout, num_pages) > INT64_MAX:
        raise PlanValidationError(
            f"staging_address: {staging_address} + {staging_nbytes(layout, num_pages)} staged "
            "bytes would end past 2**63 - 1"
        )
    dst_page_lens = layout.geometry[1, 1]
    staged = BufferLayout(
        src_ptrs=(int(staging_address) + _staged_pages(layout, num_pages)[0]).astype(np.int64),
        dst_ptrs=layout.geometry[1, 0],
        item_lens=dst_page_lens,
        src_lens=num_pages * dst_page_lens,
    )
    if isinstance(pages, torch.Tensor):
        positions = torch.arange(num_pages, dtype=torch.int64, device=pages.device)
    else:
        positions = np.arange(num_pages, dtype=np.int64)
    return plan_transfer(positions, pages, staged, backend=backend).columns_array()


def _check_whole_pages(layout: HeadSliceLayout) -> None:
    """Each staged page is a whole destination page: what moving whole pages needs."""
    _, dst_page_lens, dst_token_lens, dst_head_offsets = layout.geometry[1]
    whole = (
        (dst_head_offsets == 0)
        & (layout.slice_lens == dst_token_lens)
        & (dst_page_lens == layout.page_size * dst_token_lens)
        & (dst_page_lens > 0)
    )
    if not whole.all():
        entry = int(np.flatnonzero(~whole)[0])
        raise PlanValidationError(
            f"entry {entry}: staged pages would not be whole destination pages (a "
            f"{int(layout.slice_lens[entry])}-byte slice at offset "
            f"{int(dst_head_offsets[entry])} of each {int(dst_token_lens[entry])}-byte token "
            f"slot, {layout.page_size} slots in a {int(dst_page_lens[entry])}-byte page): "
            "send it with per-token descriptors"
        )


def _staged_pages(layout: HeadSliceLayout, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """Python ints [entries]: where each entry's staged pages start and end in the staging."""
    sizes = layout.geometry[1, 1].astype(object) * int(num_pages)
    ends = np.cumsum(sizes)
    return ends - sizes, ends


def _copy_table(layout: HeadSliceLayout, num_pages: int) -> np.ndarray:
    """int64 [entries, 7], the kernel's `entries` in bytes (checked: no sum overflows).

    Columns: source address of page 0's first slice, source page and token
    lengths, offset of the first staged slice, staged page and token lengths,
    slice length.
    """
    src_ptrs, src_page_lens, src_token_lens, src_offsets = layout.geometry[0]
    _, dst_page_lens, dst_token_lens, dst_offsets = layout.geometry[1]
    return np.stack(
        [
            src_ptrs + src_offsets,
            src_page_lens,
            src_token_lens,
            _staged_pages(layout, num_pages)[0].astype(np.int64) + dst_offsets,
            dst_page_lens,
            dst_token_lens,
            layout.slice_lens,
        ],
        axis=1,
    )


def compile_kernels() -> None:
    """Compile the CPU loop now (or load it from Numba's cache), so no send waits for it."""
    gather_loop(np.zeros((1, 7), dtype=np.int64), np.zeros(0, dtype=np.int64), 1)
