"""The hook contract (`fallback.around`): a fault at every stage of every hook, and what leaves it.

Each hook as sglang runs it after `load_plugins()` gets one injected fault
(a patched stage that raises, or an engine call that fails), and exactly one
of these must leave it:

(a) sglang's status for a send the hook completed, with only calls sglang
    makes, nothing counted;
(b) sglang's own code, when no engine call had started: the same status (or
    sglang's own exception), the same engine calls and bytes as sglang's
    original on an identical fresh manager and engine; one fallback counted;
(c) -1 once an engine call had started: only the hook's calls up to the
    fault, none after, every call ended before the hook returns, the
    original not run; one failed send counted.

An interrupt (`KeyboardInterrupt`) from an engine call leaves the hook as it
is, and each reason is logged once however often it is counted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    MooncakeTransferEngine,
)
from sglang_plugin_support import (
    ORIGINALS,
    RecordingEngine,
    common,
    conn,
    hooked_send,
    make_manager,
    send_outcome,
)
from sglang_send_scenarios import SESSION
from suite_support import set_knob
from test_gathered import (
    DST_ITEM_LEN,
    STAGING_ENV,
    ArraysMemoryEngine,
    copy_of,
    manager_for,
    registered,
    staging_bytes_for,
    tp2_to_tp4,
)
from test_send_bounds import mla_scenario, swa_state_scenario
from test_send_handoff import ArraysEngine, sglang_wrapper
from test_send_slice import BUFFER_SPAN, ORIGINAL_SLICE, ORIGINAL_SWA, many_layer_scenario

import gpu_planner as gp
from gpu_planner.integration.sglang import bounds, counters, fallback, send, send_slice, send_slots
from gpu_planner.integration.sglang import pages as pages_hook

PlanValidationError = gp.PlanValidationError
OutOfMemory = getattr(torch, "OutOfMemoryError", RuntimeError)  # a device error
WAIT_S = 30.0  # bound on every wait of a test thread
FAILURE_STATUS = 7  # an engine's non-zero status

GENERIC = "send_kvcache_generic_hook"
SLICE = "send_kvcache_slice_hook"
SWA = "send_swa_state_slice_hook"
PAGES = "kv_to_page_indices_hook"


def unexpected(hook: str, error: type[BaseException]) -> str:
    """The counter key of an unexpected exception `error` in `hook`."""
    return f"{hook}: {error.__name__}"


@pytest.fixture(autouse=True)
def fresh_logs(monkeypatch):
    """Each test logs its reasons afresh (they are logged once per process)."""
    monkeypatch.setattr(fallback, "_logged_keys", set())


@pytest.fixture
def executor():
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


def fails(error: type[BaseException], what: str) -> Callable:
    """A stand-in for `what` that raises `error`."""

    def raising(*args, **kwargs):
        raise error(f"injected fault in {what}")

    return raising


def counter_changes(before: dict) -> dict[str, dict[str, int]]:
    """Fallbacks and failed sends counted since `before` (a `counters.snapshot()`), by key."""
    after = counters.snapshot()
    return {
        kind: dict(Counter(after[kind]) - Counter(before[kind]))
        for kind in ("fallbacks", "failed_sends")
    }


class Faulty:
    """A recording raw engine (mixin) that counts its calls in flight.

    Call `error_at` raises `error` once recorded (a Mooncake binding raising);
    `on_call(number)` runs in every call once it is recorded.
    """

    def __init__(self, *args, error_at=None, error=TypeError, on_call=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.error_at, self.error, self.on_call = error_at, error, on_call
        self.in_flight = 0
        self._made = 0
        self._counting = threading.Lock()

    def _record(self, session: str, srcs, dsts, lens) -> int:
        with self._counting:
            number, self._made = self._made, self._made + 1
            self.in_flight += 1
        try:
            status = super()._record(session, srcs, dsts, lens)
            if self.on_call is not None:
                self.on_call(number)
            if number == self.error_at:
                raise self.error(f"injected engine failure in call {number}")
            return status
        finally:
            with self._counting:
                self.in_flight -= 1

    def wait_for_calls(self, count: int) -> None:
        """Wait until `count` calls have started."""
        deadline = time.monotonic() + WAIT_S
        while len(self.calls) < count:
            assert time.monotonic() < deadline, f"{count} engine calls did not start"
            time.sleep(0.001)


class FaultyEngine(Faulty, ArraysEngine):
    """Mooncake 0.3.14's raw engine (arrays and lists), failing as told."""


