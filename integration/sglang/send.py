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

import copy
import functools
import time

import numpy as np
from sglang.srt.disaggregation.mooncake import conn

import gpu_planner as gp
from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import check_manager, sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.entries import Entries, Entry, SendCall, transfer_entries
from gpu_planner.integration.sglang.fallback import Fallback, current_send
from gpu_planner.integration.sglang.layer_calls import submit_in_order
from gpu_planner.integration.sglang.page_sizes import (
    PREFILL,
    RepagedRoute,
    UnitSend,
    sends_no_token,
    unit_len,
    unit_send,
)
from gpu_planner.integration.sglang.path_cost import DIRECT, STAGED
from gpu_planner.integration.sglang.send_path import generic_path, observe, send_staged
from gpu_planner.integration.sglang.staged_send import StagedEntries

# What the hook reads of `kv_args`: the registered buffers its bounds check uses.
KV_FIELDS = ("kv_data_ptrs", "kv_data_lens")


def send_kvcache_generic_hook(manager: conn.MooncakeKVManager, *args, **kwargs) -> int:
    """Plan sglang's KV send with gpu_planner; same engine calls and status as sglang's."""
    call = SendCall(*args, **kwargs)
    check_manager(manager, KV_FIELDS)
    repaged = PREFILL.chunk_for(call.dst_data_indices)
    if repaged is not None:
        current_send().refuse_fallback("its destination pages are in another page size")
        page_size = int(manager.kv_args.page_size)
        if sends_no_token(*repaged, len(call.prefill_data_indices), page_size):
            return 0  # the decode holds every token of it: nothing moves
        route, chunk, call = _repaged_call(manager, call, *repaged)
    _check_supported(call)
    entries = transfer_entries(manager, call)
    if repaged is not None:
        _check_token_bytes(manager, call, entries, route, chunk.unit)
    started = time.perf_counter()
    try:
        planned = _plan(manager, call, entries)
    except bounds.OutOfRange as error:
        return bounds.refuse(call.mooncake_session_id, error)
    except gp.BoundsError as error:  # a source read outside the registration (`_plan`)
        return bounds.refuse(call.mooncake_session_id, bounds.OutOfRange(str(error)))
    except gp.PlanValidationError as error:
        raise Fallback(f"the planner rejected a send ({error})", key="planner rejected") from None
    if planned is None:
        return 0
    plan, buffers = planned
    session = call.mooncake_session_id
    deciding = time.perf_counter()
    decision = generic_path(
        manager,
        session,
        call.prefill_data_indices,
        call.dst_data_indices,
        buffers.staged_entries(plan.layout, call.dst_device_data_ptrs),
        plan.num_descriptors,
    )
    if decision.path == STAGED:
        status = send_staged(
            manager, session, decision, call.prefill_data_indices, call.executor, deciding
        )
    else:
        status = _send_planned(manager, call, plan, buffers, started)
    if status == 0 and repaged is not None:
        PREFILL.planned(route, chunk.first, chunk.end)
    return status


def _send_planned(
    manager: conn.MooncakeKVManager,
    call: SendCall,
    plan: gp.TransferPlan,
    buffers: PlannedBuffers,
    started: float,
) -> int:
    """`plan`'s descriptors through the engine, as sglang's send hands them over (`started`:
    when planning began, its time counted)."""
    session = call.mooncake_session_id
    nbytes = call.prefill_data_indices.size * buffers.page_bytes  # `plan.total_bytes`, in O(1)
    direct_started = time.perf_counter()
    engine_handoff = sglang_handoff(manager.engine)
    num_descriptors = plan.num_descriptors
    record_send(
        "generic",
        engine_handoff.form,
        num_descriptors,
        nbytes,
        direct_started - started,
        plan.layout.num_buffers,
        plan.num_batches,
    )
    status = _send_direct(manager, call, plan, engine_handoff)
    if status == 0:
        observe(session, DIRECT, num_descriptors, nbytes, time.perf_counter() - direct_started)
    return status


