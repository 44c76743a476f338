"""Token slots -> page indices for the host and device page spaces in one launch.

Everything is ordered (host, device), as in `gp.PageIndices`; the host space is
optional (`kv_to_page_indices` converts one slot tensor, as the device space).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import PAGES
from gpu_planner.kernels.launcher import LaunchTarget, launch


@triton.jit
def _floor_div(numerator, denominator):
    """Floor division, whatever the backend's integer `//` rounding (C truncates, NumPy floors)."""
    quotient = numerator // denominator
    remainder = numerator - quotient * denominator
    rounds_up = (remainder != 0) & ((remainder < 0) != (denominator < 0))
    return tl.where(rounds_up, quotient - 1, quotient)


# Sizes, strides and counts are never specialised (one compile serves every
# request), and the caller's slot tensors may be views at any address.
@triton.jit(
    do_not_specialize=[
        "host_slots_stride",
        "device_slots_stride",
        "start_token",
        "num_pages",
        "page_size",
    ],
    do_not_specialize_on_alignment=["host_slots_ptr", "device_slots_ptr"],
)
def _page_indices_kernel(
    host_slots_ptr,  # int32/int64 [*]: the host slot tensor (unused without HAS_HOST)
    host_slots_stride: tl.int64,  # its element stride
    device_slots_ptr,  # int32/int64 [*]: the req_to_token row (device page space)
    device_slots_stride: tl.int64,  # its element stride
    host_pages_ptr,  # out, dtype of host_slots [num_pages]
    device_pages_ptr,  # out, dtype of device_slots [num_pages]
    start_token: tl.int64,  # first token of the range
    num_pages: tl.int64,  # pages in the range: cdiv(end - start, page_size)
    page_size: tl.int64,  # tokens per page
    HAS_HOST: tl.constexpr,  # convert host slots too
    BLOCK: tl.constexpr,  # pages per program
):
    page = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    page_in_range = page < num_pages
    token = start_token + page * page_size
    if HAS_HOST:
        host_slot = tl.load(host_slots_ptr + token * host_slots_stride, mask=page_in_range, other=0)
        tl.store(host_pages_ptr + page, _floor_div(host_slot, page_size), mask=page_in_range)
    device_slot = tl.load(
        device_slots_ptr + token * device_slots_stride, mask=page_in_range, other=0
    )
    tl.store(device_pages_ptr + page, _floor_div(device_slot, page_size), mask=page_in_range)


def launch_page_indices(
    host_slots: torch.Tensor | None,
    device_slots: torch.Tensor,
    start: int,
    end: int,
    page_size: int,
    target: LaunchTarget | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(host pages or None, device pages) of tokens [start, end) with step `page_size`.

    Launches on the current CUDA device and stream (through the cached compiled
    kernel when `target` has a stream): the caller guards the device.
    """
    num_pages = -(-(end - start) // page_size) if end > start else 0
    device_pages = torch.empty(num_pages, dtype=device_slots.dtype, device=device_slots.device)
    host_pages = None
    if host_slots is not None:
        host_pages = torch.empty(num_pages, dtype=host_slots.dtype, device=host_slots.device)
    if num_pages:
        host_source = device_slots if host_slots is None else host_slots
        launch(
            _page_indices_kernel,
            (PAGES.num_programs(num_pages),),
            (host_source.dtype, device_slots.dtype, host_slots is not None),
            target,
            (
                host_source,
                host_source.stride(0),
                device_slots,
                device_slots.stride(0),
                device_pages if host_pages is None else host_pages,
                device_pages,
                start,
                num_pages,
                page_size,
            ),
            {"HAS_HOST": host_slots is not None, "BLOCK": PAGES.block},
            PAGES.num_warps,
        )
    return host_pages, device_pages