class FaultyMemoryEngine(Faulty, ArraysMemoryEngine):
    """Mooncake 0.3.14's raw engine over real memory, failing as told."""


class UncheckedWrapper(MooncakeTransferEngine):
    """A subclass of sglang's wrapper (another plugin's, a test's) that lets engine errors out.

    sglang's own `batch_transfer_sync` turns an engine exception into -1; the
    hooks call this one as it is (with lists), so its exception reaches them.
    """

    def batch_transfer_sync(self, session_id: str, buffers, peer_addresses, lengths) -> int:
        return self.engine.batch_transfer_sync_write(session_id, buffers, peer_addresses, lengths)


def wrapper_of(raw, unchecked: bool) -> MooncakeTransferEngine:
    """sglang's wrapper around `raw`, or one that lets its exceptions out."""
    if not unchecked:
        return sglang_wrapper(raw)
    wrapper = object.__new__(UncheckedWrapper)
    wrapper.engine = raw
    return wrapper


# The hooks' sends, each on a fresh manager.


def multi_batch_mla():
    """An MLA generic send of two buffers and six pages in three batches (one call each)."""
    scenario = mla_scenario()
    scenario.call["prefill_data_indices"] = np.arange(10, 16, dtype=np.int32)
    scenario.call["dst_data_indices"] = np.array([4, 5, 9, 10, 11, 20], dtype=np.int32)
    return scenario


def generic_call(raw, unchecked: bool, **manager_state) -> tuple[conn.MooncakeKVManager, dict]:
    scenario = multi_batch_mla()
    state = {"max_transfer_batch_indices": 2, **scenario.manager, **manager_state}
    manager = make_manager(wrapper_of(raw, unchecked), kv_data_lens=[BUFFER_SPAN] * 2, **state)
    return manager, scenario.call


def slice_manager(scenario: dict, raw, unchecked: bool) -> conn.MooncakeKVManager:
    manager = manager_for(scenario, raw)
    manager.engine = wrapper_of(raw, unchecked)
    return manager


def slice_call(raw, unchecked: bool) -> tuple[conn.MooncakeKVManager, dict]:
    """TP2 -> TP4, two layers: four per-token calls (staging off: conftest)."""
    scenario = many_layer_scenario(2)
    return slice_manager(scenario, raw, unchecked), scenario["call"]


def swa_call(raw, unchecked: bool) -> tuple[conn.MooncakeKVManager, dict]:
    """SWA state TP2 -> TP4, one layer's K and V: two calls."""
    scenario = swa_state_scenario()
    return slice_manager(scenario, raw, unchecked), scenario["call"]


@dataclasses.dataclass(frozen=True)
class Hook:
    original: Callable
    hooked: Callable[[], Callable]
    call: Callable  # (raw engine, unchecked) -> (manager, call arguments)


HOOKS = {
    "generic": Hook(ORIGINALS["send"], hooked_send, generic_call),
    "slice": Hook(ORIGINAL_SLICE, lambda: conn.MooncakeKVManager.send_kvcache_slice, slice_call),
    "swa": Hook(ORIGINAL_SWA, lambda: conn.MooncakeKVManager._send_swa_state_slice, swa_call),
}


def outcome(send, hook: Hook, raw, executor, unchecked: bool = False) -> dict:
    """`send` (the hooked or original function) on a fresh manager around `raw`."""
    manager, call = hook.call(raw, unchecked)
    return {**send_outcome(send, manager, **call, executor=executor), "calls": raw.calls}


