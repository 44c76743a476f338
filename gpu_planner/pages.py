"""Token slots -> page indices, for one slot list or for both destination spaces at once."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import Backend, IndexLike, as_index_tensor, check_page_size, resolve_backend


class PageIndices(NamedTuple):
    """A request's pages in the host page space and in the device page space."""

    host: torch.Tensor | np.ndarray
    device: torch.Tensor | np.ndarray


def _like_input(pages: torch.Tensor, original: IndexLike) -> torch.Tensor | np.ndarray:
    return pages.numpy() if isinstance(original, np.ndarray) else pages


def _check_token_range(start: int, end: int, slots: torch.Tensor, name: str) -> None:
    for label, value in (("start", start), ("end", end)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise PlanValidationError(f"{label}: must be an int, got {value!r}")
    if not 0 <= start <= end <= slots.numel():
        raise PlanValidationError(
            f"start/end: token range [{start}, {end}) does not fit {name} of length {slots.numel()}"
        )


def _slice_step(page_size: int, num_tokens: int) -> int:
    """A slice step that keeps the same slots as `page_size` for `num_tokens` tokens.

    torch sizes a slice as (tokens + step - 1) // step in int64, which
    overflows for a step near 2**63; any step of at least `num_tokens` keeps
    the first slot alone.
    """
    return min(page_size, max(num_tokens, 1))


def kv_to_page_indices(
    kv_slots: IndexLike, page_size: int, backend: Backend | None = None
) -> torch.Tensor | np.ndarray:
    """`kv_slots[::page_size] // page_size`: the page of each page's first token slot.

    Args:
        kv_slots: int32/int64 [num_tokens] token slots (torch tensor on any
            torch device, or NumPy array; any stride).
        page_size: tokens per page (int >= 1).
        backend: None picks Triton for CUDA tensors, the CPU path otherwise.

    Returns:
        [ceil(num_tokens / page_size)] pages, same dtype and torch device as the
        input (NumPy in, NumPy out). On CUDA one kernel launch, no host sync.

    Example:
        >>> gp.kv_to_page_indices(torch.tensor([128, 129, 130, 64]), 2)
        tensor([64, 65])
    """
    page_size = check_page_size(page_size)
    slots = as_index_tensor(kv_slots, "kv_slots")
    if resolve_backend(backend, slots.device) == "cpu":
        step = _slice_step(page_size, slots.numel())
        return _like_input(torch.div(slots[::step], page_size, rounding_mode="floor"), kv_slots)
    from gpu_planner.kernels.page_indices import launch_page_indices

    with on_torch_device(slots.device):
        target = _launch_target(slots.device)
        _, pages = launch_page_indices(None, slots, 0, slots.numel(), page_size, target)
    return _like_input(pages, kv_slots)


def _launch_target(torch_device: torch.device):
    """Cached kernel launches on the thread's context of `torch_device` (None: through the JIT)."""
    from gpu_planner.kernels.launcher import LaunchTarget

    runtime = cuda_runtime()
    if not runtime.runs_on_device(torch_device) or torch_device.index is None:
        return None
    index = runtime.device_context(torch_device).index
    return LaunchTarget(index, runtime.launch_stream(index))


def page_indices(
    req_to_token_row: IndexLike,
    host_slots: IndexLike,
    start: int,
    end: int,
    page_size: int,
    backend: Backend | None = None,
    *,
    host_range: tuple[int, int] | None = None,
    host_page_size: int | None = None,
) -> PageIndices:
    """Host-space and device-space pages of tokens [start, end) of one request, in one launch.

    HiSparse decode workers have two destination page spaces whose page ids
    differ: device-space pages come from the request's `req_to_token` row
    (logical pages), host-space pages from its host slot tensor. Each buffer
    must be planned with the space it lives in (`BufferLayout.dst_is_device`).
    A DeepSeek-V4 HiSparse host space is compressed: its slots cover fewer
    tokens, in smaller pages (`host_range`, `host_page_size`).

    Args:
        req_to_token_row: int32/int64 [>= end] device-space token slots.
        host_slots: int32/int64 host-space token slots, same torch device.
        start, end: the device space's token range, 0 <= start <= end.
        page_size: tokens per device page (int >= 1).
        backend: None picks Triton for CUDA tensors, the CPU path otherwise.
        host_range: the host space's (start, end) (default: `(start, end)`).
        host_page_size: tokens per host page (default: `page_size`).

    Returns:
        `PageIndices(host, device)`, each `slots[first:last:size] // size` of
        its space's range and page size (equal lengths when both spaces share
        them), dtype and kind of its input.

    Example:
        >>> gp.page_indices(torch.arange(8), torch.arange(100, 108), 0, 8, 4)
        PageIndices(host=tensor([25, 26]), device=tensor([0, 1]))
    """
    page_size = check_page_size(page_size)
    host_start, host_end = (start, end) if host_range is None else host_range
    host_page_size = page_size if host_page_size is None else check_page_size(host_page_size)
    device_slots = as_index_tensor(req_to_token_row, "req_to_token_row")
    host_slot_tensor = as_index_tensor(host_slots, "host_slots")
    if host_slot_tensor.device != device_slots.device:
        raise PlanValidationError(
            f"host_slots: is on {host_slot_tensor.device} but req_to_token_row is on "
            f"{device_slots.device}"
        )
    _check_token_range(host_start, host_end, host_slot_tensor, "host_slots")
    _check_token_range(start, end, device_slots, "req_to_token_row")
    if resolve_backend(backend, device_slots.device) == "cpu":
        host_pages, device_pages = (
            torch.div(
                slots[first : last : _slice_step(size, last - first)], size, rounding_mode="floor"
            )
            for slots, first, last, size in (
                (host_slot_tensor, host_start, host_end, host_page_size),
                (device_slots, start, end, page_size),
            )
        )
    else:
        from gpu_planner.kernels.page_indices import PageSpan, launch_page_indices

        with on_torch_device(device_slots.device):
            host_pages, device_pages = launch_page_indices(
                host_slot_tensor,
                device_slots,
                start,
                end,
                page_size,
                _launch_target(device_slots.device),
                PageSpan(host_start, host_end, host_page_size),
            )
    return PageIndices(
        host=_like_input(host_pages, host_slots), device=_like_input(device_pages, req_to_token_row)
    )
