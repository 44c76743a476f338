"""What the head-slice gather and scatter share: the staging argument, the backend and the checks.

Both copy one head slice per token between paged KV buffers (the gather's
sources, the scatter's destinations) and a staging region of consecutive
staged pages (`gpu_planner.head_gather`, `gpu_planner.head_scatter`). The
checks here keep every copy inside its registered KV buffer, its destination
page and the staging, and the staging apart from the KV buffers, before a
byte moves. Sums run over Python ints (object arrays): none can overflow.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import SIDES, HeadSliceLayout, PerLayer, per_layer
from gpu_planner.inputs import (
    HOST,
    INT64_MAX,
    Backend,
    PageList,
    as_host_array,
    is_integer,
    negative_page_error,
    resolve_backend,
)
from gpu_planner.kernels.launch_config import MAX_GRID_Y

_ROLES = ("source", "destination")  # by layout side
_SPACES = ("host", "device")  # by page space


@dataclass(frozen=True)
class HostRegion:
    """Host memory by address and size, such as a region registered with Mooncake."""

    address: int
    nbytes: int


Staging = torch.Tensor | np.ndarray | HostRegion


def check_layout(layout: HeadSliceLayout) -> None:
    """`PlanValidationError` unless `layout` is a `HeadSliceLayout`."""
    if not isinstance(layout, HeadSliceLayout):
        raise PlanValidationError(
            f"layout: expected a HeadSliceLayout (HeadSliceLayout.build, chunk_layout), got "
            f"{type(layout).__name__}"
        )


def largest_page(pages: PageList, name: str) -> int:
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


def staging_and_backend(
    staging: Staging, backend: Backend | None, num_entries: int
) -> tuple[torch.Tensor | np.ndarray, Backend, int, int]:
    """`staging` as bytes, the backend that copies through it, and its address and size.

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
    if isinstance(staging, torch.Tensor):
        return staging, backend, staging.data_ptr(), staging.numel()
    return staging, backend, staging.ctypes.data, staging.size


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


def check_copies(
    layout: HeadSliceLayout,
    paged_side: int,
    num_pages: int,
    registered: PerLayer,
    largest_pages: tuple[int, ...],
    staging: tuple[int, int],
    staged: tuple[np.ndarray, np.ndarray],
    spaces: np.ndarray | None = None,
) -> None:
    """Every copy inside its KV buffer, its destination page and the staging; the two apart.

    Args:
        layout: the copies' geometry; side `paged_side` is the paged KV
            buffers (0: the gather reads them, 1: the scatter writes them),
            the other side the staged pages.
        num_pages: the pages each entry copies.
        registered: the registered bytes of each entry's KV buffer.
        largest_pages: the largest page of each page list, by page space.
        staging: the staging's address and size in bytes.
        staged: per entry, the first and the end byte of the staging its
            copies use (offsets from the staging's start; any values when
            there are no pages).
        spaces: per entry, the page space whose list it takes (0 host, 1
            device); None: every entry takes the one list.
    """
    prefix, role = SIDES[paged_side], _ROLES[paged_side]
    paged_verb, staged_verb = (("reads", "writes"), ("writes", "reads"))[paged_side]
    lens_name = f"{prefix}_lens"
    ptrs, page_lens, token_lens, offsets = layout.geometry[paged_side].astype(object)
    _, dst_page_lens, dst_token_lens, dst_offsets = layout.geometry[1].astype(object)
    slice_lens = layout.slice_lens.astype(object)
    registered = per_layer(registered, lens_name, layout.num_layers).astype(object)
    past_int64 = np.flatnonzero(ptrs + registered > INT64_MAX)
    if past_int64.size:
        entry = int(past_int64[0])
        raise PlanValidationError(
            f"{lens_name}[{entry}] = {registered[entry]}: the {role} buffer at {ptrs[entry]} "
            "would end past 2**63 - 1"
        )
    last_slot = layout.page_size - 1
    slice_ends = last_slot * dst_token_lens + dst_offsets + slice_lens
    outside_page = np.flatnonzero(slice_ends > dst_page_lens)
    if outside_page.size:
        entry = int(outside_page[0])
        raise PlanValidationError(
            f"entry {entry}: the head slice of token slot {last_slot} ends at byte "
            f"{slice_ends[entry]} of a {dst_page_lens[entry]}-byte destination page "
            "(dst_token_lens, dst_head_offsets, slice_lens)"
        )
    if not (num_pages and layout.num_layers):  # no copies
        return
    staging_address, staging_len = staging
    staged_starts, staged_ends = staged
    staged_page_lens = layout.geometry[1 - paged_side, 1]
    past_staging = np.flatnonzero(staged_ends > staging_len)
    if past_staging.size:
        entry = int(past_staging[0])
        raise PlanValidationError(
            f"staging: has {staging_len} bytes but entry {entry} {staged_verb} "
            f"up to byte {staged_ends[entry]} of it ({num_pages} staged pages of "
            f"{staged_page_lens[entry]} bytes, from byte {staged_starts[entry]})"
        )
    spaces_given = spaces is not None
    spaces = spaces.astype(np.intp) if spaces_given else np.zeros(layout.num_layers, np.intp)
    largest = np.array(largest_pages, dtype=object)[spaces]
    ends = largest * page_lens + last_slot * token_lens + offsets + slice_lens
    outside_buffer = np.flatnonzero(ends > registered)
    if outside_buffer.size:
        entry = int(outside_buffer[0])
        space = _SPACES[spaces[entry]]
        page_list = f"{prefix}_pages" if space == "host" else f"{prefix}_device_pages"
        message = (
            f"entry {entry}: page {largest[entry]} ({page_list}) {paged_verb} up to byte "
            f"{ends[entry]} of its {role} buffer, but {lens_name}[{entry}] = {registered[entry]}"
        )
        if spaces_given:
            message += f"; the entry is {space}-backed: is the {space} page space right?"
        raise PlanValidationError(message)
    used_start = staging_address + int(staged_starts.min())
    used_end = staging_address + int(staged_ends.max())
    overlapping = np.flatnonzero(
        (registered > 0) & (ptrs < used_end) & (ptrs + registered > used_start)
    )
    if used_end > used_start and overlapping.size:
        entry = int(overlapping[0])
        raise PlanValidationError(
            f"staging: the {used_end - used_start} bytes {('written', 'read')[paged_side]} at "
            f"{used_start} overlap the {role} buffer of entry {entry} ({registered[entry]} bytes "
            f"at {ptrs[entry]})"
        )
