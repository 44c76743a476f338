"""Receive staging, prefill side: a send written into the decode's reservation as a few pieces.

A generic or TP-down head-sliced send toward a decode that lent its request
a part of its receive staging (`prefill_routes`), which `send_path` chose to
stage, is gathered page by page of every buffer into the prefill's send slots
(`send_slots`) one slot-sized piece of pages at a time, two slots at most,
and written into the part while the next piece is gathered:
- host slots: each piece in parts of whole buffers, every part started on the
  wire (one descriptor, Mooncake's asynchronous write) from this thread as
  soon as it is gathered (`Pieces.write_in_parts`);
- device slots, or an engine without asynchronous writes: one descriptor per
  piece from sglang's executor once its gather is done (`Pieces.write_from`).

Once every write succeeded, the send is named to the decode in a `Staged`
note on the socket sglang's status messages take (so the note arrives
first); the decode scatters it into the request's pages before it counts the
request's KV as arrived. A send whose write failed sends no note: the decode
scatters nothing of it.

`line_up` says whether a send's request lines up for the decode's scatter
(the part lent, the decode's buffers, this rank), or why not.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.head_gather import gather_in_parts
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import AsyncWrites, sglang_async_writes, sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.prefill_routes import ROUTES, Route
from gpu_planner.integration.sglang.send_slots import (
    Chunk,
    PartWrites,
    SendSlots,
    SlotLease,
    gather_into_slot,
    piece_executor,
)
from gpu_planner.integration.sglang.staging_wire import Staged, chunk_offset, writer_part
from gpu_planner.layout import BufferLayout

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
        fills a whole slot), why not (`NOT_ONE_SHARE`): `send_path` counts it as
        the reason a send toward a staging decode goes another way.
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


# Why a send's request does not line up for the decode's scatter (`line_up`).
NO_PART_LENT = "no part of the decode's receive staging lent to this request"
DECODE_UNKNOWN = "the decode's registration is not known"
OTHER_ITEM_LENS = "the decode's registration has item lengths for other buffers"
NOT_WHOLE_BUFFER = "a destination that is not a whole decode KV buffer"
PIPELINE_STAGE = "the send writes only some of the decode's KV buffers (a pipeline stage)"
RANK_UNKNOWN = "this prefill's rank is not known"
PART_MISMATCH = "the lent part does not match this send's pages"
SOURCE_OUTSIDE = "a source buffer outside the prefill's registered memory"


@dataclass(frozen=True)
class LinedUp:
    """What the decode's scatter of one send into its request's pages needs."""

    route: Route
    page_start: int  # the send's first page in the request
    decode_page_bytes: int  # the decode's bytes per page over all its buffers
    entry_ids: list[int]  # each entry's decode buffer index
    prefill_rank: int
    src_lens: np.ndarray  # each source buffer's registered bytes


def line_up(
    manager: Any, session: str, dst_pages: np.ndarray, entries: StagedEntries, num_pages: int
) -> LinedUp | str:
    """What the decode's scatter of this send into its request's pages needs, or why it cannot
    (one of this module's reasons)."""
    found = ROUTES.route_for(dst_pages)
    if found is None:
        return NO_PART_LENT
    route, page_start = found
    decode = _decode_entries(manager, session, entries, route.lent_page)
    if isinstance(decode, str):
        return decode
    decode_page_bytes, entry_ids = decode
    try:
        prefill_rank = int(manager._prefill_unique_rank())
    except Exception:  # a manager without sglang's rank fields: no note could name it
        return RANK_UNKNOWN
    reservation = route.reservation
    if (
        route.session != session
        or page_start + num_pages > reservation.pages
        or reservation.nbytes != reservation.pages * decode_page_bytes
        or decode_page_bytes % entries.writers
    ):
        return PART_MISMATCH
    src_lens = _registered_room(bounds.registration(manager.kv_args), entries.keys[0])
    if src_lens is None:
        return SOURCE_OUTSIDE
    return LinedUp(route, page_start, decode_page_bytes, entry_ids, prefill_rank, src_lens)


@dataclass(frozen=True)
class StagedWrite:
    """How one send goes staged: its entries, its request's line-up and its slot-sized pieces."""

    entries: StagedEntries
    lined_up: LinedUp
    slots: SendSlots
    chunks: list[tuple[int, int]]  # (first page, pages) of each slot-sized piece
    nbytes: int


def part_writes(manager: Any, slots: SendSlots) -> AsyncWrites | None:
    """The engine's asynchronous writes where the slots are in host memory (the gather runs
    here, part by part); None on a device (its gather is one kernel, then an event) or an
    engine without them: the pieces go from sglang's executor."""
    if cuda_runtime().runs_on_device(slots.torch_device):
        return None
    return sglang_async_writes(manager.engine)


def write_staged(
    manager: Any,
    session: str,
    write: StagedWrite,
    lease: SlotLease | PartWrites,
    src_pages: np.ndarray,
    executor: concurrent.futures.Executor,
    started: float,
) -> int:
    """Gather and write `write`'s pieces through `lease` (its first slot taken), then send the
    note; 0, or the first failing engine status (no note: the decode scatters nothing).

    `started` (perf_counter) is when the send's path was being chosen: its plan time counted.
    """
    entries, lined_up = write.entries, write.lined_up
    route = lined_up.route
    reservation = route.reservation
    part, _ = writer_part(reservation.nbytes, entries.writers, entries.writer)
    base = route.region.address + reservation.offset + part
    src_key, _, page_lens_key = entries.keys
    pieces = Pieces(
        write.slots, _gather_layout(src_key, page_lens_key), src_pages, lined_up.src_lens,
        entries.chunk_page_bytes,
        [
            (first, count, base + chunk_offset(
                lined_up.decode_page_bytes, entries.writers, lined_up.page_start + first
            ))
            for first, count in write.chunks
        ],
    )  # fmt: skip
    with lease:  # whatever raises, each slot goes back once no write reads it
        engine_handoff = sglang_handoff(manager.engine)
        record_send(
            "staged", engine_handoff.form, len(write.chunks), write.nbytes,
            time.perf_counter() - started, len(lined_up.entry_ids), len(write.chunks),
        )  # fmt: skip
        if isinstance(lease, SlotLease):
            pieces.write_from(lease, executor, engine_handoff, session)
            status = manager._await_transfer_futures(lease.futures)
        else:
            pieces.write_in_parts(lease)
            status = lease.finish()
    if status != 0:
        return status
    staged = Staged(
        room=route.room,
        reservation_id=reservation.reservation_id,
        prefill_rank=lined_up.prefill_rank,
        writer=entries.writer,
        writers=entries.writers,
        entries=np.asarray(lined_up.entry_ids, dtype=np.int64),
        is_device=entries.is_device,
        chunks=np.array(
            [(lined_up.page_start + first, count) for first, count in write.chunks],
            dtype=np.int64,
        ),
    )
    _notify(manager, route, staged)
    ROUTES.note_sent(route)
    return 0


# A host piece goes on the wire in parts of about PART_BYTES, at most MAX_PARTS, each written as
# soon as it is gathered: a part is one more request, and the first part's gather is not
# overlapped (docs/benchmarks.md, "Staged pieces in parts").
PART_BYTES = 2 << 20
MAX_PARTS = 8


@dataclass(frozen=True)
class Pieces:
    """A staged send's slot-sized pieces: what each gathers and where its bytes go."""

    slots: SendSlots
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
                self.slots, slot, self.layout, Chunk(slice(None), slice(first, first + count)),
                self.src_pages, self.src_lens,
            )  # fmt: skip
            columns = (
                np.array([self.slots.slot(slot).data_ptr()], dtype=np.int64),
                np.array([dst], dtype=np.int64),
                np.array([count * self.page_bytes], dtype=np.int64),
            )
            lease.write(slot, executor, engine_handoff, session, ready, columns)

    def write_in_parts(self, lease: PartWrites) -> None:
        """Gather each piece in parts (host slots), each part written as soon as it is
        gathered, from this thread: the gather of one part overlaps the wire of the last."""
        for first, count, dst in self.pieces:
            slot = lease.next_slot()  # may wait for this send's own earlier piece
            if slot is None:
                return
            parts = min(MAX_PARTS, max(1, round(count * self.page_bytes / PART_BYTES)))
            written = 0
            for end in gather_in_parts(
                self.layout, self.src_pages[first : first + count], self.slots.slot(slot),
                self.src_lens, parts,
            ):  # fmt: skip
                lease.write(slot, written, dst + written, end - written)
                if lease.status:
                    return  # the send fails: no more parts are gathered
                written = end


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
    manager: Any, session: str, entries: StagedEntries, lent_page: tuple[int, int]
) -> tuple[int, list[int]] | str:
    """(decode bytes per lent page over all its buffers, the decode index of each entry);
    a lent page is `lent_page[0] / lent_page[1]` of a decode page (`Route.lent_page`)."""
    decode = getattr(manager, "decode_kv_args_table", {}).get(session)
    if decode is None:
        return DECODE_UNKNOWN
    item_lens = tuple(decode.dst_kv_item_lens) or (int(decode.dst_kv_item_len),) * len(
        decode.dst_kv_ptrs
    )
    tokens, page_size = lent_page
    if tokens != page_size:
        if any(int(length) * tokens % page_size for length in item_lens):
            return PART_MISMATCH
        item_lens = tuple(int(length) * tokens // page_size for length in item_lens)
    return _entry_ids(
        tuple(decode.dst_kv_ptrs), item_lens, entries.keys[1], entries.keys[2], entries.writers
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
        return OTHER_ITEM_LENS
    index = {int(ptr): position for position, ptr in enumerate(dst_ptrs)}
    entry_ids = []
    for ptr, page_len in zip(entry_ptrs, page_lens, strict=True):
        position = index.get(ptr)
        if position is None or int(item_lens[position]) != writers * page_len:
            return NOT_WHOLE_BUFFER
        entry_ids.append(position)
    if sorted(entry_ids) != list(range(len(dst_ptrs))):
        # A pipeline stage holds some layers: the staged layout places a chunk of every
        # decode buffer, so stages writing their own layers there would overlap.
        return PIPELINE_STAGE
    return sum(int(item_len) for item_len in item_lens), entry_ids


def _notify(manager: Any, route: Route, staged: Staged) -> None:
    """Send the note on the socket sglang's status messages to this decode take."""
    from sglang.srt.utils.network import NetworkAddress

    address = NetworkAddress(route.endpoint, route.port)
    manager._send_multipart_locked(address.to_tcp(), staged.frames(), is_ipv6=address.is_ipv6)