@dataclasses.dataclass(frozen=True)
class Case:
    """A fault and what must leave the hook: "a" sglang's status, "b" its original, "c" -1.

    `patch`: (object, attribute, exception) to raise there; `fault_at`: the
    engine call that fails, by raising `error` (None: by returning
    FAILURE_STATUS), through sglang's wrapper or an `unchecked` one; `knob`:
    a variable set.
    """

    outcome: str
    key: str | None = None
    patch: tuple[object, str, type[BaseException]] | None = None
    fault_at: int | None = None
    error: type[BaseException] | None = None
    unchecked: bool = False
    knob: tuple[str, str] | None = None

    def engine(self, clean: bool = False) -> FaultyEngine:
        if clean or self.fault_at is None:
            return FaultyEngine()
        if self.error is None:
            return FaultyEngine(fail_at=self.fault_at, failure_status=FAILURE_STATUS)
        return FaultyEngine(error_at=self.fault_at, error=self.error)

    def install(self, monkeypatch) -> None:
        if self.patch is not None:
            target, name, error = self.patch
            monkeypatch.setattr(target, name, fails(error, name))
        if self.knob is not None:
            set_knob(monkeypatch, *self.knob)


def stage(hook: str, target, name: str, error=RuntimeError, key=None, **kw) -> Case:
    """Stage `name` of `hook` raises `error` before any engine call: sglang's original runs."""
    return Case("b", key or unexpected(hook, error), patch=(target, name, error), **kw)


def raising_call(hook: str, number: int, **kw) -> Case:
    """Engine call `number` raises out of an unchecked wrapper: -1."""
    return Case(
        "c", unexpected(hook, TypeError), fault_at=number, error=TypeError, unchecked=True, **kw
    )


CASES = {
    "generic": {
        "entries": stage(GENERIC, send, "transfer_entries"),
        "input-check": stage(GENERIC, send, "_check_supported", ValueError),
        "bounds": stage(GENERIC, bounds, "registration", IndexError),
        "plan": stage(GENERIC, gp, "plan_transfer"),
        "plan-out-of-memory": stage(GENERIC, gp, "plan_transfer", OutOfMemory),
        "plan-rejected": stage(
            GENERIC, gp, "plan_transfer", PlanValidationError, key="planner rejected"
        ),
        "handoff": stage(GENERIC, send, "sglang_handoff"),
        "handoff-arrays-forced": Case(
            "b", "handoff unavailable", unchecked=True, knob=("GPU_PLANNER_HANDOFF", "arrays")
        ),
        "counting": stage(GENERIC, send, "record_send", ZeroDivisionError),
        "call-1-raises": raising_call(GENERIC, 0),
        "call-2-raises": raising_call(GENERIC, 1),
        "call-3-raises": raising_call(GENERIC, 2),
        "call-2-status": Case("a", fault_at=1),
        "call-1-raises-in-sglangs-wrapper": Case("a", fault_at=0, error=TypeError),
    },
    "slice": {
        "head-slice-params": stage(SLICE, send_slice, "compute_head_slice_params"),
        "layer-pairs": stage(SLICE, send_slice, "_slice_layer_pairs", KeyError),
        "page-arrays": stage(SLICE, send_slice, "_page_arrays", ValueError),
        "bounds": stage(SLICE, send_slice, "_check_kv_slice_bounds", IndexError),
        "layout": stage(SLICE, send_slice, "_kv_slice_layout"),
        "layout-out-of-memory": stage(SLICE, send_slice, "_kv_slice_layout", OutOfMemory),
        "layout-rejected": stage(
            SLICE, send_slice, "_kv_slice_layout", PlanValidationError, key="slice rejected"
        ),
        "staging-lookup": stage(SLICE, send_slots.SEND_SLOTS, "get", AttributeError),
        "build": stage(SLICE, send_slice, "_build", MemoryError),
        "build-rejected": stage(
            SLICE,
            send_slice,
            "head_slice_descriptors",
            PlanValidationError,
            key="slice rejected",
        ),
        "handoff": stage(SLICE, send_slice, "sglang_handoff"),
        **{f"call-{number + 1}-raises": raising_call(SLICE, number) for number in range(4)},
        "call-2-status": Case("a", fault_at=1),
        "call-3-raises-in-sglangs-wrapper": Case("a", fault_at=2, error=TypeError),
    },
    "swa": {
        "layout": stage(SWA, send_slice, "_swa_layout"),
        "layout-rejected": stage(
            SWA, send_slice.HeadSliceLayout, "build", PlanValidationError, key="slice rejected"
        ),
        "page-arrays": stage(SWA, send_slice, "_page_arrays", ValueError),
        "bounds": stage(SWA, send_slice, "_check_swa_slice_bounds", IndexError),
        "build": stage(SWA, send_slice, "_build", OutOfMemory),
        "handoff": stage(SWA, send_slice, "sglang_handoff"),
        "call-1-raises": raising_call(SWA, 0),
        "call-2-raises": raising_call(SWA, 1),
        "call-2-status": Case("a", fault_at=1),
    },
}


