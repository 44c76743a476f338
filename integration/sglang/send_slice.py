"""AROUND hooks for sglang's head-sliced sends: prefill and decode with different attention TP.

`MooncakeKVManager.send_kvcache_slice` (KV) and `_send_swa_state_slice` (SWA
state) send one descriptor per token, per K/V buffer, per layer, each layer
built with NumPy and `.tolist()` in an executor thread and handed to one
engine call. The hooks keep sglang's layout decisions as sglang makes them
(head-slice parameters from `compute_head_slice_params`, layer pairing by
layer ids or `get_mha_kv_ptrs_with_pp`, its validation, its -1 returns and
their log lines, its exceptions), build every layer's descriptors in one
compiled pass without the GIL (`gpu_planner.head_slices`), then make one
engine call per layer from the executor's threads, in sglang's order, awaited
by the manager's own `_await_transfer_futures` (one task per executor thread
that takes the layers in turn, rather than one submitted task per layer:
`layer_calls`). Through sglang's wrapper around a
Mooncake 0.3.14 engine the calls take the descriptor arrays directly
(`send.engine_send`); otherwise each layer's lists are built in its executor
thread, as sglang does. Inputs sglang does not handle the way the builder
does (non-array or unequal page lists, values outside [0, 2**63)) run the
original, logged once per reason.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sglang.srt.disaggregation.common.staging_buffer import (
    compute_head_slice_params,
    resolve_total_kv_heads,
)
from sglang.srt.disaggregation.mooncake import conn

from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import HeadSliceDescriptors, HeadSliceLayout, head_slice_descriptors
from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.fallback import log_fallback_once
from gpu_planner.integration.sglang.layer_calls import submit_in_order
from gpu_planner.integration.sglang.send import engine_send

_EMPTY = inspect.Parameter.empty


@dataclasses.dataclass
class SliceCall:
    """The arguments of `send_kvcache_slice` (sglang 0.5.23), bound like the original."""

    mooncake_session_id: str
    prefill_kv_indices: Any
    dst_kv_ptrs: list[int]
    dst_kv_indices: Any
    dst_tp_rank: int
    dst_attn_tp_size: int
    dst_kv_item_len: int
    executor: concurrent.futures.Executor
    dst_layer_ids: list[int] | None = None


@dataclasses.dataclass
class SwaSliceCall:
    """The arguments of `_send_swa_state_slice` (sglang 0.5.23), bound like the original."""

    req: Any
    prefill_swa_page_indices: Any
    src_state_data_ptrs: list[int]
    src_state_item_lens: list[int]
    dst_state_data_ptrs: list[int]
    dst_swa_page_indices: Any
    dst_state_item_lens: list[int]
    dst_tp_rank: int
    dst_attn_tp_size: int
    executor: concurrent.futures.Executor


def _parameters(call_type: type) -> tuple[tuple[str, object], ...]:
    """The original's parameters as the plugin's register() compares them: self, then the call's."""
    return (("self", _EMPTY),) + tuple(
        (field.name, _EMPTY if field.default is dataclasses.MISSING else field.default)
        for field in dataclasses.fields(call_type)
    )


SLICE_PARAMETERS = _parameters(SliceCall)
SWA_SLICE_PARAMETERS = _parameters(SwaSliceCall)


