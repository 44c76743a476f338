"""Gather every token's head slice into a staging region laid out as the destination pages.

One program copies a [BLOCK_TOKENS, BLOCK_LANES] tile of one entry (a K or V
buffer of one layer): row `k` is token `k % PAGE_SIZE` of staged page
`k // PAGE_SIZE`, read from its source page's token slot at the source head
offset and written to the same slot of the staged page at the destination
head offset. The grid is (token blocks x lane blocks, entries): tokens on the
x axis, which has no practical limit, entries on the y axis (at most 65535,
checked by the caller).

The KV buffers are raw int64 addresses (sglang's data_ptrs), reached as int64
lane offsets from the staging tensor's pointer: plain pointer arithmetic,
the same compiled for CUDA and under the Triton interpreter (where the
staging tensor's pointer is a host address).

Copy unit: the widest lane (8, 4, 2 or 1 bytes) that divides every address,
page, token and slice length. When all of them are also multiples of 16
bytes (heads of 16+ bytes in allocator-aligned buffers: any bf16 head of 8+
dims), `tl.multiple_of` says so and the compiler emits 128-bit loads and
stores (two int64 lanes), the widest global access on NVIDIA GPUs; rows are
whole slices, so a warp reads and writes contiguous runs of at least a
slice. A 16 KiB tile per program (8 such accesses per thread) keeps enough
bytes in flight to stream at copy bandwidth. Byte lanes are the fallback for
odd geometries.

Variants: the page dtype, the lane, the page size and the tile shape (from
the widest slice): all fixed for a server, so its first gather compiles them.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import GATHER

_LANES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}  # lane bytes -> lane type
_VECTOR_BYTES = 16  # the widest global load/store on NVIDIA GPUs


@triton.jit(do_not_specialize=["num_tokens", "lane_blocks"])
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
    entry_ptr = entries_ptr + tl.program_id(1) * 7
    token_block = tl.program_id(0) // lane_blocks
    lane_block = tl.program_id(0) % lane_blocks
    token = token_block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    lane = lane_block * BLOCK_LANES + tl.arange(0, BLOCK_LANES)

    token_in_range = token < num_tokens
    position = token // PAGE_SIZE
    slot = token % PAGE_SIZE
    page = tl.load(src_pages_ptr + position, mask=token_in_range, other=0).to(tl.int64)
    src_row = tl.load(entry_ptr) + page * tl.load(entry_ptr + 1) + slot * tl.load(entry_ptr + 2)
    dst_row = tl.load(entry_ptr + 3) + position * tl.load(entry_ptr + 4)
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


def _copy_unit(entries: np.ndarray, staging_address: int) -> int:
    """The bytes every address and length in `entries` (and the staging address) are a multiple of.

    A power of two up to 16: the gcd with 16 of all of them.
    """
    return math.gcd(int(np.gcd.reduce(entries, axis=None)), staging_address, _VECTOR_BYTES)


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
    staging_address = staging.data_ptr()
    unit = _copy_unit(entries, staging_address)
    lane_bytes = min(unit, 8)
    lanes = entries.copy()
    lanes[:, 0] -= staging_address  # both in [0, 2**63): the difference fits
    lanes //= lane_bytes  # exact: every value is a multiple of the lane
    block_lanes = min(triton.next_power_of_2(int(lanes[:, 6].max())), GATHER.block)
    block_tokens = GATHER.block // block_lanes
    lane_blocks = triton.cdiv(int(lanes[:, 6].max()), block_lanes)
    grid = (triton.cdiv(num_tokens, block_tokens) * lane_blocks, len(entries))
    _gather_head_slices_kernel[grid](
        staging,
        _on_device(src_pages.contiguous(), staging.device),
        _on_device(torch.from_numpy(lanes), staging.device),
        num_tokens,
        lane_blocks,
        PAGE_SIZE=page_size,
        LANE=_LANES[lane_bytes],
        VECTOR=unit // lane_bytes,
        BLOCK_TOKENS=block_tokens,
        BLOCK_LANES=block_lanes,
        num_warps=GATHER.num_warps,
    )


def _on_device(values: torch.Tensor, torch_device: torch.device) -> torch.Tensor:
    """`values` on `torch_device`; host values go through pinned memory, with no host wait."""
    if values.device == torch_device or torch_device.type != "cuda":
        return values
    if values.device.type == "cuda":
        return values.to(torch_device)
    return values.pin_memory().to(torch_device, non_blocking=True)
