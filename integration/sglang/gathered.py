"""Head-sliced KV sends gathered into registered staging: whole decode pages, equal-TP counts.

When the prefill's attention TP is below the decode's, each decode rank takes
one head range of every prefill token and holds it as whole token slots of its
own pages. sglang's `send_kvcache_slice` sends one descriptor per token per
K/V buffer per layer; here each chunk of K/V buffers is first gathered
(`gpu_planner.head_gather`) into a staging region laid out as the decode
pages, then sent as one descriptor per run of consecutive decode pages per
buffer: the descriptor count of an equal-TP send of the same pages, or fewer.

Staging: one region per `MooncakeKVManager` of `GPU_PLANNER_GATHER_STAGING_BYTES`
bytes on the device whose memory holds the KV buffers (asked of CUDA for
their addresses: sglang's transfer threads never select a device, so the
thread's current device says nothing), registered with the manager's engine
through sglang's own wrapper (`register`/`deregister`) on the first gathered
send, and kept while the manager lives. It is cut into `SLOTS` slots, and a
send holds at most `SLOTS_PER_SEND` of them: while one chunk is on the wire,
the next is gathered into the send's other slot. No send waits for another's
slot (a stalled peer holds its slots until Mooncake gives up on it): a send
takes free slots without waiting, takes sglang's per-token descriptors when
none is free (counted), and otherwise waits only for its own earlier chunks.
A slot comes back to the region when the last engine call that read it has
ended (or was cancelled before it started), never earlier, whatever the
send's status.

Order on CUDA: the gather runs on the KV device's current stream, after
whatever that stream ran before (the forward pass that wrote the KV), and the
chunk's engine call waits on an event recorded after the gather. Every CUDA
call goes through `cuda_runtime()`, under the KV device.

`send_gathered` returns None where the send should take sglang's per-token
descriptors instead (staging off, not allocatable or registrable, busy, a
chunk that cannot fit, a layout whose staged pages are not whole decode
pages), logged once per reason with the size it needed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.errors import PlanValidationError
from gpu_planner.head_gather import chunk_layout, gather_head_slices, gathered_descriptors
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.sglang import bounds
from gpu_planner.integration.sglang.adapter import AsyncWrites, sglang_handoff
from gpu_planner.integration.sglang.counters import record_send
from gpu_planner.integration.sglang.fallback import current_send, log_fallback_once
from gpu_planner.plan import exact_total

SLOTS = 4  # a region's slots: two sends at once each keep one chunk on the wire while gathering
SLOTS_PER_SEND = 2  # one chunk on the wire while the next is gathered
SLOT_ALIGNMENT = 256  # bytes: every slot starts as aligned as the region (the kernel's widest lane)


def gathers(src_attn_tp_size: int, dst_attn_tp_size: int) -> bool:
    """Whether a head-sliced send between these attention TP sizes takes the gathered path.

    Prefill TP below decode TP (replication included): each decode token slot
    is written whole by one prefill rank. Above it, several prefill ranks
    write parts of each decode slot: per-token descriptors.
    """
    return src_attn_tp_size < dst_attn_tp_size


@dataclass(frozen=True)
class Chunk:
    """Entries (K/V buffers, in the layout's order) and page positions one staging slot holds."""

    entries: slice
    pages: slice


def plan_chunks(
    num_entries: int, num_pages: int, page_bytes: int, slot_bytes: int
) -> list[Chunk] | None:
    """Chunks of at most `slot_bytes` staged bytes each; None when one staged page does not fit.

    Whole entries while a slot holds every page of one: as many entries per
    chunk as fit (one engine call each), so no run of pages is cut. Else one
    entry per chunk, its pages cut into slot-sized pieces (a run crossing a
    cut becomes two descriptors).
    """
    pages_per_slot = slot_bytes // page_bytes
    if pages_per_slot == 0:
        return None
    if num_pages <= pages_per_slot:
        per_chunk = pages_per_slot // max(num_pages, 1)
        return [
            Chunk(slice(first, min(first + per_chunk, num_entries)), slice(0, num_pages))
            for first in range(0, num_entries, per_chunk)
        ]
    return [
        Chunk(slice(entry, entry + 1), slice(first, min(first + pages_per_slot, num_pages)))
        for entry in range(num_entries)
        for first in range(0, num_pages, pages_per_slot)
    ]


class GatherStaging:
    """A registered staging region cut into `SLOTS` slots, each lent to one send at a time."""

    def __init__(self, manager: Any, nbytes: int, torch_device: torch.device) -> None:
        """Allocate `nbytes` on `torch_device`, registered with `manager`'s engine wrapper
        until `release()` or the manager's end.

        Raises what the allocation or sglang's `register` raises (RuntimeError).
        """
        slot_bytes = nbytes // SLOTS // SLOT_ALIGNMENT * SLOT_ALIGNMENT
        if slot_bytes == 0:
            raise RuntimeError(f"{nbytes} bytes make no {SLOTS} slots of {SLOT_ALIGNMENT} bytes")
        self.torch_device = torch_device
        self.slot_bytes = slot_bytes
        with on_torch_device(torch_device):
            self.region = cuda_runtime().empty_bytes(SLOTS * slot_bytes, torch_device)
        self._wrapper = manager.engine
        self._wrapper.register(self.region.data_ptr(), self.region.numel())
        self._free = list(range(SLOTS))
        self._lock = threading.Lock()
        self.release = weakref.finalize(manager, self._deregister)
        self.release.atexit = False  # at exit, engine calls of daemon threads may still read it

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` of the region (a uint8 view)."""
        return self.region[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def try_take(self) -> int | None:
        """A free slot, or None when every slot is lent (never waits)."""
        with self._lock:
            return self._free.pop(0) if self._free else None

    def give_back(self, index: int) -> None:
        """Slot `index` is free again: the engine call that read it has ended."""
        with self._lock:
            self._free.append(index)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def _deregister(self) -> None:
        """Deregister the region from the engine (every slot must be free)."""
        with self._lock:
            if len(self._free) != SLOTS:
                raise RuntimeError("gather staging closed while a chunk is in flight")
        self._wrapper.deregister(self.region.data_ptr())


class _NoStaging:
    """Why a manager has no staging (remembered so that no later send tries again)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


_stagings: weakref.WeakKeyDictionary[Any, GatherStaging | _NoStaging] = weakref.WeakKeyDictionary()
_stagings_lock = threading.Lock()


def kv_torch_device(kv_args: Any) -> torch.device | str:
    """The one device whose memory holds every registered KV buffer, or why there is none."""
    runtime = cuda_runtime()
    devices = {runtime.memory_device(int(ptr)) for ptr in kv_args.kv_data_ptrs}
    if len(devices) != 1:
        return f"the KV buffers are on {sorted(map(str, devices)) or 'no device'}, not one"
    return devices.pop()


def staging_for(manager: Any) -> GatherStaging | str:
    """`manager`'s staging, allocated and registered on first use; else why it has none."""
    staging = _stagings.get(manager)  # a dict read: every send but the manager's first
    if staging is None:
        with _stagings_lock:
            staging = _stagings.get(manager)
            if staging is None:
                staging = _new_staging(manager)
                _stagings[manager] = staging
    return staging.reason if isinstance(staging, _NoStaging) else staging


def _new_staging(manager: Any) -> GatherStaging | _NoStaging:
    nbytes = settings.loaded(settings.GATHER_STAGING_BYTES)
    if nbytes == 0:
        return _NoStaging(f"{settings.GATHER_STAGING_BYTES.name}=0")
    torch_device = kv_torch_device(manager.kv_args)
    if isinstance(torch_device, str):
        return _NoStaging(torch_device)
    try:
        return GatherStaging(manager, nbytes, torch_device)
    except Exception as error:  # out of memory, a refused registration, a bug: no staging
        return _NoStaging(f"{nbytes} bytes could not be allocated and registered ({error!r})")


def release_staging(manager: Any) -> None:
    """Deregister and forget `manager`'s staging (tests; a process keeps it while it serves)."""
    with _stagings_lock:
        staging = _stagings.pop(manager, None)
    if isinstance(staging, GatherStaging):
        staging.release()


def send_gathered(
    manager: Any,
    session: str,
    layout: HeadSliceLayout,
    pages: tuple[np.ndarray, np.ndarray],
    executor: concurrent.futures.Executor,
) -> int | None:
    """Send `layout`'s head slices of `pages` gathered, with sglang's status; None: per-token.

    Args:
        manager: sglang's `MooncakeKVManager` (its engine wrapper, registered
            KV buffers and `_await_transfer_futures`).
        session: the decode peer's Mooncake session.
        layout: the send's K/V buffers in sglang's order (`send_slice`'s,
            bounds already checked).
        pages: (prefill pages, decode pages), equal-length int arrays.
        executor: sglang's executor: the chunks' engine calls run there.

    Returns:
        0 or the first failing engine status, as sglang's send returns it;
        None (logged once per reason) where the send needs per-token descriptors.
    """
    started = time.perf_counter()
    src_pages, dst_pages = pages
    if not src_pages.size:
        return 0  # sglang makes no engine call
    staging = staging_for(manager)
    page_bytes = int(layout.geometry[1, 1].max())
    if page_bytes == 0:
        return _per_token("decode pages of 0 bytes", 0)
    if isinstance(staging, str):
        return _per_token(f"no gather staging: {staging}", SLOTS * page_bytes)
    chunks = plan_chunks(layout.num_layers, src_pages.size, page_bytes, staging.slot_bytes)
    if chunks is None:
        return _per_token(
            f"a staged page of {page_bytes} bytes does not fit a {staging.slot_bytes}-byte slot",
            SLOTS * page_bytes,
        )
    src_lens = _registered_lens(manager.kv_args, layout)
    if isinstance(src_lens, str):
        return _per_token(src_lens, 0)
    try:
        columns = [
            gathered_descriptors(chunk_layout(layout, chunk.entries), dst_pages[chunk.pages], 0)
            for chunk in chunks
        ]
    except PlanValidationError as error:
        log_fallback_once(f"a gathered send was rejected ({error})", key="gather rejected")
        return None
    engine_handoff = sglang_handoff(manager.engine)
    first_slot = staging.try_take()
    if first_slot is None:
        log_fallback_once(
            "a head-sliced send takes per-token descriptors: every gather staging slot is lent "
            "to other sends (is a peer stalled?)",
            key="gather staging busy",
        )
        return None
    futures = current_send().futures
    with SlotLease(staging, first_slot, futures) as lease:  # whatever raises, slots go back
        record_send(
            "gathered",
            engine_handoff.form,
            sum(column.shape[1] for column in columns),
            sum(exact_total(column[2]) for column in columns),
            time.perf_counter() - started,
            layout.num_layers,
            len(chunks),
        )
        executor = piece_executor(executor, len(chunks))
        for chunk, (offsets, dsts, lens) in zip(chunks, columns, strict=True):
            slot = lease.next_slot()  # may wait for this send's own call
            if slot is None:
                break  # sglang stops at a failed layer; no more chunks are gathered
            ready = gather_into_slot(staging, slot, layout, chunk, src_pages, src_lens)
            srcs = offsets + staging.slot(slot).data_ptr()
            lease.write(slot, executor, engine_handoff, session, ready, (srcs, dsts, lens))
        return manager._await_transfer_futures(futures)  # slots of ended calls back on return


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once on the calling thread, its outcome in a done future.

    A send of one piece has nothing to overlap: handing its call to sglang's
    executor only adds a thread switch (and, while this thread holds the GIL,
    up to a switch interval of waiting) to every small send.
    """

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # as a pool's worker keeps it: the caller awaits the future
            future.set_exception(error)
        return future


def piece_executor(
    executor: concurrent.futures.Executor, pieces: int
) -> concurrent.futures.Executor:
    """Where a send's piece calls run: sglang's executor to overlap several, inline for one."""
    return executor if pieces > 1 else INLINE


INLINE = InlineExecutor()


class SlotLease:
    """The slots one send holds: at most `SLOTS_PER_SEND`, so that one chunk is on the wire
    while the next is gathered; each goes back once the last engine call that read it ended
    (or was cancelled unstarted), never earlier, whatever the send's status.

    Use as a context manager from the first slot taken on: leaving it, by return
    or raise, gives back every slot whose last call has ended (at once, so a send
    that awaited its calls inside it returns with them free) and hands the others
    to their call's done callback. Each write's future joins `futures` (the
    send's progress: what the hook contract and sglang's await see).
    """

    def __init__(
        self, staging: GatherStaging, first_slot: int, futures: list[concurrent.futures.Future]
    ) -> None:
        self._staging = staging
        self._futures = futures
        self._last_use: dict[int, concurrent.futures.Future | None] = {first_slot: None}

    def __enter__(self) -> SlotLease:
        return self

    def __exit__(self, *_: object) -> None:
        for slot, future in self._last_use.items():
            if future is None:
                self._staging.give_back(slot)
            else:
                future.add_done_callback(_giving_back(self._staging, slot))

    def next_slot(self) -> int | None:
        """The slot for the send's next chunk; None once one of its calls failed (no more
        chunks are gathered).

        A held slot no call reads, taking another free one while holding fewer than
        `SLOTS_PER_SEND`; else it waits for this send's own oldest chunk's call to end.
        """
        slot = self._free_held_slot()
        return None if _failed(self._futures) else slot

    def _free_held_slot(self) -> int:
        for slot, future in self._last_use.items():
            if future is None:
                return slot
        if len(self._last_use) < SLOTS_PER_SEND:
            slot = self._staging.try_take()
            if slot is not None:
                self._last_use[slot] = None
                return slot
        slot = next(iter(self._last_use))  # dicts keep insertion order: the oldest chunk's slot
        oldest = self._last_use.pop(slot)
        assert oldest is not None
        concurrent.futures.wait([oldest])
        self._last_use[slot] = None  # re-inserted last: its next chunk is the newest
        return slot

    def write(
        self,
        slot: int,
        executor: concurrent.futures.Executor,
        engine_handoff: Any,
        session: str,
        ready: Any,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        """Write `slot`'s chunk (`columns`: its srcs, dsts, lens) from `executor`, once its
        gather's `ready` event (None: already written); the slot is lent until that call ends."""
        future = executor.submit(write_chunk, engine_handoff, session, ready, *columns)
        self._futures.append(future)
        self._last_use[slot] = future


def write_chunk(
    engine_handoff: Any,
    session: str,
    ready: Any,
    srcs: np.ndarray,
    dsts: np.ndarray,
    lens: np.ndarray,
) -> int:
    """One chunk's engine call, once its gather has written the slot (`ready`: None or an event)."""
    if ready is not None:
        ready.synchronize()
    return engine_handoff.call(session, *engine_handoff.columns(srcs, dsts, lens))


class PartWrites:
    """A send's asynchronous part writes (`AsyncWrites`) and the slots they read.

    As `SlotLease`, from the first slot taken on: at most `SLOTS_PER_SEND`
    slots, the next chunk gathered into the other one while a chunk is on the
    wire; here the writes start from this thread, one per part as soon as it
    is gathered, with no hand-off to an executor. A slot is reused or given
    back only once every write reading it ended, whatever the send's status:
    leaving the block, by return or raise, waits for the writes still in flight.
    `status` is 0 until a write fails (or does not start), then -1.
    """

    def __init__(
        self, staging: GatherStaging, first_slot: int, writes: AsyncWrites, session: str
    ) -> None:
        self._staging = staging
        self._writes = writes
        self._session = session
        self._in_flight: dict[int, list[int]] = {first_slot: []}  # slot -> its writes' batches
        self.status = 0

    def __enter__(self) -> PartWrites:
        return self

    def __exit__(self, *_: object) -> None:
        try:
            self.finish()
        finally:
            for slot in self._in_flight:
                self._staging.give_back(slot)

    def next_slot(self) -> int | None:
        """The slot for the send's next chunk; None once a write failed (no more are gathered).

        A held slot no write reads, taking another free one while holding fewer
        than `SLOTS_PER_SEND`; else the oldest chunk's, once its writes ended.
        """
        for slot, batches in self._in_flight.items():
            if not batches:
                return None if self.status else slot
        if len(self._in_flight) < SLOTS_PER_SEND:
            slot = self._staging.try_take()
            if slot is not None:
                self._in_flight[slot] = []
                return None if self.status else slot
        slot = next(iter(self._in_flight))  # dicts keep insertion order: the oldest chunk's slot
        self._end(slot)
        self._in_flight[slot] = self._in_flight.pop(slot)  # re-inserted last: the newest
        return None if self.status else slot

    def write(self, slot: int, offset: int, dst: int, nbytes: int) -> None:
        """Start writing `nbytes` of `slot` from byte `offset` to the peer's `dst`."""
        src = self._staging.slot(slot).data_ptr() + offset
        batch = self._writes.submit(self._session, src, dst, nbytes)
        if batch:
            self._in_flight[slot].append(batch)
        else:
            self.status = -1

    def finish(self) -> int:
        """Wait for every write in flight; 0 when every one landed, else -1."""
        for slot in self._in_flight:
            self._end(slot)
        return self.status

    def _end(self, slot: int) -> None:
        batches, self._in_flight[slot] = self._in_flight[slot], []
        for batch in batches:  # each waited for, even after one failed: all end before reuse
            if self._writes.wait(batch) != 0:
                self.status = -1


def _per_token(reason: str, needed: int) -> None:
    """Log once why a gathered send takes per-token descriptors (None: the caller's signal)."""
    log_fallback_once(
        f"a head-sliced send takes per-token descriptors: {reason}"
        + (f" (it needs at least {needed} bytes of staging)" if needed else ""),
        key="gather unavailable",
    )


def _registered_lens(kv_args: Any, layout: HeadSliceLayout) -> np.ndarray | str:
    """Each entry's registered source bytes (to the end of its region), or why not known."""
    room = bounds.registered_room(kv_args, layout.geometry[0, 0])
    if (room < 0).any():
        return "a source buffer outside the prefill's registered memory"
    return room


def gather_into_slot(
    staging: GatherStaging,
    slot: int,
    layout: HeadSliceLayout,
    chunk: Chunk,
    src_pages: np.ndarray,
    src_lens: np.ndarray,
) -> Any:
    """Gather `chunk` into `slot`; the event its engine call waits on (None: already written).

    On a device the gather runs on the current stream, after the work queued
    there before it (the forward pass that wrote the KV).
    """
    runtime = cuda_runtime()
    with on_torch_device(staging.torch_device):  # the KV's device, not the thread's
        gather_head_slices(
            chunk_layout(layout, chunk.entries),
            src_pages[chunk.pages],
            staging.slot(slot),
            src_lens[chunk.entries],
        )
        if not runtime.runs_on_device(staging.torch_device):
            return None
        ready = runtime.new_event()
        ready.record(runtime.current_stream(staging.torch_device))
        return ready


def _giving_back(staging: GatherStaging, slot: int) -> Callable[[concurrent.futures.Future], None]:
    """A done callback: the slot is free once its engine call ended or was cancelled unstarted."""
    return lambda _: staging.give_back(slot)


def _failed(futures: list[concurrent.futures.Future]) -> bool:
    """Whether an ended engine call failed (non-zero status or raised)."""
    for future in futures:
        ended = future.done() and not future.cancelled()
        if ended and (future.exception() is not None or future.result() != 0):
            return True
    return False