@pytest.mark.parametrize(
    ("hook_name", "case"),
    [
        pytest.param(hook_name, case, id=f"{hook_name}-{case_id}")
        for hook_name, cases in CASES.items()
        for case_id, case in cases.items()
    ],
)
def test_a_fault_gives_the_contracts_outcome(hook_name: str, case: Case, monkeypatch, executor):
    hook = HOOKS[hook_name]
    # sglang's original on an identical fresh manager: without the fault, and with it.
    sglang = outcome(hook.original, hook, case.engine(clean=True), executor, case.unchecked)
    if case.outcome == "a":
        sglang_failing = outcome(hook.original, hook, case.engine(), executor, case.unchecked)
    case.install(monkeypatch)
    before = counters.snapshot()
    raw = case.engine()
    actual = outcome(hook.hooked(), hook, raw, executor, case.unchecked)
    assert raw.in_flight == 0  # no call outlives the hook
    changes = counter_changes(before)
    if case.outcome == "b":
        assert actual == sglang
        assert changes == {"fallbacks": {case.key: 1}, "failed_sends": {}}
    elif case.outcome == "c":
        assert (actual["status"], actual["error"]) == (-1, None)
        assert actual["calls"] == sglang["calls"][: case.fault_at + 1]  # none after the fault
        assert changes == {"fallbacks": {}, "failed_sends": {case.key: 1}}
    else:
        assert actual["status"] == sglang_failing["status"] != 0
        assert actual["error"] is None
        assert actual["calls"] == sglang["calls"][: case.fault_at + 1]
        assert changes == {"fallbacks": {}, "failed_sends": {}}


def released_on_settle(monkeypatch) -> threading.Event:
    """An event set when a hooked call starts settling what it started (after its fault): a
    call that waits on it is still running when the fault hits, however slow the machine."""
    settling = threading.Event()
    settle = fallback.SendProgress.settle

    def settle_after_release(progress) -> None:
        settling.set()
        settle(progress)

    monkeypatch.setattr(fallback.SendProgress, "settle", settle_after_release)
    return settling


def test_generic_per_layer_send_whose_await_fails_ends_its_calls_then_gives_minus_one(
    monkeypatch, executor
):
    """Custom memory pool: one call per buffer from the executor; the await raises while
    the first call runs. -1 once every call the running task makes has ended."""
    state = {"custom_mem_pool": True, "custom_mem_pool_type": "NVLINK"}
    sglang_raw = FaultyEngine()
    sglang_manager, call = generic_call(sglang_raw, unchecked=False, **state)
    assert ORIGINALS["send"](sglang_manager, **call, executor=executor) == 0
    settling = released_on_settle(monkeypatch)  # call 1 runs until the hook settles its calls
    raw = FaultyEngine(on_call=lambda number: settling.wait(WAIT_S) if number == 0 else None)
    manager, call = generic_call(raw, unchecked=False, **state)

    def failing_await(futures) -> int:
        raw.wait_for_calls(1)
        raise RuntimeError("injected fault in _await_transfer_futures")

    manager._await_transfer_futures = failing_await
    before = counters.snapshot()
    status = hooked_send()(manager, **call, executor=executor)
    assert (status, raw.in_flight) == (-1, 0)
    assert len(sglang_raw.calls) == 2 and raw.calls == sglang_raw.calls  # the running task's
    assert counter_changes(before) == {
        "fallbacks": {},
        "failed_sends": {unexpected(GENERIC, RuntimeError): 1},
    }


@pytest.mark.parametrize("hook_name", HOOKS)
def test_an_interrupt_in_an_engine_call_leaves_the_hook(hook_name: str, executor):
    hook = HOOKS[hook_name]
    sglang = outcome(hook.original, hook, FaultyEngine(), executor)
    raw = FaultyEngine(error_at=1, error=KeyboardInterrupt)
    manager, call = hook.call(raw, unchecked=False)
    before = counters.snapshot()
    with pytest.raises(KeyboardInterrupt):
        hook.hooked()(manager, **call, executor=executor)
    assert raw.calls == sglang["calls"][:2]  # no call after it, and not sglang's original
    assert counter_changes(before) == {"fallbacks": {}, "failed_sends": {}}


