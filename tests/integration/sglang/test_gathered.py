"""Gathered head-sliced sends land what sglang's `send_kvcache_slice` lands, in fewer descriptors.

sglang's send and the hooked one run on the same real `MooncakeKVManager`
state over hypothesis-drawn configurations (test_send_slice's scenarios:
KV heads, head sizes, page sizes, TP sizes both ways with replication, rank
pairs, PP stages, draft layers paired by layer id), with real source buffers
and a raw engine that copies each call's bytes into fake decode buffers at
call time, after checking that every source lies in memory registered with
it. Prefill TP below decode TP takes the gathered path (one descriptor per
run of decode pages per buffer); above it, per-token descriptors. Either way
every decode byte, the status, the error and sglang's log lines match.
Then the staging's rules: registered once per manager, a slot lent until its
call has ended, the next chunk gathered while the current one is sent,
sglang's status on failures, per-token descriptors when staging cannot be
had, and on the CUDA path the engine call waiting on the gather's event.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import inspect
import threading

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from sglang_plugin_support import conn, make_manager
from suite_support import set_knob
from test_send_handoff import ArraysEngine, ListEngine, sglang_wrapper
from test_send_slice import (
    BUFFER_SPAN,
    DST_BASE,
    ONE_THREAD,
    SESSION,
    kv_slice_scenarios,
    leaves_a_token_slot,
    run,
)

from gpu_planner.integration.sglang import counters, fallback, gathered, send_path, send_slots
from gpu_planner.reference import group_runs
from tests.test_head_gather import page_lists

ORIGINAL = inspect.unwrap(conn.MooncakeKVManager.send_kvcache_slice)
POOL_PAGES = 12  # pages of every source and decode buffer
STAGING_ENV = "GPU_PLANNER_GATHER_STAGING_BYTES"
WAIT_S = 30.0  # bound on every wait of a test thread


def hooked_send():
    return conn.MooncakeKVManager.send_kvcache_slice


class MovesBytes:
    """A raw engine over real memory: each call's bytes land in fake decode buffers at call time.

    Before a call copies anything it checks every source lies in one region
    registered with it (`register_memory`) and every destination in one decode
    buffer; a call outside either raises (sglang's wrapper makes that -1).
    """

    def __init__(self, regions: dict[int, int], decode: dict[int, np.ndarray], **failures):
        super().__init__(**failures)
        self.registered = dict(regions)  # address -> bytes
        self.registrations: list[tuple[int, int]] = []
        self.decode = decode  # fake decode buffer address -> its bytes

    def register_memory(self, address: int, nbytes: int) -> int:
        self.registered[address] = nbytes
        self.registrations.append((address, nbytes))
        return 0

    def unregister_memory(self, address: int) -> int:
        return 0 if self.registered.pop(address, None) is not None else -1

    def _record(self, session: str, srcs, dsts, lens) -> int:
        status = super()._record(session, srcs, dsts, lens)
        if status == 0:
            self._copy(srcs, dsts, lens)
        return status

    def _copy(self, srcs, dsts, lens) -> None:
        columns = [np.asarray(column, dtype=np.int64).tolist() for column in (srcs, dsts, lens)]
        for src, dst, length in zip(*columns, strict=True):
            if not any(a <= src and src + length <= a + n for a, n in self.registered.items()):
                raise ValueError(f"source {src:#x} + {length} is not registered memory")
            target = self._decode_view(dst, length)
            target[:] = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(src))

    def _decode_view(self, address: int, length: int) -> np.ndarray:
        for base, array in self.decode.items():
            if base <= address and address + length <= base + array.size:
                return array[address - base : address - base + length]
        raise ValueError(f"destination {address:#x} + {length} is in no decode buffer")


class ListMemoryEngine(MovesBytes, ListEngine):
    """Mooncake <= 0.3.13's list API, moving bytes."""


class ArraysMemoryEngine(MovesBytes, ArraysEngine):
    """Mooncake 0.3.14's arrays API, moving bytes."""


def real_memory(scenario: dict, src_pages: np.ndarray, dst_pages: np.ndarray, seed: int):
    """`scenario` on real source buffers of random bytes with these pages; (scenario, decode).

    Source buffers hold POOL_PAGES pages each; decode buffers stay at the
    scenario's made-up addresses, backed by the returned arrays.
    """
    rng = np.random.default_rng(seed)
    kv_args, call = dict(scenario["kv_args"]), dict(scenario["call"])
    sources = [
        rng.integers(0, 256, POOL_PAGES * item_len, dtype=np.uint8)
        for item_len in kv_args["kv_item_lens"]
    ]
    kv_args["kv_data_ptrs"] = [source.ctypes.data for source in sources]
    kv_args["kv_data_lens"] = [source.nbytes for source in sources]
    call["prefill_kv_indices"] = src_pages
    call["dst_kv_indices"] = dst_pages
    decode = {
        ptr: rng.integers(0, 256, POOL_PAGES * max(call["dst_kv_item_len"], 0), dtype=np.uint8)
        for ptr in call["dst_kv_ptrs"]
    }
    return {**scenario, "kv_args": kv_args, "call": call, "sources": sources}, decode


def copy_of(decode: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    return {ptr: array.copy() for ptr, array in decode.items()}


def registered(scenario: dict) -> dict[int, int]:
    kv_args = scenario["kv_args"]
    return dict(zip(kv_args["kv_data_ptrs"], kv_args["kv_data_lens"], strict=True))


def staging_bytes_for(slot_pages: int, page_bytes: int) -> int:
    """Staging whose two slots hold at least `slot_pages` decode pages each."""
    slot = (
        -(-max(slot_pages * page_bytes, 1) // send_slots.SLOT_ALIGNMENT) * send_slots.SLOT_ALIGNMENT
    )
    return send_slots.SLOTS * slot


@pytest.mark.parametrize(
    "raw_type", [ListMemoryEngine, ArraysMemoryEngine], ids=["lists", "arrays"]
)
@pytest.mark.parametrize("gathered_only", [False, True], ids=["both-ways", "lower-prefill-tp"])
def test_hooked_send_lands_sglangs_bytes(raw_type, gathered_only, monkeypatch):
    form = "lists" if raw_type is ListMemoryEngine else "arrays"
    before = counters.snapshot()["sends"].get(f"gathered/{form}", 0)
    check_same_bytes(raw_type, gathered_only, monkeypatch)
    # Each example whose send takes the gathered path gathered (`check_same_bytes`); drawn
    # from a lower prefill TP, some did (others read across token slots and were refused).
    assert counters.snapshot()["sends"].get(f"gathered/{form}", 0) > before or not gathered_only


@given(data=st.data())
def check_same_bytes(raw_type, gathered_only, monkeypatch, data):
    fake = data.draw(kv_slice_scenarios(lower_prefill_tp=gathered_only))
    assume(takes_gathered_path(fake) or not gathered_only)  # not: a too-small decode slot
    num_pages = len(fake["call"]["prefill_kv_indices"])
    dtype = fake["call"]["prefill_kv_indices"].dtype
    src_pages = data.draw(page_lists(num_pages, POOL_PAGES)).astype(dtype)
    dst_pages = data.draw(page_lists(num_pages, POOL_PAGES)).astype(dtype)
    fake["call"] = {**fake["call"], "prefill_kv_indices": src_pages, "dst_kv_indices": dst_pages}
    sglang_calls = run(ORIGINAL, fake, ArraysEngine(), ONE_THREAD)["calls"]
    assume_inside = not leaves_a_token_slot(fake, sglang_calls)
    slot_pages = data.draw(st.sampled_from([None, None, 1, 2, 7]))
    dst_item_len = fake["call"]["dst_kv_item_len"]
    if slot_pages is not None and dst_item_len > 0:
        set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(slot_pages, dst_item_len)))
    else:
        set_knob(monkeypatch, STAGING_ENV, None)
    scenario, decode = real_memory(fake, src_pages, dst_pages, seed=data.draw(st.integers(0, 9)))
    expected_decode, actual_decode = copy_of(decode), copy_of(decode)
    expected = run(ORIGINAL, scenario, raw_type(registered(scenario), expected_decode), ONE_THREAD)
    raw = raw_type(registered(scenario), actual_decode)
    form = "lists" if raw_type is ListMemoryEngine else "arrays"
    gathered_before = counters.snapshot()["sends"].get(f"gathered/{form}", 0)
    actual = run(hooked_send(), scenario, raw, ONE_THREAD)
    if not assume_inside:  # sglang would read across token slots: the hook refuses
        assert (actual["status"], actual["calls"]) == (-1, [])
        return
    assert (actual["status"], actual["error"], actual["log"]) == (
        expected["status"],
        expected["error"],
        expected["log"],
    )
    for ptr in decode:
        np.testing.assert_array_equal(actual_decode[ptr], expected_decode[ptr])
    if expected["status"] == 0 and expected["calls"] and takes_gathered_path(scenario):
        num_entries = len(expected["calls"])  # sglang: one call per K/V buffer of every layer
        descriptors = sum(len(call[3]) for call in raw.calls)
        dst_runs = len(group_runs(range(num_pages), dst_pages.tolist()))
        equal_tp = num_entries * len(group_runs(src_pages.tolist(), dst_pages.tolist()))
        if slot_pages is None or slot_pages >= num_pages:  # whole entries per chunk
            assert descriptors == num_entries * dst_runs <= equal_tp
        assert len(raw.calls) < num_entries or num_entries == 1 or slot_pages is not None
        assert counters.snapshot()["sends"].get(f"gathered/{form}", 0) == gathered_before + 1
    elif expected["calls"]:
        assert raw.calls == expected["calls"]  # per-token: sglang's calls


def takes_gathered_path(scenario: dict) -> bool:
    """A lower prefill TP, and staged pages that are whole decode pages (sglang's head size)."""
    kv_args, call = scenario["kv_args"], scenario["call"]
    total_heads = kv_args["total_kv_head_num"] or kv_args["kv_head_num"] * scenario["tp"]
    dst_heads = max(1, total_heads // call["dst_attn_tp_size"])
    page_size, item_len = kv_args["page_size"], call["dst_kv_item_len"]
    head_len = item_len // page_size // dst_heads
    whole = item_len > 0 and item_len == page_size * dst_heads * head_len
    return whole and gathered.gathers(scenario["tp"], call["dst_attn_tp_size"])


def test_plan_chunks_takes_whole_entries_while_a_slot_holds_all_pages():
    assert gathered.plan_chunks(5, 3, 100, 700) == [
        send_slots.Chunk(slice(0, 2), slice(0, 3)),
        send_slots.Chunk(slice(2, 4), slice(0, 3)),
        send_slots.Chunk(slice(4, 5), slice(0, 3)),
    ]
    assert gathered.plan_chunks(2, 5, 100, 200) == [
        send_slots.Chunk(slice(entry, entry + 1), pages)
        for entry in range(2)
        for pages in (slice(0, 2), slice(2, 4), slice(4, 5))
    ]
    assert gathered.plan_chunks(2, 5, 100, 99) is None


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "gathers"), [(2, 4, True), (1, 16, True), (4, 2, False), (4, 4, False)]
)
def test_only_a_lower_prefill_tp_gathers(src_tp, dst_tp, gathers):
    assert gathered.gathers(src_tp, dst_tp) is gathers


