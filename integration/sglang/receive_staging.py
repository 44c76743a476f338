"""Receive staging, decode side: a registered region, reservations, and scatters into KV pages.

A decode with the plugin registers one region of
`GPU_PLANNER_RECEIVE_STAGING_BYTES` with Mooncake (on the KV buffers' GPU, or
in host memory for host KV) and advertises it in its KV registration
(`staging_wire.Capability`). For each request it sends a prefill, it lends
the request a part of the region big enough for all of the request's pages
of every KV buffer (`Reservation`, in the request's metadata) when one is
free; none free: the request goes as today (counted, never waited for).

A gpu_planner prefill that wrote part of the request there says so
(`Staged`, before its status message, on the same socket). The decode
checks the note against its own record of the request (its pages, both
HiSparse spaces, its buffers; nothing the note says is an address) and
scatters each chunk into the request's pages: host-backed buffers by the
host pages, device-backed ones by the device pages, head slices (TP-down)
into token slots. Before sglang counts a prefill rank's Success, every
scatter of the room has completed (device events on GPU); a note that was
refused, or a scatter that failed, turns that Success into Failed, so a
request never arrives with KV that did not land.

Lending ends when the room concludes: Success frees the part at once; a
failed, aborted or cleared room quarantines it for `QUARANTINE_S` (a prefill
rank may still be writing), then frees it. Nothing here waits without a
bound, and no exception leaves a hook: sglang's own result is returned.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.head_scatter import scatter_head_slices, scatter_layout
from gpu_planner.inputs import HOST
from gpu_planner.integration.sglang.counters import record_receive_fallback, record_scatter
from gpu_planner.integration.sglang.fallback import log_fallback_once
from gpu_planner.integration.sglang.staging_wire import (
    STAGED_TAG,
    Capability,
    Reservation,
    Staged,
    chunk_offset,
    writer_part,
)

ALIGNMENT = 256  # bytes: every reservation starts as aligned as the region
MAX_RESERVATIONS = 256  # rooms lent a part at once: bounds the bookkeeping
QUARANTINE_S = 120.0  # a failed room's part waits this long: past sglang's transfer timeouts
KV_POLL_SUCCESS = 4  # sglang's KVPoll.Success
KV_POLL_FAILED = 0  # sglang's KVPoll.Failed


@dataclass
class LentRoom:
    """One room's part of the region, the pages it scatters into, and what arrived."""

    reservation: Reservation
    host_pages: np.ndarray  # int64 [pages]: the request's pages, as the decode sent them
    device_pages: np.ndarray | None  # int64 [pages]: HiSparse's device pages, or None
    claimed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # writer: ranges
    writers: int | None = None
    pending: list[Any] = field(default_factory=list)  # device events of launched scatters
    refused: str | None = None  # why this room's staged KV must not count as arrived
    quarantined_until: float | None = None


