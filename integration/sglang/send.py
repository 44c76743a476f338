"""AROUND hook for sglang's `MooncakeKVManager._send_kvcache_generic`.

sglang groups contiguous pages with NumPy and builds every descriptor in a
Python double loop. The hook keeps sglang's entry mapping (see `entries`)
and its engine calls, but plans the runs and descriptors with gpu_planner:
the same engine calls, with the same descriptors, in the same order, and the
same return value. Inputs the planner does not model raise `Fallback`: the
original runs (`fallback`). The calls go through sglang's engine wrapper as
`adapter` hands them over (descriptor arrays on Mooncake 0.3.14+). With a
custom memory pool sglang makes one call per buffer from its executor; the
hook makes the same calls in the same order from the executor's threads
(`layer_calls`).
"""

from __future__ import annotations

import time

import numpy as np
from sglang.srt.disaggregation.mooncake import conn

import gpu_planner as gp
from gpu_planner import settings
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import check_manager, sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.entries import Entry, SendCall, transfer_entries
from gpu_planner.integration.sglang.fallback import Fallback, current_send
from gpu_planner.integration.sglang.layer_calls import submit_in_order
from gpu_planner.integration.sglang.staged_send import StagedEntries, send_staged

# What the hook reads of `kv_args`: the registered buffers its bounds check uses.
KV_FIELDS = ("kv_data_ptrs", "kv_data_lens")


def send_kvcache_generic_hook(manager: conn.MooncakeKVManager, *args, **kwargs) -> int:
    """Plan sglang's KV send with gpu_planner; same engine calls and status as sglang's."""
    call = SendCall(*args, **kwargs)
    check_manager(manager, KV_FIELDS)
    _check_supported(call)
    entries = transfer_entries(manager, call)
    started = time.perf_counter()
    try:
        plan = _plan(manager, call, entries)
    except bounds.OutOfRange as error:
        return bounds.refuse(call.mooncake_session_id, error)
    except gp.PlanValidationError as error:
        raise Fallback(f"the planner rejected a send ({error})", key="planner rejected") from None
    if plan is None:
        return 0
    staged_status = send_staged(
        manager,
        call.mooncake_session_id,
        call.prefill_data_indices,
        call.dst_data_indices,
        StagedEntries.of_plan(plan.layout, call.dst_device_data_ptrs),
        plan.num_descriptors,
        call.executor,
    )
    if staged_status is not None:
        return staged_status
    plan_seconds = time.perf_counter() - started
    engine_handoff = sglang_handoff(manager.engine)
    record_send(
        "generic",
        engine_handoff.form,
        plan.num_descriptors,
        plan.total_bytes,
        plan_seconds,
        plan.layout.num_buffers,
        plan.num_batches,
    )
    session = call.mooncake_session_id
    if _uses_per_layer_futures(manager):
        pieces = list(engine_handoff.pieces(plan, per_buffer=True))

        def send_piece(index: int) -> int:
            piece = pieces[index]
            return engine_handoff.call(session, piece.srcs, piece.dsts, piece.lens)

        futures = current_send().futures
        submit_in_order(call.executor, len(pieces), send_piece, futures)
        return manager._await_transfer_futures(futures)
    for piece in engine_handoff.pieces(plan):
        status = engine_handoff.call(session, piece.srcs, piece.dsts, piece.lens)
        if status != 0:
            return status
    return 0


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _layout(
    src_ptrs: tuple[int, ...],
    dst_ptrs: tuple[int, ...],
    item_lens: tuple[int, ...],
    dst_is_device: tuple[bool, ...] | None,
) -> gp.BufferLayout:
    """The (validated, read-only) layout of these buffers: sglang sends to one peer's
    buffers again and again, so each layout is built once."""
    return gp.BufferLayout(src_ptrs, dst_ptrs, item_lens, dst_is_device=dst_is_device)


def _check_bounds(
    manager: conn.MooncakeKVManager,
    call: SendCall,
    src_ptrs: tuple[int, ...],
    item_lens: tuple[int, ...],
    host_live: bool,
    device_live: bool,
) -> None:
    """Every page >= 0 and every source buffer's pages inside the prefill's registered memory."""
    max_page = bounds.check_pages(call.prefill_data_indices, "prefill_data_indices")
    if host_live:
        bounds.check_pages(call.dst_data_indices, "dst_data_indices")
    if device_live:
        bounds.check_pages(call.dst_device_data_indices, "dst_device_data_indices")
    bounds.check_sources(
        manager.kv_args, src_ptrs, max_page, item_lens, 0, item_lens, "prefill_data_indices"
    )


def _uses_per_layer_futures(manager: conn.MooncakeKVManager) -> bool:
    """sglang submits one engine call per layer to the executor with a custom memory pool."""
    return manager.enable_custom_mem_pool and manager.custom_mem_pool_type != "INTRA_NODE_NVLINK"


def _check_supported(call: SendCall) -> None:
    """`Fallback` where the original must run (it raises or asserts on these inputs)."""
    pages = (call.prefill_data_indices, call.dst_data_indices)
    if call.dst_device_data_indices is not None:
        pages += (call.dst_device_data_indices,)
    if not all(isinstance(p, np.ndarray) and p.ndim == 1 for p in pages):
        raise Fallback("page indices are not 1-D NumPy arrays")
    src_size = call.prefill_data_indices.size
    if any(p.size not in (0, src_size) for p in pages) and src_size:
        raise Fallback("page lists of unequal lengths")
    if call.dst_device_data_ptrs and call.dst_device_data_indices is None:
        raise Fallback("device destination buffers without device page indices")


def _plan(
    manager: conn.MooncakeKVManager, call: SendCall, entries: list[Entry]
) -> gp.TransferPlan | None:
    """Plan `entries` as sglang would transfer them; None when no descriptor results.

    A destination space with an empty page list has no runs (sglang's
    `group_concurrent_contiguous` returns none when either side is empty), so
    its buffers move nothing and are left out of the layout. Raises
    `bounds.OutOfRange` for pages or buffers out of range (`_check_bounds`).
    """
    src_pages = call.prefill_data_indices
    device_ptrs = call.dst_device_data_ptrs
    is_device = [bool(device_ptrs) and int(dst) in device_ptrs for _, dst, _ in entries]
    host_live = src_pages.size > 0 and call.dst_data_indices.size > 0
    device_live = src_pages.size > 0 and any(is_device) and call.dst_device_data_indices.size > 0
    kept = [
        (entry, device)
        for entry, device in zip(entries, is_device, strict=True)
        if (device and device_live) or (not device and host_live)
    ]
    if not kept:
        return None
    src_ptrs, dst_ptrs, item_lens = zip(*(entry for entry, _ in kept), strict=True)
    kept_is_device = tuple(device for _, device in kept)
    _check_bounds(manager, call, src_ptrs, item_lens, host_live, device_live)
    if host_live:
        dst_pages = call.dst_data_indices
        device_pages = call.dst_device_data_indices if device_live else None
    else:
        # Every kept buffer is device-backed: plan them against the device pages.
        dst_pages, device_pages, kept_is_device = call.dst_device_data_indices, None, None
    layout = _layout(src_ptrs, dst_ptrs, item_lens, kept_is_device)
    max_batch_pages = 0 if _uses_per_layer_futures(manager) else manager.max_transfer_batch_indices
    return gp.plan_transfer(
        src_pages,
        dst_pages,
        layout,
        dst_device_pages=device_pages,
        max_batch_pages=max(max_batch_pages, 0),
    )
