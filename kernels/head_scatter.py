"""Scatter staged head slices into destination pages: the mirror of `head_gather`'s kernel.

Each program copies a tile of one entry (`gpu_planner.kernels.slice_copy`:
the tile, the addresses, the copy unit): token `k % PAGE_SIZE` of staged
page `k // PAGE_SIZE` is read from the staged page's slot at the staged head
offset and written to the same slot of its destination page at the
destination head offset. The destination page comes from one of two page
lists (HiSparse: host-backed and device-backed buffers number their pages
differently), picked per entry by the entries table's last column, so both
spaces take one launch.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_planner.kernels.slice_copy import copy_slices, launch_shape, on_device, token_tile


@triton.jit(
    do_not_specialize=["num_tokens", "lane_blocks"],
    do_not_specialize_on_alignment=["dst_pages_ptr", "dst_device_pages_ptr", "entries_ptr"],
)
def _scatter_head_slices_kernel(
    staging_ptr,  # uint8: the staging region; every address is a lane offset from it
    dst_pages_ptr,  # int32/int64 [pages]: host-space destination page of each staged page
    dst_device_pages_ptr,  # int32/int64 [pages]: device-space destination pages
    entries_ptr,  # int64 [entries, 8]: src_base (from staging_ptr), src_page_len,
    # src_token_len, dst_base (from staging_ptr), dst_page_len, dst_token_len, slice_len
    # (all in lanes), then the page space (0: dst_pages, 1: dst_device_pages)
    num_tokens: tl.int64,  # pages * PAGE_SIZE
    lane_blocks: tl.int64,  # lane blocks of the widest slice
    PAGE_SIZE: tl.constexpr,
    LANE: tl.constexpr,  # the copy unit: int64, int32, int16 or uint8
    VECTOR: tl.constexpr,  # lanes per 16-byte vector when all is 16-byte aligned, else 1
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_LANES: tl.constexpr,
):
    entry_ptr, position, slot, lane, token_in_range = token_tile(
        entries_ptr, num_tokens, lane_blocks, 8, PAGE_SIZE, BLOCK_TOKENS, BLOCK_LANES
    )
    space = tl.load(entry_ptr + 7)
    host_page_read = token_in_range & (space == 0)  # only the entry's own list is read
    device_page_read = token_in_range & (space != 0)
    host_page = tl.load(dst_pages_ptr + position, mask=host_page_read, other=0)
    device_page = tl.load(dst_device_pages_ptr + position, mask=device_page_read, other=0)
    page = tl.where(space != 0, device_page.to(tl.int64), host_page.to(tl.int64))
    copy_slices(staging_ptr, entry_ptr, position, page, slot, lane, token_in_range, LANE, VECTOR)


def launch_scatter_head_slices(
    staging: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_device_pages: torch.Tensor | None,
    entries: np.ndarray,
    page_size: int,
) -> None:
    """Copy every entry's staged slices into its destination pages (current device and stream).

    Args:
        staging: 1-D contiguous uint8 tensor on the KV's device.
        dst_pages, dst_device_pages: int32/int64 [pages] host- and device-space
            pages, on `staging`'s device or in host memory; None: no entry
            uses the device space.
        entries: int64 [entries, 8] in bytes: src_base (offset in `staging`
            of the head slice of slot 0 of staged page 0), src_page_len,
            src_token_len, dst_base (absolute address of the head slice of
            slot 0 of page 0), dst_page_len, dst_token_len, slice_len, then
            1 for entries of the device space, else 0; checked by the caller
            (every copy within the staging and its destination buffer and
            page, at most 65535 entries).
    """
    num_tokens = len(dst_pages) * page_size
    if num_tokens == 0 or not entries.size or not entries[:, 6].any():
        return
    shape = launch_shape(staging, entries, 3, num_tokens, page_size)
    host_pages = on_device(dst_pages.contiguous(), staging.device)
    device_pages = host_pages
    if dst_device_pages is not None:
        device_pages = on_device(dst_device_pages.contiguous(), staging.device)
    _scatter_head_slices_kernel[shape.grid](
        staging,
        host_pages,
        device_pages,
        shape.entries,
        num_tokens,
        shape.lane_blocks,
        **shape.options,
    )
