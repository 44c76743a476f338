"""Through two real Mooncake engines the gathered send lands what sglang's own send lands.

Prefill TP2 rank 1 sends to decode TP4 rank 3 (8 KV heads) over TCP on
127.0.0.1 (tests/integration/mooncake's two-process harness), through sglang's
real `MooncakeTransferEngine` wrapper. The peer holds two sets of decode
buffers: sglang's original `send_kvcache_slice` writes the first, the hooked
(gathered) send the second, with the same pages. Both must equal the decode
buffers computed from the page lists alone; the gathered send makes one
engine call per chunk with one descriptor per run of decode pages per buffer,
and its staging is registered with the prefill's engine.
"""

from __future__ import annotations

import concurrent.futures
import inspect

import numpy as np
import pytest
from sglang_plugin_support import conn
from suite_support import set_knob
from test_gathered import STAGING_ENV, staging_bytes_for
from test_send_slice_mooncake import (
    DST_HEADS,
    DST_ITEM_LEN,
    DST_RANK,
    DST_TP,
    HEAD_BYTES,
    LAYERS,
    PAGE_SIZE,
    POOL_PAGES,
    SENT_HEADS,
    SRC_HEADS,
    SRC_ITEM_LEN,
    prefill_rank_manager,
)

from gpu_planner.integration.mooncake import handoff
from gpu_planner.integration.sglang import counters, gathered, send_slots
from gpu_planner.reference import group_runs
from tests.integration.mooncake.mooncake_peer import two_sides

ORIGINAL = inspect.unwrap(conn.MooncakeKVManager.send_kvcache_slice)
NUM_PAGES = 20


@pytest.mark.parametrize(
    ("form", "slot_pages"),
    [(handoff.ARRAYS, None), (handoff.ARRAYS, 7), (handoff.LISTS, 7)],
    ids=["arrays-one-chunk", "arrays-page-pieces", "lists-page-pieces"],
)
def test_gathered_send_lands_sglangs_bytes_through_real_engines(monkeypatch, form, slot_pages):
    set_knob(monkeypatch, "GPU_PLANNER_HANDOFF", form)
    if slot_pages is None:
        set_knob(monkeypatch, STAGING_ENV, None)
    else:
        set_knob(monkeypatch, STAGING_ENV, str(staging_bytes_for(slot_pages, DST_ITEM_LEN)))
    buffers = 2 * LAYERS  # K of every layer, then V
    with two_sides(
        "push", [POOL_PAGES * SRC_ITEM_LEN] * buffers, [POOL_PAGES * DST_ITEM_LEN] * 2 * buffers
    ) as sides:
        rng = np.random.default_rng(5)
        src_pages = rng.permutation(POOL_PAGES)[:NUM_PAGES].astype(np.int32)
        dst_pages = np.sort(rng.permutation(POOL_PAGES)[:NUM_PAGES]).astype(np.int64)
        manager, spy = prefill_rank_manager(sides, buffers)
        halves = (sides.peer.ptrs[:buffers], sides.peer.ptrs[buffers:])
        descriptors_before = counters.snapshot()["descriptors"]
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as executor:
            for send, dst_ptrs in zip(
                (ORIGINAL, conn.MooncakeKVManager.send_kvcache_slice), halves, strict=True
            ):
                spy.methods.clear()
                status = send(
                    manager,
                    sides.peer.session_id,
                    src_pages,
                    dst_ptrs,
                    dst_pages,
                    DST_RANK,
                    DST_TP,
                    DST_ITEM_LEN,
                    executor,
                )
                assert status == 0
        descriptors = counters.snapshot()["descriptors"] - descriptors_before
        staging = send_slots.SEND_SLOTS.get(manager)
        chunks = gathered.plan_chunks(buffers, NUM_PAGES, DST_ITEM_LEN, staging.slot_bytes)
        assert spy.methods == [form] * len(chunks)
        dst_runs = len(group_runs(range(NUM_PAGES), dst_pages.tolist()))
        if slot_pages is None:  # every K/V buffer in one call, one descriptor per run
            assert len(chunks) == 1 and descriptors == buffers * dst_runs
        else:  # a run crossing a page cut is two descriptors
            assert buffers * dst_runs < descriptors <= buffers * (dst_runs + len(chunks))
        assert dst_runs < NUM_PAGES  # sorted pages of a 32-page pool: runs merge
        sources, before = sides.sources(), sides.destination_initial()
        after = sides.destination()
        for half in range(2):
            for buffer, source in enumerate(sources):
                index = half * buffers + buffer
                src = source.reshape(POOL_PAGES, PAGE_SIZE, SRC_HEADS, HEAD_BYTES)
                dst = before[index].reshape(POOL_PAGES, PAGE_SIZE, DST_HEADS, HEAD_BYTES).copy()
                dst[dst_pages] = src[src_pages][:, :, SENT_HEADS]
                np.testing.assert_array_equal(after[index], dst.reshape(-1))
        send_slots.SEND_SLOTS.release(manager)
