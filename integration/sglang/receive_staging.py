"""Receive staging, decode side: a registered region, lendings, and scatters into KV pages.

A decode with the plugin registers one region of
`GPU_PLANNER_RECEIVE_STAGING_BYTES` with Mooncake (on the KV buffers' GPU, or
in host memory for host KV) and advertises it in its KV registration
(`staging_wire.Capability`). For each request it sends a prefill, it lends
the request a part of the region big enough for all of the request's pages
of every KV buffer (`Reservation`, in the request's metadata) when one is
free; none free: the request goes as today (counted, never waited for).
Toward a prefill of another page size the part is lent in pages of the unit
that prefill's sends take (`page_sizes`), and scattered by them.

A gpu_planner prefill rank that wrote a chunk there says so (`Staged`,
before its status message, on the same socket); every other chunk it sent
went direct, and its Success status declares how many notes it sent
(`Declared`). The decode checks each note against its own record of the
request (its pages, both HiSparse spaces and which buffers take which, its
buffers; nothing the note says is an address) and scatters each chunk into
the request's pages: host-backed buffers by the host pages, device-backed
ones by the device pages, head slices (TP-down) into token slots.

The invariant, kept in one place (`ReceiveRegion.refusal`): a lent request
reaches Success only when every chunk is accounted for: each prefill rank
that reports Success declared its staged notes, every declared note
arrived, was accepted for this request's own lending, and scattered into
this request's pages (its device events completed). Anything else (a note
refused or unparseable, a count that does not match, a note without a
declaration, notes staged into a lending the request does not hold) turns
that Success into Failed with a `gpu_planner:` reason, as a failed
transfer fails.

A lending belongs to one request, not to a room id: its reservation id is
random, and it ends on every path by which sglang ends the request. Success
frees the part at once. Failed (a failed transfer, an abort, the waiting
timeout), a cleared room and a room sglang opens again for a new request hold
it until no write of the request can still land (`_quiet`): every prefill
rank sglang waits for reported its status (its sends returned), all Success,
or a Failed one and then `failed_hold_s()` (Mooncake may still send a write it
reported failed); a rank that never reports (a dead prefill) frees it only
after `NO_STATUS_HOLDS` such holds. A note for an ended lending scatters
nothing.
Nothing here waits without a bound, and no exception leaves a hook:
sglang's own result is returned.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.head_scatter import scatter_head_slices, scatter_layout
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.inputs import HOST
from gpu_planner.integration.mooncake.engine import stalled_write_s
from gpu_planner.integration.sglang import page_sizes
from gpu_planner.integration.sglang.counters import record_receive_fallback, record_scatter
from gpu_planner.integration.sglang.fallback import best_effort, log_fallback_once
from gpu_planner.integration.sglang.page_size_wire import page_size_frames
from gpu_planner.integration.sglang.registered_region import (
    PerManager,
    RegisteredRegion,
    kernel_backend,
)
from gpu_planner.integration.sglang.staging_warmup import decode_copies
from gpu_planner.integration.sglang.staging_wire import (
    KV_POLL_FAILED,
    KV_POLL_SUCCESS,
    STAGED_TAG,
    Capability,
    Reservation,
    Staged,
    chunk_offset,
    declared_notes,
    writer_part,
)
from gpu_planner.warmup import warm_up_slice_copies

ALIGNMENT = 256  # bytes: every reservation starts as aligned as the region
MAX_RESERVATIONS = 256  # lendings (lent and quarantined) at once: bounds the bookkeeping
NO_STATUS_HOLDS = 10  # an ended lending no prefill status concluded waits this many holds
HOST_BACKED_RATIO = 4  # sglang: HiSparse MLA layers of compression ratio 4 are host-backed


@dataclass(eq=False)
class Lending:
    """One request's part of the region, the pages it scatters into, and what arrived."""

    room: int
    reservation: Reservation
    host_pages: np.ndarray  # int64 [pages]: the request's pages, as the decode sent them
    # Each buffer's bytes per lent page, and its tokens: the KV page's, or for a prefill of
    # another page size the pages of `gcd` tokens its sends take (`page_sizes`).
    item_lens: tuple[int, ...]
    page_tokens: int
    device_pages: np.ndarray | None  # int64 [pages]: HiSparse's device pages, or None
    device_buffers: np.ndarray  # bool [buffers]: which decode buffers take the device pages
    notes: dict[int, int] = field(default_factory=dict)  # prefill rank: notes scattered
    claimed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # rank: pages
    writers: int | None = None
    pending: list[Any] = field(default_factory=list)  # device events of launched scatters
    refused: str | None = None  # why this request's staged KV must not count as arrived
    ended_at: float | None = None  # when the request ended (held), None while it lives
    expected_ranks: int = 1  # prefill ranks whose statuses conclude the request (sglang's)
    reported: dict[int, int] = field(default_factory=dict)  # prefill rank: its status
    reported_at: float = 0.0  # when the last prefill status came

    def same_request(self, host_pages: np.ndarray, device_pages: np.ndarray | None) -> bool:
        """Whether metadata with these pages is this lending's request asking again."""
        if (device_pages is None) != (self.device_pages is None):
            return False
        return np.array_equal(self.host_pages, host_pages) and (
            device_pages is None or np.array_equal(self.device_pages, device_pages)
        )


