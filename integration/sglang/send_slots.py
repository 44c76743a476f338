"""The prefill's send slots: registered memory that sends gather pages into before writing.

Two paths gather: the gathered head-sliced send (`gathered`, TP-up: whole
decode pages) and the staged send (`staged_send`, into a decode's receive
staging). Both borrow slots from one region per `MooncakeKVManager`
(`SendSlots`) of `GPU_PLANNER_GATHER_STAGING_BYTES` bytes on the device whose
memory holds the KV buffers (asked of CUDA for their addresses: sglang's
transfer threads never select a device), registered on the first send that
asks for it and kept while the manager lives.

A send holds at most `SLOTS_PER_SEND` slots: while one chunk is on the wire
the next is gathered into the other. No send waits for another's slot: a send
that finds none free takes another path (`send_path`), and otherwise waits only
for its own earlier chunks.

A slot is lent again only when no engine call is known to read it:
- a write that ended with status 0 (or a call cancelled before it started)
  gives its slot back at once;
- a write that failed, timed out or raised leaves its slot **held**
  (`SendSlots.held_slots`, counted) for four of Mooncake's transfer timeouts
  (`stalled_write_s`: `MC_TRANSFER_TIMEOUT`, 30 s unset, so 120 s). Mooncake
  0.3.14 frees a batch when `get_batch_transfer_status` gives up on it (-1 at
  that timeout), so no call can confirm the end of such a write, yet its TCP
  transport keeps the write queued while the connection lives and reads the
  source when a stalled peer resumes. The hold covers a peer that resumes
  within it; one stalled longer can still be sent what the slot then holds
  (docs/sglang.md: sglang's own send frees its KV pages at the -1). While
  every slot is held or lent, sends take their other path.

Order on CUDA: a gather runs on the KV device's current stream, after what
that stream ran before (the forward pass that wrote the KV); the chunk's
engine call waits on an event recorded after the gather.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_planner import settings
from gpu_planner.cuda_runtime import cuda_runtime
from gpu_planner.cuda_streams import on_torch_device
from gpu_planner.head_gather import chunk_layout, gather_head_slices
from gpu_planner.head_slices import HeadSliceLayout
from gpu_planner.integration.mooncake.engine import stalled_write_s
from gpu_planner.integration.sglang.adapter import AsyncWrites
from gpu_planner.integration.sglang.counters import record_held_slot
from gpu_planner.integration.sglang.registered_region import (
    PerManager,
    RegisteredRegion,
    kernel_backend,
)

SLOTS = 4  # a region's slots: two sends at once each keep one chunk on the wire while gathering
SLOTS_PER_SEND = 2  # one chunk on the wire while the next is gathered
SLOT_ALIGNMENT = 256  # bytes: every slot starts as aligned as the region (the kernel's widest lane)


class SendSlots(RegisteredRegion):
    """A registered region cut into `SLOTS` slots, each lent to one send at a time."""

    def __init__(self, manager: Any, nbytes: int, torch_device: torch.device) -> None:
        """Raises what the allocation or sglang's `register` raises (RuntimeError)."""
        slot_bytes = nbytes // SLOTS // SLOT_ALIGNMENT * SLOT_ALIGNMENT
        if slot_bytes == 0:
            raise RuntimeError(f"{nbytes} bytes make no {SLOTS} slots of {SLOT_ALIGNMENT} bytes")
        self.slot_bytes = slot_bytes
        self._free = list(range(SLOTS))
        self._held: dict[int, float] = {}  # slot -> when it may be lent again (monotonic)
        self._lock = threading.Lock()
        super().__init__(manager, SLOTS * slot_bytes, torch_device)

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` of the region (a uint8 view)."""
        return self.region[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def try_take(self) -> int | None:
        """A free slot, or None when every slot is lent or held (never waits)."""
        with self._lock:
            self._release_held()
            return self._free.pop(0) if self._free else None

    def give_back(self, index: int, clean: bool = True) -> None:
        """Slot `index`'s last engine call ended: free again when it ended `clean` (status 0,
        or cancelled unstarted), else held for `stalled_write_s()` (the engine may read it)."""
        with self._lock:
            if clean:
                self._free.append(index)
            else:
                self._held[index] = time.monotonic() + stalled_write_s()
        if not clean:
            record_held_slot()

    def _release_held(self) -> None:
        """Free the held slots whose hold ran out; the caller holds the lock."""
        if self._held:
            now = time.monotonic()
            for index in [index for index, until in self._held.items() if until <= now]:
                del self._held[index]
                self._free.append(index)

    @property
    def free_slots(self) -> int:
        with self._lock:
            self._release_held()
            return len(self._free)

    @property
    def held_slots(self) -> int:
        """Slots a write that did not end cleanly may still read: not lent until their hold
        runs out."""
        with self._lock:
            self._release_held()
            return len(self._held)

    def _deregister(self) -> None:
        """Deregister the region once no write may read it; else keep it (and its memory) for
        the process's life: the engine may still read a slot."""
        with self._lock:
            self._release_held()
            if len(self._free) != SLOTS:
                _OUTLIVING.append(self)
                return
        super()._deregister()


# Regions whose manager ended while a write may still read a slot: kept, never freed.
_OUTLIVING: list[SendSlots] = []


def kv_torch_device(kv_args: Any) -> torch.device | str:
    """The one device whose memory holds every registered KV buffer, or why there is none."""
    runtime = cuda_runtime()
    devices = {runtime.memory_device(int(ptr)) for ptr in kv_args.kv_data_ptrs}
    if len(devices) != 1:
        return f"the KV buffers are on {sorted(map(str, devices)) or 'no device'}, not one"
    return devices.pop()


def _new_send_slots(manager: Any) -> SendSlots | str:
    nbytes = settings.loaded(settings.GATHER_STAGING_BYTES)
    if nbytes == 0:
        return f"{settings.GATHER_STAGING_BYTES.name}=0"
    torch_device = kv_torch_device(manager.kv_args)
    if isinstance(torch_device, str):
        return torch_device
    try:
        return SendSlots(manager, nbytes, torch_device)
    except Exception as error:  # out of memory, a refused registration, a bug: no slots
        return f"{nbytes} bytes could not be allocated and registered ({error!r})"


SEND_SLOTS: PerManager[SendSlots] = PerManager(_new_send_slots)


@dataclass(frozen=True)
class Chunk:
    """Entries (buffers, in the layout's order) and page positions one slot holds."""

    entries: slice
    pages: slice


def gather_into_slot(
    slots: SendSlots,
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
    with on_torch_device(slots.torch_device):  # the KV's device, not the thread's
        gather_head_slices(
            chunk_layout(layout, chunk.entries),
            src_pages[chunk.pages],
            slots.slot(slot),
            src_lens[chunk.entries],
            backend=kernel_backend(slots.torch_device),
        )
        if not runtime.runs_on_device(slots.torch_device):
            return None
        ready = runtime.new_event()
        ready.record(runtime.current_stream(slots.torch_device))
        return ready


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once on the calling thread, its outcome in a done future.

    A send of one piece has nothing to overlap: handing its call to sglang's
    executor only adds a thread switch to every small send.
    """

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # as a pool's worker keeps it: the caller awaits the future
            future.set_exception(error)
        return future


INLINE = InlineExecutor()


def piece_executor(
    executor: concurrent.futures.Executor, pieces: int
) -> concurrent.futures.Executor:
    """Where a send's piece calls run: sglang's executor to overlap several, inline for one."""
    return executor if pieces > 1 else INLINE


class SlotLease:
    """The slots one send holds while its pieces' engine calls run from an executor.

    At most `SLOTS_PER_SEND`, so that one chunk is on the wire while the next
    is gathered; each goes back once the last engine call that read it ended
    (or was cancelled unstarted), never earlier, and only if that call ended
    with status 0 (`SendSlots.give_back`). Use as a context manager from the
    first slot taken on: leaving it, by return or raise, gives back every slot
    whose last call has ended (at once, so a send that awaited its calls inside
    it returns with them free) and hands the others to their call's done
    callback. Each write's future joins `futures` (the send's progress: what
    the hook contract and sglang's await see).
    """

    def __init__(
        self, slots: SendSlots, first_slot: int, futures: list[concurrent.futures.Future]
    ) -> None:
        self._slots = slots
        self.futures = futures
        self._last_use: dict[int, concurrent.futures.Future | None] = {first_slot: None}

    def __enter__(self) -> SlotLease:
        return self

    def __exit__(self, *_: object) -> None:
        for slot, future in self._last_use.items():
            if future is None:
                self._slots.give_back(slot)
            else:
                future.add_done_callback(_giving_back(self._slots, slot))

    def next_slot(self) -> int | None:
        """The slot for the send's next chunk; None once one of its calls failed (no more
        chunks are gathered).

        A held slot no call reads, taking another free one while holding fewer than
        `SLOTS_PER_SEND`; else it waits for this send's own oldest chunk's call to end.
        """
        for slot, future in self._last_use.items():
            if future is None:
                return None if _failed(self.futures) else slot
        if len(self._last_use) < SLOTS_PER_SEND:
            slot = self._slots.try_take()
            if slot is not None:
                self._last_use[slot] = None
                return None if _failed(self.futures) else slot
        slot = next(iter(self._last_use))  # dicts keep insertion order: the oldest chunk's slot
        oldest = self._last_use.pop(slot)
        assert oldest is not None
        concurrent.futures.wait([oldest])
        if not _ended_clean(oldest):  # a failed call may still read it: never reused
            self._slots.give_back(slot, clean=False)
            return None
        self._last_use[slot] = None  # re-inserted last: its next chunk is the newest
        return None if _failed(self.futures) else slot

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
        self.futures.append(future)
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
    back only once every write reading it ended with status 0; a slot one of
    whose writes failed is held (`SendSlots.give_back`). Leaving the block, by
    return or raise, waits for the writes still in flight. `status` is 0 until
    a write fails (or does not start), then -1.
    """

    def __init__(
        self, slots: SendSlots, first_slot: int, writes: AsyncWrites, session: str
    ) -> None:
        self._slots = slots
        self._writes = writes
        self._session = session
        self._in_flight: dict[int, list[int]] = {first_slot: []}  # slot -> its writes' batches
        self._unclean: set[int] = set()  # slots a write that did not end cleanly read
        self.status = 0

    def __enter__(self) -> PartWrites:
        return self

    def __exit__(self, *_: object) -> None:
        try:
            self.finish()
        finally:
            for slot in self._in_flight:
                self._slots.give_back(slot, clean=slot not in self._unclean)

    def next_slot(self) -> int | None:
        """The slot for the send's next chunk; None once a write failed (no more are gathered).

        A held slot no write reads, taking another free one while holding fewer
        than `SLOTS_PER_SEND`; else the oldest chunk's, once its writes ended.
        """
        if self.status:
            return None
        for slot, batches in self._in_flight.items():
            if not batches:
                return slot
        if len(self._in_flight) < SLOTS_PER_SEND:
            slot = self._slots.try_take()
            if slot is not None:
                self._in_flight[slot] = []
                return slot
        slot = next(iter(self._in_flight))  # dicts keep insertion order: the oldest chunk's slot
        self._end(slot)
        self._in_flight[slot] = self._in_flight.pop(slot)  # re-inserted last: the newest
        return None if self.status else slot

    def write(self, slot: int, offset: int, dst: int, nbytes: int) -> None:
        """Start writing `nbytes` of `slot` from byte `offset` to the peer's `dst`."""
        src = self._slots.slot(slot).data_ptr() + offset
        batch = self._writes.submit(self._session, src, dst, nbytes)
        if batch:
            self._in_flight[slot].append(batch)
        else:  # not started: Mooncake may still have taken part of it
            self.status = -1
            self._unclean.add(slot)

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
                self._unclean.add(slot)


def _ended_clean(future: concurrent.futures.Future) -> bool:
    """Whether an engine call's future ended with status 0 or was cancelled unstarted."""
    if future.cancelled():
        return True
    return future.exception() is None and future.result() == 0


def _giving_back(slots: SendSlots, slot: int) -> Callable[[concurrent.futures.Future], None]:
    """A done callback: the slot is back once its engine call ended (held if not cleanly)."""
    return lambda future: slots.give_back(slot, clean=_ended_clean(future))


def _failed(futures: list[concurrent.futures.Future]) -> bool:
    """Whether an ended engine call failed (non-zero status or raised)."""
    for future in futures:
        ended = future.done() and not future.cancelled()
        if ended and (future.exception() is not None or future.result() != 0):
            return True
    return False