# TP2 rank 0 -> TP4 rank 1 of 8 KV heads, 16-byte heads, page size 4: 128-byte decode pages.
TOTAL_HEADS, HEAD_BYTES, PAGE_SIZE = 8, 16, 4
SRC_ITEM_LEN, DST_ITEM_LEN = PAGE_SIZE * 4 * HEAD_BYTES, PAGE_SIZE * 2 * HEAD_BYTES


def tp2_to_tp4(num_layers: int, num_pages: int) -> tuple[dict, dict[int, np.ndarray]]:
    """A real-memory `send_kvcache_slice` of `num_layers` layers and `num_pages` shuffled pages."""
    rng = np.random.default_rng(num_layers)
    buffers = 2 * num_layers
    fake = {
        "kv_args": {
            "kv_item_lens": [SRC_ITEM_LEN] * buffers,
            "kv_layer_ids": [],
            "page_size": PAGE_SIZE,
            "engine_rank": 0,
            "kv_head_num": TOTAL_HEADS // 2,
            "total_kv_head_num": TOTAL_HEADS,
        },
        "call": {
            "mooncake_session_id": SESSION,
            "dst_kv_ptrs": [DST_BASE + index * BUFFER_SPAN for index in range(buffers)],
            "dst_tp_rank": 1,
            "dst_attn_tp_size": 4,
            "dst_kv_item_len": DST_ITEM_LEN,
        },
        "manager": {},
        "tp": 2,
    }
    src_pages, dst_pages = (rng.permutation(POOL_PAGES)[:num_pages] for _ in range(2))
    return real_memory(fake, src_pages, dst_pages, seed=num_layers)


