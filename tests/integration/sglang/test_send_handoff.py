"""The hooked send hands Mooncake arrays or lists through sglang's own wrapper, exactly as sglang.

sglang's real `MooncakeTransferEngine` wraps a raw Mooncake engine. Two raw
engine kinds stand in for Mooncake's binding and record what reaches it: a
list engine (`batch_transfer_sync_write` only, Mooncake <= 0.3.13) and an
arrays engine (also `batch_transfer_sync_write_arrays`, 0.3.14+). sglang's
original always sends lists; the hook sends int64 arrays to an arrays engine
and lists otherwise. The descriptors, their order, the statuses (an exception
in the engine is -1 on both) and `conclude_failure` calls must be identical.
Then two real 0.3.14 engines move bytes through the hooked send on both paths.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_plugin_support import ORIGINALS, hooked_send, make_manager, send_outcome
from sglang_send_scenarios import LAYOUT_KINDS, SendScenario, send_scenarios
from suite_support import set_knob

from gpu_planner import settings as gp_settings
from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.sglang.adapter import sglang_async_writes, sglang_handoff

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=4)


class ListEngine:
    """A raw Mooncake engine with the list API only: records each call's descriptors.

    Fails the call numbered `fail_at`, or calls whose first source lies in
    `fail_src_range`: with `failure_status`, or by raising (as Mooncake's
    binding does on arguments it cannot convert) when `raises`.
    """

    def __init__(
        self,
        fail_at: int | None = None,
        failure_status: int = -1,
        fail_src_range: range | None = None,
        raises: bool = False,
    ) -> None:
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []
        self.argument_types: set[type] = set()
        self.fail_at, self.failure_status, self.fail_src_range = (
            fail_at,
            failure_status,
            fail_src_range,
        )
        self.raises = raises
        self._lock = threading.Lock()

    def _record(self, session: str, srcs, dsts, lens) -> int:
        columns = [list(srcs), list(dsts), list(lens)]
        with self._lock:
            number = len(self.calls)
            self.calls.append((session, *(list(map(int, column)) for column in columns)))
            self.argument_types.update(type(column) for column in (srcs, dsts, lens))
        failing = number == self.fail_at or (
            self.fail_src_range is not None and int(srcs[0]) in self.fail_src_range
        )
        if failing and self.raises:
            raise TypeError("batch_transfer_sync_write(): incompatible function arguments")
        return self.failure_status if failing else 0

    def batch_transfer_sync_write(self, session: str, srcs, dsts, lens) -> int:
        assert all(type(v) is int for column in (srcs, dsts, lens) for v in column)
        return self._record(session, srcs, dsts, lens)


class ArraysEngine(ListEngine):
    """A raw Mooncake 0.3.14 engine: also takes contiguous int64 arrays."""

    def batch_transfer_sync_write_arrays(self, session: str, srcs, dsts, lens) -> int:
        for column in (srcs, dsts, lens):
            assert isinstance(column, np.ndarray)
            assert column.dtype == np.int64 and column.flags.c_contiguous
        return self._record(session, srcs, dsts, lens)


def sglang_wrapper(raw) -> MooncakeTransferEngine:
    """sglang's real wrapper class around `raw` (its constructor would start an engine)."""
    wrapper = object.__new__(MooncakeTransferEngine)
    wrapper.engine = raw
    return wrapper


def run_send(send, scenario: SendScenario, raw_type: type, raises: bool) -> dict:
    raw = raw_type(**scenario.engine, raises=raises)
    manager = make_manager(sglang_wrapper(raw), **scenario.manager)
    outcome = send_outcome(send, manager, **scenario.call, executor=EXECUTOR)
    return {**outcome, "calls": raw.calls, "types": raw.argument_types}


@pytest.mark.parametrize("raw_type", [ListEngine, ArraysEngine], ids=["list", "arrays"])
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_hooked_send_hands_off_as_sglang(kind: str, raw_type: type):
    check_hand_off(kind, raw_type)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), raises=st.booleans())
