"""Token slots -> page indices for the device and host page spaces in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_PAGES = 1024


@triton.jit
def _floor_div(numerator, denominator):
    """Floor division, whatever the backend's integer `//` rounding (C truncates, NumPy floors)."""
    quotient = numerator // denominator
    remainder = numerator - quotient * denominator
    rounds_up = (remainder != 0) & ((remainder < 0) != (denominator < 0))
    return tl.where(rounds_up, quotient - 1, quotient)


@triton.jit
def _page_indices_kernel(
    device_slots_ptr,
    device_slots_stride,
    host_slots_ptr,
    host_slots_stride,
    device_pages_ptr,
    host_pages_ptr,
    start_token,
    num_pages,
    page_size,
    HAS_HOST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    page = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    page_in_range = page < num_pages
    token = start_token + page.to(tl.int64) * page_size
    device_slot = tl.load(
        device_slots_ptr + token * device_slots_stride, mask=page_in_range, other=0
    )
    tl.store(device_pages_ptr + page, _floor_div(device_slot, page_size), mask=page_in_range)
    if HAS_HOST:
        host_slot = tl.load(host_slots_ptr + token * host_slots_stride, mask=page_in_range, other=0)
        tl.store(host_pages_ptr + page, _floor_div(host_slot, page_size), mask=page_in_range)


def launch_page_indices(
    device_slots: torch.Tensor,
    host_slots: torch.Tensor | None,
    start: int,
    end: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pages of tokens [start, end) with step `page_size` for one or two slot tensors."""
    num_pages = -(-(end - start) // page_size) if end > start else 0
    device_pages = torch.empty(num_pages, dtype=device_slots.dtype, device=device_slots.device)
    host_pages = None
    if host_slots is not None:
        host_pages = torch.empty(num_pages, dtype=host_slots.dtype, device=host_slots.device)
    if num_pages:
        grid = (triton.cdiv(num_pages, BLOCK_PAGES),)
        _page_indices_kernel[grid](
            device_slots,
            device_slots.stride(0),
            device_slots if host_slots is None else host_slots,
            device_slots.stride(0) if host_slots is None else host_slots.stride(0),
            device_pages,
            device_pages if host_pages is None else host_pages,
            start,
            num_pages,
            page_size,
            HAS_HOST=host_slots is not None,
            BLOCK=BLOCK_PAGES,
        )
    return device_pages, host_pages