def _repaged_call(
    manager: conn.MooncakeKVManager, call: SendCall, route: RepagedRoute, position: int
) -> tuple[RepagedRoute, UnitSend, SendCall]:
    """A chunk toward a decode of another page size as the send of both sides' unit pages
    (`page_sizes.unit_send`), each buffer's item length that of a unit page."""
    page_size = int(manager.kv_args.page_size)
    src_pages = call.prefill_data_indices
    if not (isinstance(src_pages, np.ndarray) and src_pages.ndim == 1):
        raise Fallback("page indices are not 1-D NumPy arrays")
    try:
        chunk = unit_send(route, position, src_pages, page_size)
        item_lens = _unit_lens(tuple(call.item_lens), page_size, chunk.unit, "item_lens")
        dst_item_lens = call.dst_item_lens and _unit_lens(
            tuple(call.dst_item_lens), route.decode_page_size, chunk.unit, "dst_item_lens"
        )
    except gp.PlanValidationError as error:
        raise Fallback(f"a send to another page size cannot be planned ({error})") from None
    if (call.dst_device_data_indices is None) != (chunk.dst_device_pages is None):
        raise Fallback("HiSparse's device pages on one side of a send to another page size")
    repaged = copy.copy(call)
    repaged.prefill_data_indices, repaged.dst_data_indices = chunk.src_pages, chunk.dst_pages
    repaged.dst_device_data_indices = chunk.dst_device_pages
    repaged.item_lens, repaged.dst_item_lens = item_lens, dst_item_lens
    return route, chunk, repaged


@functools.lru_cache(maxsize=64)
def _unit_lens(lengths: tuple[int, ...], page_size: int, unit: int, field: str) -> tuple[int, ...]:
    """Each buffer's bytes per unit page: the same few geometries again and again."""
    return tuple(unit_len(length, page_size, unit, field) for length in lengths)


def _check_token_bytes(
    manager: conn.MooncakeKVManager,
    call: SendCall,
    entries: Entries,
    route: RepagedRoute,
    unit: int,
) -> None:
    """Each entry's bytes per token are its decode buffer's (the decode's registration says them
    per page of its size); `Fallback` naming the buffer and both page sizes otherwise. Checked
    once per registration, entries and geometry (`Entries.derive`)."""
    registration = manager.decode_kv_args_table[call.mooncake_session_id]
    key = ("token bytes", id(registration), route.decode_page_size, unit)
    checked = entries.derive(
        key, lambda: _token_bytes_checked(manager, registration, entries, route, unit)
    )
    if checked is not registration:  # another registration at a reused id: check it now
        _token_bytes_checked(manager, registration, entries, route, unit)


def _token_bytes_checked(
    manager: conn.MooncakeKVManager, registration, entries: Entries, route: RepagedRoute, unit: int
):
    """`registration`, once its buffers' bytes per token were found to be the entries'."""
    dst_lens = list(registration.dst_kv_item_lens) or [registration.dst_kv_item_len] * len(
        registration.dst_kv_ptrs
    )
    token_bytes = {
        int(ptr): int(length) / route.decode_page_size
        for ptr, length in zip(registration.dst_kv_ptrs, dst_lens, strict=False)
    }
    for src_ptr, dst_ptr, unit_bytes in entries.entries:
        if token_bytes.get(int(dst_ptr)) != unit_bytes / unit:
            raise Fallback(
                f"the buffer at {src_ptr:#x} holds {unit_bytes // unit} bytes per token on the "
                f"prefill (page size {manager.kv_args.page_size}), the decode's at {dst_ptr:#x} "
                f"{token_bytes.get(int(dst_ptr))} (page size {route.decode_page_size})",
                key="page sizes: bytes per token differ",
            )
    return registration


