"""MooncakeSender against a real decode process: order, bounds, the HiSparse bug class, faults.

The loop is shared with MooncakeReader: the engine-free tests run both.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from mooncake_demo_support import (
    HookedEngine,
    decode_peer,
    faulty_transfer,
    kill_process,
    small_config,
    stop_process,
)

import gpu_planner as gp
from gpu_planner.integration.mooncake import (
    MooncakeReader,
    MooncakeSender,
    TransferError,
    TransferTimeoutError,
)


def _batch_bytes(batches) -> list[int]:
    return [sum(lens) for *_, lens in batches]


def test_send_submits_each_batch_in_order_and_the_bytes_arrive():
    with decode_peer(small_config()) as peer:
        request = peer.request
        plan = peer.plan(request.host_pages, request.device_pages, max_batch_pages=7)
        assert plan.num_batches > 1
        engine = HookedEngine(peer.prefill.engine)
        with MooncakeSender(engine, request.session_id) as sender:
            assert sender.submit(plan) == plan.total_bytes
        assert engine.calls == list(plan.batches())

        # Per-buffer submission writes the same bytes again, one call per (batch, buffer).
        engine.calls.clear()
        with MooncakeSender(engine, request.session_id, buffer_workers=3) as sender:
            assert sender.submit(plan) == plan.total_bytes
        pieces = [tuple(piece[2:]) for piece in plan.buffer_batches()]
        assert sorted(engine.calls) == sorted(pieces)

        verification = peer.prefill.finish(request)
    assert verification.ok, verification
    registration = peer.registration
    pool_pages = [
        n // item for n, item in zip(registration.lens, registration.item_lens, strict=True)
    ]
    assert verification.pages_checked == sum(pool_pages)


def test_out_of_range_destination_is_refused_before_any_write():
    with decode_peer(small_config()) as peer:
        request = peer.request
        last_page = peer.registration.lens[0] // peer.registration.item_lens[0] - 1
        host_pages = request.host_pages.copy()
        host_pages[len(host_pages) // 2] = last_page + 1
        with pytest.raises(gp.BoundsError, match="buffer 0: dst pages"):
            peer.plan(host_pages, request.device_pages, max_batch_pages=7)
        verification = peer.prefill.finish(request, failure="refused")
    assert verification.bad_pages == 0
    assert verification.changed_pages == 0


def test_host_pages_for_device_buffers_hit_the_bounds_check():
    # Host pool 3x the request, device pool 1x: host page ids overrun device buffers.
    config = small_config(host_pool_factor=3.0, device_pool_factor=1.0)
    with decode_peer(config) as peer:
        request = peer.request
        device_buffer = peer.registration.is_device.index(True)
        device_pool = peer.registration.lens[device_buffer] // config.item_len
        assert request.host_pages.max() >= device_pool
        with pytest.raises(gp.BoundsError, match="device-backed"):
            peer.plan(request.host_pages, request.host_pages, max_batch_pages=7)
        verification = peer.prefill.finish(request, failure="refused")
    assert verification.changed_pages == 0


def test_host_pages_for_device_buffers_fail_verification_when_they_fit():
    # Equal pools: host page ids fit the device buffers, so only the bytes can tell.
    config = small_config(host_pool_factor=2.0, device_pool_factor=2.0)
    with decode_peer(config) as peer:
        request = peer.request
        assert not np.array_equal(request.host_pages, request.device_pages)
        plan = peer.plan(request.host_pages, request.host_pages, max_batch_pages=7)
        with MooncakeSender(peer.prefill.engine, request.session_id) as sender:
            sender.submit(plan)
        verification = peer.prefill.finish(request)
    assert not verification.ok
    assert verification.bad_pages > 0  # device pages that should have the KV do not
    assert verification.changed_pages > 0  # device pages outside the request were overwritten


def test_decode_killed_mid_transfer_fails_the_batch_and_stops():
    plan, error = faulty_transfer(decode_peer, MooncakeSender, kill_process)
    batches = list(plan.batches())
    assert len(batches) > 4
    # Mooncake itself reports the dead peer (connection refused/reset): not our time bound.
    assert not isinstance(error, TransferTimeoutError)
    assert error.batch_index == 3
    assert error.confirmed_bytes == sum(_batch_bytes(batches[:3]))
    assert "batch 3" in str(error)


def test_stalled_decode_is_bounded_by_the_batch_timeout():
    # A stopped peer keeps its sockets open: Mooncake would wait 30 s per slice.
    plan, error = faulty_transfer(decode_peer, MooncakeSender, stop_process)
    assert isinstance(error, TransferTimeoutError)
    assert error.batch_index == 3
    assert error.confirmed_bytes == sum(_batch_bytes(list(plan.batches())[:3]))


class _FailingEngine:
    """Records calls (no bytes move) and fails call number `fail_at`; writes and reads alike."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.calls: list[list[int]] = []
        self._lock = threading.Lock()

    def batch_transfer_sync_write(self, peer, srcs, dsts, lens) -> int:
        with self._lock:
            self.calls.append(lens)
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
    assert caught.value.confirmed_bytes == sum(_batch_bytes(list(plan.batches())[:fail_batch]))
    assert len(engine.calls) == (fail_batch + 1) * calls_per_batch  # nothing after the failure


@pytest.mark.parametrize(
    "arguments", [{"buffer_workers": -1}, {"batch_timeout_s": 0.0}], ids=["workers", "timeout"]
)
def test_sender_rejects_bad_arguments(arguments):
    with pytest.raises(ValueError, match=next(iter(arguments))):
        MooncakeSender(object(), "peer", **arguments)


def test_empty_plan_makes_no_call():
    layout = gp.BufferLayout([0], [0], [64])
    empty = np.empty(0, dtype=np.int64)
    engine = _FailingEngine(fail_at=0)
    with MooncakeSender(engine, "peer") as sender:
        assert sender.submit(gp.plan_transfer(empty, empty, layout)) == 0
    assert engine.calls == []
