"""The submit loop against a real peer process, push (MooncakeSender) and pull (MooncakeReader).

Order and bytes, bounds, faults (dead and stalled peers, engine exceptions),
abandoned calls, sharing across threads, and queue-sized calls. Every test
that moves bytes checks every byte of the destination buffers against what
the page lists say, computed without the plan. The engine-free tests at the
end cover the loop's bookkeeping alone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from mooncake_peer import (
    LOCALHOST,
    HookedEngine,
    Sides,
    changed_pages,
    expected_after,
    local_engine,
    page_request,
    two_sides,
)
from suite_support import list_batches

import gpu_planner as gp
from gpu_planner.integration.mooncake import (
    MooncakeReader,
    MooncakeSender,
    MooncakeTransfer,
    TransferError,
    TransferTimeoutError,
    handoff,
)
from gpu_planner.plan import PlanPiece

DIRECTIONS = ["push", "pull"]
ITEM_LEN = 4096
POOL_PAGES = 64
NUM_PAGES = 40
BATCH_PAGES = 4
IS_DEVICE = [False, True, False]  # destination buffer 1 uses the device-space pages
NBYTES = [POOL_PAGES * ITEM_LEN] * len(IS_DEVICE)
WAIT_S = 60.0  # bound on waiting for an abandoned call once the peer resumes
# A batch's bound where the peer stalls, waited out: far above a healthy batch on a busy machine.
STALLED_BATCH_TIMEOUT_S = 5.0


def _sides(direction: str, **environment: str):
    return two_sides(direction, NBYTES, NBYTES, environment or None)


def _plan(sides: Sides, pages, max_batch_pages: int = BATCH_PAGES) -> gp.TransferPlan:
    src, dst, dst_device = pages
    return gp.plan_transfer(
        src, dst, sides.layout(ITEM_LEN, IS_DEVICE), dst_device, max_batch_pages=max_batch_pages
    )


def _expected(sides: Sides, pages, num_pages: int = NUM_PAGES) -> list[np.ndarray]:
    """The destination once the first `num_pages` pages of the request have moved."""
    src, dst, dst_device = (p[:num_pages] for p in pages)
    dst_pages = [dst_device if device_space else dst for device_space in IS_DEVICE]
    return expected_after(sides.destination_initial(), sides.sources(), src, dst_pages, ITEM_LEN)


def _batch_bytes(plan: gp.TransferPlan, batches: int) -> int:
    return sum(sum(lens) for *_, lens in list_batches(plan)[:batches])


@pytest.mark.parametrize("buffer_workers", [0, 3])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_each_batch_is_submitted_in_order_and_every_byte_arrives(direction, buffer_workers):
    pages = page_request(NUM_PAGES, POOL_PAGES)
    with _sides(direction) as sides:
        plan = _plan(sides, pages)
        assert plan.num_batches > 1 and plan.num_descriptors > plan.num_batches
        engine = HookedEngine(sides.local.engine)
        with sides.transfer(engine, sides.peer.session_id, buffer_workers=buffer_workers) as t:
            assert t.submit(plan) == plan.total_bytes
        if buffer_workers:
            pieces = [tuple(piece[2:]) for piece in plan.pieces(per_buffer=True, lists=True)]
            assert sorted(engine.calls) == sorted(pieces)
        else:
            assert engine.calls == list_batches(plan)  # the peer's addresses as sources on a read
        assert changed_pages(sides.destination(), _expected(sides, pages), ITEM_LEN) == 0


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_an_out_of_range_page_is_refused_before_any_byte_moves(direction):
    src, dst, dst_device = page_request(NUM_PAGES, POOL_PAGES)
    with _sides(direction) as sides:
        wrong = (
            (src, dst.copy(), dst_device) if direction == "push" else (src.copy(), dst, dst_device)
        )
        side = 1 if direction == "push" else 0
        wrong[side][NUM_PAGES // 2] = POOL_PAGES
        with pytest.raises(gp.BoundsError, match="dst pages" if side else "src pages"):
            _plan(sides, wrong)
        assert changed_pages(sides.destination(), sides.destination_initial(), ITEM_LEN) == 0


def test_host_pages_for_device_buffers_change_the_wrong_pages_when_they_fit():
    # The HiSparse bug class: the host list used for a device-backed buffer. Bounds cannot
    # tell when the pools are the same size; only the bytes can.
    pages = page_request(NUM_PAGES, POOL_PAGES)
    src, dst, _ = pages
    with _sides("push") as sides:
        plan = _plan(sides, (src, dst, dst))
        with MooncakeSender(sides.local.engine, sides.peer.session_id) as sender:
            sender.submit(plan)
        assert changed_pages(sides.destination(), _expected(sides, pages), ITEM_LEN) > 0


@dataclasses.dataclass
class Failed:
    """A submit that failed at batch 3, with its peer still there to inspect."""

    sides: Sides
    pages: tuple[np.ndarray, np.ndarray, np.ndarray]
    plan: gp.TransferPlan
    transfer: MooncakeTransfer
    error: TransferError


@contextlib.contextmanager
def failed_at_batch_3(direction: str, fault: str) -> Iterator[Failed]:
    """Submit with the peer's `fault` method ("kill", "stop") run as batch 3 starts.

    A killed peer is Mooncake's to report, so its bound is one no report takes; a stalled
    peer's batch runs into the bound.
    """
    pages = page_request(NUM_PAGES, POOL_PAGES)
    batch_timeout_s = STALLED_BATCH_TIMEOUT_S if fault == "stop" else WAIT_S
    with _sides(direction) as sides:
        plan = _plan(sides, pages)
        engine = HookedEngine(sides.local.engine, at_call=3, hook=getattr(sides.peer, fault))
        transfer = sides.transfer(engine, sides.peer.session_id, batch_timeout_s=batch_timeout_s)
        with pytest.raises(TransferError) as caught:
            transfer.submit(plan)
        yield Failed(sides, pages, plan, transfer, caught.value)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_dead_peer_fails_the_batch_at_once_and_stops(direction):
    with failed_at_batch_3(direction, "kill") as failed:
        error = failed.error
        assert len(list_batches(failed.plan)) > 4
        # Mooncake itself reports the dead peer (connection refused or reset): not our bound.
        assert not isinstance(error, TransferTimeoutError)
        assert error.batch_index == 3 and error.in_flight == ()
        assert error.confirmed_bytes == _batch_bytes(failed.plan, 3)
        assert f"batch 3 ({failed.transfer.operation}" in str(error)
        assert failed.transfer.close() == []


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_stalled_peer_times_out_and_the_abandoned_call_stays_visible(direction):
    with failed_at_batch_3(direction, "stop") as failed:
        error, transfer = failed.error, failed.transfer
        assert isinstance(error, TransferTimeoutError)
        assert error.batch_index == 3
        assert error.confirmed_bytes == _batch_bytes(failed.plan, 3)
        (call,) = error.in_flight
        assert call.running() and not call.cancelled()
        assert transfer.close(timeout=0.1) == [call]  # still running: buffers stay registered
        with pytest.raises(TransferError, match="closed"):
            transfer.submit(failed.plan)
        # The peer resumes: the abandoned call completes and writes batch 3, and nothing later.
        failed.sides.peer.resume()
        done, _ = concurrent.futures.wait(error.in_flight, timeout=WAIT_S)
        assert done == {call} and call.result() == 0
        assert transfer.close(timeout=0.0) == []
        expected = _expected(failed.sides, failed.pages, num_pages=4 * BATCH_PAGES)
        assert changed_pages(failed.sides.destination(), expected, ITEM_LEN) == 0


@pytest.mark.parametrize("buffer_workers", [0, 2])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_an_address_the_binding_refuses_is_a_transfer_error(direction, buffer_workers):
    # Python ints >= 2**64 (sglang's list path can build them): pybind raises TypeError.
    # Lists: no int64 array can hold such an address.
    pages = page_request(NUM_PAGES, POOL_PAGES)
    with _sides(direction) as sides:
        plan = _plan(sides, pages)
        batches = list_batches(plan)
        srcs, dsts, lens = batches[2]
        batches[2] = (srcs, [*dsts[:-1], 2**64 + dsts[-1]], lens)
        engine = HookedEngine(sides.local.engine)
        transfer = sides.transfer(
            engine,
            sides.peer.session_id,
            buffer_workers=buffer_workers,
            batch_timeout_s=30.0,
            handoff_form=handoff.LISTS,
        )
        with transfer, pytest.raises(TransferError, match="batch 2.*TypeError") as caught:
            transfer.submit_pieces(
                PlanPiece(index, None, *batch) for index, batch in enumerate(batches)
            )
        assert isinstance(caught.value.__cause__, TypeError)
        assert caught.value.batch_index == 2
        assert caught.value.confirmed_bytes == _batch_bytes(plan, 2)
        assert len(engine.calls) == 3  # nothing after the failed batch
        expected = _expected(sides, pages, num_pages=2 * BATCH_PAGES)
        assert changed_pages(sides.destination(), expected, ITEM_LEN) == 0


class HeldCall:
    """A hook that holds an engine call, before it reaches Mooncake, until released (bounded)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        self.released.wait(WAIT_S)