def _send_direct(
    manager: conn.MooncakeKVManager, call: SendCall, plan: gp.TransferPlan, engine_handoff
) -> int:
    """The plan's engine calls, as sglang makes them; the first failing status, else 0."""
    session = call.mooncake_session_id
    num_descriptors = plan.num_descriptors
    if _uses_per_layer_futures(manager):
        pieces = list(engine_handoff.pieces(plan, per_buffer=True))

        def send_piece(index: int) -> int:
            piece = pieces[index]
            return engine_handoff.call(session, piece.srcs, piece.dsts, piece.lens)

        futures = current_send().futures
        submit_in_order(call.executor, len(pieces), send_piece, futures)
        return manager._await_transfer_futures(futures)
    if plan.num_batches == 1 and num_descriptors and engine_handoff.form == handoff.ARRAYS:
        srcs, dsts, lens = plan.columns_array()[:, :num_descriptors]  # the one piece's views
        return engine_handoff.call(session, srcs, dsts, lens)
    for piece in engine_handoff.pieces(plan):
        status = engine_handoff.call(session, piece.srcs, piece.dsts, piece.lens)
        if status != 0:
            return status
    return 0


class PlannedBuffers:
    """The buffers that sends to one peer layout plan when the same page lists are empty.

    A destination space with an empty page list has no runs, so which buffers
    a send plans depends on which of its page lists have pages
    (`PeerBuffers.planned`). What is here is per buffer, built once, the same
    for every such send: the columns the bounds check reads, the layout (per
    registration of the prefill's memory), the staged send's entries.
    """

    def __init__(self, entries: list[Entry], is_device: tuple[bool, ...] | None) -> None:
        self.src_ptrs, self.dst_ptrs, self.item_lens = zip(*entries, strict=True)
        self.is_device = is_device  # None: every buffer planned against one page list
        # Each buffer's runs cover every page once: a send's bytes are its pages times this.
        self.page_bytes = sum(int(item_len) for item_len in self.item_lens)
        # (registration, layout): one pair, replaced whole (a send reads it in one step).
        self._bounded: tuple[bounds.Registration, gp.BufferLayout] | None = None
        self._staged: StagedEntries | None = None

    def layout(self, registered: bounds.Registration) -> gp.BufferLayout:
        """The (validated, read-only) layout whose source lengths are the room the prefill's
        registration `registered` leaves each buffer: the plan's own scan refuses a read
        outside it. Built once per registration; `PlanValidationError` every time it is
        invalid."""
        bounded = self._bounded
        if bounded is None or bounded[0] != registered:
            checked = gp.BufferLayout(  # the buffers' own values checked first, by name
                self.src_ptrs, self.dst_ptrs, self.item_lens, dst_is_device=self.is_device
            )
            rooms = np.maximum(bounds.registered_room_of(registered, checked.src_ptrs), 0)
            layout = gp.BufferLayout(
                checked.src_ptrs, checked.dst_ptrs, checked.item_lens,
                dst_is_device=self.is_device, src_lens=rooms,
            )  # fmt: skip
            bounded = self._bounded = (registered, layout)
        return bounded[1]

    def staged_entries(
        self, layout: gp.BufferLayout, dst_device_ptrs: set[int] | None
    ) -> StagedEntries:
        """These buffers (`layout`: one of theirs) as the staged send takes them
        (`dst_device_ptrs`: the peer's, as keyed)."""
        if self._staged is None:
            self._staged = StagedEntries.of_plan(layout, dst_device_ptrs)
        return self._staged


class PeerBuffers:
    """One peer layout's entries with their destination spaces, and what its sends plan."""

    def __init__(self, entries: Entries, dst_device_ptrs: set[int] | None) -> None:
        self.entries = entries.entries
        self.is_device = tuple(
            bool(dst_device_ptrs) and int(dst) in dst_device_ptrs for dst in entries.dst_ptrs
        )
        self.any_device = any(self.is_device)
        self._planned: dict[tuple[bool, bool], PlannedBuffers | None] = {}

    def planned(self, host_live: bool, device_live: bool) -> PlannedBuffers | None:
        """The buffers a send plans when only the live spaces have pages; None: no buffer."""
        key = (host_live, device_live)
        if key not in self._planned:
            self._planned[key] = self._select(host_live, device_live)
        return self._planned[key]

    def _select(self, host_live: bool, device_live: bool) -> PlannedBuffers | None:
        kept = [
            (entry, device)
            for entry, device in zip(self.entries, self.is_device, strict=True)
            if (device and device_live) or (not device and host_live)
        ]
        if not kept:
            return None
        # Host pages live: each buffer by its space. Else every kept buffer is
        # device-backed: planned against the device pages, as the only space.
        is_device = tuple(device for _, device in kept) if host_live else None
        return PlannedBuffers([entry for entry, _ in kept], is_device)


