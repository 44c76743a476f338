"""A HiSparse decode request's two page lists in one launch, one pinned copy and one host wait.

In sglang 0.5.23 `DecodePreallocQueue.pop_preallocated` builds, for a
HiSparse decode with a DeepSeek-V4 pool or a draft pool, two page lists per
request, each through `kv_to_page_indices`: the device space first (its
`req_to_token` row, the allocator's page size), then the host space in
`_send_kv_metadata` (the host slots `_pre_alloc` returned, HiSparse's page
size). Each call alone is a launch, a pinned copy and a host wait.

Two AROUND hooks make them one, without touching sglang's method:
`pop_preallocated` opens a `PreallocPages` for its call (a context variable,
so only this thread's calls see it), and `_pre_alloc`, where sglang's
two-space condition holds, leaves there what the two calls will pass
(`TwoSpacePages`: each tensor view and page size, keyed by `SlotsKey`). The
page hook asks it first (`kept_pages`): a call whose input is exactly one
of the two converts both spaces in one `page_indices` launch, copies both
in one pinned copy and waits once; the other space's call then gets its
list with no work. Each list is handed out once; anything else (another
input, a tensor written since `_pre_alloc`) takes the page hook's usual path,
and nothing is launched for a request whose calls never come.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import gpu_planner as gp
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.integration.sglang.fallback import best_effort


@dataclasses.dataclass(frozen=True)
class SlotsKey:
    """What identifies a slot tensor's content: its memory, shape, dtype and write version."""

    device: torch.device
    address: int
    length: int
    stride: int
    dtype: torch.dtype
    version: int  # torch bumps it on every in-place write to the tensor or any view of its base
    page_size: int


def slots_key(slots: object, page_size: object) -> SlotsKey | None:
    """The key of `kv_to_page_indices(slots, page_size)`, or None for an input that has none."""
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or type(page_size) is not int:
        return None
    return SlotsKey(
        slots.device,
        slots.data_ptr(),
        slots.numel(),
        slots.stride(0),
        slots.dtype,
        slots._version,
        page_size,
    )


class TwoSpacePages:
    """One request's host and device slot views, converted together at the first call for one."""

    def __init__(
        self,
        host_slots: torch.Tensor,
        host_page_size: int,
        device_slots: torch.Tensor,
        device_page_size: int,
    ) -> None:
        self._inputs = {
            "host": (host_slots, host_page_size),
            "device": (device_slots, device_page_size),
        }
        self._keys = {space: slots_key(*given) for space, given in self._inputs.items()}
        self._pages: gp.PageIndices | None = None  # both spaces in host memory, once converted

    def take(self, slots: torch.Tensor, page_size: int) -> np.ndarray | None:
        """sglang's page list for this exact input, if it is one of the request's two not yet
        handed out (converting both at the first); else None."""
        key = slots_key(slots, page_size)
        space = next(
            (s for s, expected in self._keys.items() if key is not None and key == expected), None
        )
        if space is None:
            return None
        if self._pages is None:  # both spaces as they are now; the other's key still says
            self._pages = self._convert()  # whether its call sees the same slots
        del self._keys[space]
        return getattr(self._pages, space)

    @property
    def handed_out(self) -> bool:
        """Whether both lists were handed out."""
        return not self._keys

    def _convert(self) -> gp.PageIndices:
        (host_slots, host_page_size), (device_slots, device_page_size) = self._inputs.values()
        pending = gp.page_indices_async(
            device_slots,
            host_slots,
            0,
            device_slots.numel(),
            device_page_size,
            "triton",
            host_range=(0, host_slots.numel()),
            host_page_size=host_page_size,
        )
        return pending.numpy()


class PreallocPages:
    """What one `pop_preallocated` call's page hook may hand out: the request being prepared."""

    def __init__(self) -> None:
        self.request: TwoSpacePages | None = None

    def take(self, slots: torch.Tensor, page_size: int) -> np.ndarray | None:
        request = self.request
        if request is None:
            return None
        try:
            pages = request.take(slots, page_size)
        except BaseException:
            self.request = None  # a failed conversion is not tried again
            raise
        if request.handed_out:
            self.request = None
        return pages


_prealloc: contextvars.ContextVar[PreallocPages | None] = contextvars.ContextVar(
    "gpu_planner_prealloc_pages", default=None
)


def kept_pages(slots: object, page_size: object) -> np.ndarray | None:
    """The page list a `_pre_alloc` of this thread's `pop_preallocated` call kept for exactly
    this input (see the module docstring), or None."""
    prealloc = _prealloc.get()
    if prealloc is None or not isinstance(slots, torch.Tensor):
        return None
    return prealloc.take(slots, page_size)


def pop_preallocated_hook(original: Callable, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `DecodePreallocQueue.pop_preallocated`: its `_pre_alloc` calls may keep a
    request's two page spaces for the page hook while it runs; none outlives it."""
    token = _prealloc.set(PreallocPages())
    try:
        return original(queue, *args, **kwargs)
    finally:
        _prealloc.reset(token)


def pre_alloc_hook(
    original: Callable,
    queue: Any,
    req: Any,
    prefix_indices: Any = None,
    prefix_len: int | None = None,
    total_prefix_len: int | None = None,
) -> Any:
    """AROUND `DecodePreallocQueue._pre_alloc`: sglang's result; inside `pop_preallocated` where
    it will convert two page spaces for `req`, what those two calls will pass is kept."""
    result = original(queue, req, prefix_indices, prefix_len, total_prefix_len)
    prealloc = _prealloc.get()
    if prealloc is not None:
        prealloc.request = None
        with best_effort("keeping a HiSparse request's two page spaces failed", "two spaces"):
            prealloc.request = two_space_pages(queue, req, result, prefix_len or 0)
    return result


def two_space_pages(
    queue: Any, req: Any, host_indices: Any, prefix_len: int
) -> TwoSpacePages | None:
    """The two inputs `pop_preallocated` (sglang 0.5.23) converts for `req` after this
    `_pre_alloc`, where it converts two on a device; None where it converts one or none."""
    from sglang.srt.disaggregation import decode

    if not (
        queue.scheduler.enable_hisparse
        and (
            isinstance(queue.token_to_kv_pool, decode.DeepSeekV4TokenToKVPool)
            or queue.draft_token_to_kv_pool is not None
        )
        and not decode._is_fake_transfer(req)
        and queue.transfer_backend == decode.TransferBackend.MOONCAKE
        and isinstance(host_indices, torch.Tensor)
    ):
        return None
    allocator = queue.token_to_kv_pool_allocator
    origin_input_len = queue._rebootstrap_prefill_len(req)
    # decode.py: `kv_indices = dst_kv_indices[: origin_input_len - prefix_len]`, converted with
    # the HiSparse page size in `_transfer_page_indices`; the device space's row slice, with the
    # allocator's (logical) page size, right before `_send_kv_metadata`.
    host_slots = host_indices[: origin_input_len - prefix_len]
    device_slots = queue.req_to_token_pool.req_to_token[
        req.kv.req_pool_idx, prefix_len:origin_input_len
    ]
    runtime = cuda_runtime()
    if not all(runtime.runs_on_device(slots.device) for slots in (host_slots, device_slots)):
        return None
    if host_slots.device != device_slots.device:
        return None
    host_page_size = getattr(allocator, "hisparse_page_size", allocator.page_size)
    return TwoSpacePages(host_slots, host_page_size, device_slots, allocator.page_size)