# Gathered head-sliced sends: TP2 -> TP4, two layers (four buffers), three pages, a chunk per
# buffer, two slots per send.


class RecordingPool(concurrent.futures.ThreadPoolExecutor):
    """An executor that keeps every future it returns."""

    def __init__(self, max_workers: int) -> None:
        super().__init__(max_workers=max_workers)
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


@dataclasses.dataclass(frozen=True)
class ChunkFault:
    """A fault in a gathered send: gather `gather_at` (0: chunk 1) or engine call `call_at`
    raises `error`; `calls`: the calls of a clean gathered send made before -1 (c)."""

    outcome: str
    key: str | None = None
    gather_at: int | None = None
    call_at: int | None = None
    error: type[BaseException] = RuntimeError
    unchecked: bool = False
    queued: bool = False  # chunk 1's call is still queued (the executor busy) at the fault
    calls: int = 0


CHUNK_FAULTS = {
    "gather-1": ChunkFault("b", unexpected(SLICE, RuntimeError), gather_at=0),
    "gather-2-before-chunk-1-call-started": ChunkFault(
        "b", unexpected(SLICE, RuntimeError), gather_at=1, queued=True
    ),
    "gather-2": ChunkFault("c", unexpected(SLICE, RuntimeError), gather_at=1, calls=1),
    "gather-3": ChunkFault("c", unexpected(SLICE, RuntimeError), gather_at=2, calls=2),
    "gather-3-rejected": ChunkFault(
        "c", "slice rejected", gather_at=2, error=PlanValidationError, calls=2
    ),
    "gather-2-out-of-memory": ChunkFault(
        "c", unexpected(SLICE, OutOfMemory), gather_at=1, error=OutOfMemory, calls=1
    ),
    "call-2-raises": ChunkFault(
        "c", unexpected(SLICE, TypeError), call_at=1, error=TypeError, unchecked=True, calls=2
    ),
    "call-2-raises-in-sglangs-wrapper": ChunkFault("a", call_at=1, error=TypeError, calls=2),
}


def failing_gathers(monkeypatch, fault: ChunkFault, raw: Faulty) -> list[int]:
    """Gather `fault.gather_at` raises once the calls of the chunks before it started (unless
    `fault.queued`); the gathers begun, in order."""
    begun: list[int] = []
    gather = send_slots.gather_head_slices

    def faulty_gather(*args, **kwargs):
        number = len(begun)
        begun.append(number)
        if number == fault.gather_at:
            if not fault.queued:
                raw.wait_for_calls(number)
            raise fault.error(f"injected fault in gather {number}")
        return gather(*args, **kwargs)

    monkeypatch.setattr(send_slots, "gather_head_slices", faulty_gather)
    return begun


def staged_calls(manager, calls) -> list:
    """`calls` with each source relative to `manager`'s staging region (sends compare)."""
    base = send_slots.SEND_SLOTS.get(manager).region.data_ptr()
    return [
        (session, [src - base for src in srcs], dsts, lens) for session, srcs, dsts, lens in calls
    ]


def on_call_for(
    fault: ChunkFault, pool: RecordingPool, settling: threading.Event
) -> Callable[[int], None]:
    """What each engine call does once recorded, so that the fault hits where it says."""

    def on_call(number: int) -> None:
        if fault.call_at is not None and number == 0:
            # Chunk 1's call ends after chunk 2's failed: chunk 3 sees the failure.
            deadline = time.monotonic() + WAIT_S
            while len(pool.futures) <= fault.call_at:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            concurrent.futures.wait([pool.futures[fault.call_at]], WAIT_S)
        elif fault.gather_at is not None and number == fault.gather_at - 1:
            settling.wait(WAIT_S)  # still running when the gather fails: the hook waits for it

    return on_call


