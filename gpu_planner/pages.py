"""Token slots -> page indices, for one slot list or for both destination spaces at once."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpu_planner.cuda_streams import on_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.inputs import Backend, IndexLike, as_index_tensor, check_page_size, resolve_backend


class PageIndices(NamedTuple):
    """A request's pages in the host space and in the device space (same length)."""

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


def kv_to_page_indices(
    kv_slots: IndexLike, page_size: int, backend: Backend | None = None
) -> torch.Tensor | np.ndarray:
    """`kv_slots[::page_size] // page_size`: the page of each page's first token slot.

    Same device and dtype as the input (NumPy in, NumPy out). On CUDA the
    Triton kernel converts without any host synchronisation.
    """
    page_size = check_page_size(page_size)
    slots = as_index_tensor(kv_slots, "kv_slots")
    if resolve_backend(backend, slots.device) == "cpu":
        return _like_input(
            torch.div(slots[::page_size], page_size, rounding_mode="floor"), kv_slots
        )
    from gpu_planner.kernels.page_indices import launch_page_indices

    with on_device(slots.device):
        pages, _ = launch_page_indices(slots, None, 0, slots.numel(), page_size)
    return _like_input(pages, kv_slots)


def page_indices(
    req_to_token_row: IndexLike,
    host_slots: IndexLike,
    start: int,
    end: int,
    page_size: int,
    backend: Backend | None = None,
) -> PageIndices:
    """Host and device pages of tokens [start, end) of one request, in one kernel launch.

    Device pages come from the request's `req_to_token` row (logical pages),
    host pages from its host slot tensor; the two page ids differ and each
    buffer must be planned with the space it lives in.
    """
    page_size = check_page_size(page_size)
    device_slots = as_index_tensor(req_to_token_row, "req_to_token_row")
    host = as_index_tensor(host_slots, "host_slots")
    if host.device != device_slots.device:
        raise PlanValidationError(
            f"host_slots: is on {host.device} but req_to_token_row is on {device_slots.device}"
        )
    _check_token_range(start, end, device_slots, "req_to_token_row")
    _check_token_range(start, end, host, "host_slots")
    if resolve_backend(backend, device_slots.device) == "cpu":
        device_pages = torch.div(
            device_slots[start:end:page_size], page_size, rounding_mode="floor"
        )
        host_pages = torch.div(host[start:end:page_size], page_size, rounding_mode="floor")
    else:
        from gpu_planner.kernels.page_indices import launch_page_indices

        with on_device(device_slots.device):
            device_pages, host_pages = launch_page_indices(
                device_slots, host, start, end, page_size
            )
    return PageIndices(
        host=_like_input(host_pages, host_slots), device=_like_input(device_pages, req_to_token_row)
    )