@contextlib.contextmanager
def submit_in_a_thread(
    transfer: MooncakeTransfer, plan: gp.TransferPlan, held: HeldCall
) -> Iterator[concurrent.futures.Future[int]]:
    """Submit `plan` on another thread; yield its future once the held call is reached.

    The held call is released when the block exits, however it exits.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        try:
            submit = thread.submit(transfer.submit, plan)
            assert held.entered.wait(WAIT_S)
            yield submit
        finally:
            held.released.set()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_threads_sharing_a_transfer_each_get_their_own_time_bound(direction):
    # Thread A's first call is held (before it reaches Mooncake) until thread B has finished:
    # B's calls must not wait for A's worker, nor be cut off by A's stall.
    pages = page_request(NUM_PAGES, POOL_PAGES)
    held = HeldCall()
    with _sides(direction) as sides:
        plan = _plan(sides, pages)
        engine = HookedEngine(sides.local.engine, at_call=0, hook=held)
        with sides.transfer(engine, sides.peer.session_id, batch_timeout_s=5.0) as shared:
            with submit_in_a_thread(shared, plan, held) as submit_a:
                assert shared.submit(plan) == plan.total_bytes  # thread B: this one
            assert submit_a.result(WAIT_S) == plan.total_bytes
        assert changed_pages(sides.destination(), _expected(sides, pages), ITEM_LEN) == 0


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_close_from_another_thread_stops_the_submit_before_its_next_batch(direction):
    pages = page_request(NUM_PAGES, POOL_PAGES)
    held = HeldCall()
    with _sides(direction) as sides:
        plan = _plan(sides, pages)
        engine = HookedEngine(sides.local.engine, at_call=1, hook=held)
        transfer = sides.transfer(engine, sides.peer.session_id, batch_timeout_s=30.0)
        with submit_in_a_thread(transfer, plan, held) as submit:
            (call,) = transfer.close(timeout=0.05)  # batch 1's call, held: really running
            assert call.running()
        with pytest.raises(TransferError, match="closed") as caught:
            submit.result(WAIT_S)
        assert call.done() and not call.cancelled() and call.result() == 0
        assert (caught.value.batch_index, caught.value.in_flight) == (2, ())
        assert caught.value.confirmed_bytes == _batch_bytes(plan, 2)
        assert transfer.close(timeout=WAIT_S) == []
        expected = _expected(sides, pages, num_pages=2 * BATCH_PAGES)
        assert changed_pages(sides.destination(), expected, ITEM_LEN) == 0


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_close_is_final_inside_a_batch_split_into_calls(direction):
    # One batch cut into calls of 4 descriptors; call 1 is held when close() is called. In
    # pull mode every call writes local pages: none may change but those of the two calls
    # started before close() returned. (Buffer workers: test_transfer_bounds.py, with a fake
    # engine that holds every call.)
    pages = page_request(NUM_PAGES, POOL_PAGES)
    held = HeldCall()
    with _sides(direction) as sides:
        plan = _plan(sides, pages, max_batch_pages=0)
        engine = HookedEngine(sides.local.engine, at_call=1, hook=held)
        transfer = sides.transfer(
            engine, sides.peer.session_id, batch_timeout_s=30.0, max_call_descriptors=4
        )
        assert plan.num_batches == 1 and plan.num_descriptors > 3 * 4
        with submit_in_a_thread(transfer, plan, held) as submit:
            (running,) = transfer.close(timeout=0.05)  # call 1, held: really running
            assert running.running() and len(engine.calls) == 2
        with pytest.raises(TransferError, match="closed") as caught:
            submit.result(WAIT_S)
        assert running.result() == 0 and transfer.close(timeout=0.0) == []
        assert len(engine.calls) == 2  # nothing started after close() returned
        assert caught.value.in_flight == ()
        assert caught.value.confirmed_bytes == sum(sum(lens) for *_, lens in engine.calls)
        expected = sides.after_calls(engine.calls)
        assert changed_pages(sides.destination(), expected, ITEM_LEN) == 0
        assert changed_pages(expected, _expected(sides, pages), ITEM_LEN) > 0  # a real stop


def test_calls_abandoned_in_a_stalled_handshake_are_capped_until_they_end():
    # First contact with a peer whose port accepts connections (the kernel's backlog) but
    # never answers: Mooncake's handshake read blocks 60 s (README: measured 61.5-61.8 s).
    with (
        local_engine([POOL_PAGES * ITEM_LEN]) as local,
        socket.create_server((LOCALHOST, 0)) as listener,
    ):
        peer = f"{LOCALHOST}:{listener.getsockname()[1]}"
        layout = gp.BufferLayout(local.ptrs, [1 << 20], [ITEM_LEN])
        plan = gp.plan_transfer(np.arange(4), np.arange(4), layout)
        engine = HookedEngine(local.engine)
        transfer = MooncakeSender(engine, peer, batch_timeout_s=0.5, max_abandoned_calls=1)
        # Four threads submit at once: one call reaches Mooncake, the other submits are refused.
        start = threading.Barrier(4)

        def submit() -> int:
            start.wait(WAIT_S)
            return transfer.submit(plan)

        with concurrent.futures.ThreadPoolExecutor(4) as threads:
            errors = [call.exception(WAIT_S) for call in [threads.submit(submit) for _ in range(4)]]
        (timed_out,) = [error for error in errors if isinstance(error, TransferTimeoutError)]
        assert all("refused:" in str(error) for error in errors if error is not timed_out)
        assert len(engine.calls) == 1
        (abandoned,) = timed_out.in_flight
        with pytest.raises(TransferError, match="refused: 1 abandoned calls") as refused:
            transfer.submit(plan)
        assert not isinstance(refused.value, TransferTimeoutError) and len(engine.calls) == 1
        listener.close()  # the peer is gone: the stalled handshake fails at once
        assert abandoned.result(WAIT_S) != 0
        with pytest.raises(TransferError, match="status -1"):  # accepted again; Mooncake fails it
            transfer.submit(plan)
        assert len(engine.calls) == 2 and transfer.close() == []


@pytest.mark.parametrize("path", [handoff.ARRAYS, handoff.LISTS])
@pytest.mark.parametrize("buffer_workers", [0, 3])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_batch_larger_than_the_tcp_queue_is_split_into_queue_sized_calls(
    direction, buffer_workers, path
):
    # An engine whose TCP transport queues 16 descriptors per peer and parks 1 more: one call
    # of more fails with -1 after writing part of it. Runs of one page: many descriptors.
    queue = 16
    environment = {
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(queue),
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "1",
    }
    rng = np.random.default_rng(7)
    pages = tuple(rng.permutation(POOL_PAGES)[:NUM_PAGES] for _ in range(3))
    with _sides(direction, **environment) as sides:
        plan = _plan(sides, pages, max_batch_pages=0)  # one batch
        assert plan.num_batches == 1 and plan.num_descriptors > 4 * queue
        engine = HookedEngine(sides.local.engine)
        transfer = sides.transfer(
            engine,
            sides.peer.session_id,
            buffer_workers=buffer_workers,
            max_call_descriptors=queue,
            handoff_form=path,
        )
        with transfer:
            assert transfer.submit(plan) == plan.total_bytes
        limit = queue // max(buffer_workers, 1)
        assert max(len(lens) for *_, lens in engine.calls) == limit
        called = sorted(triple for call in engine.calls for triple in zip(*call, strict=True))
        assert called == sorted(zip(*next(iter(list_batches(plan))), strict=True))
        assert changed_pages(sides.destination(), _expected(sides, pages), ITEM_LEN) == 0


class _FailingEngine:
    """Records calls (no bytes move) and fails call number `fail_at`; writes and reads alike."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls: list[list[int]] = []
        self._lock = threading.Lock()

    def batch_transfer_sync_write(self, peer, srcs, dsts, lens) -> int:
        with self._lock:
            self.calls.append(list(lens))
            number = len(self.calls) - 1
        return -7 if number == self.fail_at else 0

    batch_transfer_sync_read = batch_transfer_sync_write