class ReceiveRegion:
    """The decode's registered receive staging and the rooms it lends parts of it to."""

    def __init__(self, manager: Any, nbytes: int, torch_device: torch.device) -> None:
        """Allocate `nbytes` on `torch_device`, registered with `manager`'s engine wrapper.

        Raises what the allocation or sglang's `register` raises.
        """
        nbytes = nbytes // ALIGNMENT * ALIGNMENT
        if nbytes == 0:
            raise RuntimeError(f"receive staging of {nbytes} bytes holds no {ALIGNMENT}-byte part")
        self.torch_device = torch_device
        with on_torch_device(torch_device):
            self.region = cuda_runtime().empty_bytes(nbytes, torch_device)
        self.capability = Capability(self.region.data_ptr(), self.region.numel())
        self._wrapper = manager.engine
        self._wrapper.register(self.region.data_ptr(), self.region.numel())
        self.release = weakref.finalize(manager, self._wrapper.deregister, self.region.data_ptr())
        self.release.atexit = False  # at exit, a prefill's write may still land
        self._kv = manager.kv_args
        self._page_bytes = sum(int(item_len) for item_len in self._kv.kv_item_lens)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, bytes), by offset
        self._rooms: dict[int, LentRoom] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    # Scheduler thread: lending.

    def reserve(
        self,
        request_status: dict,
        room: int,
        host_pages: np.ndarray,
        device_pages: np.ndarray | None,
    ) -> Reservation | None:
        """A part for `room`'s pages (the same one when asked again), or None when none is free."""
        pages = len(host_pages)
        nbytes = pages * self._page_bytes
        with self._lock:
            self._sweep(request_status)
            lent = self._rooms.get(room)
            if lent is not None and lent.quarantined_until is None:
                return lent.reservation if lent.reservation.pages == pages else None
            if lent is not None or nbytes == 0 or len(self._rooms) >= MAX_RESERVATIONS:
                return None
            offset = self._take(nbytes)
            if offset is None:
                return None
            reservation = Reservation(self._next_id, offset, nbytes, pages)
            self._next_id += 1
            self._rooms[room] = LentRoom(
                reservation,
                np.array(host_pages, dtype=np.int64),
                None if device_pages is None else np.array(device_pages, dtype=np.int64),
            )
            return reservation

    def _take(self, nbytes: int) -> int | None:
        """First fit; the caller holds the lock."""
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT
        for position, (offset, free) in enumerate(self._free):
            if free >= size:
                self._free[position] = (offset + size, free - size)
                if free == size:
                    del self._free[position]
                return offset
        return None

    def _give_back(self, reservation: Reservation) -> None:
        """Return a part to the free list, merging neighbours; the caller holds the lock."""
        size = -(-reservation.nbytes // ALIGNMENT) * ALIGNMENT
        self._free.append((reservation.offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for offset, free in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + free)
            else:
                merged.append((offset, free))
        self._free = merged

    def _sweep(self, request_status: dict) -> None:
        """Quarantine rooms sglang no longer tracks; free quarantined parts whose time is up."""
        now = time.monotonic()
        for room, lent in list(self._rooms.items()):
            if lent.quarantined_until is None and request_status.get(room) in (
                None,
                KV_POLL_FAILED,
            ):
                lent.quarantined_until = now + QUARANTINE_S
            expired = lent.quarantined_until is not None and lent.quarantined_until <= now
            if expired and all(event.query() for event in lent.pending):
                del self._rooms[room]
                self._give_back(lent.reservation)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(free for _, free in self._free)

    @property
    def lent_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    # Decode thread: what prefills wrote, and their statuses.

    def on_staged(self, staged: Staged, request_status: dict) -> None:
        """Scatter the chunks `staged` names, or remember why its room must fail.

        A room sglang no longer tracks (cleared, or failed) gets no scatter: its
        pages may already hold another request's KV.
        """
        with self._lock:
            lent = self._rooms.get(staged.room)
            if lent is not None and request_status.get(staged.room) in (None, KV_POLL_FAILED):
                if lent.quarantined_until is None:
                    lent.quarantined_until = time.monotonic() + QUARANTINE_S
                return
        if lent is None or lent.quarantined_until is not None:
            return  # the room was never lent, or ended: nothing counts it as arrived
        try:
            chunks = self._check(lent, staged)
            self._scatter(lent, staged, chunks)
        except Exception as error:  # a hostile note or a failed scatter fails the room
            lent.refused = f"{type(error).__name__}: {error}"
            record_receive_fallback("staged chunk refused")
            log_fallback_once(
                f"a staged chunk was refused, its request fails ({lent.refused})",
                key="staged chunk refused",
            )

    def _check(self, lent: LentRoom, staged: Staged) -> list[tuple[int, int]]:
        """The note's chunks, checked against what the decode knows of the room."""
        reservation = lent.reservation
        if staged.reservation_id != reservation.reservation_id:
            raise ValueError(
                f"reservation {staged.reservation_id}, but room {staged.room} holds "
                f"{reservation.reservation_id}"
            )
        if lent.writers not in (None, staged.writers):
            raise ValueError(f"{staged.writers} writers, after {lent.writers} for this room")
        num_buffers = len(self._kv.kv_data_ptrs)
        if int(staged.entries.max()) >= num_buffers:
            raise ValueError(f"entry {int(staged.entries.max())} of {num_buffers} KV buffers")
        if staged.is_device.any() and lent.device_pages is None:
            raise ValueError("device-backed entries, but the request has no device pages")
        unit = staged.writers * int(self._kv.page_size)
        item_lens = np.asarray(self._kv.kv_item_lens, dtype=np.int64)
        if (item_lens % unit).any() or self._page_bytes % staged.writers:
            raise ValueError(f"KV pages that {staged.writers} writers cannot share by tokens")
        claimed = lent.claimed.setdefault(staged.writer, [])
        chunks = []
        for start, count in staged.chunks.tolist():
            if count <= 0 or start + count > reservation.pages:
                raise ValueError(f"pages [{start}, {start + count}) of {reservation.pages}")
            if any(start < end and other < start + count for other, end in claimed):
                raise ValueError(f"pages [{start}, {start + count}) written twice")
            claimed.append((start, start + count))
            chunks.append((start, count))
        lent.writers = staged.writers
        return chunks

    def _scatter(self, lent: LentRoom, staged: Staged, chunks: list[tuple[int, int]]) -> None:
        """Scatter each chunk into its pages; on a device, record the event Success waits for."""
        entries = staged.entries
        dst_ptrs = [int(self._kv.kv_data_ptrs[entry]) for entry in entries]
        dst_page_lens = [int(self._kv.kv_item_lens[entry]) for entry in entries]
        dst_lens = [int(self._kv.kv_data_lens[entry]) for entry in entries]
        part, _ = writer_part(lent.reservation.nbytes, staged.writers, staged.writer)
        runtime = cuda_runtime()
        with on_torch_device(self.torch_device):
            for start, count in chunks:
                base = lent.reservation.offset + part
                base += chunk_offset(self._page_bytes, staged.writers, start)
                layout = scatter_layout(
                    dst_ptrs,
                    dst_page_lens,
                    int(self._kv.page_size),
                    writers=staged.writers,
                    writer=staged.writer,
                    staged_base=base,
                    num_pages=count,
                )
                device_pages = lent.device_pages
                scatter_head_slices(
                    layout,
                    lent.host_pages[start : start + count],
                    self.region,
                    dst_lens,
                    dst_device_pages=None
                    if device_pages is None
                    else device_pages[start : start + count],
                    dst_is_device=staged.is_device,
                )
            if runtime.runs_on_device(self.torch_device):
                event = runtime.new_event()
                event.record(runtime.current_stream(self.torch_device))
                lent.pending.append(event)
        record_scatter(len(chunks))

    def before_status(self, room: int, status: int) -> str | None:
        """Before sglang applies a rank's status: its scatters done; why to fail it, or None."""
        with self._lock:
            lent = self._rooms.get(room)
        if lent is None or status != KV_POLL_SUCCESS:
            return None
        for event in lent.pending:
            event.synchronize()
        lent.pending.clear()
        return None if lent.refused is None else f"gpu_planner: {lent.refused}"

    def after_status(self, request_status: dict, room: int) -> None:
        """After sglang applied it: a room that succeeded gives its part back now."""
        with self._lock:
            lent = self._rooms.get(room)
            if lent is None or lent.quarantined_until is not None:
                return
            state = request_status.get(room)
            if state == KV_POLL_SUCCESS and not lent.pending:
                del self._rooms[room]
                self._give_back(lent.reservation)
            elif state in (None, KV_POLL_FAILED):
                lent.quarantined_until = time.monotonic() + QUARANTINE_S


class _NoRegion:
    """Why a manager has no receive staging (remembered so that no later call tries again)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


_regions: weakref.WeakKeyDictionary[Any, ReceiveRegion | _NoRegion] = weakref.WeakKeyDictionary()
_regions_lock = threading.Lock()


def region_for(manager: Any) -> ReceiveRegion | None:
    """`manager`'s receive staging, made on first use; None (logged once) where it has none."""
    with _regions_lock:
        region = _regions.get(manager)
        if region is None:
            region = _new_region(manager)
            _regions[manager] = region
    if isinstance(region, _NoRegion):
        log_fallback_once(f"no receive staging: {region.reason}", key="no receive staging")
        return None
    return region


def existing_region(manager: Any) -> ReceiveRegion | None:
    """`manager`'s receive staging if it advertised one (never makes one).

    None for a manager that cannot be a weak key (sglang's unit tests build
    `SimpleNamespace` managers, which are unhashable): it never had one.
    """
    with _regions_lock:
        try:
            region = _regions.get(manager)
        except TypeError:
            return None
    return region if isinstance(region, ReceiveRegion) else None


def release_region(manager: Any) -> None:
    """Deregister and forget `manager`'s region (tests; a process keeps it while it serves)."""
    with _regions_lock:
        region = _regions.pop(manager, None)
    if isinstance(region, ReceiveRegion):
        region.release()


def receive_device(kv_args: Any) -> torch.device | str:
    """Where the region goes: the one GPU holding device KV buffers, else host memory."""
    runtime = cuda_runtime()
    devices = {runtime.memory_device(int(ptr)) for ptr in kv_args.kv_data_ptrs}
    gpus = devices - {HOST}
    if len(gpus) > 1:
        return f"the KV buffers are on {sorted(map(str, gpus))}, not one GPU"
    if gpus and HOST in devices:
        return "host-backed and GPU KV buffers together (HiSparse on a GPU) are not staged yet"
    return gpus.pop() if gpus else HOST


def _new_region(manager: Any) -> ReceiveRegion | _NoRegion:
    nbytes = settings.loaded(settings.RECEIVE_STAGING_BYTES)
    if nbytes == 0:
        return _NoRegion(f"{settings.RECEIVE_STAGING_BYTES.name}=0")
    if getattr(manager, "enable_staging", False):
        return _NoRegion("sglang's own staging (SGLANG_DISAGG_STAGING_BUFFER) handles this decode")
    kv_args = getattr(manager, "kv_args", None)
    if kv_args is None or not getattr(kv_args, "kv_data_ptrs", None):
        return _NoRegion("a manager without KV buffers")
    torch_device = receive_device(kv_args)
    if isinstance(torch_device, str):
        return _NoRegion(torch_device)
    try:
        return ReceiveRegion(manager, nbytes, torch_device)
    except (RuntimeError, MemoryError) as error:
        return _NoRegion(f"{nbytes} bytes could not be allocated and registered ({error})")


# The decode's hooks. Each returns what sglang's own code returns (plus the
# capability or reservation frames); none lets an exception of its own out.


def _is_decode(manager: Any) -> bool:
    mode = getattr(manager, "disaggregation_mode", None)
    return getattr(mode, "name", None) == "DECODE"


def registration_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's KV registration, with this decode's receive staging advertised."""
    frames = original(manager, *args, **kwargs)
    try:
        region = region_for(manager) if _is_decode(manager) else None
        if region is not None:
            return [*frames, *region.capability.frames()]
    except Exception as error:  # advertise nothing: prefills send as today
        log_fallback_once(f"receive staging not advertised ({error})", key="no receive staging")
    return frames


def metadata_message_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's per-request metadata, with a part of the region lent to the request."""
    frames = original(manager, *args, **kwargs)
    try:
        region = existing_region(manager) if _is_decode(manager) and not args else None
        if region is None or kwargs.get("is_dummy"):
            return frames
        pages = kwargs["kv_indices"]
        device_pages = kwargs.get("device_kv_indices")
        reservation = region.reserve(
            manager.request_status, int(kwargs["bootstrap_room"]), pages, device_pages
        )
        if reservation is None:
            record_receive_fallback("receive staging full")
            return frames
        return [*frames, *reservation.frames()]
    except Exception as error:  # lend nothing: the request goes as today
        log_fallback_once(f"no receive staging lent ({error})", key="receive staging not lent")
    return frames


def chunk_ready_hook(original: Any, manager: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
    """A gpu_planner prefill's `Staged` note: scattered here; any other message: sglang's."""
    if not (isinstance(msg, list) and msg and msg[0] == STAGED_TAG):
        return original(manager, msg, *args, **kwargs)
    try:
        region = existing_region(manager)
        if region is not None:
            region.on_staged(Staged.from_frames(msg), manager.request_status)
    except Exception as error:  # a malformed note names no room it could fail: drop it
        log_fallback_once(f"a malformed staged note was dropped ({error})", key="staged malformed")
    return True


def prefill_status_hook(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """sglang's status handling, after this room's scatters completed (or failed it)."""
    region = existing_region(manager) if not args else None
    room = kwargs.get("bootstrap_room")
    if region is not None and room is not None:
        try:
            refusal = region.before_status(room, kwargs.get("status"))
        except Exception as error:  # a scatter that cannot be waited for did not land
            refusal = f"gpu_planner: a scatter failed ({error})"
        if refusal is not None:
            kwargs = {**kwargs, "status": KV_POLL_FAILED, "failure_reason": refusal}
    result = original(manager, *args, **kwargs)
    if region is not None and room is not None:
        try:
            region.after_status(manager.request_status, room)
        except Exception as error:
            log_fallback_once(f"receive staging bookkeeping failed ({error})", key="staged books")
    return result
