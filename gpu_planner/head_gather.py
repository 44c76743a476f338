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
`PlanValidationError` names the argument, layer and page at fault. Reads stay
in the registered source buffers (`src_lens`: the largest page's last slice
ends inside each), writes in the staging region (each slice inside its staged
page; the region large enough and apart from the sources).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import HeadSliceLayout, PerLayer, per_layer
from gpu_planner.host_copy import gather_loop
from gpu_planner.inputs import (
    HOST,
    INT64_MAX,
    Backend,
    IndexLike,
    PageList,
    as_host_array,
    as_page_list,
    as_tensor,
    is_integer,
    negative_page_error,
    resolve_backend,
)
from gpu_planner.kernels.launch_config import MAX_GRID_Y
from gpu_planner.layout import BufferLayout
from gpu_planner.plan import plan_transfer


@dataclass(frozen=True)
class HostRegion:
    """Host memory by address and size, such as a region registered with Mooncake."""

    address: int
    nbytes: int


Staging = torch.Tensor | np.ndarray | HostRegion


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
        PlanValidationError: naming the argument, layer or page at fault,
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
    _check_layout(layout)
    pages = as_page_list(src_pages, "src_pages")
    largest_page = _largest_page(pages, "src_pages")
    staging, backend = staging_and_backend(staging, backend, layout.num_layers)
    staging_address, staging_len = _address_and_nbytes(staging)
    _check_copies(layout, len(pages), largest_page, staging_address, staging_len, src_lens)
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
    _check_layout(layout)
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
        src_ptrs=int(staging_address) + _staged_offsets(layout, num_pages),
        dst_ptrs=layout.geometry[1, 0],
        item_lens=dst_page_lens,
        src_lens=num_pages * dst_page_lens,
    )
    if isinstance(pages, torch.Tensor):
        positions = torch.arange(num_pages, dtype=torch.int64, device=pages.device)
    else:
        positions = np.arange(num_pages, dtype=np.int64)
    return plan_transfer(positions, pages, staged, backend=backend).columns_array()


def _check_layout(layout: HeadSliceLayout) -> None:
    if not isinstance(layout, HeadSliceLayout):
        raise PlanValidationError(
            f"layout: expected a HeadSliceLayout (HeadSliceLayout.build, chunk_layout), got "
            f"{type(layout).__name__}"
        )


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
            f"layer {entry}: staged pages would not be whole destination pages (a "
            f"{int(layout.slice_lens[entry])}-byte slice at offset "
            f"{int(dst_head_offsets[entry])} of each {int(dst_token_lens[entry])}-byte token "
            f"slot, {layout.page_size} slots in a {int(dst_page_lens[entry])}-byte page): "
            "send it with per-token descriptors"
        )


def staging_and_backend(
    staging: Staging, backend: Backend | None, num_entries: int
) -> tuple[torch.Tensor | np.ndarray, Backend]:
    """`staging` as bytes, and the backend that copies through it (gather and scatter alike).

    `PlanValidationError` for the compiled loop on device staging, or more
    entries than the kernel's grid takes.
    """
    staging = _as_staging(staging)
    torch_device = staging.device if isinstance(staging, torch.Tensor) else HOST
    backend = resolve_backend(backend, torch_device)
    if backend == "cpu" and torch_device != HOST:
        raise PlanValidationError(
            f"backend='cpu': the compiled loop needs staging in host memory, got {torch_device}"
        )
    if backend == "triton" and num_entries > MAX_GRID_Y:
        raise PlanValidationError(
            f"layout: {num_entries} entries in one call; the kernel takes at most {MAX_GRID_Y}"
        )
    return staging, backend


def _largest_page(pages: PageList, name: str) -> int:
    """The largest page (-1 when empty); a negative one raises, naming its position."""
    if not len(pages):
        return -1
    if isinstance(pages, np.ndarray):
        smallest, largest = int(pages.min()), int(pages.max())
    else:
        smallest, largest = (int(value) for value in torch.aminmax(pages))
    if smallest < 0:
        position = int(np.flatnonzero(as_host_array(pages) < 0)[0])
        raise negative_page_error(name, position, int(pages[position]))
    return largest