@pytest.mark.parametrize("transfer", [MooncakeSender, MooncakeReader])
@pytest.mark.parametrize("buffer_workers", [0, 2])
def test_submit_stops_at_the_first_failed_batch(transfer, buffer_workers):
    src = np.arange(40)
    layout = gp.BufferLayout([0, 1 << 30], [0, 1 << 30], [64, 32], dst_is_device=[False, True])
    plan = gp.plan_transfer(src, src[::-1].copy(), layout, src + 5, max_batch_pages=8)
    fail_batch = 2
    calls_per_batch = 2 if buffer_workers else 1
    engine = _FailingEngine(fail_at=fail_batch * calls_per_batch)
    submitter = transfer(engine, "peer", buffer_workers=buffer_workers, batch_timeout_s=None)
    with (
        submitter,
        pytest.raises(TransferError, match=f"{submitter.operation} peer.*status -7") as caught,
    ):
        submitter.submit(plan)
    assert caught.value.batch_index == fail_batch
    assert len(engine.calls) == (fail_batch + 1) * calls_per_batch  # nothing after the failure
    # Confirmed: the earlier batches, and the calls of the failed batch that succeeded.
    batch_calls = engine.calls[fail_batch * calls_per_batch :]
    this_batch = sum(map(sum, batch_calls)) - sum(engine.calls[engine.fail_at])
    assert caught.value.confirmed_bytes == _batch_bytes(plan, fail_batch) + this_batch


@pytest.mark.parametrize(
    "arguments",
    [{"buffer_workers": -1}, {"batch_timeout_s": 0.0}, {"max_call_descriptors": 0}],
    ids=["workers", "timeout", "call-limit"],
)
def test_sender_rejects_bad_arguments(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        MooncakeSender(_FailingEngine(0), "peer", **arguments)


def test_empty_plan_makes_no_call():
    layout = gp.BufferLayout([0], [0], [64])
    empty = np.empty(0, dtype=np.int64)
    engine = _FailingEngine(fail_at=0)
    with MooncakeSender(engine, "peer") as sender:
        assert sender.submit(gp.plan_transfer(empty, empty, layout)) == 0
    assert engine.calls == []
