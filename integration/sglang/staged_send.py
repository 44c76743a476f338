"""Receive staging, prefill side: write a send into the decode's reservation as a few pieces.

A decode with the plugin advertises its receive staging in its KV
registration and lends each request a part of it in the request's metadata
(`staging_wire`); the hooks on sglang's parsers of those two messages
(`KVArgsRegisterInfo.from_zmq`, `TransferInfo.from_zmq`) keep what a
gpu_planner decode added, checked, and leave sglang's result as it is. A
plain sglang decode adds nothing, so its sends never take this path.

A generic send toward a decode that lent its request a part, which `decide`
finds both possible (everything lines up for the decode's scatter) and
cheaper staged (`path_cost`: its price both ways to this peer, learned from
this process's own sends; or the gate a user set with
`GPU_PLANNER_STAGING_MIN_DESCRIPTORS` / `..._MAX_MEAN_BYTES`), is gathered page
by page of every buffer into the prefill's registered send staging (the
gathered path's slots) one slot-sized piece of pages at a time, two slots at
most, and written into the part while the next is gathered: in host memory,
each piece in parts of whole buffers, every part started on the wire (one
descriptor, Mooncake's asynchronous write) from this thread as soon as it is
gathered (`Pieces.write_in_parts`); on a device, or through an engine without
asynchronous writes, one descriptor per piece from sglang's executor once its
gather is done (`Pieces.write_from`). Once every write succeeded, the send is
named to the decode in a `Staged` note on the socket sglang's
status messages take (so the note arrives first); the decode scatters it into
its pages before it counts the request's KV as arrived. The rank's Success
status declares how many notes it sent for each lent request
(`status_message_hook`): every other chunk went direct, and a decode whose
notes did not all arrive fails the request.

Which request a send belongs to: sglang hands the send a slice of the
`TransferInfo`'s destination pages; the slice's base array is the one the
parser hook saw, and its offset is the chunk's first page in the request.
Anything that does not line up (no part lent, a layout the decode would not
scatter, no free slot) returns None before any byte moved: the send goes as
planned, counted.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.head_gather import gather_in_parts
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import AsyncWrites, sglang_async_writes, sglang_handoff
from gpu_planner.integration.sglang.counters import (
    record_fallback,
    record_path_choice,
    record_send,
)
from gpu_planner.integration.sglang.fallback import current_send, log_fallback_once, log_once
from gpu_planner.integration.sglang.gathered import (
    Chunk,
    PartWrites,
    SlotLease,
    gather_into_slot,
    piece_executor,
    staging_for,
)
from gpu_planner.integration.sglang.path_cost import DIRECT, STAGED, path_costs
from gpu_planner.integration.sglang.staging_wire import (
    KV_POLL_SUCCESS,
    Capability,
    Reservation,
    Staged,
    chunk_offset,
    declared_frames,
    writer_part,
)
from gpu_planner.layout import BufferLayout

_peers: dict[str, Capability] = {}  # decode session -> its advertised region
_routes: dict[int, Route] = {}  # id of a TransferInfo's page array -> its lent part
_lock = threading.Lock()


@dataclass(eq=False)
class Route:
    """Where one request's staged bytes go, whom to tell, and how many notes it was told."""

    room: int
    session: str
    endpoint: str
    port: int
    region: Capability
    reservation: Reservation
    pages: weakref.ref  # the TransferInfo's destination pages (the send's slices view them):
    # weak, so that the route ends with sglang's TransferInfo
    pages_address: int  # where those pages' data starts (a slice's offset is from here)
    staged_notes: int = 0  # notes sent for this request: its Success status declares them


