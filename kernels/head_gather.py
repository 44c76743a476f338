"""Gather every token's head slice into a staging region laid out as the destination pages.

Each program copies a tile of one entry (`gpu_planner.kernels.slice_copy`:
the tile, the addresses, the copy unit): token `k % PAGE_SIZE` of staged
page `k // PAGE_SIZE` is read from its source page's token slot at the
source head offset and written to the same slot of the staged page at the
destination head offset.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_planner.kernels.slice_copy import copy_slices, launch_shape, on_device, token_tile


@triton.jit(
    do_not_specialize=["num_tokens", "lane_blocks"],
    do_not_specialize_on_alignment=["src_pages_ptr", "entries_ptr"],
)
def _gather_head_slices_kernel(
    staging_ptr,  # uint8: the staging region; every address is a lane offset from it
    src_pages_ptr,  # int32/int64 [pages]: the source page of each staged page
    entries_ptr,  # int64 [entries, 7], in lanes: src_base (from staging_ptr), src_page_len,
    # src_token_len, dst_base (from staging_ptr), dst_page_len, dst_token_len, slice_len
    num_tokens: tl.int64,  # pages * PAGE_SIZE
    lane_blocks: tl.int64,  # lane blocks of the widest slice
    PAGE_SIZE: tl.constexpr,  # a server has one: `//` and `%` by it compile to shifts
    LANE: tl.constexpr,  # the copy unit: int64, int32, int16 or uint8
    VECTOR: tl.constexpr,  # lanes per 16-byte vector when all is 16-byte aligned, else 1
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_LANES: tl.constexpr,
):
    entry_ptr, position, slot, lane, token_in_range = token_tile(
        entries_ptr, num_tokens, lane_blocks, 7, PAGE_SIZE, BLOCK_TOKENS, BLOCK_LANES
    )
    page = tl.load(src_pages_ptr + position, mask=token_in_range, other=0).to(tl.int64)
    copy_slices(staging_ptr, entry_ptr, page, position, slot, lane, token_in_range, LANE, VECTOR)


def launch_gather_head_slices(
    staging: torch.Tensor, src_pages: torch.Tensor, entries: np.ndarray, page_size: int
) -> None:
    """Copy every entry's head slices of `src_pages` into `staging` (current device and stream).

    Args:
        staging: 1-D contiguous uint8 tensor on the KV's device.
        src_pages: int32/int64 [pages], on `staging`'s device or in host memory.
        entries: int64 [entries, 7] in bytes: src_base (absolute address of
            the head slice of slot 0 of page 0), src_page_len, src_token_len,
            dst_base (its offset in `staging`), dst_page_len, dst_token_len,
            slice_len; checked by the caller (every copy within its source
            buffer and its staged page, at most 65535 entries).
    """
    num_tokens = len(src_pages) * page_size
    if num_tokens == 0 or not entries.size or not entries[:, 6].any():
        return
    shape = launch_shape(staging, entries, 0, num_tokens, page_size)
    _gather_head_slices_kernel[shape.grid](
        staging,
        on_device(src_pages.contiguous(), staging.device),
        shape.entries,
        num_tokens,
        shape.lane_blocks,
        **shape.options,
    )