@pytest.mark.parametrize("fault", CHUNK_FAULTS.values(), ids=CHUNK_FAULTS)
def test_a_fault_in_a_gathered_send_gives_the_contracts_outcome(fault: ChunkFault, monkeypatch):
    set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(3, DST_ITEM_LEN)))
    scenario, decode = tp2_to_tp4(num_layers=2, num_pages=3)
    hooked = conn.MooncakeKVManager.send_kvcache_slice
    with RecordingPool(1) as pool:
        sglang_raw = ArraysMemoryEngine(registered(scenario), copy_of(decode))
        sglang = send_outcome(
            ORIGINAL_SLICE, manager_for(scenario, sglang_raw), **scenario["call"], executor=pool
        )
        clean_raw = FaultyMemoryEngine(registered(scenario), copy_of(decode))
        clean_manager = manager_for(scenario, clean_raw)
        assert send_outcome(hooked, clean_manager, **scenario["call"], executor=pool)["status"] == 0
    clean_calls = staged_calls(clean_manager, clean_raw.calls)
    assert sglang["status"] == 0 and len(clean_calls) == len(sglang_raw.calls) == 4

    pool = RecordingPool(1 if fault.call_at is None else 2)
    raw = FaultyMemoryEngine(
        registered(scenario),
        copy_of(decode),
        error_at=fault.call_at,
        error=fault.error,
        on_call=on_call_for(fault, pool, released_on_settle(monkeypatch)),
    )
    manager = slice_manager(scenario, raw, fault.unchecked)
    begun = failing_gathers(monkeypatch, fault, raw)
    settled_while_busy: list[bool] = []
    if fault.queued:  # the executor's one thread is busy (another send's call) until it settled
        busy = threading.Event()
        other_send = pool.submit(busy.wait, WAIT_S)
        settle = fallback.SendProgress.settle

        def settle_then_free_the_executor(progress) -> None:
            settle(progress)  # cancels chunk 1's queued call: nothing to wait for
            settled_while_busy.append(not other_send.done())
            busy.set()

        monkeypatch.setattr(fallback.SendProgress, "settle", settle_then_free_the_executor)
    before = counters.snapshot()
    with pool:
        actual = send_outcome(hooked, manager, **scenario["call"], executor=pool)
        in_flight = raw.in_flight
    changes = counter_changes(before)
    assert in_flight == 0  # every call the hook started ended before it returned
    slots = send_slots.SEND_SLOTS.get(manager)
    held = 0 if fault.call_at is None else 1  # a failed call's slot: the engine may still read it
    assert (slots.free_slots, slots.held_slots) == (send_slots.SLOTS - held, held)
    if fault.outcome == "b":
        assert actual == sglang
        assert raw.calls == sglang_raw.calls  # sglang's per-token calls, no chunk's
        for ptr, expected in sglang_raw.decode.items():
            np.testing.assert_array_equal(raw.decode[ptr], expected)
        assert changes == {"fallbacks": {fault.key: 1}, "failed_sends": {}}
        if fault.queued:  # chunk 1's call, never made, cancelled without waiting for the
            assert pool.futures[1].cancelled()  # executor to reach it (nor for other sends)
            assert settled_while_busy == [True]
        return
    assert (actual["status"], actual["error"]) == (-1, None)
    assert staged_calls(manager, raw.calls) == clean_calls[: fault.calls]  # not sglang's original
    last_gather = fault.gather_at if fault.gather_at is not None else fault.call_at
    assert begun == list(range(last_gather + 1))  # no chunk gathered after the fault
    failed = {} if fault.outcome == "a" else {fault.key: 1}
    assert changes == {"fallbacks": {}, "failed_sends": failed}


# kv_to_page_indices: CPU tensors take the CUDA path through the host stand-in.


@pytest.mark.parametrize(
    ("target", "name", "error", "key"),
    [
        (gp, "kv_to_page_indices", RuntimeError, unexpected(PAGES, RuntimeError)),
        (gp, "kv_to_page_indices", OutOfMemory, unexpected(PAGES, OutOfMemory)),
        (gp, "kv_to_page_indices", PlanValidationError, "pages"),
        (pages_hook, "copy_to_host", RuntimeError, unexpected(PAGES, RuntimeError)),
    ],
    ids=["convert", "convert-out-of-memory", "convert-rejected", "copy"],
)
def test_a_failing_page_conversion_gives_sglangs_pages(
    host_cuda, monkeypatch, target, name, error, key
):
    kv = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:777]
    expected = ORIGINALS["pages"](kv, 16)
    monkeypatch.setattr(target, name, fails(error, name))
    before = counters.snapshot()
    pages = common.kv_to_page_indices(kv, 16)
    assert pages.dtype == expected.dtype
    np.testing.assert_array_equal(pages, expected)
    assert counter_changes(before) == {"fallbacks": {key: 1}, "failed_sends": {}}


