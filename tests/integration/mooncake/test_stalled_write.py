"""A write Mooncake reports failed at its transfer timeout still lands once a stalled peer
resumes: the send slot it read is not lent again meanwhile, so a later request's bytes never
reach the stalled request's part. Real engines: sglang's wrapper in this process, a peer
process stalled with SIGSTOP past Mooncake's timeout (its least: 5 s)."""

from __future__ import annotations

import time

import numpy as np
import torch
from mooncake_peer import peer_process

PART = 32 << 20  # past what loopback's socket buffers absorb: the write stalls with the peer
TIMEOUT_S = 5  # MC_TRANSFER_TIMEOUT: the least Mooncake's binding takes
BLOCK = 4096
LAND_WITHIN_S = 60.0


class Manager:
    """What `SendSlots` reads of sglang's manager: its engine wrapper."""

    def __init__(self, engine) -> None:
        self.engine = engine


def test_a_slot_a_timed_out_write_read_is_not_lent_while_that_write_can_land(monkeypatch):
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", str(TIMEOUT_S))
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        MooncakeTransferEngine,
    )

    from gpu_planner.integration.sglang.adapter import AsyncWrites
    from gpu_planner.integration.sglang.send_slots import SLOTS, PartWrites, SendSlots

    rng = np.random.default_rng(3)
    request_a = rng.integers(0, 256, PART, dtype=np.uint8)
    request_b = rng.integers(0, 256, PART, dtype=np.uint8)
    with peer_process([2 * PART]) as peer:
        part_a, part_b = peer.ptrs[0], peer.ptrs[0] + PART
        wrapper = MooncakeTransferEngine("127.0.0.1")
        manager = Manager(wrapper)
        slots = SendSlots(manager, SLOTS * PART, torch.device("cpu"))
        try:
            writes = AsyncWrites(wrapper.engine)
            others = [slots.try_take() for _ in range(SLOTS - 1)]  # other sends hold theirs
            stalled = slots.try_take()
            slots.slot(stalled).numpy()[:] = request_a
            with PartWrites(slots, stalled, writes, peer.session_id) as lease:
                lease.write(stalled, 0, part_a, BLOCK)  # the connection, before the stall
                assert lease.finish() == 0
            stalled = slots.try_take()
            peer.stop()
            started = time.monotonic()
            with PartWrites(slots, stalled, writes, peer.session_id) as lease:
                lease.write(stalled, 0, part_a, PART)
                assert lease.finish() == -1  # Mooncake gave up on it; its write stays queued
            assert time.monotonic() - started >= TIMEOUT_S
            assert slots.held_slots == 1 and slots.try_take() is None  # held, not lent
            slots.give_back(others[0])  # another send ends cleanly
            later = slots.try_take()
            assert later == others[0] and later != stalled
            slots.slot(later).numpy()[:] = request_b
            peer.resume()
            with PartWrites(slots, later, writes, peer.session_id) as lease:
                lease.write(later, 0, part_b, PART)
                assert lease.finish() == 0
            deadline = time.monotonic() + LAND_WITHIN_S
            while True:  # the stalled write lands after the resume (bounded wait)
                memory = peer.contents()[0]
                if np.array_equal(memory[:PART], request_a) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            np.testing.assert_array_equal(memory[PART:], request_b)
            a_blocks = memory[:PART].reshape(-1, BLOCK)
            b_blocks = request_b.reshape(-1, BLOCK)
            assert not (a_blocks == b_blocks).all(axis=1).any()  # no block of B in A's part
        finally:
            for slot in others[1:]:
                slots.give_back(slot)
            slots.release()