def registration_info_hook(original: Any, cls: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's parse of a decode's registration; keeps the receive staging it advertised."""
    info = original(cls, msg, *args, **kwargs)
    session = getattr(info, "mooncake_session_id", None)
    try:
        capability = Capability.from_registration(msg)
        if capability is not None:
            _check_apart(capability, info)
    except Exception as error:  # malformed or hostile: ignored, the peer sends as today
        capability = None
        log_fallback_once(
            f"a decode's receive-staging advertisement was ignored ({error})",
            key="staging advertisement ignored",
        )
    with _lock:
        if capability is None:
            _peers.pop(session, None)
        else:
            _peers[session] = capability
    return info


def _check_apart(capability: Capability, info: Any) -> None:
    """`ValueError` when the advertised region overlaps what else the decode registered.

    sglang's registration carries each buffer's base (KV, aux, state, its own
    staging) and each KV buffer's page length, not its size: no base may lie
    inside the region, nor the region inside a KV buffer's first page.
    """
    start, end = capability.address, capability.address + capability.nbytes
    kv_ptrs = [int(ptr) for ptr in info.dst_kv_ptrs]
    item_lens = list(info.dst_kv_item_lens) or [int(info.dst_kv_item_len)] * len(kv_ptrs)
    state_ptrs = [int(ptr) for ptrs in info.dst_state_data_ptrs for ptr in ptrs]
    bases = kv_ptrs + [int(ptr) for ptr in info.dst_aux_ptrs] + state_ptrs
    bases += [int(info.staging_base_ptr)] if info.staging_base_ptr else []
    inside = [base for base in bases if start <= base < end]
    first_pages = [
        (ptr, ptr + int(item_len))
        for ptr, item_len in zip(kv_ptrs, item_lens, strict=False)
        if ptr < end and start < ptr + int(item_len)
    ]
    if inside or first_pages:
        at = inside[0] if inside else first_pages[0][0]
        raise ValueError(
            f"{capability.nbytes} bytes at {start} overlap the decode's registered buffer at {at}"
        )


def transfer_info_hook(original: Any, cls: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's parse of a request's metadata; keeps the part of the region lent to it."""
    info = original(cls, msg, *args, **kwargs)
    try:
        with _lock:
            region = _peers.get(info.mooncake_session_id)
        reservation = None if region is None else Reservation.from_metadata(msg, region)
        if reservation is None or info.is_dummy:
            return info
        pages = info.dst_kv_indices
        if reservation.pages != len(pages):
            raise ValueError(f"{reservation.pages} pages lent for {len(pages)} pages")
        pages_ref = weakref.ref(pages)
        route = Route(
            info.room, info.mooncake_session_id, info.endpoint, info.dst_port,
            region, reservation, pages_ref, pages.ctypes.data,
        )  # fmt: skip
        key = id(pages)
        with _lock:
            _routes[key] = route
        weakref.finalize(pages, _forget_route, key, pages_ref)
    except Exception as error:  # ignored: the request is sent as today
        log_fallback_once(
            f"a decode's receive-staging reservation was ignored ({error})",
            key="staging reservation ignored",
        )
    return info


def _forget_route(key: int, pages_ref: weakref.ref) -> None:
    with _lock:
        route = _routes.get(key)
        if route is not None and route.pages is pages_ref:
            del _routes[key]


def route_for(dst_pages: np.ndarray) -> tuple[Route, int] | None:
    """The request `dst_pages` (a slice of its metadata's pages) belongs to, and its first page."""
    base = dst_pages.base if isinstance(dst_pages.base, np.ndarray) else dst_pages
    route = _routes.get(id(base))  # one dict read: atomic, no lock
    if route is None or route.pages() is not base or dst_pages.dtype != base.dtype:
        return None
    itemsize = base.dtype.itemsize
    offset = dst_pages.ctypes.data - route.pages_address
    if dst_pages.strides != (itemsize,) or offset % itemsize:
        return None
    return route, offset // itemsize


# Why a head-sliced send's buffers cannot be staged (`StagedEntries.of_head_slices`).
NOT_ONE_SHARE = "a head-sliced send whose prefill tokens are not each one share of a decode slot"


@dataclass(frozen=True)
class StagedEntries:
    """The buffers a send moves, as the staging moves them: whole source pages, buffer-major.

    `writer` of `writers` is this prefill rank's share of each decode token
    (TP-down: its heads, at `writer / writers` of the slot; 1 and 0 otherwise),
    so every decode page of buffer `j` is `writers * src_page_lens[j]` bytes.
    """

    src_ptrs: np.ndarray  # int64 [entries]
    dst_ptrs: np.ndarray  # int64 [entries]: decode buffer base addresses
    src_page_lens: np.ndarray  # int64 [entries]
    is_device: np.ndarray  # bool [entries]: the decode buffer takes the device pages
    writers: int = 1
    writer: int = 0

    # What every send of these entries reads, computed on first use (the entries of a
    # generic send are built once per layout, `send.PlannedBuffers`).
    @functools.cached_property
    def chunk_page_bytes(self) -> int:
        """Bytes of one page of every entry: a staged chunk's bytes per page."""
        return int(self.src_page_lens.sum())

    @functools.cached_property
    def keys(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(source pointers, destination pointers, page lengths) as tuples: cache keys."""
        return (
            tuple(self.src_ptrs.tolist()),
            tuple(self.dst_ptrs.tolist()),
            tuple(self.src_page_lens.tolist()),
        )

    @classmethod
    def of_plan(cls, layout: BufferLayout, dst_device_ptrs: set[int] | None) -> StagedEntries:
        """A generic send's planned buffers (HiSparse: sglang's device-backed set)."""
        is_device = [
            bool(dst_device_ptrs) and int(ptr) in dst_device_ptrs for ptr in layout.dst_ptrs
        ]
        return cls(layout.src_ptrs, layout.dst_ptrs, layout.item_lens, np.array(is_device))

    @classmethod
    def of_head_slices(cls, layout: HeadSliceLayout) -> StagedEntries | str:
        """A TP-down head-sliced send, where each prefill token is one share of a decode slot.

        Where the slices are not that (a prefill rank sending part of its
        heads, shares that do not tile the decode slot, a prefill token that
        fills a whole slot), why not (`NOT_ONE_SHARE`): `decide` counts it as
        the reason a send toward a staging decode is not staged.
        """
        (src_ptrs, src_page_lens, src_token_lens, src_offsets) = layout.geometry[0]
        (dst_ptrs, dst_page_lens, dst_token_lens, dst_offsets) = layout.geometry[1]
        slices = layout.slice_lens
        if not slices.size or (slices <= 0).any():
            return NOT_ONE_SHARE
        writers = dst_token_lens // slices
        whole_source = (src_offsets == 0) & (src_token_lens == slices)
        tiles = (dst_token_lens == writers * slices) & (dst_offsets % slices == 0)
        one_share = (writers == writers[0]) & (dst_offsets // slices == dst_offsets[0] // slices[0])
        pages = dst_page_lens == layout.page_size * dst_token_lens
        if not (whole_source & tiles & one_share & pages).all() or writers[0] < 2:
            return NOT_ONE_SHARE
        return cls(
            src_ptrs, dst_ptrs, src_page_lens, np.zeros(len(slices), dtype=bool),
            int(writers[0]), int(dst_offsets[0] // slices[0]),
        )  # fmt: skip


@dataclass(frozen=True)
class StagedWrite:
    """How one send goes staged: where each piece goes, and the note that names them."""

    route: Route
    page_start: int  # the send's first page in the request
    decode_page_bytes: int  # the decode's bytes per page over all its buffers
    entry_ids: list[int]  # each entry's decode buffer index
    prefill_rank: int
    staging: Any  # the prefill's `GatherStaging`
    src_lens: np.ndarray  # each source buffer's registered bytes
    chunks: list[tuple[int, int]]  # (first page, pages) of each slot-sized piece
    nbytes: int


def decide(
    manager: Any,
    session: str,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    entries: StagedEntries | str,
    descriptors: int,
) -> StagedWrite | str | None:
    """Whether a send goes staged: how, or why not (counted by the caller as `not staged`);
    None: it goes direct with nothing more to count (the decode offered no staging, or the
    path's choice said direct, counted as that choice).

    The one place that decides, in three steps: what this prefill and the
    send's buffers allow (no request is looked up); what the send would cost
    each way to this peer (`path_cost`: the model, or the gate a user set);
    and, for a send priced faster staged, whether its request lines up for
    the decode's scatter (`_line_up`). A send priced slower staged (most
    small sends) goes direct without that look-up. Each priced send's path is
    counted with its reason (`paths_chosen`): direct where staging was priced
    slower (or the gate or a probe said so), or a staged choice did not line up
    (under the line-up's reason, which the caller also counts as `not staged`).
    """
    if session not in _peers or not src_pages.size:  # one dict read: atomic, no lock
        return None
    if isinstance(entries, str):  # the send's buffers cannot be staged: why
        return entries
    if dst_pages.size != src_pages.size:
        return "page lists of unequal lengths"
    if getattr(manager, "deferred_bootstrap", None) is not None:
        return "sglang publishes this prefill's Success later (deferred bootstrap)"
    staging = staging_for(manager)
    if isinstance(staging, str):
        return f"no send staging: {staging}"
    chunk_page_bytes = entries.chunk_page_bytes
    pages_per_slot = staging.slot_bytes // chunk_page_bytes
    if pages_per_slot == 0:
        return f"a page of every buffer ({chunk_page_bytes} bytes) exceeds a slot"
    num_pages = src_pages.size
    nbytes = num_pages * chunk_page_bytes
    choice = path_costs().choose(session, descriptors, nbytes, -(-num_pages // pages_per_slot))
    if not choice.staged:
        record_path_choice(DIRECT, choice.reason)
        return None
    lined_up = _line_up(manager, session, dst_pages, entries, num_pages)
    if isinstance(lined_up, str):
        record_path_choice(DIRECT, lined_up)
        return lined_up
    record_path_choice(STAGED, choice.reason)
    route, page_start, decode_page_bytes, entry_ids, prefill_rank, src_lens = lined_up
    chunks = [
        (first, min(pages_per_slot, num_pages - first))
        for first in range(0, num_pages, pages_per_slot)
    ]
    return StagedWrite(
        route, page_start, decode_page_bytes, entry_ids, prefill_rank, staging, src_lens,
        chunks, nbytes,
    )  # fmt: skip


def _line_up(
    manager: Any, session: str, dst_pages: np.ndarray, entries: StagedEntries, num_pages: int
) -> tuple[Route, int, int, list[int], int, np.ndarray] | str:
    """What the decode's scatter of this send into its request's pages needs, or why it cannot:
    (route, first page, decode bytes per page, entry ids, prefill rank, source rooms)."""
    found = route_for(dst_pages)
    if found is None:
        return "no part of the decode's receive staging lent to this request"
    route, page_start = found
    decode = _decode_entries(manager, session, entries)
    if isinstance(decode, str):
        return decode
    decode_page_bytes, entry_ids = decode
    try:
        prefill_rank = int(manager._prefill_unique_rank())
    except Exception as error:  # a manager without sglang's rank fields: no note could name it
        return f"this prefill's rank is not known ({error})"
    reservation = route.reservation
    if (
        route.session != session
        or page_start + num_pages > reservation.pages
        or reservation.nbytes != reservation.pages * decode_page_bytes
        or decode_page_bytes % entries.writers
    ):
        return "the lent part does not match this send's pages"
    src_lens = _registered_room(bounds.registration(manager.kv_args), entries.keys[0])
    if src_lens is None:
        return "a source buffer outside the prefill's registered memory"
    return route, page_start, decode_page_bytes, entry_ids, prefill_rank, src_lens


def send_staged(
    manager: Any,
    session: str,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    entries: StagedEntries | str,
    descriptors: int,
    executor: concurrent.futures.Executor,
) -> int | None:
    """Write a send through the decode's receive staging; None: send it as planned.

    Args:
        manager: sglang's `MooncakeKVManager` (prefill).
        session: the decode's Mooncake session.
        src_pages: the send's prefill pages.
        dst_pages: sglang's slice of the request's decode (host) pages, as
            the send got it: its base array says which request it is.
        entries: the buffers the send moves (`StagedEntries`), or why they cannot be
            staged (counted as the reason, where the decode offered staging).
        descriptors: what the send would otherwise hand Mooncake (its price direct).
        executor: sglang's executor: each piece's engine call runs there, so
            that the next piece is gathered while one is on the wire.

    Returns:
        0 or the first failing engine status; None before any byte moved when
        the send goes as planned (counted by `decide` as the path's choice, or
        as `not staged: <why>` where something did not allow staging).
    """
    # What staging adds to a send, as the model prices it: the choice and the request's
    # line-up, the gathers and engine calls, the note (a direct send's observation is its
    # engine calls: the choice, paid either way, is charged to staging, never to sglang's path).
    started = time.perf_counter()
    write = decide(manager, session, src_pages, dst_pages, entries, descriptors)
    if not isinstance(write, StagedWrite):
        return None if write is None else _not_staged(write)
    route = write.route
    reservation = route.reservation
    part, _ = writer_part(reservation.nbytes, entries.writers, entries.writer)
    base = route.region.address + reservation.offset + part
    src_key, _, page_lens_key = entries.keys
    pieces = Pieces(
        write.staging, _gather_layout(src_key, page_lens_key), src_pages, write.src_lens,
        entries.chunk_page_bytes,
        [
            (first, count, base + chunk_offset(
                write.decode_page_bytes, entries.writers, write.page_start + first
            ))
            for first, count in write.chunks
        ],
    )  # fmt: skip
    engine_handoff = sglang_handoff(manager.engine)
    writes = _part_writes(manager, write.staging)
    first_slot = write.staging.try_take()
    if first_slot is None:
        return _not_staged("every send staging slot is lent to other sends")
    if writes is None:
        lease = SlotLease(write.staging, first_slot, current_send().futures)
    else:
        lease = PartWrites(write.staging, first_slot, writes, session)
    with lease:  # whatever raises, each slot goes back once no write reads it
        record_send(
            "staged", engine_handoff.form, len(write.chunks), write.nbytes,
            time.perf_counter() - started, len(write.entry_ids), len(write.chunks),
        )  # fmt: skip
        if writes is None:
            pieces.write_from(lease, executor, engine_handoff, session)
            status = manager._await_transfer_futures(current_send().futures)
        else:
            pieces.write_in_parts(lease)
            status = lease.finish()
    if status != 0:
        return status  # no note: the decode scatters nothing of this send
    staged = Staged(
        room=route.room,
        reservation_id=reservation.reservation_id,
        prefill_rank=write.prefill_rank,
        writer=entries.writer,
        writers=entries.writers,
        entries=np.asarray(write.entry_ids, dtype=np.int64),
        is_device=entries.is_device,
        chunks=np.array(
            [(write.page_start + first, count) for first, count in write.chunks], dtype=np.int64
        ),
    )
    _notify(manager, route, staged)
    observe(session, STAGED, len(write.chunks), write.nbytes, time.perf_counter() - started, True)
    with _lock:
        route.staged_notes += 1
    return 0


# A host-staged piece goes on the wire in parts of about PART_BYTES (at most MAX_PARTS),
# each written as soon as it is gathered, while the next part is gathered. Measured on two
# cores over loopback TCP (docs/benchmarks.md): 4 MB in 1, 2, 3, 4 parts 3.24, 3.07, 3.19,
# 3.30 ms; 32 MB in 1, 2, 4, 8, 16 parts 26.2, 23.8, 23.5, 22.7, 23.9 ms (each part is one
# more request; the gather of the first part is not overlapped).
PART_BYTES = 2 << 20
MAX_PARTS = 8


@dataclass(frozen=True)
class Pieces:
    """A staged send's slot-sized pieces: what each gathers and where its bytes go."""

    staging: Any  # the prefill's `GatherStaging`
    layout: HeadSliceLayout  # whole source pages of every buffer, buffer-major
    src_pages: np.ndarray
    src_lens: np.ndarray  # each source buffer's registered bytes
    page_bytes: int  # a page of every buffer: a piece's bytes per page
    pieces: list[tuple[int, int, int]]  # (first page, pages, the decode's address) of each

    def write_from(
        self, lease: SlotLease, executor: concurrent.futures.Executor, engine_handoff: Any,
        session: str,
    ) -> None:  # fmt: skip
        """Gather each piece here and write it from `executor` (sglang's, for more than one
        piece: the next is gathered while one is on the wire), once its gather is done."""
        executor = piece_executor(executor, len(self.pieces))
        for first, count, dst in self.pieces:
            slot = lease.next_slot()  # may wait for this send's own earlier piece
            if slot is None:
                return  # the send fails: no more pieces are gathered
            ready = gather_into_slot(
                self.staging, slot, self.layout, Chunk(slice(None), slice(first, first + count)),
                self.src_pages, self.src_lens,
            )  # fmt: skip
            columns = (
                np.array([self.staging.slot(slot).data_ptr()], dtype=np.int64),
                np.array([dst], dtype=np.int64),
                np.array([count * self.page_bytes], dtype=np.int64),
            )
            lease.write(slot, executor, engine_handoff, session, ready, columns)

    def write_in_parts(self, lease: PartWrites) -> None:
        """Gather each piece in parts (host staging), each part written as soon as it is
        gathered, from this thread: the gather of one part overlaps the wire of the last."""
        for first, count, dst in self.pieces:
            slot = lease.next_slot()  # may wait for this send's own earlier piece
            if slot is None:
                return
            parts = min(MAX_PARTS, max(1, round(count * self.page_bytes / PART_BYTES)))
            written = 0
            for end in gather_in_parts(
                self.layout, self.src_pages[first : first + count], self.staging.slot(slot),
                self.src_lens, parts,
            ):  # fmt: skip
                lease.write(slot, written, dst + written, end - written)
                if lease.status:
                    return  # the send fails: no more parts are gathered
                written = end


def _part_writes(manager: Any, staging: Any) -> AsyncWrites | None:
    """The engine's asynchronous writes where the staging is in host memory (the gather runs
    here, part by part); None on a device (its gather is one kernel, then an event) or an
    engine without them: the pieces go from sglang's executor."""
    if cuda_runtime().runs_on_device(staging.torch_device):
        return None
    return sglang_async_writes(manager.engine)


def observe(session: str, path: str, requests: int, nbytes: int, seconds: float, ok: bool) -> None:
    """A send to `session` took `path`: its time teaches the cost model, where that decode
    offers staging (the only peers it chooses for). Never raises: the send's status stands."""
    if session not in _peers:  # one dict read: atomic, no lock
        return
    try:
        path_costs().observe(session, path, requests, nbytes, seconds, ok)
    except Exception as error:
        log_fallback_once(f"the cost model did not take a send ({error})", key="cost model")


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _gather_layout(src_ptrs: tuple[int, ...], page_lens: tuple[int, ...]) -> HeadSliceLayout:
    """Whole source pages of every buffer, buffer-major, as the decode scatters them: the same
    for every send of these buffers, so each is built (and validated) once."""
    lens = np.asarray(page_lens, dtype=np.int64)
    return HeadSliceLayout.build(
        src_ptrs=np.asarray(src_ptrs, dtype=np.int64),
        dst_ptrs=np.zeros(len(src_ptrs), dtype=np.int64),
        page_size=1,
        src_page_lens=lens,
        dst_page_lens=lens,
        src_token_lens=lens,
        dst_token_lens=lens,
        src_head_offsets=0,
        dst_head_offsets=0,
        slice_lens=lens,
    )


def _decode_entries(
    manager: Any, session: str, entries: StagedEntries
) -> tuple[int, list[int]] | str:
    """(decode bytes per page over all its buffers, the decode index of each entry)."""
    decode = getattr(manager, "decode_kv_args_table", {}).get(session)
    if decode is None:
        return "the decode's registration is not known"
    return _entry_ids(
        tuple(decode.dst_kv_ptrs),
        tuple(decode.dst_kv_item_lens) or (int(decode.dst_kv_item_len),) * len(decode.dst_kv_ptrs),
        entries.keys[1],
        entries.keys[2],
        entries.writers,
    )


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _registered_room(
    registration: tuple[tuple[int, ...], tuple[int, ...]], src_ptrs: tuple[int, ...]
) -> np.ndarray | None:
    """Each source buffer's registered bytes from its pointer (read-only); None where one lies
    outside the prefill's registered memory. The same for every send of these buffers under
    one registration (`bounds.registration`: what it reads of `kv_args`)."""
    room = bounds.registered_room_of(registration, np.asarray(src_ptrs, dtype=np.int64))
    if (room < 0).any():
        return None
    room.flags.writeable = False
    return room


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def _entry_ids(
    dst_ptrs: tuple[int, ...],
    item_lens: tuple[int, ...],
    entry_ptrs: tuple[int, ...],
    page_lens: tuple[int, ...],
    writers: int,
) -> tuple[int, list[int]] | str:
    """`_decode_entries` for one decode registration and one send layout (the same for every
    send between them: matched once)."""
    if len(item_lens) != len(dst_ptrs):
        return "the decode's registration has item lengths for other buffers"
    index = {int(ptr): position for position, ptr in enumerate(dst_ptrs)}
    entry_ids = []
    for ptr, page_len in zip(entry_ptrs, page_lens, strict=True):
        position = index.get(ptr)
        if position is None or int(item_lens[position]) != writers * page_len:
            return "a destination that is not a whole decode KV buffer"
        entry_ids.append(position)
    if sorted(entry_ids) != list(range(len(dst_ptrs))):
        # A pipeline stage holds some layers: the staged layout places a chunk of every
        # decode buffer, so stages writing their own layers there would overlap.
        return "the send writes only some of the decode's KV buffers (a pipeline stage)"
    return sum(int(item_len) for item_len in item_lens), entry_ids


def declarations(manager: Any, room: int) -> dict[tuple[str, int], int]:
    """{(decode session, reservation id): staged notes sent} of `room`'s lent requests.

    What this rank's Success status for `room` declares: every chunk of a
    lent request that no note names went direct.
    """
    infos = getattr(manager, "transfer_infos", {}).get(room) or {}
    declared = {}
    with _lock:
        for info in infos.values():
            pages = getattr(info, "dst_kv_indices", None)
            route = _routes.get(id(pages))
            if route is not None and route.pages() is pages:
                declared[route.session, route.reservation.reservation_id] = route.staged_notes
    return declared


def status_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's status message; a Success declares the notes sent for each lent request."""
    parts = original(manager, *args, **kwargs)
    try:
        if int(kwargs.get("status", -1)) != KV_POLL_SUCCESS or args:
            return parts
        declared = declarations(manager, kwargs["bootstrap_room"])
        if not declared:
            return parts
        reason = [] if manager.kv_status_msg_carries_reason else [b""]  # sglang reads frame 3
        return [*parts, *reason, *declared_frames(declared)]
    except Exception as error:  # nothing declared: a decode that got notes fails the request
        log_fallback_once(f"a status declared no staged notes ({error})", key="not declared")
    return parts


def _notify(manager: Any, route: Route, staged: Staged) -> None:
    """Send the note on the socket sglang's status messages to this decode take."""
    from sglang.srt.utils.network import NetworkAddress

    address = NetworkAddress(route.endpoint, route.port)
    manager._send_multipart_locked(address.to_tcp(), staged.frames(), is_ipv6=address.is_ipv6)


def _not_staged(reason: str) -> None:
    """A send toward a staging decode goes direct: counted as `not staged: <reason>` (among
    the fallbacks, of the staged path), logged the first time; it stays the hook's send."""
    key = f"not staged: {reason}"
    record_fallback(key)
    log_once(logging.INFO, f"gpu_planner: a send goes direct, not staged: {reason}", key)
    return None


def forget_peers() -> None:
    """Forget every advertised region and lent part (tests)."""
    with _lock:
        _peers.clear()
        _routes.clear()