def manager_for(scenario: dict, raw) -> conn.MooncakeKVManager:
    manager = make_manager(sglang_wrapper(raw), **scenario["manager"])
    for name, value in scenario["kv_args"].items():
        setattr(manager.kv_args, name, value)
    manager.attn_tp_size = scenario["tp"]
    return manager


def send(manager, scenario: dict, executor) -> int:
    return hooked_send()(manager, **scenario["call"], executor=executor)


def test_staging_is_registered_once_per_manager_and_deregistered_on_release(monkeypatch):
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(1, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=2, num_pages=3)
    raw = ArraysMemoryEngine(registered(scenario), decode)
    manager = manager_for(scenario, raw)
    for _ in range(2):
        assert send(manager, scenario, ONE_THREAD) == 0
    staging = send_slots.SEND_SLOTS.get(manager)
    assert raw.registrations == [(staging.region.data_ptr(), staging.region.numel())]
    assert staging.region.numel() == staging_bytes_for(1, DST_ITEM_LEN)
    assert staging.release.atexit is False  # daemon threads' calls may still read it at exit
    assert len(raw.calls) == 2 * 4 * 2  # two sends, four buffers, pages 0-1 and 2 (256-byte slots)
    send_slots.SEND_SLOTS.release(manager)
    assert staging.region.data_ptr() not in raw.registered