# Logging: once per reason, every occurrence counted.


def plugin_log(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == fallback.logger.name]


@pytest.mark.parametrize("kind", ["fallback", "failed send"])
def test_each_reason_is_logged_once_and_counted_every_time(
    kind: str, monkeypatch, caplog, executor
):
    if kind == "fallback":
        monkeypatch.setattr(send, "transfer_entries", fails(RuntimeError, "transfer_entries"))
        raw_kwargs, unchecked, counted = {}, False, "fallbacks"
        levels = [logging.WARNING, logging.INFO]
    else:
        raw_kwargs, unchecked, counted = {"error_at": 1}, True, "failed_sends"
        levels = [logging.ERROR]
    key = unexpected(GENERIC, RuntimeError if kind == "fallback" else TypeError)
    before = counters.snapshot()
    with caplog.at_level(logging.INFO, logger=fallback.logger.name):
        first = outcome(
            hooked_send(), HOOKS["generic"], FaultyEngine(**raw_kwargs), executor, unchecked
        )
        logged = plugin_log(caplog)
        second = outcome(
            hooked_send(), HOOKS["generic"], FaultyEngine(**raw_kwargs), executor, unchecked
        )
    assert first == second
    assert [level for level, _ in logged] == levels
    assert all(key.replace(": ", " raised ") in message for _, message in logged)
    assert plugin_log(caplog) == logged  # the second: counted, not logged
    assert counter_changes(before)[counted] == {key: 2}


@pytest.mark.parametrize("kind", ["fallback", "failed send"])
def test_an_unexpected_exception_is_logged_with_its_traceback(
    kind: str, monkeypatch, caplog, executor
):
    """A bug in a hook is logged (once) with the exception that left it, traceback and all."""
    injected: list[BaseException] = []

    def entries_fault(*args, **kwargs):
        injected.append(error := RuntimeError("injected fault in transfer_entries"))
        raise error

    if kind == "fallback":
        monkeypatch.setattr(send, "transfer_entries", entries_fault)
        raw, level = FaultyEngine(), logging.WARNING
    else:
        raw, level = FaultyEngine(error_at=0), logging.ERROR
    with caplog.at_level(logging.INFO, logger=fallback.logger.name):
        outcome(hooked_send(), HOOKS["generic"], raw, executor, unchecked=kind != "fallback")
    [record] = [r for r in caplog.records if r.name == fallback.logger.name and r.levelno == level]
    assert record.exc_info is not None and record.exc_info[1] is not None
    assert isinstance(record.exc_info[1], RuntimeError if kind == "fallback" else TypeError)
    if injected:
        assert record.exc_info[1] is injected[0]


class RaisingRecordingEngine:
    """A list-API engine wrapper whose every call raises (after bytes could have moved)."""

    def batch_transfer_sync(self, *args) -> int:
        raise RuntimeError("the engine broke mid-call")


def test_broken_counting_never_leaves_the_hook(monkeypatch):
    """Counting and logging that raise (a broken metrics folder): the contract still holds."""

    def broken(*args, **kwargs) -> None:
        raise OSError("metrics folder gone")

    monkeypatch.setattr(fallback, "record_failure", broken)
    monkeypatch.setattr(fallback, "record_fallback", broken)
    pages = np.array([0, 1, 5], dtype=np.int32), np.array([3, 4, 9], dtype=np.int32)
    call = (SESSION, [1 << 40], [1 << 44], [64], *pages, None)

    def manager_of(engine) -> conn.MooncakeKVManager:
        return make_manager(engine, mla=True, kv_data_ptrs=[1 << 40], kv_data_lens=[1 << 30])

    assert hooked_send()(manager_of(RaisingRecordingEngine()), *call) == -1  # (c)
    set_knob(monkeypatch, "GPU_PLANNER_HANDOFF", "arrays")  # a lists engine: (b)
    hooked, original = RecordingEngine(), RecordingEngine()
    assert hooked_send()(manager_of(hooked), *call) == ORIGINALS["send"](
        manager_of(original), *call
    )
    assert hooked.calls == original.calls and original.calls