def send_kvcache_slice_hook(
    original: Callable[..., int], manager: conn.MooncakeKVManager, *args, **kwargs
) -> int:
    """sglang's head-sliced KV send, descriptors built compiled; same calls and status."""
    call = SliceCall(*args, **kwargs)
    kv_args = manager.kv_args
    # sglang's own decisions, in its order (its exceptions surface as they would).
    src_kv_item_len = kv_args.kv_item_lens[0]
    page_size = kv_args.page_size
    total_kv_heads = getattr(kv_args, "total_kv_head_num", 0)
    if total_kv_heads <= 0:
        total_kv_heads = kv_args.kv_head_num * manager.attn_tp_size
    dst_heads_per_rank = max(1, total_kv_heads // call.dst_attn_tp_size)
    head_len = call.dst_kv_item_len // page_size // dst_heads_per_rank
    src_head_start, num_heads, dst_head_start, _ = compute_head_slice_params(
        manager.attn_tp_size,
        call.dst_attn_tp_size,
        kv_args.engine_rank,
        call.dst_tp_rank,
        total_kv_heads,
    )
    layer_pairs = _slice_layer_pairs(manager, call, src_kv_item_len)
    if layer_pairs is None:
        return -1
    slice_len = num_heads * head_len
    if slice_len > call.dst_kv_item_len // page_size:
        conn.logger.error(
            f"[{call.mooncake_session_id}] slice size ({slice_len}) exceeds "
            f"target token slot size ({call.dst_kv_item_len // page_size})"
        )
        return -1
    pages = _page_arrays(call.prefill_kv_indices, call.dst_kv_indices, lists=False)
    if isinstance(pages, str):
        log_fallback_once(pages)
        return original(manager, *args, **kwargs)
    try:
        _check_kv_slice_bounds(
            manager,
            call,
            [src for src, _ in layer_pairs],
            pages,
            (src_head_start * head_len, dst_head_start * head_len),
            slice_len,
        )
    except bounds.OutOfRange as error:
        return bounds.refuse(call.mooncake_session_id, error)
    started = time.perf_counter()
    try:
        layout = _kv_slice_layout(
            tuple(layer_pairs),
            page_size,
            src_kv_item_len,
            call.dst_kv_item_len,
            src_head_start * head_len,
            dst_head_start * head_len,
            slice_len,
        )
        descriptors, block = _build(layout, pages)
    except PlanValidationError as error:
        log_fallback_once(f"a head-sliced send was rejected ({error})", key="slice rejected")
        return original(manager, *args, **kwargs)
    return _send_layers(
        manager, call.mooncake_session_id, descriptors, block, call.executor, started
    )


def _check_kv_slice_bounds(
    manager: conn.MooncakeKVManager,
    call: SliceCall,
    src_ptrs: list[int],
    pages: tuple[np.ndarray, np.ndarray],
    head_offsets: tuple[int, int],
    slice_len: int,
) -> None:
    """The KV slice send stays in registered memory (`bounds`); raises `bounds.OutOfRange`.

    The decode's `dst_kv_item_len` sets the head size, so the offsets and the
    slice length (Python ints, any size) are checked against both sides' token
    slots before anything else uses them.
    """
    if not pages[0].size:
        return  # sglang makes no engine call
    page_size = manager.kv_args.page_size
    src_item_len = manager.kv_args.kv_item_lens[0]
    token_lens = (src_item_len // page_size, call.dst_kv_item_len // page_size)
    for side, offset, token_len in zip(
        ("source", "destination"), head_offsets, token_lens, strict=True
    ):
        bounds.check_head_slices(side, offset, slice_len, token_len, "dst_kv_item_len")
    max_page = bounds.check_pages(pages[0], "prefill_kv_indices")
    bounds.check_pages(pages[1], "dst_kv_indices")
    last_offset = (page_size - 1) * token_lens[0] + head_offsets[0]
    bounds.check_sources(
        manager.kv_args,
        src_ptrs,
        max_page,
        src_item_len,
        last_offset,
        slice_len,
        "prefill_kv_indices",
    )


@functools.lru_cache(maxsize=64)
def _kv_slice_layout(
    layer_pairs: tuple[tuple[int, int], ...],
    page_size: int,
    src_item_len: int,
    dst_item_len: int,
    src_head_offset: int,
    dst_head_offset: int,
    slice_len: int,
) -> HeadSliceLayout:
    """The head-slice geometry of the KV send to one peer's buffers, built (and checked) once.

    sglang sends to the same peers' buffers again and again; building the
    per-layer columns of an 80-layer model takes about 0.3 ms with the GIL held.
    The layout is shared between sends: nothing writes to it.
    """
    return HeadSliceLayout.build(
        src_ptrs=[src for src, _ in layer_pairs],
        dst_ptrs=[dst for _, dst in layer_pairs],
        page_size=page_size,
        src_page_lens=src_item_len,
        dst_page_lens=dst_item_len,
        src_token_lens=src_item_len // page_size,
        dst_token_lens=dst_item_len // page_size,
        src_head_offsets=src_head_offset,
        dst_head_offsets=dst_head_offset,
        slice_lens=slice_len,
    )


def _slice_layer_pairs(
    manager: conn.MooncakeKVManager, call: SliceCall, src_kv_item_len: int
) -> list[tuple[int, int]] | None:
    """sglang's (src, dst) buffer of each layer in send order; None (logged) where it returns -1."""
    kv_args = manager.kv_args
    src_data_ptrs = kv_args.kv_data_ptrs
    src_layer_ids = kv_args.kv_layer_ids
    if src_layer_ids or call.dst_layer_ids:
        # Draft buffers: sglang pairs by layer id and needs one item length.
        if any(item_len != src_kv_item_len for item_len in kv_args.kv_item_lens):
            conn.logger.error(
                f"[{call.mooncake_session_id}] head-sliced transfer assumes one item "
                f"length for every KV entry, got {set(kv_args.kv_item_lens)}"
            )
            return None
        pairs = conn.build_transfer_entry_pairs(
            src_layer_ids,
            call.dst_layer_ids or [],
            len(src_data_ptrs),
            len(call.dst_kv_ptrs),
            allow_positional_fallback=manager.pp_size == 1,
        )
        return [(src_data_ptrs[i], call.dst_kv_ptrs[j]) for i, j in pairs]
    src_k, src_v, dst_k, dst_v, num_layers = manager.get_mha_kv_ptrs_with_pp(
        src_data_ptrs, call.dst_kv_ptrs
    )
    return [(src_k[i], dst_k[i]) for i in range(num_layers)] + [
        (src_v[i], dst_v[i]) for i in range(num_layers)
    ]


def send_swa_state_slice_hook(
    original: Callable[..., int], manager: conn.MooncakeKVManager, *args, **kwargs
) -> int:
    """sglang's head-sliced SWA state send, descriptors built compiled; same calls and status.

    Where sglang's `_get_mha_head_slice_blocks` raises (PP > 1, a layout other
    than NHD, unpaired K/V entries, unequal page counts, item lengths that do
    not split into heads), the original runs and raises it.
    """
    call = SwaSliceCall(*args, **kwargs)
    layout = _swa_layout(manager, call)
    pages = _page_arrays(call.prefill_swa_page_indices, call.dst_swa_page_indices, lists=True)
    if layout is None or isinstance(pages, str):
        if isinstance(pages, str):
            log_fallback_once(pages)
        return original(manager, *args, **kwargs)
    try:
        _check_swa_slice_bounds(manager, layout, pages)
    except bounds.OutOfRange as error:
        return bounds.refuse(call.req.mooncake_session_id, error)
    started = time.perf_counter()
    try:
        descriptors, block = _build(layout, pages)
    except PlanValidationError as error:
        log_fallback_once(f"a head-sliced send was rejected ({error})", key="slice rejected")
        return original(manager, *args, **kwargs)
    conn.logger.warning_once(
        "Using SWA state head-slice transfer for different attention TP sizes: "
        f"prefill={manager.attn_tp_size}, decode={call.dst_attn_tp_size}."
    )
    return _send_layers(
        manager, call.req.mooncake_session_id, descriptors, block, call.executor, started
    )


def _swa_layout(manager: conn.MooncakeKVManager, call: SwaSliceCall) -> HeadSliceLayout | None:
    """sglang's per-entry head slices of an SWA state send; None where sglang raises."""
    if manager.pp_size > 1 or manager.kv_args.swa_kv_cache_layout != "nhd":
        return None
    src_k, src_v, dst_k, dst_v, num_layers = manager.get_mha_kv_ptrs_with_pp(
        call.src_state_data_ptrs, call.dst_state_data_ptrs
    )
    _, _, dst_k_lens, dst_v_lens, _ = manager.get_mha_kv_ptrs_with_pp(
        call.src_state_item_lens, call.dst_state_item_lens
    )
    entries = list(
        zip(
            src_k + src_v,
            dst_k + dst_v,
            call.src_state_item_lens,
            dst_k_lens + dst_v_lens,
            strict=False,  # sglang's zip: shorter lists end it, then the count check fails
        )
    )
    num_src = len(call.src_state_data_ptrs)
    if len(entries) != num_src or 2 * num_layers != num_src:
        return None
    if len(call.prefill_swa_page_indices) != len(call.dst_swa_page_indices):
        return None
    total_kv_heads = resolve_total_kv_heads(manager.kv_args, manager.attn_tp_size)
    src_head_start, num_heads, dst_head_start, _ = compute_head_slice_params(
        src_attn_tp_size=manager.attn_tp_size,
        dst_attn_tp_size=call.dst_attn_tp_size,
        src_tp_rank=manager.kv_args.engine_rank,
        dst_tp_rank=call.dst_tp_rank,
        total_kv_heads=total_kv_heads,
    )
    src_heads = max(1, total_kv_heads // manager.attn_tp_size)
    dst_heads = max(1, total_kv_heads // call.dst_attn_tp_size)
    page_size = manager.kv_args.page_size
    head_lens = []
    for _, _, src_item_len, dst_item_len in entries:
        head_len = src_item_len // (page_size * src_heads)
        if (
            head_len * page_size * src_heads != src_item_len
            or head_len * page_size * dst_heads != dst_item_len
        ):
            return None
        head_lens.append(head_len)
    head_lens = np.array(head_lens, dtype=np.int64)
    src_ptrs, dst_ptrs, src_item_lens, dst_item_lens = (
        list(column) for column in zip(*entries, strict=True)
    )
    try:
        return HeadSliceLayout.build(
            src_ptrs=src_ptrs,
            dst_ptrs=dst_ptrs,
            page_size=page_size,
            src_page_lens=src_item_lens,
            dst_page_lens=dst_item_lens,
            src_token_lens=(src_heads * head_lens).tolist(),
            dst_token_lens=(dst_heads * head_lens).tolist(),
            src_head_offsets=(src_head_start * head_lens).tolist(),
            dst_head_offsets=(dst_head_start * head_lens).tolist(),
            slice_lens=(num_heads * head_lens).tolist(),
        )
    except PlanValidationError as error:
        log_fallback_once(f"a head-sliced send was rejected ({error})", key="slice rejected")
        return None


def _check_swa_slice_bounds(
    manager: conn.MooncakeKVManager, layout: HeadSliceLayout, pages: tuple[np.ndarray, np.ndarray]
) -> None:
    """The SWA state slice send stays in registered memory (`bounds`); raises `bounds.OutOfRange`.

    The layout's per-entry values are int64 in [0, 2**63) (checked when built).
    """
    if not pages[0].size:
        return  # sglang makes no engine call
    ptrs, page_lens, token_lens, head_offsets = layout.geometry[0]  # the source side's
    for side, geometry in zip(("source", "destination"), layout.geometry, strict=True):
        bounds.check_head_slices(
            side, geometry[3], layout.slice_lens, geometry[2], "dst_state_item_lens"
        )
    max_page = bounds.check_pages(pages[0], "prefill_swa_page_indices")
    bounds.check_pages(pages[1], "dst_swa_page_indices")
    last_offsets = (layout.page_size - 1) * token_lens + head_offsets
    bounds.check_sources(
        manager.kv_args,
        ptrs,
        max_page,
        page_lens,
        last_offsets,
        layout.slice_lens,
        "prefill_swa_page_indices",
    )


def _page_arrays(
    src_pages: Any, dst_pages: Any, lists: bool
) -> tuple[np.ndarray, np.ndarray] | str:
    """Both page lists flattened as sglang reads them (`reshape(-1)`), or why the original runs.

    `lists`: sglang takes Python lists of pages too (`np.asarray`), as for SWA state.
    """
    arrays = []
    for pages in (src_pages, dst_pages):
        if lists and isinstance(pages, list):
            try:
                pages = np.asarray(pages, dtype=np.int64)
            except (OverflowError, TypeError, ValueError):
                return "head-sliced page lists that are not int64 values"
        if not isinstance(pages, np.ndarray) or pages.dtype.kind not in "iu":
            return "head-sliced page indices are not integer NumPy arrays"
        arrays.append(pages.reshape(-1))
    if arrays[0].size != arrays[1].size:
        return "head-sliced page lists of unequal lengths"
    return arrays[0], arrays[1]


class AddressBlocks:
    """int64 blocks for the descriptors' addresses, reused from send to send.

    At 128k tokens of an 80-layer model the addresses take 335 MB: fresh memory
    per send costs its page faults, and after other work has fragmented memory
    the kernel's huge-page compaction (measured: 0.6-0.8 s to first touch
    instead of 20 ms). A block comes back once every engine call of its send
    has ended (cancelled ones included), so no running call reads a reused
    block. At most `MAX_FREE` free blocks are kept (one per concurrent send).
    """

    MAX_FREE = 2

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @property
    def free(self) -> tuple[np.ndarray, ...]:
        """The blocks kept for later sends."""
        with self._lock:
            return tuple(self._free)

    def take(self, size: int) -> np.ndarray:
        """The smallest free block of at least `size` values, else a new one."""
        with self._lock:
            fitting = [i for i, block in enumerate(self._free) if block.size >= size]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].size))
        return np.empty(size, dtype=np.int64)

    def give_back(self, block: np.ndarray) -> None:
        """Keep `block` for a later send; past MAX_FREE blocks the smallest is freed."""
        with self._lock:
            self._free.append(block)
            if len(self._free) > self.MAX_FREE:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i].size)
                del self._free[smallest]