@settings.sized_cache(settings.LAYOUT_CACHE_SIZE)
def chunk_scatter_layout(
    dst_ptrs: tuple[int, ...],
    dst_page_lens: tuple[int, ...],
    page_size: int,
    writers: int,
    writer: int,
    num_pages: int,
) -> HeadSliceLayout:
    """`scatter_layout` of one writer's chunk of `num_pages` pages, from the start of its staged
    bytes: the same for every such chunk into these buffers, so each is built (and checked)
    once; the scatter reads the staging from the chunk's start."""
    return scatter_layout(
        dst_ptrs, dst_page_lens, page_size, writers=writers, writer=writer, num_pages=num_pages
    )


class PartAllocator:
    """First-fit parts of a region of `nbytes`, each `ALIGNMENT`-aligned; not thread-safe."""

    def __init__(self, nbytes: int) -> None:
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, bytes), by offset

    def take(self, nbytes: int) -> int | None:
        """The offset of a free part of `nbytes`, or None when none is large enough."""
        size = _aligned(nbytes)
        for position, (offset, free) in enumerate(self._free):
            if free >= size:
                self._free[position] = (offset + size, free - size)
                if free == size:
                    del self._free[position]
                return offset
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        """The part `take(nbytes)` returned at `offset` is free again (merged with neighbours)."""
        self._free.append((offset, _aligned(nbytes)))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, free in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + free)
            else:
                merged.append((start, free))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(free for _, free in self._free)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class ReceiveRegion(RegisteredRegion):
    """The decode's registered receive staging and the requests it lends parts of it to."""

    def __init__(self, manager: Any, nbytes: int, torch_device: torch.device) -> None:
        """Raises what the allocation or sglang's `register` raises."""
        nbytes = nbytes // ALIGNMENT * ALIGNMENT
        if nbytes == 0:
            raise RuntimeError(f"receive staging of {nbytes} bytes holds no {ALIGNMENT}-byte part")
        super().__init__(manager, nbytes, torch_device)
        self.capability = Capability(self.region.data_ptr(), self.region.numel())
        self.session = manager.get_session_id()  # declarations toward this decode name it
        self._kv = manager.kv_args
        self._num_buffers = len(self._kv.kv_data_ptrs)
        self._device_buffers = device_backed_buffers(self._kv)
        self._parts = PartAllocator(nbytes)
        self._lent: dict[int, Lending] = {}  # room: the lending of its live request
        self._lendings: dict[int, Lending] = {}  # reservation id: every lending not yet freed
        self._declared: tuple[int, int, dict[int, int] | str | None] | None = None
        # Lent page tokens: why their scatter is not ready (None: compiled).
        self._unit_scatters: dict[int, str | None] = {}
        self._lock = threading.Lock()

    def scatter_unready(self, page_tokens: int) -> str | None:
        """Why scatters of lent pages of `page_tokens` tokens would compile in a request, or
        None where they compile nothing.

        The KV page's compile with the manager (`staging_warmup`); the first ask
        for another (a prefill of another page size) starts their compile on a
        thread of its own, and until it is done such requests are lent nothing:
        none compiles, none waits. A compile that failed lends them nothing.
        """
        if self.torch_device.type != "cuda" or page_tokens == int(self._kv.page_size):
            return None
        with self._lock:
            if page_tokens not in self._unit_scatters:
                self._unit_scatters[page_tokens] = SCATTER_COMPILING
                threading.Thread(
                    target=self._compile_scatters,
                    args=(page_tokens,),
                    name="gpu_planner-scatter-compile",
                    daemon=True,
                ).start()
            return self._unit_scatters[page_tokens]

    def _compile_scatters(self, page_tokens: int) -> None:
        outcome: str | None = SCATTER_FAILED
        with best_effort(
            "the scatters for another page size did not compile: its requests go direct",
            "scatter compile",
        ):
            page_size = int(self._kv.page_size)
            lens = [int(length) // page_size * page_tokens for length in self._kv.kv_item_lens]
            kv_heads = int(getattr(self._kv, "kv_head_num", 1) or 1)
            copies = decode_copies(self._kv.kv_data_ptrs, lens, page_tokens, kv_heads)
            warm_up_slice_copies(self.torch_device, copies)
            outcome = None
        with self._lock:
            self._unit_scatters[page_tokens] = outcome

    # Scheduler thread: lending.

    def reserve(
        self,
        request_status: dict,
        room: int,
        host_pages: np.ndarray,
        device_pages: np.ndarray | None,
        page_tokens: int | None = None,
    ) -> Reservation | str:
        """A part for `room`'s request (the same one when it asks again), or why none is lent.

        `page_tokens`: the tokens of each of `host_pages` where they are not KV pages (a
        request toward a prefill of another page size: pages of a unit dividing the KV's).
        """
        host_pages = np.array(host_pages, dtype=np.int64)
        device_pages = None if device_pages is None else np.array(device_pages, dtype=np.int64)
        page_size = int(self._kv.page_size)
        page_tokens = page_size if page_tokens is None else int(page_tokens)
        if not 1 <= page_tokens <= page_size or page_size % page_tokens:
            return f"lent pages of {page_tokens} tokens do not divide a KV page of {page_size}"
        kv_item_lens = self._kv.kv_item_lens
        item_lens = tuple(int(length) // page_size * page_tokens for length in kv_item_lens)
        nbytes = len(host_pages) * sum(item_lens)
        with self._lock:
            self._sweep(request_status)
            lent = self._lent.get(room)
            if (
                lent is not None
                and lent.page_tokens == page_tokens
                and lent.same_request(host_pages, device_pages)
            ):
                return lent.reservation
            if lent is not None:  # other pages: a new request of this room
                self._end(lent)
            if nbytes == 0:
                return "no pages"
            if device_pages is not None and self._device_buffers is None:
                return "HiSparse pages, but the decode's device-backed buffers are not known"
            if len(self._lendings) >= MAX_RESERVATIONS:
                return "receive staging full"
            offset = self._parts.take(nbytes)
            if offset is None:
                return "receive staging full"
            reservation = Reservation(self._new_id(), offset, nbytes, len(host_pages))
            device_buffers = np.zeros(self._num_buffers, dtype=bool)
            if device_pages is not None:
                device_buffers = self._device_buffers
            lending = Lending(
                room, reservation, host_pages, item_lens, page_tokens, device_pages, device_buffers
            )
            self._lent[room] = lending
            self._lendings[reservation.reservation_id] = lending
            return reservation

    def _new_id(self) -> int:
        """A random reservation id no lending holds: a later request of a room, or of a decode
        that restarted with the same region, cannot be taken for an earlier one."""
        while True:
            reservation_id = secrets.randbits(63)
            if reservation_id and reservation_id not in self._lendings:
                return reservation_id

    def _give_back(self, lending: Lending) -> None:
        """Free a lending's part; the caller holds the lock."""
        del self._lendings[lending.reservation.reservation_id]
        if self._lent.get(lending.room) is lending:
            del self._lent[lending.room]
        self._parts.give_back(lending.reservation.offset, lending.reservation.nbytes)

    def _end(self, lending: Lending) -> None:
        """The request ended: hold its part (`_quiet`); the caller holds the lock."""
        if self._lent.get(lending.room) is lending:
            del self._lent[lending.room]
        if lending.ended_at is None:
            lending.ended_at = time.monotonic()

    def _sweep(self, request_status: dict) -> None:
        """End lendings of rooms sglang no longer tracks or failed; free the ended ones no
        write can still land in."""
        now = time.monotonic()
        for lending in list(self._lendings.values()):
            if lending.ended_at is None and request_status.get(lending.room) in (
                None,
                KV_POLL_FAILED,
            ):
                self._end(lending)
            quiet = lending.ended_at is not None and _quiet(lending, now)
            if quiet and all(event.query() for event in lending.pending):
                self._give_back(lending)

    def on_prefill_status(self, room: int, prefill_rank: int, status: int, expected: int) -> None:
        """A prefill rank reported `status` for `room` (as it sent it, before any refusal here):
        its writes into the room's lendings ended, cleanly where it is Success. `expected`:
        how many ranks sglang waits for."""
        now = time.monotonic()
        with self._lock:
            for lending in self._lendings.values():
                if lending.room == room:
                    lending.expected_ranks = max(int(expected), 1)
                    lending.reported[int(prefill_rank)] = int(status)
                    lending.reported_at = now

    def end(self, room: int) -> None:
        """sglang ended `room`'s request (failed, aborted, timed out, cleared, or opened anew)."""
        with self._lock:
            lending = self._lent.get(room)
            if lending is not None:
                self._end(lending)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._parts.free_bytes

    @property
    def lent_rooms(self) -> int:
        """Lendings whose part is not free: lent to a live request, or quarantined."""
        with self._lock:
            return len(self._lendings)

    # Decode thread: what prefills wrote, and their statuses.

    def on_staged(self, staged: Staged, request_status: dict) -> None:
        """Scatter the chunks `staged` names, or remember why its request must fail.

        A note for a lending that ended (its request failed, was cleared or
        replaced) gets no scatter: its pages may already hold another
        request's KV.
        """
        with self._lock:
            lending = self._lendings.get(staged.reservation_id)
            if lending is not None and lending.ended_at is None:
                if lending.room != staged.room:
                    lending.refused = f"a note for room {staged.room} names this room's part"
                    lending = None
                elif request_status.get(staged.room) in (None, KV_POLL_FAILED):
                    self._end(lending)
        if lending is None or lending.ended_at is not None:
            record_receive_fallback("staged note for no live lending")
            return  # nothing counts it as arrived, and an ended lending scatters nothing
        try:
            chunks = self._check(lending, staged)
            self._scatter(lending, staged, chunks)
        except Exception as error:  # a hostile note or a failed scatter fails the request
            self._refuse(lending, f"{type(error).__name__}: {error}")
            return
        with self._lock:
            lending.notes[staged.prefill_rank] = lending.notes.get(staged.prefill_rank, 0) + 1

    def on_unparsed(self, frames: object, error: Exception) -> None:
        """A note that does not parse: it fails the live lending its room frame names."""
        room = Staged.room_named(frames)
        with self._lock:
            lending = None if room is None else self._lent.get(room)
        if lending is None:
            record_receive_fallback("staged note malformed")
            log_fallback_once(
                f"a malformed staged note naming no lent room was dropped ({error})",
                key="staged malformed",
            )
            return
        self._refuse(lending, f"a staged note that does not parse ({error})")

    def _refuse(self, lending: Lending, reason: str) -> None:
        lending.refused = lending.refused or reason
        record_receive_fallback("staged chunk refused")
        log_fallback_once(
            f"a staged chunk was refused, its request fails ({reason})", key="staged chunk refused"
        )

    def _check(self, lending: Lending, staged: Staged) -> list[tuple[int, int]]:
        """The note's chunks, checked against what the decode knows of the request."""
        reservation = lending.reservation
        if lending.writers not in (None, staged.writers):
            raise ValueError(f"{staged.writers} writers, after {lending.writers} for this room")
        if sorted(staged.entries.tolist()) != list(range(self._num_buffers)):
            raise ValueError(f"entries {staged.entries.tolist()}: not every KV buffer once")
        expected_device = lending.device_buffers[staged.entries]
        wrong = np.flatnonzero(staged.is_device != expected_device)
        if wrong.size:
            entry = int(staged.entries[wrong[0]])
            space = "device" if expected_device[wrong[0]] else "host"
            raise ValueError(f"buffer {entry} takes the request's {space} pages, not the note's")
        unit = staged.writers * int(self._kv.page_size)
        item_lens = np.asarray(self._kv.kv_item_lens, dtype=np.int64)
        if (item_lens % unit).any() or sum(lending.item_lens) % staged.writers:
            raise ValueError(f"KV pages that {staged.writers} writers cannot share by tokens")
        claimed = lending.claimed.setdefault(staged.prefill_rank, [])
        chunks = []
        for start, count in staged.chunks.tolist():
            if count <= 0 or start + count > reservation.pages:
                raise ValueError(f"pages [{start}, {start + count}) of {reservation.pages}")
            if any(start < end and other < start + count for other, end in claimed):
                raise ValueError(f"pages [{start}, {start + count}) written twice by one rank")
            claimed.append((start, start + count))
            chunks.append((start, count))
        lending.writers = staged.writers
        return chunks

    def _scatter(self, lending: Lending, staged: Staged, chunks: list[tuple[int, int]]) -> None:
        """Scatter each chunk into its pages; on a device, record the event Success waits for."""
        entries = staged.entries.tolist()
        dst_ptrs = tuple(int(self._kv.kv_data_ptrs[entry]) for entry in entries)
        dst_page_lens = tuple(lending.item_lens[entry] for entry in entries)
        dst_lens = [int(self._kv.kv_data_lens[entry]) for entry in entries]
        part, _ = writer_part(lending.reservation.nbytes, staged.writers, staged.writer)
        device_pages = lending.device_pages
        page_bytes = sum(lending.item_lens)
        runtime = cuda_runtime()
        with on_torch_device(self.torch_device):
            for start, count in chunks:
                base = lending.reservation.offset + part
                base += chunk_offset(page_bytes, staged.writers, start)
                layout = chunk_scatter_layout(
                    dst_ptrs, dst_page_lens, lending.page_tokens, staged.writers, staged.writer,
                    count,
                )  # fmt: skip
                scatter_head_slices(
                    layout,
                    lending.host_pages[start : start + count],
                    self.region[base:],
                    dst_lens,
                    dst_device_pages=None
                    if device_pages is None
                    else device_pages[start : start + count],
                    dst_is_device=staged.is_device,
                    backend=kernel_backend(self.torch_device),
                )
            if runtime.runs_on_device(self.torch_device):
                event = runtime.new_event()
                event.record(runtime.current_stream(self.torch_device))
                lending.pending.append(event)
        record_scatter(len(chunks))

    def on_declared(self, room: int, prefill_rank: int, declared: dict[int, int] | str | None):
        """What the status sglang just parsed declared (None: nothing; str: malformed)."""
        with self._lock:
            self._declared = (room, prefill_rank, declared)

    def refusal(self, room: int, status: int, prefill_rank: int) -> str | None:
        """Before sglang applies a rank's status: why its Success must be Failed, else None.

        The one place the invariant is decided (the module's docstring); waits
        for the request's scatters to complete first.
        """
        with self._lock:
            parsed, self._declared = self._declared, None
            lending = self._lent.get(room)
            declared = parsed[2] if parsed and parsed[:2] == (room, prefill_rank) else None
            if status != KV_POLL_SUCCESS:
                return None
            if isinstance(declared, str):
                return f"gpu_planner: prefill rank {prefill_rank}'s declaration: {declared}"
            current = None if lending is None else lending.reservation.reservation_id
            for reservation_id, notes in (declared or {}).items():
                if notes and reservation_id != current:
                    return (
                        f"gpu_planner: prefill rank {prefill_rank} staged {notes} chunks into "
                        f"reservation {reservation_id}, which this request does not hold"
                    )
            if lending is None:
                return None
            pending, lending.pending = lending.pending, []
        for event in pending:
            event.synchronize()
        with self._lock:
            arrived = lending.notes.get(prefill_rank, 0)
            expected = (declared or {}).get(lending.reservation.reservation_id)
            if lending.refused is not None:
                return f"gpu_planner: {lending.refused}"
            if expected is None and arrived:
                return (
                    f"gpu_planner: prefill rank {prefill_rank} staged {arrived} chunks but its "
                    "status declares none"
                )
            if expected is not None and expected != arrived:
                return (
                    f"gpu_planner: prefill rank {prefill_rank} declared {expected} staged "
                    f"chunks, {arrived} arrived and scattered"
                )
        return None

    def after_status(self, request_status: dict, room: int) -> None:
        """After sglang applied it: a request that succeeded gives its part back now."""
        with self._lock:
            lending = self._lent.get(room)
            if lending is None:
                return
            state = request_status.get(room)
            if state == KV_POLL_SUCCESS and not lending.pending:
                self._give_back(lending)
            elif state in (None, KV_POLL_FAILED):
                self._end(lending)


def failed_hold_s() -> float:
    """How long an ended lending is held after the last status of its prefill ranks when one
    of them failed: as long as the prefill holds what a failed write read (`send_slots`)."""
    return stalled_write_s()


def _quiet(lending: Lending, now: float) -> bool:
    """Whether no write of an ended lending's request can still land in its part.

    Every prefill rank sglang waits for reported: all Success (their writes ended cleanly),
    or else `failed_hold_s()` after the last report (a failed write may still be queued in
    Mooncake). A rank that never reports (a prefill that died) frees it only after
    `NO_STATUS_HOLDS` holds from the end: the one case a clock alone decides.
    """
    if len(lending.reported) >= lending.expected_ranks:
        if all(status == KV_POLL_SUCCESS for status in lending.reported.values()):
            return True
        return now >= lending.reported_at + failed_hold_s()
    assert lending.ended_at is not None
    return now >= lending.ended_at + NO_STATUS_HOLDS * failed_hold_s()


def device_backed_buffers(kv_args: Any) -> np.ndarray | None:
    """Which decode KV buffers take HiSparse's device pages, by sglang's own rule; None if
    `kv_args` does not say (`MooncakeKVManager.send_kvcache`: MLA layers of compression
    ratio 4 are host-backed, else every buffer before the draft entries is)."""
    num_buffers = len(kv_args.kv_data_ptrs)
    ratios = getattr(kv_args, "mla_compression_ratios", None)
    draft = getattr(kv_args, "num_draft_entries", 0) or 0
    if ratios is not None:
        if len(ratios) != num_buffers:
            return None
        host_backed = sum(ratio == HOST_BACKED_RATIO for ratio in ratios)
    elif 0 < draft < num_buffers:
        host_backed = num_buffers - draft
    else:
        return None
    return np.arange(num_buffers) >= host_backed


def region_for(manager: Any) -> ReceiveRegion | None:
    """`manager`'s receive staging, made on first use; None (logged once) where it has none."""
    region = REGIONS.get(manager)
    if isinstance(region, str):
        log_fallback_once(f"no receive staging: {region}", key="no receive staging")
        return None
    return region


# Why HiSparse on a GPU gets no region (docs/sglang.md, "HiSparse on a GPU is not staged").
HOST_AND_GPU_REFUSAL = (
    "host-backed and GPU KV buffers together (HiSparse on a GPU) are not staged: one region "
    "on one device would have to be scattered into both, and neither scatter can (a GPU "
    "kernel writing sglang's host pool is a UVA write over PCIe, impossible where the pool is "
    "not pinned and verified by nothing here; the CPU loop of a host region cannot write GPU "
    "buffers); it takes a region per page space, which the staging wire does not carry"
)


def receive_device(kv_args: Any) -> torch.device | str:
    """Where the region goes: the one GPU holding device KV buffers, else host memory."""
    runtime = cuda_runtime()
    devices = {runtime.memory_device(int(ptr)) for ptr in kv_args.kv_data_ptrs}
    gpus = devices - {HOST}
    if len(gpus) > 1:
        return f"the KV buffers are on {sorted(map(str, gpus))}, not one GPU"
    if gpus and HOST in devices:
        return HOST_AND_GPU_REFUSAL
    return gpus.pop() if gpus else HOST


def _new_region(manager: Any) -> ReceiveRegion | str:
    nbytes = settings.loaded(settings.RECEIVE_STAGING_BYTES)
    if nbytes == 0:
        return f"{settings.RECEIVE_STAGING_BYTES.name}=0"
    if getattr(manager, "enable_staging", False):
        return "sglang's own staging (SGLANG_DISAGG_STAGING_BUFFER) handles this decode"
    kv_args = getattr(manager, "kv_args", None)
    if kv_args is None or not getattr(kv_args, "kv_data_ptrs", None):
        return "a manager without KV buffers"
    try:
        torch_device = receive_device(kv_args)
        if isinstance(torch_device, str):
            return torch_device
        return ReceiveRegion(manager, nbytes, torch_device)
    except Exception as error:  # out of memory, a refused registration, a bug: no region
        return f"{nbytes} bytes could not be allocated and registered ({error!r})"


REGIONS: PerManager[ReceiveRegion] = PerManager(_new_region)


def decode_hooks_registered(registered: bool) -> None:
    """Whether every hook of the decode's receive-staging set registered (the plugin says once):
    without all of them no manager gets a region."""
    REGIONS.unavailable = None if registered else NOT_ALL_HOOKS


NOT_ALL_HOOKS = "the decode's receive-staging hooks are not all registered"
SCATTER_COMPILING = "the scatter for the prefill's page size is compiling"
SCATTER_FAILED = "the scatter for the prefill's page size did not compile"


# The decode's hooks. Each returns what sglang's own code returns (plus the
# capability or reservation frames); none lets an exception of its own out.


def _is_decode(manager: Any) -> bool:
    mode = getattr(manager, "disaggregation_mode", None)
    return getattr(mode, "name", None) == "DECODE"


def registration_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's KV registration, with this decode's page size and receive staging advertised."""
    frames = original(manager, *args, **kwargs)
    if not _is_decode(manager):
        return frames
    added: list[bytes] = []
    with best_effort("page size not declared", "page size not declared"):
        if isinstance(page_sizes.DECODES.get(manager), page_sizes.DecodePageSizes):
            added += page_size_frames(int(manager.kv_args.page_size))
    with best_effort("receive staging not advertised", "no receive staging"):
        region = region_for(manager)
        if region is not None:
            added += region.capability.frames()
    return [*frames, *added] if added else frames  # nothing added: prefills send as today


def metadata_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's per-request metadata with a part of the region lent to it; toward a prefill of
    another page size, its pages in gpu_planner's frame only (`page_sizes`), and the part lent
    in the pages that prefill's sends take."""
    decode = _is_decode(manager) and not args
    repaged = page_sizes.metadata_frames(original, manager, kwargs) if decode else None
    frames = original(manager, *args, **kwargs) if repaged is None else repaged.frames
    with best_effort("no receive staging lent", "receive staging not lent"):
        region = REGIONS.existing(manager) if decode else None
        if region is None or kwargs.get("is_dummy"):
            return frames
        pages, device_pages = kwargs["kv_indices"], kwargs.get("device_kv_indices")
        page_tokens = None
        if repaged is not None:
            if repaged.pages is None:
                return frames  # the request failed here: nothing goes
            unready = region.scatter_unready(repaged.unit)
            if unready is not None:
                record_receive_fallback(unready)
                return frames
            pages, device_pages = repaged.unit_pages(repaged.pages), repaged.device_pages
            device_pages = None if device_pages is None else repaged.unit_pages(device_pages)
            page_tokens = repaged.unit
        lent = region.reserve(
            manager.request_status, int(kwargs["bootstrap_room"]), pages, device_pages, page_tokens
        )
        if isinstance(lent, str):
            record_receive_fallback(lent)
            return frames
        return [*frames, *lent.frames()]
    return frames  # nothing lent: the request goes as today


def chunk_ready_hook(original: Any, manager: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """A gpu_planner prefill's `Staged` note: scattered here; any other message: sglang's."""
    if not (isinstance(msg, list) and msg and msg[0] == STAGED_TAG):
        return original(manager, msg, *args, **kwargs)
    with best_effort("a staged note was dropped", "staged malformed"):
        region = REGIONS.existing(manager)
        if region is None:
            return True
        try:
            staged = Staged.from_frames(msg)
        except Exception as error:  # it fails the lent room it names, if it names one
            region.on_unparsed(msg, error)
            return True
        region.on_staged(staged, manager.request_status)
    return True


def status_message_hook(original: Any, manager: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's parse of a prefill's status; keeps what a gpu_planner prefill declared."""
    parsed = original(manager, msg, *args, **kwargs)
    if parsed is None:
        return parsed
    with best_effort("a status declaration was dropped", "staged books"):
        page_sizes.declared_toward(manager, msg, parsed[0], parsed[2])
        region = REGIONS.existing(manager)
        if region is not None:
            try:
                declared: dict[int, int] | str | None = declared_notes(msg, region.session)
            except Exception as error:  # a malformed declaration fails the rank's Success
                declared = str(error)
            region.on_declared(parsed[0], parsed[2], declared)
    return parsed


def prefill_status_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's status handling, after this room's scatters completed and its chunks were all
    planned for this decode's page size (or failed it)."""
    region = REGIONS.existing(manager) if not args else None
    repaged = page_sizes.DECODES.existing(manager) if not args else None
    room = kwargs.get("bootstrap_room")
    if (region is not None or repaged is not None) and room is not None:
        status, rank = kwargs.get("status"), kwargs.get("prefill_rank")
        expected = 1
        with best_effort(BOOKKEEPING_FAILED, "staged books"):
            expected = manager.required_prefill_response_num_table.get(room, 1)
        refusals = []
        if repaged is not None:
            try:
                refusals.append(repaged.refusal(room, status, rank, expected))
            except Exception as error:  # a check that cannot finish admits nothing
                refusals.append(f"gpu_planner: the page-size check failed ({error})")
        if region is not None:
            with best_effort(BOOKKEEPING_FAILED, "staged books"):
                region.on_prefill_status(room, rank, status, expected)
            try:
                refusals.append(region.refusal(room, status, rank))
            except Exception as error:  # a scatter that cannot be waited for did not land
                refusals.append(f"gpu_planner: a scatter failed ({error})")
        refusal = next((why for why in refusals if why is not None), None)
        if refusal is not None:
            kwargs = {**kwargs, "status": KV_POLL_FAILED, "failure_reason": refusal}
    result = original(manager, *args, **kwargs)
    if room is not None:
        with best_effort(BOOKKEEPING_FAILED, "staged books"):
            if region is not None:
                region.after_status(manager.request_status, room)
            if repaged is not None:
                repaged.after_status(manager.request_status, room)
    return result


def update_status_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's room status update; a Failed room, or one opened anew, ends its lending and
    its page-size record.

    Every way sglang fails a request (a failed transfer, an abort, the
    waiting timeout) sets Failed here; a new request of a room sglang
    cleared opens it here again.
    """
    region = REGIONS.existing(manager)
    repaged = page_sizes.DECODES.existing(manager)
    if region is None and repaged is None:
        return original(manager, *args, **kwargs)
    try:
        room, status = _room_and_status(args, kwargs)
        opened = room not in manager.request_status
    except Exception:  # not the call sglang 0.5.23 makes: leave the lending to the sweep
        return original(manager, *args, **kwargs)
    result = original(manager, *args, **kwargs)
    with best_effort(BOOKKEEPING_FAILED, "staged books"):
        if opened or int(status) == KV_POLL_FAILED:
            for ended in (region, repaged):
                if ended is not None:
                    ended.end(room)
    return result


def receiver_clear_hook(original: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's receiver clean-up; a room it forgot ends its lending and page-size record."""
    result = original(receiver, *args, **kwargs)
    with best_effort(BOOKKEEPING_FAILED, "staged books"):
        manager = receiver.kv_mgr
        room = receiver.bootstrap_room
        if room not in manager.request_status:
            for ended in (REGIONS.existing(manager), page_sizes.DECODES.existing(manager)):
                if ended is not None:
                    ended.end(room)
    return result


BOOKKEEPING_FAILED = "receive staging bookkeeping failed"


def _room_and_status(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bootstrap_room, status) of an `update_status(bootstrap_room, status)` call."""
    values = dict(zip(("bootstrap_room", "status"), args, strict=False)) | kwargs
    return values["bootstrap_room"], values["status"]