def _peer_buffers(entries: Entries, dst_device_ptrs: set[int] | None) -> PeerBuffers:
    """`entries` with the destination spaces of `dst_device_ptrs`, built once per peer layout."""
    key = frozenset(dst_device_ptrs) if dst_device_ptrs else None
    return entries.derive(("generic", key), lambda: PeerBuffers(entries, dst_device_ptrs))


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
        bounds.check_no_negative(call.dst_data_indices, "dst_data_indices")
    if device_live:
        bounds.check_no_negative(call.dst_device_data_indices, "dst_device_data_indices")
    bounds.check_sources(
        manager.kv_args, src_ptrs, max_page, item_lens, 0, item_lens, "prefill_data_indices"
    )


def _uses_per_layer_futures(manager: conn.MooncakeKVManager) -> bool:
    """sglang submits one engine call per layer to the executor with a custom memory pool."""
    return manager.enable_custom_mem_pool and manager.custom_mem_pool_type != "INTRA_NODE_NVLINK"


def _check_supported(call: SendCall) -> None:
    """`Fallback` where the original must run (it raises or asserts on these inputs)."""
    src, device = call.prefill_data_indices, call.dst_device_data_indices
    pages = (src, call.dst_data_indices) if device is None else (src, call.dst_data_indices, device)
    if not all([isinstance(p, np.ndarray) and p.ndim == 1 for p in pages]):
        raise Fallback("page indices are not 1-D NumPy arrays")
    src_size = src.size
    if src_size and not all([p.size in (0, src_size) for p in pages]):
        raise Fallback("page lists of unequal lengths")
    if call.dst_device_data_ptrs and call.dst_device_data_indices is None:
        raise Fallback("device destination buffers without device page indices")


def _plan(
    manager: conn.MooncakeKVManager, call: SendCall, entries: Entries
) -> tuple[gp.TransferPlan, PlannedBuffers] | None:
    """Plan `entries` as sglang would transfer them; None when no descriptor results.

    A destination space with an empty page list has no runs (sglang's
    `group_concurrent_contiguous` returns none when either side is empty), so
    its buffers move nothing and are left out of the layout.

    The plan's own scan finds a negative page and a source read outside the
    prefill's registered memory (the layout's source lengths: `PlannedBuffers.layout`),
    on the pages it reads anyway. Where it refuses a send, `_check_bounds` says
    why (`bounds.OutOfRange`, naming sglang's field); a `gp.BoundsError` it does
    not account for is still a source read outside the registration (the layout
    bounds no destination), which the caller refuses as well.
    """
    src_pages = call.prefill_data_indices
    peer = _peer_buffers(entries, call.dst_device_data_ptrs)
    host_live = src_pages.size > 0 and call.dst_data_indices.size > 0
    device_live = src_pages.size > 0 and peer.any_device and call.dst_device_data_indices.size > 0
    buffers = peer.planned(host_live, device_live)
    if buffers is None:
        return None
    layout = buffers.layout(bounds.registration(manager.kv_args))
    if host_live:
        dst_pages = call.dst_data_indices
        device_pages = call.dst_device_data_indices if device_live else None
    else:
        dst_pages, device_pages = call.dst_device_data_indices, None
    max_batch_pages = 0 if _uses_per_layer_futures(manager) else manager.max_transfer_batch_indices
    try:
        plan = gp.plan_transfer(
            src_pages,
            dst_pages,
            layout,
            dst_device_pages=device_pages,
            max_batch_pages=max(max_batch_pages, 0),
        )
    except gp.PlanValidationError:
        _check_bounds(manager, call, buffers.src_ptrs, buffers.item_lens, host_live, device_live)
        raise
    return plan, buffers
