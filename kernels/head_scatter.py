"""Scatter staged head slices into destination pages: the mirror of `head_gather`'s kernel.

One program copies a [BLOCK_TOKENS, BLOCK_LANES] tile of one entry (a K or V
buffer of one layer): row `k` is token `k % PAGE_SIZE` of staged page
`k // PAGE_SIZE`, read from the staged page's slot at the staged head offset
and written to the same slot of its destination page at the destination
head offset. The destination page comes from one of two page lists (HiSparse:
host-backed and device-backed buffers number their pages differently), picked
per entry by the entries table's last column, so both spaces take one launch.
The grid is (token blocks x lane blocks, entries), as the gather's.

Addresses, copy unit (8/4/2/1-byte lanes from the gcd of every address and
length, 16-byte vectors via `tl.multiple_of`) and tile sizes are the gather's:
see `gpu_planner.kernels.head_gather`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_planner.kernels.head_gather import _LANES, _copy_unit, _on_device
from gpu_planner.kernels.launch_config import GATHER

SCATTER = GATHER  # the same copy, page indirection on the other side: the same tile


@triton.jit(do_not_specialize=["num_tokens", "lane_blocks"])
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
    entry_ptr = entries_ptr + tl.program_id(1) * 8
    token_block = tl.program_id(0) // lane_blocks
    lane_block = tl.program_id(0) % lane_blocks
    token = token_block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    lane = lane_block * BLOCK_LANES + tl.arange(0, BLOCK_LANES)

    token_in_range = token < num_tokens
    position = token // PAGE_SIZE
    slot = token % PAGE_SIZE
    space = tl.load(entry_ptr + 7)
    host_page_read = token_in_range & (space == 0)  # only the entry's own list is read
    device_page_read = token_in_range & (space != 0)
    host_page = tl.load(dst_pages_ptr + position, mask=host_page_read, other=0)
    device_page = tl.load(dst_device_pages_ptr + position, mask=device_page_read, other=0)
    page = tl.where(space != 0, device_page.to(tl.int64), host_page.to(tl.int64))
    src_row = tl.load(entry_ptr) + position * tl.load(entry_ptr + 1)
    src_row += slot * tl.load(entry_ptr + 2)
    dst_row = tl.load(entry_ptr + 3) + page * tl.load(entry_ptr + 4)
    dst_row += slot * tl.load(entry_ptr + 5)
    slice_len = tl.load(entry_ptr + 6)
    if VECTOR > 1:
        src_row = tl.multiple_of(src_row, VECTOR)
        dst_row = tl.multiple_of(dst_row, VECTOR)
        slice_len = tl.multiple_of(slice_len, VECTOR)
    lane_in_slice = lane < slice_len
    copy_mask = token_in_range[:, None] & lane_in_slice[None, :]

    lanes_ptr = staging_ptr.to(tl.pointer_type(LANE))
    tile = tl.load(lanes_ptr + src_row[:, None] + lane[None, :], mask=copy_mask)
    tl.store(lanes_ptr + dst_row[:, None] + lane[None, :], tile, mask=copy_mask)


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
    staging_address = staging.data_ptr()
    copy_columns = entries[:, :7]
    unit = _copy_unit(copy_columns, staging_address)
    lane_bytes = min(unit, 8)
    lanes = entries.copy()
    lanes[:, 3] -= staging_address  # both in [0, 2**63): the difference fits
    lanes[:, :7] //= lane_bytes  # exact: every value is a multiple of the lane
    widest = int(lanes[:, 6].max())
    block_lanes = min(triton.next_power_of_2(widest), SCATTER.block)
    block_tokens = SCATTER.block // block_lanes
    lane_blocks = triton.cdiv(widest, block_lanes)
    grid = (triton.cdiv(num_tokens, block_tokens) * lane_blocks, len(entries))
    host_pages = _on_device(dst_pages.contiguous(), staging.device)
    device_pages = host_pages
    if dst_device_pages is not None:
        device_pages = _on_device(dst_device_pages.contiguous(), staging.device)
    _scatter_head_slices_kernel[grid](
        staging,
        host_pages,
        device_pages,
        _on_device(torch.from_numpy(lanes), staging.device),
        num_tokens,
        lane_blocks,
        PAGE_SIZE=page_size,
        LANE=_LANES[lane_bytes],
        VECTOR=unit // lane_bytes,
        BLOCK_TOKENS=block_tokens,
        BLOCK_LANES=block_lanes,
        num_warps=SCATTER.num_warps,
    )
