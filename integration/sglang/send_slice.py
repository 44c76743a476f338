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
`layer_calls`). Through sglang's wrapper around a Mooncake 0.3.14 engine the
calls take the descriptor arrays directly (`adapter`); otherwise each layer's
lists are built in its executor thread, as sglang does. Inputs sglang does
not handle the way the builder does (non-array or unequal page lists, values
outside [0, 2**63)) raise `Fallback`: the original runs (`fallback`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from sglang.srt.disaggregation.common.staging_buffer import (
    compute_head_slice_params,
    resolve_total_kv_heads,
)
from sglang.srt.disaggregation.mooncake import conn

from gpu_planner import settings
from gpu_planner.block_pool import BlockPool
from gpu_planner.errors import PlanValidationError
from gpu_planner.head_slices import HeadSliceDescriptors, HeadSliceLayout, head_slice_descriptors
from gpu_planner.integration.sglang import bounds, gathered, send_path
from gpu_planner.integration.sglang.adapter import check_manager, sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.fallback import Failed, Fallback, current_send
from gpu_planner.integration.sglang.layer_calls import submit_in_order
from gpu_planner.integration.sglang.page_sizes import (
    PREFILL,
    RepagedRoute,
    UnitSend,
    sends_no_token,
    unit_len,
    unit_send,
)

# What the hooks read of `kv_args`: the KV (or SWA state) buffers and their registered lengths.
KV_FIELDS = ("kv_data_ptrs", "kv_data_lens", "kv_item_lens")
STATE_FIELDS = ("state_data_ptrs", "state_data_lens")

# Descriptor address blocks, reused from send to send (see `_build`); made at the first send.
ADDRESS_POOL: BlockPool | None = None


def _address_pool() -> BlockPool:
    global ADDRESS_POOL
    if ADDRESS_POOL is None:
        ADDRESS_POOL = BlockPool(settings.loaded(settings.ADDRESS_RETAINED_BYTES))
    return ADDRESS_POOL


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


def send_kvcache_slice_hook(manager: conn.MooncakeKVManager, *args, **kwargs) -> int:
    """sglang's head-sliced KV send, descriptors built compiled; same calls and status.

    Toward a decode of another page size (`page_sizes`) the chunk's pages are both sides'
    unit pages, and a page of every buffer is a unit page: the same head slices per token.
    """
    call = SliceCall(*args, **kwargs)
    check_manager(manager, KV_FIELDS)
    kv_args = manager.kv_args
    # sglang's own decisions, in its order (its exceptions surface as they would).
    src_kv_item_len = kv_args.kv_item_lens[0]
    geometry = SliceGeometry(kv_args.page_size, src_kv_item_len, call.dst_kv_item_len)
    pages = (call.prefill_kv_indices, call.dst_kv_indices)
    repaged = PREFILL.chunk_for(call.dst_kv_indices)
    if repaged is not None:
        current_send().refuse_fallback("its destination pages are in another page size")
        if sends_no_token(*repaged, len(call.prefill_kv_indices), geometry.page_size):
            return 0  # the decode holds every token of it: nothing moves
        route, chunk, geometry, pages = _repaged_slice(manager, call, geometry, *repaged)
    total_kv_heads = getattr(kv_args, "total_kv_head_num", 0)
    if total_kv_heads <= 0:
        total_kv_heads = kv_args.kv_head_num * manager.attn_tp_size
    dst_heads_per_rank = max(1, total_kv_heads // call.dst_attn_tp_size)
    head_len = geometry.dst_item_len // geometry.page_size // dst_heads_per_rank
    src_head_start, num_heads, dst_head_start, _ = compute_head_slice_params(
        manager.attn_tp_size,
        call.dst_attn_tp_size,
        kv_args.engine_rank,
        call.dst_tp_rank,
        total_kv_heads,
    )
    layer_pairs = _slice_layer_pairs(manager, call, src_kv_item_len)
    slice_len = num_heads * head_len
    if slice_len > geometry.dst_item_len // geometry.page_size:
        conn.logger.error(
            f"[{call.mooncake_session_id}] slice size ({slice_len}) exceeds "
            f"target token slot size ({geometry.dst_item_len // geometry.page_size})"
        )
        return -1
    pages = _page_arrays(*pages, lists=False)
    try:
        _check_kv_slice_bounds(
            manager,
            geometry,
            [src for src, _ in layer_pairs],
            pages,
            (src_head_start * head_len, dst_head_start * head_len),
            slice_len,
        )
    except bounds.OutOfRange as error:
        return bounds.refuse(call.mooncake_session_id, error)
    started = time.perf_counter()
    session = call.mooncake_session_id
    with _planner_rejections():
        layout = _kv_slice_layout(
            tuple(layer_pairs),
            geometry.page_size,
            geometry.src_item_len,
            geometry.dst_item_len,
            src_head_start * head_len,
            dst_head_start * head_len,
            slice_len,
        )
        decision = send_path.slice_path(
            manager, session, layout, pages, pages[1], call.dst_attn_tp_size
        )
        if decision.path == send_path.STAGED:
            status = send_path.send_staged(
                manager, session, decision, pages[0], call.executor, started
            )
        elif decision.path == send_path.GATHERED:
            status = gathered.write_gathered(
                manager, session, decision.gathered_send, decision.lease, pages[0],
                call.executor, started,
            )  # fmt: skip
        else:
            descriptors = _build(layout, pages)
            status = _send_layers(manager, session, descriptors, call.executor, started)
    if status == 0 and repaged is not None:
        PREFILL.planned(route, chunk.first, chunk.end)
    return status


@dataclasses.dataclass(frozen=True)
class SliceGeometry:
    """Tokens per page, and each side's bytes per page of a KV buffer, as a slice send plans."""

    page_size: int
    src_item_len: int
    dst_item_len: int


def _repaged_slice(
    manager: conn.MooncakeKVManager,
    call: SliceCall,
    geometry: SliceGeometry,
    route: RepagedRoute,
    position: int,
) -> tuple[RepagedRoute, UnitSend, SliceGeometry, tuple[np.ndarray, np.ndarray]]:
    """A chunk toward a decode of another page size as a slice send of unit pages."""
    src_pages = call.prefill_kv_indices
    if not (isinstance(src_pages, np.ndarray) and src_pages.ndim == 1):
        raise Fallback("page indices are not 1-D NumPy arrays")
    try:
        chunk = unit_send(route, position, src_pages, geometry.page_size)
        unit = SliceGeometry(
            chunk.unit,
            unit_len(geometry.src_item_len, geometry.page_size, chunk.unit, "kv_item_lens"),
            unit_len(geometry.dst_item_len, route.decode_page_size, chunk.unit, "dst_kv_item_len"),
        )
    except PlanValidationError as error:
        raise Fallback(f"a send to another page size cannot be planned ({error})") from None
    return route, chunk, unit, (chunk.src_pages, chunk.dst_pages)


@contextlib.contextmanager
def _planner_rejections() -> Iterator[None]:
    """Turn the builder's `PlanValidationError` into a fallback to sglang's original."""
    try:
        yield
    except PlanValidationError as error:
        raise Fallback(f"a head-sliced send was rejected ({error})", key="slice rejected") from None


def _check_kv_slice_bounds(
    manager: conn.MooncakeKVManager,
    geometry: SliceGeometry,
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
    page_size, src_item_len = geometry.page_size, geometry.src_item_len
    token_lens = (src_item_len // page_size, geometry.dst_item_len // page_size)
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


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
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

    sglang sends to the same peers' buffers again and again, and building the
    per-layer columns holds the GIL (docs/sglang.md). The layout is shared
    between sends: nothing writes to it.
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
) -> list[tuple[int, int]]:
    """sglang's (src, dst) buffer of each layer in send order; `Failed` (logged) where it fails."""
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
            raise Failed(-1)
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


def send_swa_state_slice_hook(manager: conn.MooncakeKVManager, *args, **kwargs) -> int:
    """sglang's head-sliced SWA state send, descriptors built compiled; same calls and status.

    Where sglang's `_get_mha_head_slice_blocks` raises (PP > 1, a layout other
    than NHD, unpaired K/V entries, unequal page counts, item lengths that do
    not split into heads), the original runs and raises it.
    """
    call = SwaSliceCall(*args, **kwargs)
    check_manager(manager, STATE_FIELDS)
    layout = _swa_layout(manager, call)
    pages = _page_arrays(call.prefill_swa_page_indices, call.dst_swa_page_indices, lists=True)
    try:
        _check_swa_slice_bounds(manager, layout, pages)
    except bounds.OutOfRange as error:
        return bounds.refuse(call.req.mooncake_session_id, error)
    started = time.perf_counter()
    with _planner_rejections():
        descriptors = _build(layout, pages)
    send_path.swa_slice_path()
    conn.logger.warning_once(
        "Using SWA state head-slice transfer for different attention TP sizes: "
        f"prefill={manager.attn_tp_size}, decode={call.dst_attn_tp_size}."
    )
    return _send_layers(manager, call.req.mooncake_session_id, descriptors, call.executor, started)


def _sglang_raises() -> Fallback:
    """An SWA layout sglang's `_get_mha_head_slice_blocks` raises on: the original runs, raises."""
    return Fallback("an SWA state layout sglang's own send raises on", key="swa layout")


def _swa_layout(manager: conn.MooncakeKVManager, call: SwaSliceCall) -> HeadSliceLayout:
    """sglang's per-entry head slices of an SWA state send; `Fallback` where sglang raises."""
    if manager.pp_size > 1 or manager.kv_args.swa_kv_cache_layout != "nhd":
        raise _sglang_raises()
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
        raise _sglang_raises()
    if len(call.prefill_swa_page_indices) != len(call.dst_swa_page_indices):
        raise _sglang_raises()
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
            raise _sglang_raises()
        head_lens.append(head_len)
    head_lens = np.array(head_lens, dtype=np.int64)
    src_ptrs, dst_ptrs, src_item_lens, dst_item_lens = (
        list(column) for column in zip(*entries, strict=True)
    )
    with _planner_rejections():
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


def _page_arrays(src_pages: Any, dst_pages: Any, lists: bool) -> tuple[np.ndarray, np.ndarray]:
    """Both page lists flattened as sglang reads them (`reshape(-1)`); `Fallback` when it can't.

    `lists`: sglang takes Python lists of pages too (`np.asarray`), as for SWA state.
    """
    arrays = []
    for pages in (src_pages, dst_pages):
        if lists and isinstance(pages, list):
            try:
                pages = np.asarray(pages, dtype=np.int64)
            except (OverflowError, TypeError, ValueError):
                raise Fallback("head-sliced page lists that are not int64 values") from None
        if not isinstance(pages, np.ndarray) or pages.dtype.kind not in "iu":
            raise Fallback("head-sliced page indices are not integer NumPy arrays")
        arrays.append(pages.reshape(-1))
    if arrays[0].size != arrays[1].size:
        raise Fallback("head-sliced page lists of unequal lengths")
    return arrays[0], arrays[1]


def _build(layout: HeadSliceLayout, pages: tuple[np.ndarray, np.ndarray]) -> HeadSliceDescriptors:
    """Every layer's descriptors, written into a block borrowed from ADDRESS_POOL.

    The addresses of a large send are hundreds of MB: fresh memory per send
    costs its page faults and, once memory is fragmented, the kernel's
    huge-page compaction. The block goes back to the pool when the
    descriptors and every view of them are gone: after the last engine call
    that reads them has ended, whichever thread ran it (docs/sglang.md).
    """
    num_values = 2 * layout.num_layers * pages[0].size * layout.page_size
    block = _address_pool().borrow(8 * num_values).view(np.int64)
    return head_slice_descriptors(layout, *pages, out=block)


def _send_layers(
    manager: conn.MooncakeKVManager,
    session: str,
    descriptors: HeadSliceDescriptors,
    executor: concurrent.futures.Executor,
    started: float,
) -> int:
    """One engine call per layer from `executor`, in layer order (`layer_calls`); sglang's status.

    A layer without descriptors returns 0 without a call, as in sglang.
    `started` (perf_counter) is when the build began: the plan time counted.
    """
    plan_seconds = time.perf_counter() - started
    engine_handoff = sglang_handoff(manager.engine)
    record_send(
        "slice",
        engine_handoff.form,
        descriptors.addresses[0].size,
        int(descriptors.slice_lens.sum()) * descriptors.num_tokens,
        plan_seconds,
        descriptors.addresses.shape[1],
    )

    def send_layer(layer: int) -> int:
        if descriptors.num_tokens == 0:
            return 0
        columns = engine_handoff.columns(*descriptors.layer(layer), equal_lens=True)
        return engine_handoff.call(session, *columns)  # a layer's slices are of one length

    futures = current_send().futures
    # One call at a time: to one peer, concurrent per-layer calls were slower (docs/sglang.md).
    submit_in_order(executor, descriptors.addresses.shape[1], send_layer, futures, max_tasks=1)
    return manager._await_transfer_futures(futures)