ADDRESS_BLOCKS = AddressBlocks()


def _build(
    layout: HeadSliceLayout, pages: tuple[np.ndarray, np.ndarray]
) -> tuple[HeadSliceDescriptors, np.ndarray]:
    """Every layer's descriptors, written into a block of ADDRESS_BLOCKS; (descriptors, block)."""
    block = ADDRESS_BLOCKS.take(2 * layout.num_layers * pages[0].size * layout.page_size)
    try:
        return head_slice_descriptors(layout, *pages, out=block), block
    except PlanValidationError:
        ADDRESS_BLOCKS.give_back(block)
        raise


def _send_layers(
    manager: conn.MooncakeKVManager,
    session: str,
    descriptors: HeadSliceDescriptors,
    block: np.ndarray,
    executor: concurrent.futures.Executor,
    started: float,
) -> int:
    """One engine call per layer from `executor`, in layer order (`layer_calls`); sglang's status.

    A layer without descriptors returns 0 without a call, as in sglang. The
    block goes back to ADDRESS_BLOCKS when the last call has ended. `started`
    (perf_counter) is when the build began: the plan time counted.
    """
    plan_seconds = time.perf_counter() - started
    path, send = engine_send(manager.engine)
    record_send(
        "slice",
        path,
        descriptors.addresses[0].size,
        int(descriptors.slice_lens.sum()) * descriptors.num_tokens,
        plan_seconds,
        descriptors.addresses.shape[1],
    )

    def send_layer(layer: int) -> int:
        if descriptors.num_tokens == 0:
            return 0
        srcs, dsts, lens = descriptors.layer(layer)
        if path == handoff.LISTS:  # as sglang builds them: the lengths list repeats one int
            return send(session, srcs.tolist(), dsts.tolist(), [int(lens[0])] * lens.size)
        return send(session, srcs, dsts, lens)

    futures: list[concurrent.futures.Future] = []
    try:
        submit_in_order(executor, descriptors.addresses.shape[1], send_layer, futures)
        return manager._await_transfer_futures(futures)
    finally:
        _give_back_when_ended(block, futures)


def _give_back_when_ended(block: np.ndarray, futures: list[concurrent.futures.Future]) -> None:
    """Give `block` back to ADDRESS_BLOCKS once every one of `futures` has ended.

    Called after the send's await: only tasks still running (sglang returns
    at the first failure) get a done callback.
    """
    running = [future for future in futures if not future.done()]
    if not running:
        ADDRESS_BLOCKS.give_back(block)
        return
    count = [len(running)]
    lock = threading.Lock()

    def ended(_: concurrent.futures.Future) -> None:
        with lock:
            count[0] -= 1
            last = count[0] == 0
        if last:
            ADDRESS_BLOCKS.give_back(block)

    for future in running:
        future.add_done_callback(ended)