class UnregistrableEngine(ArraysMemoryEngine):
    def register_memory(self, address: int, nbytes: int) -> int:
        return -1


def test_unavailable_staging_sends_per_token_and_logs_the_size_it_needed(monkeypatch, caplog):
    monkeypatch.setattr(fallback, "_logged_keys", set())
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=3)
    raw = UnregistrableEngine(registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)
    key = f"{send_path.PER_TOKEN}/{send_path.NO_SEND_SLOTS}"
    before = counters.snapshot()["paths_chosen"].get(key, 0)
    with caplog.at_level("INFO", logger="gpu_planner.integration.sglang.plugin"):
        assert send(manager, scenario, ONE_THREAD) == 0
        assert send(manager, scenario, ONE_THREAD) == 0
    assert counters.snapshot()["paths_chosen"][key] == before + 2
    [line] = [record.getMessage() for record in caplog.records]
    assert (
        "registration failed" in line
        and f"at least {send_slots.SLOTS * DST_ITEM_LEN} bytes" in line
    )
    assert [len(call[3]) for call in raw.calls] == [3 * PAGE_SIZE] * 2 * 2  # per token
    expected_decode = copy_of(decode)
    run(ORIGINAL, scenario, ArraysMemoryEngine(registered(scenario), expected_decode), ONE_THREAD)
    for ptr in decode:
        np.testing.assert_array_equal(raw.decode[ptr], expected_decode[ptr])