def check_hand_off(kind: str, raw_type: type, data, raises: bool):
    scenario = data.draw(send_scenarios(kind))
    expected = run_send(ORIGINALS["send"], scenario, raw_type, raises)
    actual = run_send(hooked_send(), scenario, raw_type, raises)
    assert actual["error"] == expected["error"]
    assert actual["status"] == expected["status"]
    assert actual["failures"] == expected["failures"]
    if actual["calls"]:
        assert actual["types"] == ({np.ndarray} if raw_type is ArraysEngine else {list})
    if not scenario.threaded:
        assert actual["calls"] == expected["calls"]
    elif expected["status"] == 0:
        assert Counter(map(repr, actual["calls"])) == Counter(map(repr, expected["calls"]))


def test_sglang_handoff_forms():
    assert sglang_handoff(sglang_wrapper(ArraysEngine())).form == handoff.ARRAYS
    assert sglang_handoff(sglang_wrapper(ListEngine())).form == handoff.LISTS

    class OwnWrapper(MooncakeTransferEngine):  # overrides the send: its own code must run
        def batch_transfer_sync(self, *args) -> int:
            return 7

    own = object.__new__(OwnWrapper)
    own.engine = ArraysEngine()
    own_handoff = sglang_handoff(own)
    assert own_handoff.form == handoff.LISTS
    assert own_handoff.call("peer", [1], [2], [3]) == 7


def test_forced_lists_reach_an_arrays_engine_as_lists(monkeypatch):
    monkeypatch.setenv(gp_settings.HANDOFF.name, "lists")
    forced = sglang_handoff(sglang_wrapper(raw := ArraysEngine()))
    assert forced.form == handoff.LISTS
    assert forced.call("peer", [1], [2], [3]) == 0
    assert raw.argument_types == {list}


