"""The tile, the copy and the launch shape the head-slice gather and scatter kernels share.

Both kernels copy one head slice per token between paged KV buffers and
consecutive staged pages, one [BLOCK_TOKENS, BLOCK_LANES] tile of one entry
(a K or V buffer of one layer) per program: row `k` is token `k % PAGE_SIZE`
of staged page `k // PAGE_SIZE`. The grid is (token blocks x lane blocks,
entries): tokens on the x axis, which has no practical limit, entries on the
y axis (at most 65535, checked by the callers). The kernels differ only in
which side a page list indexes (`copy_slices`' `src_page` and `dst_page`).

Addresses: the KV buffers are raw int64 addresses (sglang's data_ptrs),
reached as int64 lane offsets from the staging tensor's pointer: plain
pointer arithmetic, the same compiled for CUDA and under the Triton
interpreter (where the staging tensor's pointer is a host address).

Copy unit: the widest lane (8, 4, 2 or 1 bytes) that divides every address,
page, token and slice length. When all of them are also multiples of 16
bytes (heads of 16+ bytes in allocator-aligned buffers: any bf16 head of 8+
dims), `tl.multiple_of` says so and the compiler emits 128-bit loads and
stores (two int64 lanes), the widest global access on NVIDIA GPUs; rows are
whole slices, so a warp reads and writes contiguous runs of at least a
slice. A 16 KiB tile per program (8 such accesses per thread) keeps enough
bytes in flight to stream at copy bandwidth. Byte lanes are the fallback for
odd geometries.

Variants: the page dtypes, the page size, the copy unit (lane and vector)
and the tile shape (from the widest slice), and whether the staging pointer
is 16-byte aligned. Counts are `do_not_specialize` and the page lists and
entries table `do_not_specialize_on_alignment`, so nothing else can vary: a
server's KV geometry fixes the set, which `gpu_planner.warmup.warm_up_slice_copies`
compiles before any request copies (`SliceCopies` says how it is derived).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import HEAD_SLICES

COPY_COLUMNS = 7  # src_base, src_page_len, src_token_len, dst_base, dst_page_len,
# dst_token_len, slice_len: the copy's columns of an entries row, in lanes in the kernels
_LANES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}  # lane bytes -> lane type
_VECTOR_BYTES = 16  # the widest global load/store on NVIDIA GPUs


@triton.jit
def token_tile(
    entries_ptr,
    num_tokens,
    lane_blocks,
    ENTRY_WIDTH: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_LANES: tl.constexpr,
):
    """This program's entries row, and its tokens' staged page positions, slots and lanes."""
    entry_ptr = entries_ptr + tl.program_id(1) * ENTRY_WIDTH
    token_block = tl.program_id(0) // lane_blocks
    lane_block = tl.program_id(0) % lane_blocks
    token = token_block.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    lane = lane_block * BLOCK_LANES + tl.arange(0, BLOCK_LANES)
    token_in_range = token < num_tokens
    return entry_ptr, token // PAGE_SIZE, token % PAGE_SIZE, lane, token_in_range


@triton.jit
def copy_slices(
    staging_ptr,
    entry_ptr,
    src_page,
    dst_page,
    slot,
    lane,
    token_in_range,
    LANE: tl.constexpr,
    VECTOR: tl.constexpr,
):
    """Copy each token's slice from slot `slot` of `src_page` to the same slot of `dst_page`.

    Pages index the entry's page lengths on their side (one side's pages are
    the staged positions); `VECTOR` > 1 says every row and slice is a whole
    number of 16-byte vectors.
    """
    src_row = tl.load(entry_ptr) + src_page * tl.load(entry_ptr + 1)
    src_row += slot * tl.load(entry_ptr + 2)
    dst_row = tl.load(entry_ptr + 3) + dst_page * tl.load(entry_ptr + 4)
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


@dataclass(frozen=True)
class LaunchShape:
    """One launch's entries in lanes (on the staging's device), grid and constexprs."""

    entries: torch.Tensor
    grid: tuple[int, int]
    lane_blocks: int
    options: dict[str, object]


def launch_shape(
    staging: torch.Tensor, entries: np.ndarray, kv_base: int, num_tokens: int, page_size: int
) -> LaunchShape:
    """`entries` (bytes; columns as `COPY_COLUMNS`, then any others) in the widest common lane.

    Column `kv_base` (0 for the gather's sources, 3 for the scatter's
    destinations) holds the KV's absolute addresses, which become offsets
    from the staging's pointer; the other base is already one.
    """
    staging_address = staging.data_ptr()
    unit = _copy_unit(entries[:, :COPY_COLUMNS], staging_address)
    lane_bytes = min(unit, 8)
    lanes = entries.copy()
    lanes[:, kv_base] -= staging_address  # both in [0, 2**63): the difference fits
    lanes[:, :COPY_COLUMNS] //= lane_bytes  # exact: every value is a multiple of the lane
    widest = int(lanes[:, 6].max())
    block_lanes = min(triton.next_power_of_2(widest), HEAD_SLICES.block)
    block_tokens = HEAD_SLICES.block // block_lanes
    lane_blocks = triton.cdiv(widest, block_lanes)
    return LaunchShape(
        entries=on_device(torch.from_numpy(lanes), staging.device),
        grid=(triton.cdiv(num_tokens, block_tokens) * lane_blocks, len(entries)),
        lane_blocks=lane_blocks,
        options={
            "PAGE_SIZE": page_size,
            "LANE": _LANES[lane_bytes],
            "VECTOR": unit // lane_bytes,
            "BLOCK_TOKENS": block_tokens,
            "BLOCK_LANES": block_lanes,
            "num_warps": HEAD_SLICES.num_warps,
        },
    )


def _copy_unit(entries: np.ndarray, staging_address: int) -> int:
    """The bytes every address and length in `entries` (and the staging address) are a multiple of.

    A power of two up to 16: the gcd with 16 of all of them.
    """
    return math.gcd(int(np.gcd.reduce(entries, axis=None)), staging_address, _VECTOR_BYTES)


def on_device(values: torch.Tensor, torch_device: torch.device) -> torch.Tensor:
    """`values` on `torch_device`; host values go through pinned memory, with no host wait."""
    if values.device == torch_device or torch_device.type != "cuda":
        return values
    if values.device.type == "cuda":
        return values.to(torch_device)
    return values.pin_memory().to(torch_device, non_blocking=True)