class Timeline:
    """What happened, in order, across threads."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def add(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def before(self, first: str, second: str) -> bool:
        return self.events.index(first) < self.events.index(second)


def spy_on_gathers(monkeypatch, timeline: Timeline) -> list[threading.Event]:
    """Record each gather in `timeline`; the returned events are set as gathers 0, 1, ... end."""
    gathered_events = [threading.Event() for _ in range(8)]
    gather = send_slots.gather_head_slices
    count = iter(range(8))

    def recorded_gather(*args, **kwargs):
        number = next(count)
        timeline.add(f"gather {number}")
        gather(*args, **kwargs)
        gathered_events[number].set()

    monkeypatch.setattr(send_slots, "gather_head_slices", recorded_gather)
    return gathered_events


class TimedEngine(ArraysMemoryEngine):
    """Records each call's start and end; call 0 waits until gather 1 has ended."""

    def __init__(self, timeline: Timeline, gather_ended: list[threading.Event], *args, **kw):
        super().__init__(*args, **kw)
        self.timeline, self.gather_ended = timeline, gather_ended
        self.numbers = iter(range(100))

    def batch_transfer_sync_write_arrays(self, session, srcs, dsts, lens) -> int:
        number = next(self.numbers)
        self.timeline.add(f"call {number}")
        if number == 0:
            assert self.gather_ended[1].wait(WAIT_S), "chunk 1 was not gathered during call 0"
        status = super().batch_transfer_sync_write_arrays(session, srcs, dsts, lens)
        self.timeline.add(f"call {number} ended")
        return status