class AsyncArraysEngine(ArraysEngine):
    """A raw 0.3.14 engine's asynchronous writes: batch ids from 1; `status` per batch."""

    def __init__(self, submit_error: Exception | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.submit_error = submit_error
        self.status: dict[int, int | Exception] = {}

    def batch_transfer_async_write_arrays(self, session: str, srcs, dsts, lens) -> int:
        if self.submit_error is not None:
            raise self.submit_error
        self._record(session, srcs, dsts, lens)
        return len(self.calls)

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        (batch,) = batch_ids
        status = self.status.get(batch, 0)
        if isinstance(status, Exception):
            raise status
        return status


def test_async_writes_only_where_a_hook_calls_the_engine_and_it_writes_asynchronously(
    monkeypatch,
):
    assert sglang_async_writes(sglang_wrapper(AsyncArraysEngine())) is not None
    assert sglang_async_writes(sglang_wrapper(ArraysEngine())) is None  # no asynchronous writes
    assert sglang_async_writes(sglang_wrapper(ListEngine())) is None

    class OwnWrapper(MooncakeTransferEngine):  # its own send: the hook makes its calls
        def batch_transfer_sync(self, *args) -> int:
            return 0

    own = object.__new__(OwnWrapper)
    own.engine = AsyncArraysEngine()
    assert sglang_async_writes(own) is None
    set_knob(monkeypatch, gp_settings.HANDOFF.name, "lists")
    assert sglang_async_writes(sglang_wrapper(AsyncArraysEngine())) is None


def test_async_writes_give_sglangs_statuses():
    """One descriptor of int64 arrays per write; whatever the engine raises or reports as a
    failure is -1, as sglang's wrapper gives it; a write that did not start ends -1."""
    raw = AsyncArraysEngine()
    writes = sglang_async_writes(sglang_wrapper(raw))
    batch = writes.submit("peer", 4096, 8192, 512)
    assert raw.calls == [("peer", [4096], [8192], [512])] and raw.argument_types == {np.ndarray}
    assert writes.wait(batch) == 0
    raw.status = {batch: 1, batch + 1: RuntimeError("engine gone")}
    assert writes.wait(batch) == -1
    assert writes.wait(writes.submit("peer", 1, 2, 3)) == -1
    assert writes.wait(0) == -1
    raw.submit_error = TypeError("incompatible function arguments")
    assert writes.submit("peer", 1, 2, 3) == 0


# Two real Mooncake engines over TCP, through sglang's wrapper and the hooked send.

POOL_PAGES = 512
ITEM_LENS = [64] * 4 + [128] * 4


class SpyEngine:
    """A real Mooncake engine: passes every call through and records which method took it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.methods: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def batch_transfer_sync_write(self, *args) -> int:
        self.methods.append("lists")
        return self.engine.batch_transfer_sync_write(*args)

    def batch_transfer_sync_write_arrays(self, *args) -> int:
        self.methods.append("arrays")
        return self.engine.batch_transfer_sync_write_arrays(*args)


@pytest.fixture(scope="module")
def engines():
    """(prefill, decode): sglang's wrapper around real Mooncake engines, TCP on 127.0.0.1."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MOONCAKE_PROTOCOL", "tcp")
        env.setenv("MC_FORCE_TCP", "1")
        prefill, decode = MooncakeTransferEngine("127.0.0.1"), MooncakeTransferEngine("127.0.0.1")
    assert hasattr(prefill.engine, "batch_transfer_sync_write_arrays"), "test env needs 0.3.14"
    yield prefill, decode


def registered_pool(engine, seed: int | None) -> np.ndarray:
    """All buffers' pages in one registered array: random bytes, or zeros when `seed` is None."""
    nbytes = POOL_PAGES * sum(ITEM_LENS)
    pool = np.zeros(nbytes, np.uint8)
    if seed is not None:
        pool[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    engine.register(pool.ctypes.data, nbytes)
    return pool


def buffer_ptrs(pool: np.ndarray) -> list[int]:
    offsets = np.cumsum([0] + [POOL_PAGES * n for n in ITEM_LENS[:-1]])
    return [pool.ctypes.data + int(offset) for offset in offsets]


@pytest.mark.parametrize("path", [handoff.ARRAYS, handoff.LISTS])
@pytest.mark.parametrize("custom_mem_pool", [False, True], ids=["batched", "per-layer"])
def test_hooked_send_moves_the_bytes_through_real_engines(
    engines, monkeypatch, path, custom_mem_pool
):
    prefill, decode = engines
    if path == handoff.LISTS:
        monkeypatch.setenv(gp_settings.HANDOFF.name, "lists")
    src, dst = registered_pool(prefill, seed=5), registered_pool(decode, seed=None)
    try:
        rng = np.random.default_rng(6)
        src_pages = rng.permutation(POOL_PAGES)[:300]
        dst_pages = np.sort(rng.permutation(POOL_PAGES)[:300])  # long runs on the decode side
        monkeypatch.setattr(prefill, "engine", spy := SpyEngine(prefill.engine))
        manager = make_manager(
            prefill,
            custom_mem_pool=custom_mem_pool,
            max_transfer_batch_indices=128,
            kv_data_ptrs=buffer_ptrs(src),
            kv_data_lens=[POOL_PAGES * n for n in ITEM_LENS],
        )
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as executor:
            status = hooked_send()(
                manager,
                decode.get_session_id(),
                buffer_ptrs(src),
                buffer_ptrs(dst),
                ITEM_LENS,
                src_pages,
                dst_pages,
                executor,
            )
        assert status == 0
        assert set(spy.methods) == {path}
        expected = np.zeros_like(dst)
        src_ptrs, dst_ptrs = buffer_ptrs(src), buffer_ptrs(dst)
        for buffer, item_len in enumerate(ITEM_LENS):
            src_at = src_ptrs[buffer] - src.ctypes.data + src_pages[:, None] * item_len
            dst_at = dst_ptrs[buffer] - dst.ctypes.data + dst_pages[:, None] * item_len
            expected[dst_at + np.arange(item_len)] = src[src_at + np.arange(item_len)]
        np.testing.assert_array_equal(dst, expected)
    finally:
        prefill.deregister(src.ctypes.data)
        decode.deregister(dst.ctypes.data)