def _as_staging(staging: Staging) -> torch.Tensor | np.ndarray:
    """`staging` as a writable 1-D contiguous uint8 tensor or array (a host region is viewed)."""
    if isinstance(staging, HostRegion):
        address, nbytes = staging.address, staging.nbytes
        for name, value in (("address", address), ("nbytes", nbytes)):
            if not (is_integer(value) and 0 <= value <= INT64_MAX):
                raise PlanValidationError(
                    f"staging.{name}: must be an integer in [0, 2**63), got {value!r}"
                )
        if address + nbytes > INT64_MAX or (address == 0 and nbytes):
            raise PlanValidationError(f"staging: {nbytes} bytes at {address} is not a host region")
        if not nbytes:
            return np.empty(0, dtype=np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    if isinstance(staging, np.ndarray):
        usable = staging.dtype == np.uint8 and staging.ndim == 1 and staging.flags.c_contiguous
        if usable and staging.flags.writeable:
            return staging
    elif isinstance(staging, torch.Tensor):
        usable = staging.dtype == torch.uint8 and staging.dim() == 1 and staging.is_contiguous()
        if usable:
            return staging
    raise PlanValidationError(
        "staging: expected a 1-D contiguous uint8 torch tensor, a writable 1-D contiguous "
        f"uint8 NumPy array or a HostRegion, got {_describe(staging)}"
    )


def _describe(value: object) -> str:
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__


def _address_and_nbytes(staging: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(staging, torch.Tensor):
        return staging.data_ptr(), staging.numel()
    return staging.ctypes.data, staging.size


def _staged_offsets(layout: HeadSliceLayout, num_pages: int) -> np.ndarray:
    """int64 [entries]: where each entry's staged pages start in the staging region."""
    starts = itertools.accumulate(layout.geometry[1, 1, :-1].tolist(), initial=0)
    return np.array([start * num_pages for start in starts], dtype=np.int64)


def _check_copies(
    layout: HeadSliceLayout,
    num_pages: int,
    largest_page: int,
    staging_address: int,
    staging_len: int,
    src_lens: PerLayer,
) -> None:
    """Every read inside its registered source buffer, every write inside its staged page.

    Python ints (object arrays) over the entries: no sum can overflow.
    """
    src_ptrs, src_page_lens, src_token_lens, src_offsets = layout.geometry[0].astype(object)
    _, dst_page_lens, dst_token_lens, dst_offsets = layout.geometry[1].astype(object)
    slice_lens = layout.slice_lens.astype(object)
    registered = per_layer(src_lens, "src_lens", layout.num_layers).astype(object)
    past_int64 = np.flatnonzero(src_ptrs + registered > INT64_MAX)
    if past_int64.size:
        entry = int(past_int64[0])
        raise PlanValidationError(
            f"src_lens[{entry}] = {registered[entry]}: the source buffer at {src_ptrs[entry]} "
            "would end past 2**63 - 1"
        )
    last_slot = layout.page_size - 1
    slice_ends = last_slot * dst_token_lens + dst_offsets + slice_lens
    outside_page = np.flatnonzero(slice_ends > dst_page_lens)
    if outside_page.size:
        entry = int(outside_page[0])
        raise PlanValidationError(
            f"layer {entry}: the head slice of token slot {last_slot} ends at byte "
            f"{slice_ends[entry]} of a {dst_page_lens[entry]}-byte destination page "
            "(dst_token_lens, dst_head_offsets, slice_lens)"
        )
    needed = staging_nbytes(layout, num_pages)
    if staging_len < needed:
        raise PlanValidationError(
            f"staging: has {staging_len} bytes but {num_pages} pages of this chunk need {needed}"
        )
    if not num_pages:
        return
    read_ends = largest_page * src_page_lens + last_slot * src_token_lens + src_offsets
    read_ends += slice_lens
    outside_source = np.flatnonzero(read_ends > registered)
    if outside_source.size:
        entry = int(outside_source[0])
        raise PlanValidationError(
            f"layer {entry}: page {largest_page} (src_pages) reads up to byte "
            f"{read_ends[entry]} of its source buffer, but src_lens[{entry}] = "
            f"{registered[entry]}"
        )
    overlapping = np.flatnonzero(
        (registered > 0)
        & (src_ptrs < staging_address + needed)
        & (src_ptrs + registered > staging_address)
    )
    if needed and overlapping.size:
        entry = int(overlapping[0])
        raise PlanValidationError(
            f"staging: its {needed} bytes at {staging_address} overlap the source buffer of "
            f"layer {entry} ({registered[entry]} bytes at {src_ptrs[entry]})"
        )


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
            _staged_offsets(layout, num_pages) + dst_offsets,
            dst_page_lens,
            dst_token_lens,
            layout.slice_lens,
        ],
        axis=1,
    )


def compile_kernels() -> None:
    """Compile the CPU loop now (or load it from Numba's cache), so no send waits for it."""
    gather_loop(np.zeros((1, 7), dtype=np.int64), np.zeros(0, dtype=np.int64), 1)