def test_the_next_chunk_is_gathered_while_the_current_one_is_sent(monkeypatch):
    """Three chunks in two slots: chunk 1 gathers during call 0; chunk 2 waits for call 0's end."""
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=4)
    timeline = Timeline()
    gather_ended = spy_on_gathers(monkeypatch, timeline)
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(2, DST_ITEM_LEN)))  # pages 2 + 2
    raw = TimedEngine(timeline, gather_ended, registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as executor:
        assert send(manager, scenario, executor) == 0
    assert len(raw.calls) == 4  # K pages 0-1, 2-3, then V's
    assert timeline.before("gather 1", "call 0 ended")  # overlap
    assert timeline.before("call 0 ended", "gather 2")  # slot 0 reused after its call
    assert timeline.before("call 1 ended", "gather 3")
    expected_decode = copy_of(decode)
    run(ORIGINAL, scenario, ArraysMemoryEngine(registered(scenario), expected_decode), ONE_THREAD)
    for ptr in decode:
        np.testing.assert_array_equal(raw.decode[ptr], expected_decode[ptr])


class FailingHeldEngine(ArraysMemoryEngine):
    """Call 0 fails (status or raise) once call 1 is held; call 1 waits for `release`."""

    def __init__(self, *args, raises: bool, **kw):
        super().__init__(*args, **kw)
        self.fail_raises = raises
        self.holding, self.release = threading.Event(), threading.Event()
        self.numbers = iter(range(100))

    def batch_transfer_sync_write_arrays(self, session, srcs, dsts, lens) -> int:
        number = next(self.numbers)
        if number == 0:
            assert self.holding.wait(WAIT_S)
            if self.fail_raises:
                raise RuntimeError("engine failure")
            return -1
        self.holding.set()
        assert self.release.wait(WAIT_S)
        return super().batch_transfer_sync_write_arrays(session, srcs, dsts, lens)


@pytest.mark.parametrize("raises", [False, True], ids=["status", "raises"])
@pytest.mark.parametrize("deferred_release", [False, True])
def test_a_failing_call_gives_sglangs_status_and_its_running_slot_waits(
    monkeypatch, raises, deferred_release
):
    """sglang's -1; no chunk gathered after the failure; a running call's slot stays lent until
    it ends, and the failed call's slot is held for good (the engine may still read it)."""
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(3, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=3, num_pages=3)  # six chunks of one entry
    raw = FailingHeldEngine(registered(scenario), copy_of(decode), raises=raises)
    manager = manager_for(scenario, raw)
    manager.enable_deferred_decode_kv_release = deferred_release
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as executor:
        if deferred_release:  # sglang drains running calls first: let call 1 end
            threading.Timer(0.2, raw.release.set).start()
        assert send(manager, scenario, executor) == -1
        staging = send_slots.SEND_SLOTS.get(manager)
        if not deferred_release:
            assert raw.holding.is_set()  # call 1 holds its slot; call 0's is held for good
            assert (staging.free_slots, staging.held_slots) == (send_slots.SLOTS - 2, 1)
            raw.release.set()
    assert (staging.free_slots, staging.held_slots) == (send_slots.SLOTS - 1, 1)
    assert len(raw.calls) <= 1  # only call 1 moved bytes; nothing after the failure


class EventLog:
    """A stand-in event that records its record and wait in a timeline."""

    def __init__(self, event, timeline: Timeline, number: int) -> None:
        self.event, self.timeline, self.number = event, timeline, number

    def record(self, stream=None) -> None:
        self.timeline.add(f"record {self.number}")
        self.event.record(stream)

    def synchronize(self) -> None:
        self.timeline.add(f"wait {self.number}")
        self.event.synchronize()


def test_on_the_cuda_path_each_call_waits_on_its_gathers_event(monkeypatch, host_cuda):
    """Gather on the current stream, record an event after it, the call waits on that event."""
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(3, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=3)
    timeline = Timeline()
    spy_on_gathers(monkeypatch, timeline)
    numbers = iter(range(8))
    new_event = host_cuda.new_event
    monkeypatch.setattr(
        host_cuda, "new_event", lambda: EventLog(new_event(), timeline, next(numbers))
    )

    class Calls(ArraysMemoryEngine):
        def batch_transfer_sync_write_arrays(self, session, srcs, dsts, lens) -> int:
            timeline.add(f"call {len(self.calls)}")
            return super().batch_transfer_sync_write_arrays(session, srcs, dsts, lens)

    raw = Calls(registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)
    assert send(manager, scenario, ONE_THREAD) == 0
    for chunk in range(2):
        order = [f"gather {chunk}", f"record {chunk}", f"wait {chunk}", f"call {chunk}"]
        assert all(timeline.before(a, b) for a, b in zip(order, order[1:], strict=False))


STALLED = "127.0.0.1:23456"  # a decode peer that stops answering mid-send


class StalledPeerEngine(ArraysMemoryEngine):
    """Calls to STALLED block until `resume` is set; calls to any other peer go through."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.resume, self.stalled_calls = threading.Event(), threading.Semaphore(0)

    def batch_transfer_sync_write_arrays(self, session, srcs, dsts, lens) -> int:
        if session == STALLED:
            self.stalled_calls.release()
            assert self.resume.wait(WAIT_S), "the stalled peer was never resumed"
        return super().batch_transfer_sync_write_arrays(session, srcs, dsts, lens)


def send_to(manager, scenario: dict, session: str, executor) -> int:
    return hooked_send()(
        manager, **{**scenario["call"], "mooncake_session_id": session}, executor=executor
    )


@pytest.mark.parametrize("stalled_sends", [1, 2], ids=["slots-left", "every-slot-lent"])
def test_a_stalled_peer_never_delays_a_healthy_one(monkeypatch, stalled_sends):
    """Sends to a stalled peer hold their slots; a send to a healthy peer from another transfer
    worker does not wait for them: it gathers into free slots, or sends per-token when none is."""
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(2, DST_ITEM_LEN)))  # pages 2 + 2
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=4)  # four chunks, two slots a send
    raw = StalledPeerEngine(registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)
    busy_key = f"{send_path.PER_TOKEN}/{send_path.SLOTS_BUSY}"
    busy_before = counters.snapshot()["paths_chosen"].get(busy_key, 0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2 * stalled_sends) as executor:
        stalled = [
            threading.Thread(target=send_to, args=(manager, scenario, STALLED, executor))
            for _ in range(stalled_sends)
        ]
        for thread in stalled:
            thread.start()
        for _ in range(2 * stalled_sends):  # each stalled send has both its chunks on the wire
            assert raw.stalled_calls.acquire(timeout=WAIT_S)
        healthy = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        outcome = healthy.submit(send_to, manager, scenario, SESSION, healthy)
        try:
            assert outcome.result(timeout=WAIT_S) == 0  # on old code: waits for the stalled peer
            free_during_stall = send_slots.SEND_SLOTS.get(manager).free_slots
        finally:
            raw.resume.set()
            healthy.shutdown()
        for thread in stalled:
            thread.join(WAIT_S)
    busy = counters.snapshot()["paths_chosen"].get(busy_key, 0) - busy_before
    assert busy == (stalled_sends == 2)  # no free slot: per-token, counted
    assert free_during_stall == send_slots.SLOTS - 2 * stalled_sends
    assert send_slots.SEND_SLOTS.get(manager).free_slots == send_slots.SLOTS
    expected_decode = copy_of(decode)
    run(ORIGINAL, scenario, ArraysMemoryEngine(registered(scenario), expected_decode), ONE_THREAD)
    for ptr in decode:
        np.testing.assert_array_equal(raw.decode[ptr], expected_decode[ptr])


def test_staging_and_gathers_run_on_the_kv_device_not_the_threads(monkeypatch, host_cuda):
    """KV on device 1 (sglang's scheduler thread selected it); the transfer thread never selects
    a device (its current device is 0): staging, gathers and events still run on device 1."""
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(2, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=4)
    for source in scenario["sources"]:
        host_cuda.place(torch.from_numpy(source), 1)
    devices_seen: list[tuple[str, int]] = []
    gather = send_slots.gather_head_slices

    def recorded_gather(*args, **kwargs):
        devices_seen.append(("gather", host_cuda.current_device()))
        return gather(*args, **kwargs)

    monkeypatch.setattr(send_slots, "gather_head_slices", recorded_gather)
    new_event = host_cuda.new_event

    def recorded_event():
        devices_seen.append(("event", host_cuda.current_device()))
        return new_event()

    monkeypatch.setattr(host_cuda, "new_event", recorded_event)
    raw = ArraysMemoryEngine(registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)
    transfer_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # starts on device 0
    assert transfer_thread.submit(host_cuda.current_device).result() == 0
    assert transfer_thread.submit(send, manager, scenario, ONE_THREAD).result() == 0
    transfer_thread.shutdown()
    staging = send_slots.SEND_SLOTS.get(manager)
    assert staging.torch_device == torch.device("cuda", 1)
    assert host_cuda.memory_device(staging.region.data_ptr()) == torch.device("cuda", 1)
    assert host_cuda.allocations == [(torch.device("cuda", 1), 1)]  # allocated under device 1
    assert devices_seen and all(device == 1 for _, device in devices_seen)
    assert {what for what, _ in devices_seen} == {"gather", "event"}
    expected_decode = copy_of(decode)
    run(ORIGINAL, scenario, ArraysMemoryEngine(registered(scenario), expected_decode), ONE_THREAD)
    for ptr in decode:
        np.testing.assert_array_equal(raw.decode[ptr], expected_decode[ptr])


def test_kv_buffers_on_two_devices_send_per_token(monkeypatch, host_cuda):
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(2, DST_ITEM_LEN)))
    monkeypatch.setattr(fallback, "_logged_keys", set())
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=4)
    host_cuda.place(torch.from_numpy(scenario["sources"][0]), 1)  # K on device 1, V on the host
    raw = ArraysMemoryEngine(registered(scenario), copy_of(decode))
    assert send(manager_for(scenario, raw), scenario, ONE_THREAD) == 0
    assert [len(call[3]) for call in raw.calls] == [4 * PAGE_SIZE] * 2  # per token
    assert not host_cuda.allocations


def test_a_fault_after_the_first_slot_is_taken_gives_every_slot_back(monkeypatch):
    """Counting the send raises once a slot is held: sglang's code runs and the slot comes back."""
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(2, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=1, num_pages=4)
    raw = ArraysMemoryEngine(registered(scenario), copy_of(decode))
    manager = manager_for(scenario, raw)

    def broken_count(*args, **kwargs) -> None:
        raise RuntimeError("prometheus is broken")

    monkeypatch.setattr(gathered, "record_send", broken_count)
    assert send(manager, scenario, ONE_THREAD) == 0  # sglang's own per-token send
    assert send_slots.SEND_SLOTS.get(manager).free_slots == send_slots.SLOTS
    expected_decode = copy_of(decode)
    run(ORIGINAL, scenario, ArraysMemoryEngine(registered(scenario), expected_decode), ONE_THREAD)
    for ptr in decode:
        np.testing.assert_array_equal(raw.decode[ptr], expected_decode[ptr])


class CountedSlots:
    """A staging's slots, lent and given back, in host memory (what `PartWrites` reads)."""

    def __init__(self, slots: int = send_slots.SLOTS) -> None:
        self._slots = [torch.zeros(64, dtype=torch.uint8) for _ in range(slots)]
        self.free = list(range(slots))
        self.held: list[int] = []  # given back after a write that did not end cleanly
        self.given_back: list[tuple[int, int]] = []  # (slot, writes still unwaited then)
        self.writes: RecordedWrites | None = None

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def try_take(self) -> int | None:
        return self.free.pop(0) if self.free else None

    def give_back(self, index: int, clean: bool = True) -> None:
        self.given_back.append((index, len(self.writes.unwaited)))
        (self.free if clean else self.held).append(index)


class RecordedWrites:
    """`AsyncWrites` without an engine: each write gets a batch; `failing` batches end -1,
    a `refused` write starts none."""

    def __init__(self, failing: tuple[int, ...] = (), refused: tuple[int, ...] = ()) -> None:
        self.submitted: list[tuple[int, int, int]] = []
        self.unwaited: set[int] = set()
        self.waited: list[int] = []
        self._failing, self._refused = failing, refused

    def submit(self, session: str, src: int, dst: int, nbytes: int) -> int:
        self.submitted.append((src, dst, nbytes))
        batch = len(self.submitted)
        if batch in self._refused:
            return 0
        self.unwaited.add(batch)
        return batch

    def wait(self, batch: int) -> int:
        self.unwaited.discard(batch)
        self.waited.append(batch)
        return -1 if batch in self._failing else 0


def part_writes(writes: RecordedWrites) -> tuple[send_slots.PartWrites, CountedSlots]:
    staging = CountedSlots()
    staging.writes = writes
    return send_slots.PartWrites(staging, staging.try_take(), writes, SESSION), staging


def test_part_writes_reuse_a_slot_only_once_its_writes_ended():
    writes = RecordedWrites()
    lease, staging = part_writes(writes)
    with lease:
        first = lease.next_slot()
        lease.write(first, 0, 1000, 16)
        lease.write(first, 16, 1016, 16)
        second = lease.next_slot()
        assert second != first and writes.waited == []  # a second slot, nothing waited for
        lease.write(second, 0, 2000, 32)
        assert lease.next_slot() == first and writes.waited == [1, 2]  # the oldest, once ended
        assert staging.free == [2, 3]  # two slots held at most
        lease.write(first, 0, 3000, 8)
    assert writes.unwaited == set() and writes.waited == [1, 2, 3, 4]
    assert sorted(staging.given_back) == [(first, 0), (second, 0)]
    assert lease.status == 0
    base = staging.slot(first).data_ptr()
    assert writes.submitted[:2] == [(base, 1000, 16), (base + 16, 1016, 16)]


@pytest.mark.parametrize("fault", ["failing", "refused", "raises"])
def test_part_writes_end_every_write_before_any_slot_goes_back(fault):
    """A failed write, a write that never started, or an exception in the send: every write
    still in flight is waited for (each, even after one failed) before its slot goes back,
    once a write failed no slot is lent for another chunk, and the slot a write that did not
    end cleanly read is held, never free again."""
    writes = RecordedWrites(
        failing=(1,) if fault == "failing" else (), refused=(3,) if fault == "refused" else ()
    )
    lease, staging = part_writes(writes)
    raised = pytest.raises(RuntimeError) if fault == "raises" else contextlib.nullcontext()
    with raised, lease:
        slot = lease.next_slot()
        lease.write(slot, 0, 1000, 16)
        lease.write(slot, 16, 1016, 16)
        second = lease.next_slot()
        lease.write(second, 0, 2000, 16)
        if fault == "raises":
            raise RuntimeError("a fault in the send")
        assert lease.next_slot() is None
        assert lease.finish() == -1
    started = [1, 2] if fault == "refused" else [1, 2, 3]  # a refused write has no batch
    assert writes.unwaited == set() and sorted(writes.waited) == started
    assert all(unwaited == 0 for _, unwaited in staging.given_back)
    held = {"failing": [slot], "refused": [second], "raises": []}[fault]
    assert staging.held == held
    assert sorted(staging.free + staging.held) == list(range(send_slots.SLOTS))
