"""Pull: decode plans on its own device and reads from a real prefill process with MooncakeReader.

The demo scenarios (host-only, mixed, batch limits, empty request) run in
both modes in test_demo.py; these tests drive the decode side step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mooncake_demo_support import (
    HookedEngine,
    faulty_transfer,
    kill_process,
    prefill_peer,
    small_config,
    stop_process,
)

import gpu_planner as gp
from gpu_planner.integration.demo.sides import pair_layout
from gpu_planner.integration.mooncake import MooncakeReader, TransferTimeoutError
from gpu_planner.integration.sglang.frames import KVRegistration, TransferRequest


def _push_plan(peer, max_batch_pages: int) -> gp.TransferPlan:
    """The plan prefill would make in push mode, from what decode would send it over ZMQ."""
    decode = peer.decode
    registration = KVRegistration.from_frames(decode.registration().to_frames())
    request = TransferRequest.from_frames(decode.transfer_request().to_frames())
    layout = pair_layout(peer.registration, registration)
    return gp.plan_transfer(
        torch.from_numpy(peer.source.pages),
        torch.from_numpy(request.host_pages),
        layout,
        torch.from_numpy(request.device_pages),
        max_batch_pages=max_batch_pages,
    )


@pytest.mark.parametrize("buffer_workers", [0, 3])
def test_pull_reads_the_push_plans_triples_and_the_bytes_arrive(buffer_workers):
    with prefill_peer(small_config()) as peer:
        pull = peer.plan_request(max_batch_pages=7)
        push = _push_plan(peer, max_batch_pages=7)
        assert pull.num_batches > 1 and pull.num_descriptors > pull.num_batches
        torch.testing.assert_close(pull.columns, push.columns, rtol=0, atol=0)
        assert pull.batch_offsets.tolist() == push.batch_offsets.tolist()

        engine = HookedEngine(peer.engine)
        with MooncakeReader(engine, peer.session_id, buffer_workers=buffer_workers) as reader:
            assert reader.submit(pull) == push.total_bytes
        # Each read names the prefill addresses as sources: exactly the push plan's calls.
        if buffer_workers:
            pieces = [tuple(piece[2:]) for piece in push.buffer_batches()]
            assert sorted(engine.calls) == sorted(pieces)
        else:
            assert engine.calls == list(push.batches())
        verification = peer.decode.verify(peer.source.pages)
    assert verification.ok, verification
    assert verification.bad_pages == verification.changed_pages == 0


def test_pull_refuses_an_out_of_range_source_before_any_read():
    with prefill_peer(small_config()) as peer:
        src_pages = peer.source.pages.copy()
        prefill_pool = peer.registration.lens[2] // peer.registration.item_lens[2]
        src_pages[len(src_pages) // 3] = prefill_pool
        with pytest.raises(gp.BoundsError, match="src pages"):
            peer.plan(src_pages, max_batch_pages=7)
        verification = peer.decode.verify(np.empty(0, np.int64))
    assert verification.ok  # nothing changed


def test_prefill_killed_mid_read_fails_the_batch_and_stops():
    plan, error = faulty_transfer(prefill_peer, MooncakeReader, kill_process)
    batches = list(plan.batches())
    assert len(batches) > 4
    # Mooncake itself reports the dead peer: not our time bound.
    assert not isinstance(error, TransferTimeoutError)
    assert error.batch_index == 3
    assert error.confirmed_bytes == sum(sum(lens) for *_, lens in batches[:3])
    assert "batch 3 (read from" in str(error)


def test_stalled_prefill_is_bounded_by_the_batch_timeout():
    plan, error = faulty_transfer(prefill_peer, MooncakeReader, stop_process)
    assert isinstance(error, TransferTimeoutError)
    assert error.batch_index == 3
    assert error.confirmed_bytes == sum(sum(lens) for *_, lens in list(plan.batches())[:3])
