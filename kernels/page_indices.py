"""Token slots -> page indices for the host and device page spaces in one launch.

Everything is ordered (host, device), as in `gp.PageIndices`; the host space is
optional (`kv_to_page_indices` converts one slot tensor, as the device space).
Each space has its own token range and page size (a HiSparse decode's host
space is compressed: fewer token slots, a smaller page).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_planner.kernels.launch_config import PAGES
from gpu_planner.kernels.launcher import LaunchTarget, launch

OUTPUT_ALIGN_BYTES = 16  # where the device pages start in the shared output allocation


class PageSpan(NamedTuple):
    """Tokens [start, end) of a slot tensor, converted with step and divisor `page_size`."""

    start: int
    end: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return -(-(self.end - self.start) // self.page_size) if self.end > self.start else 0


@triton.jit
def _floor_div(numerator, denominator):
    """Floor division, whatever the backend's integer `//` rounding (C truncates, NumPy floors)."""
    quotient = numerator // denominator
    remainder = numerator - quotient * denominator
    rounds_up = (remainder != 0) & ((remainder < 0) != (denominator < 0))
    return tl.where(rounds_up, quotient - 1, quotient)


@triton.jit
def _convert_space(slots_ptr, slots_stride, pages_ptr, page, start_token, num_pages, page_size):
    """Pages `page` of one space: the slot at each page's first token, floor-divided."""
    page_in_range = page < num_pages
    token = start_token + page * page_size
    slot = tl.load(slots_ptr + token * slots_stride, mask=page_in_range, other=0)
    tl.store(pages_ptr + page, _floor_div(slot, page_size), mask=page_in_range)


# Sizes, strides and counts are never specialised (one compile serves every
# request), and the caller's slot tensors may be views at any address.
@triton.jit(
    do_not_specialize=[
        "host_slots_stride",
        "device_slots_stride",
        "host_start_token",
        "host_num_pages",
        "host_page_size",
        "device_start_token",
        "device_num_pages",
        "device_page_size",
    ],
    do_not_specialize_on_alignment=["host_slots_ptr", "device_slots_ptr"],
)
def _page_indices_kernel(
    host_slots_ptr,  # int32/int64 [*]: the host slot tensor (unused without HAS_HOST)
    host_slots_stride: tl.int64,  # its element stride
    device_slots_ptr,  # int32/int64 [*]: the req_to_token row (device page space)
    device_slots_stride: tl.int64,  # its element stride
    host_pages_ptr,  # out, dtype of host_slots [host_num_pages]
    device_pages_ptr,  # out, dtype of device_slots [device_num_pages]
    host_start_token: tl.int64,  # first token of the host range
    host_num_pages: tl.int64,  # pages in it: cdiv(end - start, host_page_size)
    host_page_size: tl.int64,  # tokens per host page
    device_start_token: tl.int64,  # the same three for the device space
    device_num_pages: tl.int64,
    device_page_size: tl.int64,
    HAS_HOST: tl.constexpr,  # convert host slots too
    BLOCK: tl.constexpr,  # pages per program (of the longer space)
):
    page = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_HOST:
        _convert_space(
            host_slots_ptr,
            host_slots_stride,
            host_pages_ptr,
            page,
            host_start_token,
            host_num_pages,
            host_page_size,
        )
    _convert_space(
        device_slots_ptr,
        device_slots_stride,
        device_pages_ptr,
        page,
        device_start_token,
        device_num_pages,
        device_page_size,
    )


def _outputs(
    host_slots: torch.Tensor | None, device_slots: torch.Tensor, host: PageSpan, device: PageSpan
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Output tensors; with a host space, both are views of one allocation (host pages first),
    so one copy can bring both to host memory (`gp.page_indices_async`)."""
    if host_slots is None:
        return None, torch.empty(
            device.num_pages, dtype=device_slots.dtype, device=device_slots.device
        )
    host_bytes = host.num_pages * host_slots.element_size()
    device_offset = -(-host_bytes // OUTPUT_ALIGN_BYTES) * OUTPUT_ALIGN_BYTES
    device_bytes = device.num_pages * device_slots.element_size()
    packed = torch.empty(
        device_offset + device_bytes, dtype=torch.uint8, device=device_slots.device
    )
    return (
        packed[:host_bytes].view(host_slots.dtype),
        packed[device_offset:].view(device_slots.dtype),
    )


def launch_page_indices(
    host_slots: torch.Tensor | None,
    device_slots: torch.Tensor,
    start: int,
    end: int,
    page_size: int,
    target: LaunchTarget | None = None,
    host_span: PageSpan | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(host pages or None, device pages) of tokens [start, end) with step `page_size`.

    `host_span` gives the host space a range and page size of its own (default:
    the device space's). Launches on the current CUDA device and stream
    (through the cached compiled kernel when `target` has a stream): the caller
    guards the device.
    """
    device = PageSpan(start, end, page_size)
    host = device if host_span is None else host_span
    host_pages, device_pages = _outputs(host_slots, device_slots, host, device)
    num_pages = max(device.num_pages, host.num_pages if host_slots is not None else 0)
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
                host.start,
                host.num_pages,
                host.page_size,
                device.start,
                device.num_pages,
                device.page_size,
            ),
            {"HAS_HOST": host_slots is not None, "BLOCK": PAGES.block},
            PAGES.num_warps,
        )
    return host_pages, device_pages
