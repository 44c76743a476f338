"""The submit loop's bounds with a fake engine whose calls block until a test releases them.

A final `close()` (no engine call starts after it returned, however a batch is
split), exceptions that are not errors (re-raised at once, no phantom call),
validated timeouts, the cap on abandoned calls (concurrent submits included),
the knobs read when a transfer is built (never at import), and exact byte
totals. The same properties against real engines are in test_transfer.py.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import gpu_planner as gp
from gpu_planner import settings
from gpu_planner.integration.mooncake import (
    MooncakeReader,
    MooncakeSender,
    MooncakeTransfer,
    TransferError,
    TransferTimeoutError,
    handoff,
)
from gpu_planner.plan import exact_total

WAIT_S = 60.0  # bound on every wait for a thread or a call; a passing test waits far less


class BlockingEngine:
    """Records each call as it starts; a call blocks while `blocking` is set, until `release`.

    `raise_at` maps a call number to an exception the call raises instead.
    """

    def __init__(self, raise_at: dict[int, BaseException] | None = None) -> None:
        self.raise_at = raise_at or {}
        self.calls: list[list[int]] = []
        self.blocking = threading.Event()
        self.released = threading.Event()
        self.entered = threading.Semaphore(0)  # one release per call that started
        self._lock = threading.Lock()

    def batch_transfer_sync_write(self, peer, srcs, dsts, lens) -> int:
        with self._lock:
            number = len(self.calls)
            self.calls.append([int(length) for length in lens])
        self.entered.release()
        if number in self.raise_at:
            raise self.raise_at[number]
        if self.blocking.is_set():
            assert self.released.wait(WAIT_S), "a test never released its blocked call"
        return 0

    batch_transfer_sync_read = batch_transfer_sync_write
    batch_transfer_sync_write_arrays = batch_transfer_sync_write
    batch_transfer_sync_read_arrays = batch_transfer_sync_write

    def wait_entered(self, count: int) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=WAIT_S), "an engine call did not start"


def one_batch_plan(num_pages: int = 24) -> gp.TransferPlan:
    """One batch of `num_pages` one-page descriptors over two buffers (fragmented pages)."""
    src = np.arange(0, 2 * num_pages, 2)
    layout = gp.BufferLayout([0, 1 << 30], [0, 1 << 30], [64, 32])
    return gp.plan_transfer(src, src, layout)


def submit_in_a_thread(
    transfer: MooncakeTransfer, plan: gp.TransferPlan
) -> tuple[concurrent.futures.ThreadPoolExecutor, concurrent.futures.Future[int]]:
    thread = concurrent.futures.ThreadPoolExecutor(1)
    return thread, thread.submit(transfer.submit, plan)


@pytest.mark.parametrize("transfer_type", [MooncakeSender, MooncakeReader])
@pytest.mark.parametrize("buffer_workers", [0, 2])
@pytest.mark.parametrize("batch_timeout_s", [None, 30.0])
def test_no_engine_call_starts_after_close_returned(transfer_type, buffer_workers, batch_timeout_s):
    # One batch of 48 descriptors cut into calls of 4 (2 per buffer worker): close() while
    # the first calls are blocked must keep every later call of the batch from starting.
    plan = one_batch_plan()
    assert plan.num_batches == 1 and plan.num_descriptors == 48
    engine = BlockingEngine()
    engine.blocking.set()
    transfer = transfer_type(
        engine,
        "peer",
        buffer_workers=buffer_workers,
        batch_timeout_s=batch_timeout_s,
        max_call_descriptors=4,
    )
    running_at_close = max(buffer_workers, 1)
    thread, submit = submit_in_a_thread(transfer, plan)
    with thread:
        engine.wait_entered(running_at_close)
        still_running = transfer.close(timeout=0.05)
        assert len(still_running) == running_at_close
        assert all(call.running() for call in still_running)
        started_before_close_returned = len(engine.calls)
        engine.released.set()
        with pytest.raises(TransferError, match="closed") as caught:
            submit.result(WAIT_S)
    assert len(engine.calls) == started_before_close_returned == running_at_close
    assert all(call.done() and call.result() == 0 for call in still_running)
    assert caught.value.batch_index == 0 and caught.value.in_flight == ()
    assert caught.value.confirmed_bytes == sum(map(sum, engine.calls))
    assert transfer.close(timeout=None) == []  # nothing reported that is not running


def test_close_reports_nothing_when_nothing_runs():
    engine = BlockingEngine()
    transfer = MooncakeSender(engine, "peer", max_call_descriptors=4)
    assert transfer.submit(one_batch_plan()) == one_batch_plan().total_bytes
    assert transfer.close(timeout=0.0) == []
    with pytest.raises(TransferError, match="closed"):
        transfer.submit(one_batch_plan())
    assert len(engine.calls) == 12  # the first submit's calls only


@pytest.mark.parametrize("buffer_workers", [0, 2])
def test_a_failed_call_stops_the_rest_of_its_split_batch(buffer_workers):
    engine = BlockingEngine(raise_at={1: RuntimeError("refused")})
    transfer = MooncakeSender(engine, "peer", buffer_workers=buffer_workers, max_call_descriptors=4)
    with pytest.raises(TransferError, match="RuntimeError: refused") as caught:
        transfer.submit(one_batch_plan())
    assert not isinstance(caught.value, TransferTimeoutError)
    assert len(engine.calls) == 2  # the failed call and the one started before it


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize(
    ("buffer_workers", "batch_timeout_s"),
    [(0, None), (0, 30.0), (2, 30.0)],
    ids=["submitting-thread", "call-thread", "buffer-workers"],
)
def test_an_interrupt_in_an_engine_call_is_re_raised_at_once_without_a_phantom_call(
    interrupt, buffer_workers, batch_timeout_s
):
    engine = BlockingEngine(raise_at={1: interrupt()})
    transfer = MooncakeSender(
        engine,
        "peer",
        buffer_workers=buffer_workers,
        batch_timeout_s=batch_timeout_s,
        max_call_descriptors=8,
    )
    thread, submit = submit_in_a_thread(transfer, one_batch_plan())
    with thread:
        with pytest.raises(interrupt):
            submit.result(WAIT_S)  # at once: not after the batch's 30 s bound
        assert transfer.close(timeout=WAIT_S) == []  # no call claims to run
    assert len(engine.calls) <= 1 + max(buffer_workers, 1)


@pytest.mark.parametrize("bad", [math.inf, 1e10, math.nan, -1.0, 0.0, True, "60"], ids=repr)
def test_unbounded_or_invalid_batch_timeouts_are_refused_at_construction(bad):
    with pytest.raises(ValueError, match=r"batch_timeout_s: must be a finite number of seconds"):
        MooncakeSender(BlockingEngine(), "peer", batch_timeout_s=bad)


def test_the_largest_batch_timeout_and_close_timeout_are_usable():
    engine = BlockingEngine()
    with MooncakeSender(engine, "peer", batch_timeout_s=threading.TIMEOUT_MAX) as transfer:
        assert transfer.submit(one_batch_plan()) == one_batch_plan().total_bytes
        assert transfer.close(timeout=threading.TIMEOUT_MAX) == []


@pytest.mark.parametrize("bad", [math.inf, 1e10, math.nan, -1.0, True], ids=repr)
def test_invalid_close_timeouts_are_refused_before_closing(bad):
    transfer = MooncakeSender(BlockingEngine(), "peer")
    with pytest.raises(ValueError, match="timeout: must be a finite number of seconds"):
        transfer.close(timeout=bad)
    assert transfer.submit(one_batch_plan()) > 0  # still open


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_the_abandoned_call_cap_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_abandoned_calls: must be an integer >= 1"):
        MooncakeSender(BlockingEngine(), "peer", max_abandoned_calls=bad)


@pytest.mark.parametrize("buffer_workers", [0, 2])
def test_abandoned_calls_are_capped_until_the_peer_recovers(buffer_workers):
    # Every call blocks (a stalled peer): each submit times out and abandons its running calls.
    engine = BlockingEngine()
    engine.blocking.set()
    cap = 2 * max(buffer_workers, 1)
    transfer = MooncakeSender(
        engine,
        "peer",
        buffer_workers=buffer_workers,
        batch_timeout_s=0.05,
        max_call_descriptors=8,
        max_abandoned_calls=cap,
    )
    plan = one_batch_plan()
    abandoned = []
    for _ in range(2):
        with pytest.raises(TransferTimeoutError) as caught:
            transfer.submit(plan)
        abandoned += caught.value.in_flight
        engine.wait_entered(max(buffer_workers, 1))
    assert len(abandoned) == cap and len(engine.calls) == cap
    with pytest.raises(TransferError, match=rf"{cap} abandoned calls .* max_abandoned_calls={cap}"):
        transfer.submit(plan)
    assert len(engine.calls) == cap  # refused before any call
    # The peer recovers: the abandoned calls end, and submits are accepted again.
    engine.blocking.clear()
    engine.released.set()
    concurrent.futures.wait(abandoned, timeout=WAIT_S)
    assert all(call.result() == 0 for call in abandoned)
    assert transfer.submit(plan) == plan.total_bytes
    assert transfer.close() == []


def huge_overlapping_plan(backend: str = "cpu") -> gp.TransferPlan:
    """Four descriptors of 2**62 bytes each over one range: 2**64 bytes, which int64 wraps to 0."""
    layout = gp.BufferLayout([0] * 4, [0] * 4, [2**62] * 4)
    page = np.zeros(1, dtype=np.int64)
    return gp.plan_transfer(page, page, layout, backend=backend)


def test_plan_total_bytes_is_exact_past_int64(backend_device):
    backend, _ = backend_device
    plan = huge_overlapping_plan(backend)
    assert plan.num_descriptors == 4
    assert plan.total_bytes == 2**64


@pytest.mark.parametrize("path", [handoff.ARRAYS, handoff.LISTS])
@pytest.mark.parametrize("buffer_workers", [0, 2])
def test_submitted_and_confirmed_bytes_are_exact_past_int64(path, buffer_workers):
    plan = huge_overlapping_plan()
    engine = BlockingEngine(raise_at={1: RuntimeError("the second call fails")})
    with MooncakeSender(
        BlockingEngine(), "peer", buffer_workers=buffer_workers, handoff_form=path
    ) as transfer:
        assert transfer.submit(plan) == 2**64
    with (
        MooncakeSender(engine, "peer", max_call_descriptors=3, handoff_form=path) as transfer,
        pytest.raises(TransferError, match=r"1 descriptors, 4611686018427387904 bytes") as caught,
    ):
        transfer.submit(plan)
    assert caught.value.confirmed_bytes == 3 * 2**62


def test_exact_total_matches_python_sum_on_large_and_small_values():
    rng = np.random.default_rng(3)
    for high in (2**20, 2**62):
        lengths = rng.integers(1, high, 1000, dtype=np.int64)
        assert exact_total(lengths) == sum(lengths.tolist())
    assert exact_total(np.empty(0, dtype=np.int64)) == 0


@pytest.mark.parametrize("buffer_workers", [0, 2])
def test_concurrent_submits_to_a_stalled_peer_abandon_at_most_the_cap(buffer_workers):
    # Eight threads submit at once and every call blocks: the cap check and the slot taken
    # are one step, so only the calls of the first slots' batches start (and are abandoned);
    # every other submit is refused before its first call.
    engine = BlockingEngine()
    engine.blocking.set()
    cap, submitters = 2, 8
    transfer = MooncakeSender(
        engine,
        "peer",
        buffer_workers=buffer_workers,
        batch_timeout_s=0.2,
        max_call_descriptors=8,
        max_abandoned_calls=cap,
    )
    plan = one_batch_plan()
    start = threading.Barrier(submitters)

    def submit() -> int:
        start.wait(WAIT_S)
        return transfer.submit(plan)

    with concurrent.futures.ThreadPoolExecutor(submitters) as threads:
        submits = [threads.submit(submit) for _ in range(submitters)]
        errors = [call.exception(WAIT_S) for call in submits]
    timed_out = [error for error in errors if isinstance(error, TransferTimeoutError)]
    abandoned = [call for error in timed_out for call in error.in_flight]
    assert len(engine.calls) <= cap and len(abandoned) == len(engine.calls) > 0
    assert not any(call.done() for call in abandoned)  # still running, abandoned
    refused = [error for error in errors if error not in timed_out]
    assert len(refused) == submitters - len(timed_out)
    for error in refused:
        assert isinstance(error, TransferError) and error.in_flight == ()
        assert re.search(rf"refused: .*max_abandoned_calls={cap}", str(error)), error
    engine.blocking.clear()
    engine.released.set()
    concurrent.futures.wait(abandoned, timeout=WAIT_S)
    assert transfer.submit(plan) == plan.total_bytes  # the slots came back
    assert transfer.close() == []


def test_a_batch_waits_for_a_slot_that_a_running_call_frees_in_time():
    # Cap 1, a healthy peer: the second submit waits while the first's call runs, then runs.
    engine = BlockingEngine()
    engine.blocking.set()
    transfer = MooncakeSender(engine, "peer", batch_timeout_s=WAIT_S, max_abandoned_calls=1)
    plan = one_batch_plan()
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        first = threads.submit(transfer.submit, plan)
        engine.wait_entered(1)
        second = threads.submit(transfer.submit, plan)
        assert not engine.entered.acquire(timeout=0.05)  # no slot: its call has not started
        engine.released.set()
        assert first.result(WAIT_S) == second.result(WAIT_S) == plan.total_bytes
    assert len(engine.calls) == 2 and transfer.close() == []


def test_importing_the_transfer_module_reads_no_knob():
    # A malformed knob must not stop the module (and so the sglang plugin) from loading.
    environment = {
        **os.environ,
        settings.BATCH_TIMEOUT_S.name: "nan",
        settings.MAX_ABANDONED_CALLS.name: "0",
    }
    imported = subprocess.run(
        [sys.executable, "-c", "import gpu_planner.integration.mooncake.transfer"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr


@pytest.mark.parametrize("transfer_type", [MooncakeSender, MooncakeReader])
def test_the_default_knobs_are_read_when_a_transfer_is_built(monkeypatch, transfer_type):
    monkeypatch.delenv(settings.BATCH_TIMEOUT_S.name, raising=False)
    monkeypatch.delenv(settings.MAX_ABANDONED_CALLS.name, raising=False)
    transfer = transfer_type(BlockingEngine(), "peer")
    assert transfer.batch_timeout_s == settings.BATCH_TIMEOUT_S.default
    assert transfer.max_abandoned_calls == settings.MAX_ABANDONED_CALLS.default
    monkeypatch.setenv(settings.BATCH_TIMEOUT_S.name, "7.5")
    monkeypatch.setenv(settings.MAX_ABANDONED_CALLS.name, "3")
    transfer = transfer_type(BlockingEngine(), "peer")
    assert (transfer.batch_timeout_s, transfer.max_abandoned_calls) == (7.5, 3)
    given = transfer_type(BlockingEngine(), "peer", batch_timeout_s=None, max_abandoned_calls=1)
    assert (given.batch_timeout_s, given.max_abandoned_calls) == (None, 1)  # arguments win


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        (settings.BATCH_TIMEOUT_S, "0"),
        (settings.BATCH_TIMEOUT_S, "nan"),
        (settings.BATCH_TIMEOUT_S, "60s"),
        (settings.MAX_ABANDONED_CALLS, "0"),
        (settings.MAX_ABANDONED_CALLS, "many"),
    ],
    ids=lambda value: getattr(value, "name", repr(value)),
)
def test_a_malformed_default_knob_is_refused_when_a_transfer_is_built(monkeypatch, setting, value):
    settings.load()  # the plugin's knobs, parsed before: only the constructor's read can raise
    monkeypatch.setenv(setting.name, value)
    with pytest.raises(settings.SettingError, match=setting.name):
        MooncakeSender(BlockingEngine(), "peer")
